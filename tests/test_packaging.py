"""The wheel: kernels/, audit/ and migrations/ install under kvguard's namespace and nothing else
lands at the top level of site-packages (Hugging Face's `kernels` owns that name there)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_python_folder_is_a_listed_package():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    mapped = {v: k for k, v in cfg["package-dir"].items()}
    found = set()
    for top in ["kvguard", *mapped]:
        for d in [ROOT / top, *(p for p in (ROOT / top).rglob("*") if p.is_dir())]:
            if d.name != "__pycache__" and any(d.glob("*.py")):
                rel = d.relative_to(ROOT).parts
                found.add(".".join(mapped.get(rel[0], rel[0]).split(".") + list(rel[1:])))
    assert found == listed, f"pyproject's packages miss {sorted(found - listed)}, list stale {sorted(listed - found)}"


def test_wheel_installs_only_under_kvguard(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("kvguard-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"kvguard"}, tops
    for member in ("kvguard/audit/bundle/verify.py", "kvguard/kernels/paged_decode.py", "kvguard/audit/py.typed",
                   "kvguard/migrations/env.py", "kvguard/migrations/script.py.mako",
                   "kvguard/migrations/versions/0001_audit_tables.py"):
        assert member in names, member
