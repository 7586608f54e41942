"""The `kvguard` command on the auditor's install (cryptography and rfc8785 only): every
command's --help and --version work, and a command whose extra is missing names the extra
to install and exits 2, without a traceback."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvguard import __version__
from kvguard.cli import main

REPO = Path(__file__).resolve().parents[1]

# What `pip install kvguard` (no extras) does not bring.
BLOCKED = ("torch", "triton", "numpy", "sqlalchemy", "fastapi", "structlog", "yaml", "pydantic")
AUDITOR = textwrap.dedent(f"""
    import sys
    import importlib.abc

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in {BLOCKED!r}):
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, Block())
    sys.path.insert(0, {str(REPO)!r})
    from kvguard.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def auditor(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-I", "-c", AUDITOR, *argv], capture_output=True, text=True, cwd=cwd)


def test_help_and_version_on_the_auditor_s_install(tmp_path):
    proc = auditor("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for command in ("audit", "demo", "serve", "token", "keygen", "eval"):
        assert command in proc.stdout
    assert "needs kvguard[serve]" in proc.stdout  # serve, token and keygen are listed with their extra
    proc = auditor("--version", cwd=tmp_path)
    assert (proc.returncode, proc.stdout.strip()) == (0, f"kvguard {__version__}"), proc.stderr
    for command in ("demo", "serve", "token", "keygen", "eval", "audit"):
        proc = auditor(command, "--help", cwd=tmp_path)
        assert proc.returncode == 0 and proc.stdout.startswith("usage: kvguard"), (command, proc.stderr)
        assert "Traceback" not in proc.stderr
    assert "SmolLM2" in auditor("demo", "--help", cwd=tmp_path).stdout  # it says what it does
    assert "pip install 'kvguard[serve]'" in auditor("serve", "--help", cwd=tmp_path).stdout


@pytest.mark.parametrize("argv, extra", [
    (["serve"], "serve"), (["serve", "--port", "9"], "serve"), (["token", "create", "--scope", "admin"], "serve"),
    (["keygen", "k"], "serve"), (["eval", "--methods", "int8"], "models"), (["demo", "--no-sidecar"], "models"),
])
def test_a_command_without_its_extra_names_it_and_exits_2(tmp_path, argv, extra):
    proc = auditor(*argv, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"pip install 'kvguard[{extra}]'" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert f"kvguard {argv[0]}: needs the '{extra}' extra" in proc.stderr


def test_audit_verify_still_runs_there(tmp_path):
    proc = auditor("audit", "verify", str(tmp_path / "missing.zip"), "--public-key", str(tmp_path / "k.pub"),
                   cwd=tmp_path)
    assert proc.returncode == 2 and "cannot read" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_the_blocker_blocks(tmp_path):
    proc = subprocess.run([sys.executable, "-I", "-c", AUDITOR.replace("from kvguard.cli import main", "import yaml")],
                          capture_output=True, text=True, cwd=tmp_path)
    assert "No module named 'yaml'" in proc.stderr


def test_full_install_registers_the_real_commands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--port" in out and "needs kvguard" not in out
    with pytest.raises(SystemExit):
        main(["serve", "--no-such-option"])
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err
    assert main([]) == 2


def test_a_bug_in_kvguard_itself_is_not_taken_for_a_missing_extra(monkeypatch):
    import kvguard.cli as cli

    def broken(args):
        raise ModuleNotFoundError("No module named 'kvguard.nowhere'", name="kvguard.nowhere")

    monkeypatch.setattr(cli, "_cmd_demo", broken)
    with pytest.raises(ModuleNotFoundError):
        main(["demo", "--no-model", "--no-sidecar"])
