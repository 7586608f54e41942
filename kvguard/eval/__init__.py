"""The fidelity harness: what codecs, evictors and policies do to a real model.

    from kvguard.eval import evaluate, builtin_methods, Settings, load_texts, write_report
    report = evaluate(model, tokenizer, load_texts(["stdlib-code"]), list(builtin_methods().values()))
    write_report(report, Path("out"))

Command line: `kvguard eval --help` or `python -m kvguard.eval --help`; `register(subparsers)`
adds the subcommand to an argparse parser. The protocol is in docs/fidelity.md.
Imports are lazy so that the command line's help needs neither torch nor transformers.
"""

from __future__ import annotations

from .cli import register

_LAZY = {
    "evaluate": ("evaluate", "evaluate"), "Report": ("evaluate", "Report"),
    "Settings": ("settings", "Settings"), "Summary": ("harness", "Summary"),
    "Method": ("methods", "Method"), "builtin_methods": ("methods", "builtin_methods"),
    "policy_method": ("methods", "policy_method"), "load_texts": ("texts", "load_texts"),
    "write_report": ("report", "write"), "ProbeCache": ("probe", "ProbeCache"),
    "quest_attention": ("sparse", "quest_attention"), "HeadwiseCache": ("headwise", "HeadwiseCache"),
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    return getattr(importlib.import_module(f".{module}", __name__), attr)


__all__ = ["register", *_LAZY]
