"""The command line: help that explains the protocol, registration under `kvguard`,
errors without a traceback."""

from __future__ import annotations

import argparse
import subprocess
import sys

from kvguard.eval import register
from kvguard.eval.cli import main


def test_module_help_describes_the_protocol():
    out = subprocess.run([sys.executable, "-m", "kvguard.eval", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for words in ("--prefix", "--score", "--methods", "--policies", "docs/fidelity.md", "||O'-O||/||O||",
                  "sparse"):
        assert words in out


def test_register_adds_eval_to_a_parser():
    parser = argparse.ArgumentParser(prog="kvguard")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["eval", "--methods", "none,int8", "--texts", "stdlib-code", "--prefix", "256"])
    assert args.methods == ["none", "int8"] and args.texts == ["stdlib-code"] and args.prefix == 256
    assert callable(args.func)


def test_kvguard_eval_help_through_the_main_command():
    out = subprocess.run([sys.executable, "-m", "kvguard", "eval", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--budget" in out.stdout


def test_bad_arguments_are_errors_not_tracebacks(capsys):
    assert main(["--formats", "pdf"]) == 1
    assert "unknown format(s) ['pdf']" in capsys.readouterr().err
    assert main(["--methods", "int3", "--policies", ""]) == 1
    assert "unknown method(s) ['int3']" in capsys.readouterr().err
