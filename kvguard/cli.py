"""The `kvguard` command line.

    kvguard serve            run the sidecar (admin API, audit log, erasure)
    kvguard serve-llm        an OpenAI-compatible inference server whose KV cache is kvguard's
    kvguard token create     create an admin API token (printed once)
    kvguard keygen           create an Ed25519 signing key (mode 0600)
    kvguard db upgrade|grant migrate the audit store as its owner; grant the sidecar's role
    kvguard keys rotate      rotate the log's signing key (running sidecar, or --offline)
    kvguard erasure exclude  close a fleet erasure without a sidecar gone for good
    kvguard fleet status     the sidecars sharing the database
    kvguard audit ...        export and verify sealed audit bundles (offline), check a store
    kvguard witness ...      a C2SP tlog-witness cosigning the sidecars' checkpoints
    kvguard eval ...         measure fidelity of codecs, evictors and policies on a real model
    kvguard demo             what each scenario policy saves and costs on a real model, then the sidecar

Heavy modules are imported by the subcommand that needs them, so `kvguard audit
verify` works with only the audit package's dependencies installed, and every
command's --help works there too. A command whose extra is not installed says
which one to install and exits 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

EXIT_USAGE = 2

# Subcommands that live in modules of an extra: (module:register, extra, {command: help}).
# On an install without the extra, each command is still listed and its --help says what to install.
_OPTIONAL = (
    ("kvguard.sidecar.cli:register", "serve", {
        "serve": "run the sidecar: admin API, audit log, erasure",
        "token": "manage admin API tokens",
        "keygen": "create an Ed25519 signing key file (mode 0600)",
        "db": "migrate the audit store and grant the sidecar's database role",
        "keys": "rotate the log's signing key",
        "erasure": "operate on fleet erasure requests",
        "fleet": "the sidecars sharing the database",
    }),
    ("kvguard.witness.cli:register", "serve", {
        "witness": "run a C2SP tlog-witness that cosigns kvguard checkpoints",
    }),
    ("kvguard.eval.cli:register", "models", {
        "eval": "measure fidelity of codecs, evictors and policies on a real model",
    }),
    ("kvguard.serve.cli:register", "models", {
        "serve-llm": "serve a model over an OpenAI-compatible API, its KV cache kvguard's",
    }),
)
# The extra each command needs when it runs (its --help needs none).
EXTRAS = {"serve": "serve", "token": "serve", "keygen": "serve", "witness": "serve", "db": "serve", "keys": "serve",
          "erasure": "serve", "fleet": "serve", "eval": "models", "demo": "models", "serve-llm": "models"}


def _install_hint(extra: str) -> str:
    return f"pip install 'kvguard[{extra}]'"


def _missing_dependency(exc: ImportError) -> str | None:
    """The third-party module an ImportError says is absent, or None when it is kvguard's own
    (a bug to show, not an extra to install)."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    top = exc.name.split(".")[0]
    return None if top == "kvguard" else top


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run

    return run(args)


def _add_demo(sub) -> None:
    # kvguard.demo imports torch only when it runs: its options and --help need nothing heavy
    from .demo import DESCRIPTION, add_arguments

    p = sub.add_parser("demo", help="what each scenario policy saves and costs on a real model, then the sidecar",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=_cmd_demo)


def _add_missing(sub, name: str, help: str, extra: str, module: str) -> None:
    p = sub.add_parser(name, help=f"{help} (needs kvguard[{extra}])",
                       description=f"{help}. This install lacks {module}, which it needs: "
                                   f"{_install_hint(extra)}")
    p.set_defaults(func=None, missing=(extra, module))


def _optional(register_path: str, extra: str, commands: dict[str, str], sub) -> None:
    """Register the subcommands of a module that an install without `extra` cannot import."""
    module, _, func = register_path.partition(":")
    try:
        register = getattr(importlib.import_module(module), func)
        # a dry run on a scratch parser: register() may import what the extra brings, and a
        # failure half way must not leave half of its commands on the real parser
        register(argparse.ArgumentParser().add_subparsers())
    except ImportError as exc:
        missing = _missing_dependency(exc)
        if missing is None:
            raise
        for name, help in commands.items():
            _add_missing(sub, name, help, extra, missing)
        return
    register(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvguard",
        description="Compliance-audited KV-cache manager: paged compressed KV cache, signed tamper-evident "
                    "audit log, erasure with signed receipts, sealed audit bundles.",
        epilog="Run 'kvguard COMMAND --help' for a command's options. 'kvguard audit --help' lists the "
               "auditor's commands. New here? 'kvguard demo' shows what the policies save and cost.",
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"kvguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("audit", help="export, verify and check audit logs (see 'kvguard audit --help')")
    _add_demo(sub)
    for register_path, extra, commands in _OPTIONAL:
        _optional(register_path, extra, commands, sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "audit":
        from kvguard.audit.cli import main as audit_main

        return audit_main(argv[1:], prog="kvguard audit")
    parser = build_parser()
    # known args first: a command whose extra is missing has no options to check, only a hint to give
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "missing", None):
        extra, module = args.missing
        print(f"kvguard {args.command}: needs the '{extra}' extra, which this install lacks ({module} is "
              f"missing): {_install_hint(extra)}", file=sys.stderr)
        return EXIT_USAGE
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ImportError as e:
        missing = _missing_dependency(e)
        if missing is None:
            raise
        extra = EXTRAS.get(args.command, "models")
        print(f"kvguard {args.command}: needs the '{extra}' extra, which this install lacks ({missing} is "
              f"missing): {_install_hint(extra)}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # expected errors print without a traceback
        from .errors import KVGuardError

        expected: tuple[type[BaseException], ...] = (KVGuardError,)
        try:
            from kvguard.audit.errors import AuditError

            expected += (AuditError,)
        except ImportError:
            pass
        if isinstance(e, expected):
            print(f"kvguard: error: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
