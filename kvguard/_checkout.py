"""Running from a source checkout: its top-level `kernels/` folder (installed as kvguard.kernels)
must not stand in for Hugging Face's `kernels` package.

A process whose sys.path holds the checkout's root (`python -m kvguard...` from there, or pytest,
which puts the root there for the `tests` package) would import the folder as `kernels`, and
transformers, which imports Hugging Face's `kernels` when that is installed, fails on it. This
finder looks `kernels` up everywhere but the checkout's root; it imports nothing itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class InstalledKernels(importlib.abc.MetaPathFinder):
    """`import kernels` from sys.path without the checkout's root."""

    def __init__(self, root: Path) -> None:
        self.root = str(root)

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "kernels":
            return None
        dirs = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != self.root]
        return importlib.machinery.PathFinder.find_spec(fullname, dirs)


def install() -> None:
    """Put the finder first, once, when kvguard runs from a checkout (its root holds the
    project's pyproject.toml and kernels/)."""
    if (ROOT / "pyproject.toml").is_file() and (ROOT / "kernels" / "_launch.py").is_file() and not any(
            isinstance(f, InstalledKernels) for f in sys.meta_path):
        sys.meta_path.insert(0, InstalledKernels(ROOT))
