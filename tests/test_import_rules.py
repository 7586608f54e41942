"""The arrows of the layout: kvguard → kernels, kvguard → audit; never back.

Checked on the source (every import statement, also inside functions) and by
importing the packages in a fresh interpreter that refuses forbidden modules.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imports_of(folder: str) -> dict[str, set[str]]:
    """The absolute modules each file imports, by their full dotted names."""
    out = {}
    for path in (ROOT / folder).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
        out[str(path.relative_to(ROOT))] = names
    return out


def under(name: str, forbidden: set[str]) -> bool:
    return any(name == f or name.startswith(f + ".") for f in forbidden)


# The cache may seal the pages it sends to disk and Redis (an AEAD cipher) but never signs:
# signing keys belong to the audit side.
SIGNING = "cryptography.hazmat.primitives.asymmetric"
RULES = [
    ("kernels", {"kvguard", "audit", "sqlalchemy", "fastapi"}),
    ("audit", {"kvguard", "kernels", "torch", "triton"}),
    ("kvguard/cache", {"sqlalchemy", "fastapi", "audit", SIGNING, "structlog"}),
    ("kvguard/compress", {"sqlalchemy", "fastapi", "audit", "cryptography"}),
]


@pytest.mark.parametrize("folder, forbidden", RULES, ids=[r[0] for r in RULES])
def test_source_imports_follow_the_arrows(folder, forbidden):
    bad = {f: sorted(n for n in names if under(n, forbidden)) for f, names in imports_of(folder).items()}
    bad = {f: names for f, names in bad.items() if names}
    assert not bad, f"{folder} must not import {sorted(forbidden)}: {bad}"


def test_the_rules_see_submodules_and_imports_inside_functions():
    assert under(SIGNING + ".ed25519", {SIGNING}) and not under("cryptography.hazmat.primitives.ciphers", {SIGNING})
    assert "cryptography.hazmat.primitives.ciphers.aead" in imports_of("kvguard/cache")["kvguard/cache/tiers.py"]


BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in BLOCKED:
            raise ImportError(f'{name} is forbidden here')
sys.meta_path.insert(0, Block())
"""


@pytest.mark.parametrize("module, blocked", [
    ("kvguard.cache", ["sqlalchemy", "fastapi", "audit", "cryptography"]),
    ("kernels.quantize", ["kvguard", "audit"]),
    ("audit", ["torch", "triton", "kvguard", "kernels"]),
])
def test_packages_import_without_forbidden_modules(module, blocked):
    code = f"BLOCKED = {blocked!r}\n{BLOCKER}\nimport {module}\n"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_transformers_does_not_mistake_our_kernels_for_hf_kernels():
    """Our top-level `kernels` package is not Hugging Face's `kernels`, and the
    distribution metadata must not make transformers think it is."""
    code = (
        "import transformers\n"
        "from transformers.utils import import_utils as iu\n"
        "assert not iu.is_kernels_available(), 'transformers thinks kvguard kernels is HF kernels'\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
