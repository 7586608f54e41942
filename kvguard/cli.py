"""The `kvguard` command line.

    kvguard serve            run the sidecar (admin API, audit log, erasure)
    kvguard token create     create an admin API token (printed once)
    kvguard keygen           create an Ed25519 signing key (mode 0600)
    kvguard audit ...        export and verify sealed audit bundles (offline)
    kvguard eval ...         measure fidelity of codecs, evictors and policies on a real model
    kvguard demo             drive a synthetic workload through the cache and print what it saved

Heavy modules are imported by the subcommand that needs them, so `kvguard audit
verify` works with only the audit package's dependencies installed.
"""

from __future__ import annotations

import argparse
import sys


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import main as demo_main

    return demo_main(["--synthetic-only"] if args.synthetic_only else [])


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="drive a workload through the cache and the sidecar",
                       description="Drive a workload through the cache (and, unless --synthetic-only, "
                                   "the sidecar on SQLite) and print what each codec and evictor saved.")
    p.add_argument("--synthetic-only", action="store_true", help="only the in-process cache workload")
    p.set_defaults(func=_cmd_demo)


def _optional(register_path: str, sub) -> None:
    """Register a subcommand whose module may be absent from an audit-only install."""
    module, _, func = register_path.partition(":")
    try:
        mod = __import__(module, fromlist=[func])
    except ImportError:
        return
    getattr(mod, func)(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvguard",
        description="Compliance-audited KV-cache manager: paged compressed KV cache, signed tamper-evident "
                    "audit log, erasure with signed receipts, sealed audit bundles.",
        epilog="Run 'kvguard COMMAND --help' for a command's options. 'kvguard audit --help' lists the "
               "auditor's commands.",
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"kvguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("audit", help="export and verify sealed audit bundles (see 'kvguard audit --help')")
    _add_demo(sub)
    _optional("kvguard.sidecar.cli:register", sub)
    _optional("kvguard.eval.cli:register", sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "audit":
        from kvguard.audit.cli import main as audit_main

        return audit_main(argv[1:], prog="kvguard audit")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
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
