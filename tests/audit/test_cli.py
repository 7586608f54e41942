"""The audit CLI: exit codes 0/1/2, readable and JSON output, and an offline verifier that
runs with neither torch nor SQLAlchemy importable."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kvguard.audit.cli import main
from kvguard.audit.keys import SigningKey

from .audit_testlib import fill, open_log, read_bundle, write_bundle

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def setup(store, db_url, origin, tmp_path):
    key = SigningKey.generate()
    key.save(tmp_path / "log.key")
    (tmp_path / "log.pub").write_text(key.public_key.to_pem())
    with open_log(store, origin, key) as log:
        fill(log, 25)
        log.append("erase", {"user": "ef" * 16}, {"scope": "user"})
        log.checkpoint()
    return db_url, origin, tmp_path


def test_export_then_verify(setup, capsys):
    url, origin, d = setup
    rc = main(["export", "--database-url", url, "--origin", origin, "--key", str(d / "log.key"),
               "-o", str(d / "b.zip"), "--from-seq", "3", "--to-seq", "20", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    assert "records #3..#20 (18)" in capsys.readouterr().out
    assert main(["verify", str(d / "b.zip"), "--public-key", str(d / "log.pub")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("VERIFIED") and "#3..#20 (18)" in out
    assert main(["verify", str(d / "b.zip"), "--public-key", str(d / "log.pub"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["verified"] is True and result["records"] == 18


def test_not_verified_is_1_and_names_the_failure(setup, capsys):
    url, origin, d = setup
    assert main(["export", "--database-url", url, "--origin", origin, "--key", str(d / "log.key"),
                 "-o", str(d / "b.zip"), "--no-progress"]) == 0
    members = read_bundle(d / "b.zip")
    members["records.jsonl"] = members["records.jsonl"].replace(b'"pages":[7]', b'"pages":[8]')
    write_bundle(d / "bad.zip", members)
    capsys.readouterr()
    assert main(["verify", str(d / "bad.zip"), "--public-key", str(d / "log.pub")]) == 1
    out = capsys.readouterr().out
    assert out.startswith("NOT VERIFIED") and f"{origin}#7" in out and "records.jsonl" in out
    assert "signature" in out and "Traceback" not in out
    assert main(["verify", str(d / "bad.zip"), "--public-key", str(d / "log.pub"), "--json"]) == 1
    error = json.loads(capsys.readouterr().out)["error"]
    assert (error["member"], error["record"], error["check"]) == ("records.jsonl", f"{origin}#7", "signature")


def test_not_verified_when_the_keys_are_not_the_trusted_log_s(setup, store, capsys):
    url, origin, d = setup
    trusted = SigningKey.load(d / "log.key")
    rogue, rogue_origin = SigningKey.generate(), origin + "-rogue"
    with open_log(store, rogue_origin, rogue) as log:  # records no trusted key signed
        fill(log, 5)
        log.checkpoint()
    rogue.save(d / "rogue.key")
    assert main(["export", "--database-url", url, "--origin", rogue_origin, "--key", str(d / "rogue.key"),
                 "-o", str(d / "rogue.zip"), "--no-progress"]) == 0
    write_bundle(d / "rogue-resealed.zip", read_bundle(d / "rogue.zip"), reseal_with=trusted)
    assert main(["export", "--database-url", url, "--origin", origin, "--key", str(d / "log.key"),
                 "-o", str(d / "b.zip"), "--no-progress"]) == 0
    write_bundle(d / "other-signer.zip", read_bundle(d / "b.zip"), reseal_with=rogue)
    (d / "rogue.pub").write_text(rogue.public_key.to_pem())
    capsys.readouterr()
    for bundle, keys, reason in (
        ("rogue-resealed.zip", ["log.pub"], f"the log's first key {rogue.public_key.key_id[:16]}... is not a "
                                            "trusted key"),
        ("other-signer.zip", ["log.pub", "rogue.pub"], f"not signed by key {trusted.public_key.key_id[:16]}"
                                                        "..., the log's key at tree size 26"),
    ):
        argv = ["verify", str(d / bundle)] + [a for k in keys for a in ("--public-key", str(d / k))]
        assert main(argv) == 1
        out = capsys.readouterr().out
        assert out.startswith("NOT VERIFIED") and reason in out and "Traceback" not in out, out


def test_usage_errors_are_2(setup, capsys):
    url, origin, d = setup
    assert main([]) == 2
    assert main(["verify"]) == 2
    assert main(["verify", str(d / "missing.zip"), "--public-key", str(d / "log.pub")]) == 2
    assert main(["verify", str(d / "log.pub"), "--public-key", str(d / "missing.pub")]) == 2
    (d / "bad.pub").write_text("nonsense")
    assert main(["verify", str(d / "log.pub"), "--public-key", str(d / "bad.pub")]) == 2
    (d / "log.key").chmod(0o644)
    assert main(["export", "--database-url", url, "--origin", origin, "--key", str(d / "log.key"),
                 "-o", str(d / "x.zip")]) == 2
    assert "chmod 600" in capsys.readouterr().err
    assert main(["export", "--database-url", url, "--origin", origin, "--key", str(d / "log.key"),
                 "-o", str(d / "x.zip"), "--since", "2025-01-01"]) == 2  # no time zone
    assert main(["--help"]) == 0
    assert "exit status" in capsys.readouterr().out


def test_export_refused_is_1(setup, capsys):
    url, _origin, d = setup
    assert main(["export", "--database-url", url, "--origin", "no.such/log", "--key", str(d / "log.key"),
                 "-o", str(d / "x.zip"), "--no-progress"]) == 1
    assert "no log" in capsys.readouterr().err


# Everything but kvguard/__init__.py and kvguard.audit: what an auditor's laptop lacks or needs not load.
BLOCKED = ("torch", "triton", "sqlalchemy", "alembic", "psycopg", "tqdm", "numpy", "hypothesis", "kvguard.cache",
           "kvguard.compress", "kvguard.kernels", "kvguard.sidecar", "kvguard.hf", "kvguard.eval", "kvguard.policy",
           "kvguard.types", "kvguard.cli")
OFFLINE = textwrap.dedent(f"""
    import sys
    import importlib.abc

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in {BLOCKED!r}):
                raise ImportError(f"{{name}} is not installed here")
            return None

    sys.meta_path.insert(0, Block())
    sys.path.insert(0, {str(REPO)!r})
    from kvguard.audit.cli import main
    code = main(sys.argv[1:])
    loaded = sorted(m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in {BLOCKED!r}))
    print("LOADED", loaded)
    sys.exit(code)
""")


def test_verifier_runs_without_torch_or_sqlalchemy(setup):
    url, origin, d = setup
    assert main(["export", "--database-url", url, "--origin", origin, "--key", str(d / "log.key"),
                 "-o", str(d / "b.zip"), "--no-progress"]) == 0
    members = read_bundle(d / "b.zip")
    members["keys.json"] = members["keys.json"].replace(b'"valid_from_seq":0', b'"valid_from_seq":1')
    write_bundle(d / "bad.zip", members)
    for bundle, expected in (("b.zip", 0), ("bad.zip", 1)):
        proc = subprocess.run([sys.executable, "-I", "-c", OFFLINE, "verify", str(d / bundle),
                               "--public-key", str(d / "log.pub"), "--previous", str(d / "b.zip")],
                              capture_output=True, text=True, cwd=d)
        assert proc.returncode == expected, proc.stdout + proc.stderr
        assert "LOADED []" in proc.stdout
    proc = subprocess.run([sys.executable, "-I", "-c", OFFLINE.replace("from kvguard.audit.cli import main",
                           "import sqlalchemy")], capture_output=True, text=True, cwd=d)
    assert "sqlalchemy is not installed here" in proc.stderr  # the blocker does block


def test_python_dash_m_audit(setup):
    _url, _origin, d = setup
    proc = subprocess.run([sys.executable, "-m", "kvguard.audit", "verify", "--help"], capture_output=True, text=True,
                          cwd=REPO)
    assert proc.returncode == 0 and "--previous" in proc.stdout


def test_prog_names_the_command_when_embedded(capsys):
    assert main(["verify"], prog="kvguard audit") == 2
    assert "usage: kvguard audit verify" in capsys.readouterr().err


def test_export_shows_progress_on_stderr(setup, capsys):
    url, origin, d = setup
    assert main(["export", "--database-url", url, "--origin", origin, "--key", str(d / "log.key"),
                 "-o", str(d / "b.zip")]) == 0
    captured = capsys.readouterr()
    assert f"export {origin}" in captured.err and "100%" in captured.err  # tqdm's bar
    assert "wrote" in captured.out and "export" not in captured.out.split("wrote")[0]


def test_verify_shows_numbered_progress_on_stderr(setup, capsys, monkeypatch):
    url, origin, d = setup
    assert main(["export", "--database-url", url, "--origin", origin, "--key", str(d / "log.key"),
                 "-o", str(d / "b.zip"), "--no-progress"]) == 0
    verify = ["verify", str(d / "b.zip"), "--public-key", str(d / "log.pub")]
    capsys.readouterr()
    assert main(verify + ["--progress"]) == 0
    out, err = capsys.readouterr()
    steps = [line.split(")")[0] for line in err.splitlines()]
    assert steps[0] == "verify (1/8" and steps[-1] == "verify (8/8", err
    assert "verify (5/8) records  26/26 records  100%" in err  # fill(25) + the erase record
    assert out.startswith("VERIFIED") and "verify (" not in out
    assert main(verify + ["--previous", str(d / "b.zip"), "--progress"]) == 0
    assert "verify (9/9) previous bundle" in capsys.readouterr().err
    # by default: only on a terminal, and never under --json or --no-progress
    assert main(verify) == 0
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(verify) == 0
    err = capsys.readouterr().err
    assert "\rverify (5/8) records" in err and err.endswith("\n")
    for quiet in (["--json"], ["--no-progress"]):
        assert main(verify + quiet) == 0
        assert capsys.readouterr().err == ""
    assert main(verify + ["--progress", "--no-progress"]) == 2


def test_verify_bundle_reports_each_step_and_the_records_as_they_stream(setup, monkeypatch):
    from kvguard.audit.bundle import verify as bundle_verify

    url, origin, d = setup
    assert main(["export", "--database-url", url, "--origin", origin, "--key", str(d / "log.key"),
                 "-o", str(d / "b.zip"), "--no-progress"]) == 0
    monkeypatch.setattr(bundle_verify, "PROGRESS_EVERY", 10)
    calls = []
    bundle_verify.verify_bundle(d / "b.zip", [SigningKey.load(d / "log.key").public_key],
                                progress=lambda *call: calls.append(call))
    assert [c[0] for c in calls if c[2] == 0] == list(range(1, 9))  # steps (1)..(8) in order
    assert [c[2] for c in calls if c[0] == 5] == [0, 10, 20, 26] and {c[3] for c in calls if c[0] == 5} == {26}
