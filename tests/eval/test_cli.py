"""The command line: help that explains the protocol, registration under `kvguard`,
errors without a traceback."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from kvguard.errors import ConfigError
from kvguard.eval import register
from kvguard.eval.cli import main
from kvguard.eval.settings import Settings


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


@pytest.mark.parametrize("argv, words", [
    (["--chunk", "0"], "chunk must be an integer >= 1, got 0"),
    (["--prefix", "0"], "prefix must be an integer >= 1, got 0"),
    (["--score", "1"], "score must be an integer >= 2"),  # no query would be compared: every deviation 0
    (["--page-size", "0"], "page_size must be an integer >= 1, got 0"),
    (["--generate", "-1"], "generate must be an integer >= 0"),
    (["--max-deviation", "2"], "--max-deviation must be between 0 and 1"),
    (["--max-deviation", "nan"], "--max-deviation must be between 0 and 1"),
    (["--max-ppl-increase", "0"], "--max-ppl-increase must be above 0"),
    (["--from-json", "/nonexistent/fidelity.json"], "cannot read /nonexistent/fidelity.json"),
    (["--policies", "/nonexistent/policies"], "no folder /nonexistent/policies"),
])
def test_bad_settings_are_errors_before_any_measurement(capsys, argv, words):
    assert main([*argv, "--methods", "none", "--texts", "", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvguard eval: error: ") and words in err, err


def test_settings_refuse_a_protocol_that_measures_nothing():
    with pytest.raises(ConfigError, match="score must be an integer >= 2"):
        Settings(score=1)
