"""The arrows of the layout: kvguard → kernels, kvguard → audit; never back.

kernels/ and audit/ install as kvguard.kernels and kvguard.audit, so "never back"
means: they import nothing of kvguard but themselves (by relative imports).

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
# The registry of record ops, which names the cache's events: the one module of kvguard.audit
# the cache may import (it imports nothing itself).
OPS = "kvguard.audit.ops"
RULES = [  # folder, forbidden, allowed although under a forbidden name
    ("kernels", {"kvguard", "audit", "sqlalchemy", "fastapi"}, set()),
    ("audit", {"kvguard", "kernels", "torch", "triton"}, set()),
    ("kvguard/cache", {"sqlalchemy", "fastapi", "kvguard.audit", SIGNING, "structlog"}, {OPS}),
    ("kvguard/compress", {"sqlalchemy", "fastapi", "kvguard.audit", "cryptography"}, set()),
]


@pytest.mark.parametrize("folder, forbidden, allowed", RULES, ids=[r[0] for r in RULES])
def test_source_imports_follow_the_arrows(folder, forbidden, allowed):
    bad = {f: sorted(n for n in names if under(n, forbidden) and n not in allowed)
           for f, names in imports_of(folder).items()}
    bad = {f: names for f, names in bad.items() if names}
    assert not bad, f"{folder} must not import {sorted(forbidden)}: {bad}"


def test_the_cache_imports_the_op_registry_by_its_own_name_only():
    """`from kvguard.audit import ops` would pass the rule above as an import of kvguard.audit
    itself; the cache names the module, so the rule sees which part of kvguard.audit it is."""
    seen = set().union(*imports_of("kvguard/cache").values())
    assert OPS in seen and not {n for n in seen if under(n, {"kvguard.audit"})} - {OPS}
    assert imports_of("audit")["audit/ops.py"] == {"__future__"}  # the registry imports nothing


def test_the_rules_see_submodules_and_imports_inside_functions():
    assert under(SIGNING + ".ed25519", {SIGNING}) and not under("cryptography.hazmat.primitives.ciphers", {SIGNING})
    assert "cryptography.hazmat.primitives.ciphers.aead" in imports_of("kvguard/cache")["kvguard/cache/tiers.py"]


BLOCKER = """
import sys
ALLOWED = globals().get('ALLOWED', [])
class Block:
    def find_spec(self, name, path=None, target=None):
        if name not in ALLOWED and any(name == b or name.startswith(b + '.') for b in BLOCKED):
            raise ImportError(f'{name} is forbidden here')
sys.meta_path.insert(0, Block())
"""

# Every kvguard subpackage but the one under test (kvguard/__init__.py itself is light).
KVGUARD_REST = ["kvguard.cache", "kvguard.compress", "kvguard.eval", "kvguard.hf", "kvguard.sidecar",
                "kvguard.policy", "kvguard.types", "kvguard.cli", "kvguard.client"]


@pytest.mark.parametrize("module, blocked", [
    # the inference process's side of the sidecar: never the daemon's app or store
    ("kvguard.client", ["fastapi", "sqlalchemy", "uvicorn", "kvguard.sidecar"]),
    ("kvguard.audit.ops", ["sqlalchemy", "cryptography", "rfc8785", "torch", "kvguard.kernels", *KVGUARD_REST]),
    ("kvguard.kernels.quantize", KVGUARD_REST + ["kvguard.audit", "audit"]),
    ("kvguard.audit", ["torch", "triton", "kvguard.kernels", "kernels"] + KVGUARD_REST),
    ("kvguard.audit.bundle.verify", ["torch", "triton", "sqlalchemy", "kvguard.kernels"] + KVGUARD_REST),
])
def test_packages_import_without_forbidden_modules(module, blocked):
    code = f"BLOCKED = {blocked!r}\n{BLOCKER}\nimport {module}\n"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_the_cache_loads_the_op_registry_and_nothing_else_of_audit():
    # kvguard.audit (the package) loads its errors module, which imports nothing either
    allowed = ["kvguard.audit", "kvguard.audit.errors", OPS]
    blocked = ["sqlalchemy", "fastapi", "kvguard.audit", "cryptography"]
    code = (f"BLOCKED = {blocked!r}\nALLOWED = {allowed!r}\n{BLOCKER}\nimport kvguard.cache, kvguard.cache.events\n"
            "print(sorted(m for m in sys.modules if m.startswith('kvguard.audit')))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == repr(sorted(allowed))


def test_hf_kernels_and_ours_live_side_by_side():
    """Hugging Face's `kernels` (installed by the dev extra, as transformers users have it) and
    kvguard's kernels share one venv: each imports as itself and transformers reads HF's version."""
    code = (
        "import importlib.metadata as md\n"
        "from kernels import get_kernel\n"
        "import kvguard.kernels.paged_decode as pd\n"
        "import kernels\n"
        "import os\n"
        "ours = os.path.join(os.path.dirname(os.path.realpath(pd.__file__)), '__init__.py')\n"
        "assert callable(get_kernel) and os.path.realpath(kernels.__file__) != ours, kernels.__file__\n"
        "assert pd.__name__ == 'kvguard.kernels.paged_decode'\n"
        "assert md.version('kernels') != md.version('kvguard'), 'kernels reads as kvguard'\n"
        "assert not [f for f in md.files('kvguard') if str(f).split('/')[0] in ('kernels', 'audit', 'migrations')]\n"
        "from transformers.utils import import_utils as iu\n"
        "avail, seen = iu._is_package_available('kernels', return_version=True)\n"
        "assert avail and seen == md.version('kernels'), (avail, seen)\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_from_the_checkout_hf_kernels_is_not_our_folder():
    """A process started in the checkout's root (`python -m kvguard...`, pytest) has the root on
    sys.path, where the `kernels/` folder would stand in for Hugging Face's `kernels`, which
    transformers imports when it is installed (transformers 5.25: at import of its models)."""
    code = (
        "import os, sys\n"
        "import kvguard\n"
        "import kernels\n"
        "from transformers import modeling_utils\n"
        "assert os.path.realpath(kernels.__file__) != os.path.realpath(os.path.join('kernels', '__init__.py'))\n"
        "import kvguard.kernels.paged_decode as pd\n"
        "assert os.path.realpath(pd.__file__) == os.path.realpath(os.path.join('kernels', 'paged_decode.py'))\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]



# --- no circles ---------------------------------------------------------------------------------
# A circle of imports leaves no module that can be read, tested or moved without the others, and
# makes the order of imports matter. Every import counts: at the top, inside a function (deferred
# for weight, it still ties the two) and under TYPE_CHECKING (a type named is a dependency).

PACKAGES = {"kvguard": "kvguard", "kvguard.kernels": "kernels", "kvguard.audit": "audit",
            "kvguard.migrations": "migrations"}  # installed name -> folder (pyproject's package-dir)


def module_files(root: Path = ROOT, packages: dict[str, str] = PACKAGES) -> dict[str, Path]:
    """Every module by its installed dotted name (a package by its __init__.py)."""
    out = {}
    for name, folder in packages.items():
        for path in (root / folder).rglob("*.py"):
            parts = path.relative_to(root / folder).with_suffix("").parts
            out[".".join((name, *parts[: -1 if parts[-1] == "__init__" else None]))] = path
    return out


def import_graph(root: Path = ROOT, packages: dict[str, str] = PACKAGES) -> dict[str, dict[str, int]]:
    """Each module -> the modules of the same tree it imports, with the line of the first such
    import. `from a.b import c` is an arrow to a.b.c when that is a module, else to a.b; the
    packages above a module imported are not arrows (importing a.b.c runs a/b/__init__.py, but a
    package's __init__ that hands on its submodules' names would otherwise be in a circle with
    each of them)."""
    files = module_files(root, packages)

    def known(name: str) -> str | None:
        while name not in files and "." in name:
            name = name.rpartition(".")[0]
        return name if name in files else None

    graph = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        arrows: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                names = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                target = known(name)
                if target is not None and target != mod:
                    arrows.setdefault(target, node.lineno)
        graph[mod] = arrows
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The groups of modules that import each other (strongly connected), each sorted."""
    def reach(start: str) -> set[str]:
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(graph.get(m, ()))
        return seen

    reached = {m: reach(m) for m in graph}
    out, placed = [], set()
    for m in sorted(graph):
        if m in reached[m] and m not in placed:
            group = sorted(n for n in reached[m] if m in reached[n])
            placed.update(group)
            out.append(group)
    return out


def test_no_module_imports_itself_through_others():
    graph = import_graph()
    found = circles(graph)
    ties = [[f"{a} -> {b} (line {graph[a][b]})" for a in group for b in group if b in graph[a]] for group in found]
    assert not found, ("modules that import each other: move what they share to the module it belongs to "
                       "(a deferred import still ties them):\n" + "\n\n".join("\n".join(t) for t in ties))


def test_the_circle_check_sees_imports_in_functions_and_for_types(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import A\n")  # a package handing on a name: no circle
    (pkg / "a.py").write_text("from .b import B\nA = 1\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\nB = 2\n")  # a -> b -> a, in a function
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import D\n")
    (pkg / "sub" / "d.py").write_text("from .. import sub\nfrom ..sub import c\nD = 3\n")  # d -> c -> d
    graph = import_graph(tmp_path, {"pkg": "pkg"})
    assert graph["pkg.a"] == {"pkg.b": 1} and graph["pkg.sub.c"] == {"pkg.sub.d": 3}
    assert circles(graph) == [["pkg.a", "pkg.b"], ["pkg.sub.c", "pkg.sub.d"]]
    # the real tree: relative, absolute and installed-name imports all land on files
    real = import_graph()
    assert "kvguard.cache.sequence" in real["kvguard.cache.manager"]
    assert "kvguard.audit.ops" in real["kvguard.cache.events"]
    assert "kvguard.kernels.quantize" in real["kvguard.cache.compaction"]


def test_every_source_file_opens_with_what_it_is_for():
    """A module docstring in every non-empty Python file of the source folders."""
    missing = []
    for folder in ("kvguard", "kernels", "audit", "benchmarks", "migrations", "deploy", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            if text.strip() and not ast.get_docstring(ast.parse(text, str(path))):
                missing.append(path.relative_to(ROOT).as_posix())
    assert not missing, missing
