"""kernels/ stands alone: it never imports kvguard, and here its kernels run interpreted on a CPU."""

import ast
from pathlib import Path

import kvguard.kernels as kernels
import kvguard.kernels.paged_decode as pd

from .conftest import ON_GPU


def test_kernels_never_import_kvguard():
    for path in Path(kernels.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] == "kvguard" for n in names), f"{path.name} imports kvguard"


def test_interpreted_without_gpu():
    assert ON_GPU or type(pd._decode_kernel).__name__ == "InterpretedFunction"
