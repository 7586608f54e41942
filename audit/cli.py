"""kvguard-audit: export a sealed audit bundle, or verify one offline.

    kvguard-audit export --database-url URL --origin LOG --key KEY -o FILE [range]
    kvguard-audit verify BUNDLE --public-key KEY [--previous OLD_BUNDLE] [--witness-key VKEY [--witnesses N]]
                         [--json] [--[no-]progress]
    kvguard-audit verify-receipt RECEIPT --public-key KEY [--public-key KEY ...] [--witness-key VKEY [--witnesses N]]
                         [--json]
    kvguard-audit check --database-url URL [--origin LOG ...] [--public-key KEY ...] [--json]

Exit status: 0 exported / verified / consistent; 1 not verified (or export refused, or
the store inconsistent), naming the first failure; 2 usage error, unreadable file or
unreachable store. `main(argv)` returns the status
and never exits the interpreter, so `kvguard audit ...` can call it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime
from typing import Any

from .errors import AuditError, KeyFileError, VerificationError
from .keys import PublicKey, SigningKey

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
MAX_RECEIPT = 16 << 20  # a fleet receipt of many origins stays far below this


class _UsageError(Exception):
    """A bad command line or an unreadable input file: exit status 2."""


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="Export and verify kvguard's sealed audit bundles; check an audit store in place.",
        epilog="exit status: 0 ok, 1 not verified / export refused, 2 usage error or unreadable file")
    sub = p.add_subparsers(dest="command", required=True, metavar="{export,verify,verify-receipt,check}")

    e = sub.add_parser("export", help="write a signed bundle of a log range (needs kvguard[store])",
                       description="Write one bundle file: records, checkpoints, proofs, keys, erasure "
                       "receipts and a DSSE-signed in-toto manifest. Default range: every record a "
                       "checkpoint covers.")
    e.add_argument("--database-url", default=os.environ.get("KVGUARD_DATABASE_URL"),
                   help="SQLAlchemy URL of the audit store (default: $KVGUARD_DATABASE_URL)")
    e.add_argument("--origin", required=True, help="the log to export, e.g. kvguard.example/pod-1")
    e.add_argument("--key", required=True, help="private key file (PEM, mode 0600) that signs the manifest: "
                   "the log's key at the bundle's tree size (its current key exports any range)")
    e.add_argument("-o", "--output", required=True, help="bundle file to write")
    e.add_argument("--from-seq", type=int, help="first record (default 0)")
    e.add_argument("--to-seq", type=int, help="last record, inclusive (default: last checkpointed)")
    e.add_argument("--since", help="records at or after this time (RFC 3339, e.g. 2025-01-31T00:00:00Z)")
    e.add_argument("--until", help="records before this time (RFC 3339)")
    e.add_argument("--witnessed", action="store_true",
                   help="cover the range with the log's latest checkpoint that witnesses cosigned, whose fresh "
                   "cosignatures 'verify --witness-key' requires")
    e.add_argument("--warn-tail", action="store_true",
                   help="export even if a record past the last checkpoint (in no bundle yet) fails verification, "
                   "naming it on stderr; without it the export is refused")
    e.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    v = sub.add_parser("verify", help="verify a bundle offline with the log's first public key",
                       description="Verify every signature, digest, the hash chain, the Merkle root "
                       "against the signed checkpoint and, with --previous, that this bundle extends "
                       "an older one. The log's first key must be a trusted key (later keys are proven "
                       "by their rotation records) and the manifest must be signed by the key in force "
                       "at the bundle's tree size.")
    v.add_argument("bundle", help="bundle file")
    v.add_argument("--public-key", required=True, action="append", dest="public_keys", metavar="KEY",
                   help="trusted public key file (PEM, base64 or hex of the raw key): the key the log "
                   "started with, not a later one; repeatable")
    v.add_argument("--previous", metavar="OLD_BUNDLE", help="an earlier bundle this one must extend")
    _witness_arguments(v)
    v.add_argument("--witness-max-age", type=int, default=600, metavar="SECONDS",
                   help="a cosignature counts only if made at most this long before the bundle's export "
                   "(default 600; 0: any age, which no longer catches a log rolled back to an older checkpoint)")
    v.add_argument("--json", action="store_true", help="print the result as JSON")
    shown = v.add_mutually_exclusive_group()
    shown.add_argument("--progress", action="store_true", default=None,
                       help="show each step's progress on stderr (default: when stderr is a terminal and "
                       "not --json)")
    shown.add_argument("--no-progress", action="store_false", dest="progress", help="no progress on stderr")
    r = sub.add_parser("verify-receipt", help="verify an erasure receipt offline (one log's, or a fleet's)",
                       description="Verify an erasure receipt: one log's (its record's signature, the signed "
                       "checkpoint and the inclusion proof), or a fleet's (every origin's receipt, each record of "
                       "the request and stating the same fleet, one receipt for each origin it names). The file "
                       "may also be the erasure request as the admin API returns it.")
    r.add_argument("receipt", help="receipt file (JSON), or '-' for standard input")
    r.add_argument("--public-key", required=True, action="append", dest="public_keys", metavar="KEY",
                   help="trusted public key file (PEM, base64 or hex); for a fleet, every origin's: repeatable")
    _witness_arguments(r)
    r.add_argument("--json", action="store_true", help="print the result as JSON")
    c = sub.add_parser("check", help="check a whole audit store in place (needs kvguard[store])",
                       description="Check a store as an attacker with database access could have left it: "
                       "every record's signature, chain, key, leaf hash and query columns, every checkpoint "
                       "(signature, root, columns), the keys table against the key_rotation records, and "
                       "that no subject secret an erase record destroyed is stored again. Streams each "
                       "log; stops at the first failure and names it by origin and sequence number.")
    c.add_argument("--database-url", default=os.environ.get("KVGUARD_DATABASE_URL"),
                   help="SQLAlchemy URL of the audit store (default: $KVGUARD_DATABASE_URL)")
    c.add_argument("--origin", action="append", dest="origins", metavar="LOG",
                   help="a log to check (repeatable; default: every log in the store)")
    c.add_argument("--public-key", action="append", dest="public_keys", metavar="KEY", default=[],
                   help="a trusted key a log may start with (repeatable); without one, the keys table's "
                   "first key is trusted")
    c.add_argument("--json", action="store_true", help="print the result as JSON")
    shown = c.add_mutually_exclusive_group()
    shown.add_argument("--progress", action="store_true", default=None,
                       help="a progress bar on stderr (default: when stderr is a terminal and not --json)")
    shown.add_argument("--no-progress", action="store_false", dest="progress", help="no progress bar")
    return p


def _witness_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--witness-key", action="append", default=[], dest="witness_keys", metavar="VKEY",
                   help="a trusted witness's public key <name>+<key id>+<key> (kvguard witness keygen prints "
                   "it) or a file holding it; repeatable. The checkpoint must then carry their cosignatures")
    p.add_argument("--witnesses", type=int, metavar="N",
                   help="how many of the --witness-key witnesses must have cosigned (default: all)")


def _witnesses(args: argparse.Namespace) -> tuple[list, int]:
    from .cosignature import Witness

    witnesses = [Witness.load(k) for k in args.witness_keys]
    count = len(witnesses) if args.witnesses is None else args.witnesses
    if args.witnesses is not None and not 1 <= args.witnesses <= len(witnesses):
        raise _UsageError(f"--witnesses {args.witnesses}: give a number from 1 to the {len(witnesses)} "
                          "--witness-key given")
    if len({w.key for w in witnesses}) != len(witnesses):
        raise _UsageError("the same witness key is given twice: it would count as two witnesses")
    return witnesses, count


def main(argv: list[str] | None = None, prog: str = "kvguard-audit") -> int:
    """Run the CLI on `argv` (default sys.argv[1:]); returns the exit status. `prog` names
    the command in usage and messages (e.g. "kvguard audit" when called from kvguard)."""
    try:
        args = _parser(prog).parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help (0) and on usage errors (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        if args.command == "check":
            return _check(args, prog)
        if args.command == "export":
            return _export(args, prog)
        return _verify(args) if args.command == "verify" else _verify_receipt(args)
    except (_UsageError, KeyFileError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _export(args: argparse.Namespace, prog: str) -> int:
    if not args.database_url:
        raise _UsageError("--database-url (or KVGUARD_DATABASE_URL) is required")
    if (args.since or args.until) and (args.from_seq is not None or args.to_seq is not None):
        raise _UsageError("give --from-seq/--to-seq or --since/--until, not both")
    since, until = _time(args.since, "--since"), _time(args.until, "--until")
    key = SigningKey.load(args.key)
    try:
        from .bundle.export import export_bundle
        from .store import AuditStore
    except ImportError as exc:
        raise _UsageError(f"export needs the store extra (pip install 'kvguard[store]'): {exc}") from None
    store = AuditStore(args.database_url)
    try:
        summary = export_bundle(store, args.origin, args.output, key, from_seq=args.from_seq,
                                to_seq=args.to_seq, since_ms=since, until_ms=until,
                                progress=not args.no_progress, witnessed=args.witnessed,
                                warn_tail=args.warn_tail)
    except AuditError as exc:
        print(f"{prog}: export refused: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as exc:  # the database itself: unreachable, no schema
        print(f"{prog}: export failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        store.dispose()
    if summary.tail_failure is not None:
        print(f"{prog}: warning: {summary.tail_failure}; run `kvguard audit check`", file=sys.stderr)
    print(f"wrote {summary.path}: {summary.origin} records #{summary.from_seq}..#{summary.to_seq} "
          f"({summary.records}), tree size {summary.tree_size}, {summary.receipts} erasure receipts "
          f"in {summary.seconds:.1f}s")
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    from .bundle.verify import verify_bundle

    keys = [PublicKey.load(path) for path in args.public_keys]
    witnesses, count = _witnesses(args)
    for path in [args.bundle] + ([args.previous] if args.previous else []):
        try:
            open(path, "rb").close()
        except OSError as exc:
            raise _UsageError(f"cannot read {path}: {exc.strerror}") from None
    show = args.progress if args.progress is not None else sys.stderr.isatty() and not args.json
    progress = _Progress(sys.stderr, steps=10 if witnesses else 9 if args.previous else 8) if show else None
    try:
        summary = verify_bundle(args.bundle, keys, previous=args.previous, progress=progress,
                                witnesses=witnesses, min_witnesses=count,
                                max_age_s=args.witness_max_age or None)
    except VerificationError as exc:
        _report(args, False, error=exc)
        return EXIT_FAILED
    finally:
        if progress:
            progress.close()
    _report(args, True, summary=summary)
    return EXIT_OK


def _check(args: argparse.Namespace, prog: str) -> int:
    if not args.database_url:
        raise _UsageError("--database-url (or KVGUARD_DATABASE_URL) is required")
    keys = [PublicKey.load(path) for path in args.public_keys]
    try:
        from tqdm import tqdm

        from .check import check_store, store_size
        from .store import AuditStore
    except ImportError as exc:
        raise _UsageError(f"check needs the store extra (pip install 'kvguard[store]'): {exc}") from None
    show = args.progress if args.progress is not None else sys.stderr.isatty() and not args.json
    store = AuditStore(args.database_url)
    bar = None
    try:
        total = store_size(store, args.origins) if show else None
        bar = tqdm(total=total, unit="rec", unit_scale=True, desc="check", file=sys.stderr,
                   disable=not show, mininterval=0.5)
        summary = check_store(store, args.origins, keys, progress=bar.update)
    except VerificationError as exc:
        if bar is not None:
            bar.close()
        _report_check(args, False, error=exc)
        return EXIT_FAILED
    except AuditError as exc:  # e.g. no such log
        raise _UsageError(str(exc)) from None
    except Exception as exc:  # the database itself: unreachable, no schema
        raise _UsageError(f"cannot read the store: {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
    finally:
        if bar is not None:
            bar.close()
        store.dispose()
    _report_check(args, True, summary=summary)
    return EXIT_OK


def _print_failure(error: VerificationError, width: int) -> None:
    """What failed, a line each: the bundle member (if any), the record, the check, the reason."""
    for label, value in (("member", error.member), ("record", error.record),
                         ("check", error.check), ("reason", error.message)):
        if value:
            print(f"  {label:<{width}}{value}")


def _report_check(args, ok: bool, summary: Any = None, error: VerificationError | None = None) -> None:
    if args.json:
        out: dict[str, Any] = {"consistent": ok}
        if ok:
            out.update({k: getattr(summary, k) for k in summary.__slots__})
        else:
            out["error"] = error.to_dict()
        print(json.dumps(out, indent=2))
        return
    if not ok:
        print("NOT CONSISTENT")
        _print_failure(error, 13)
        return
    s = summary
    print("CONSISTENT")
    print(f"  {'logs':<13}{s.origins}")
    print(f"  {'records':<13}{s.records} ({s.erase_records} erase records)")
    print(f"  {'checkpoints':<13}{s.checkpoints}")
    print(f"  {'keys':<13}{s.keys} key rows, each matching its rotation record")
    print(f"  {'secrets':<13}{s.secrets} subject secrets, none destroyed by an erase record")
    print(f"  {'time':<13}{s.seconds:.1f}s")
    if not args.public_keys:
        print("  note         the keys table's first key was trusted; pass --public-key to pin it")


class _Progress:
    """Verification's steps on stderr, numbered as in kvguard.audit.bundle.verify, with the
    records step's count, share and rate. On a terminal one line is redrawn in place; in a file
    each update is a line of its own, at most one a second. (No tqdm: the auditor's install
    has only cryptography and rfc8785.)"""

    def __init__(self, stream, steps: int) -> None:
        self.stream, self.steps = stream, steps
        self.tty = stream.isatty()
        self.interval = 0.2 if self.tty else 1.0
        self.step, self.started, self.shown, self.width = 0, 0.0, 0.0, 0

    def __call__(self, step: int, name: str, done: int, total: int) -> None:
        now = time.monotonic()
        if step != self.step:
            self._end_line()
            self.step, self.started, self.shown = step, now, 0.0
        elif now - self.shown < self.interval and done != total:
            return
        self.shown = now
        text = f"verify ({step}/{self.steps}) {name}"
        if step == 5 and total:
            rate = done / max(now - self.started, 1e-9)
            text += f"  {done:,}/{total:,} records  {done / total:.0%}"
            if done:
                text += f"  {rate:,.0f} rec/s" + (f", {(total - done) / rate:.0f}s left" if done < total else "")
        self._write(text)

    def _write(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r" + text.ljust(self.width))
            self.width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def _end_line(self) -> None:
        if self.tty and self.width:
            self.stream.write("\n")
            self.width = 0

    def close(self) -> None:
        self._end_line()
        self.stream.flush()


def _report(args, ok: bool, summary: Any = None, error: VerificationError | None = None) -> None:
    if args.json:
        out: dict[str, Any] = {"verified": ok, "bundle": args.bundle}
        if ok:
            out.update({k: getattr(summary, k) for k in summary.__slots__})
        else:
            out["error"] = error.to_dict()
        print(json.dumps(out, indent=2))
        return
    if not ok:
        print(f"NOT VERIFIED  {args.bundle}")
        _print_failure(error, 11)
        return
    s = summary
    print(f"VERIFIED  {args.bundle}")
    print(f"  {'log':<11}{s.origin}")
    print(f"  {'records':<11}#{s.from_seq}..#{s.to_seq} ({s.records})")
    print(f"  {'checkpoint':<11}tree size {s.tree_size}, root {s.root}")
    print(f"  {'keys':<11}{s.keys}; manifest signed by {s.signer}")
    print(f"  {'receipts':<11}{s.receipts} erasure receipt(s)")
    if s.previous_tree_size is not None:
        print(f"  {'previous':<11}extends the bundle at tree size {s.previous_tree_size}")
    if s.cosignatures is not None:
        print(f"  {'witnesses':<11}{s.cosignatures} valid cosignature(s) on the checkpoint, made within the "
              f"maximum age before the export at {s.exported_at}: check that is when the bundle was made")


def _verify_receipt(args: argparse.Namespace) -> int:
    from .canonical import loads
    from .cosignature import require_cosignatures
    from .receipt import FLEET_RECEIPT_FORMAT, verify_fleet_receipt, verify_receipt

    keys = [PublicKey.load(path) for path in args.public_keys]
    witnesses, count = _witnesses(args)
    try:
        data = sys.stdin.buffer.read(MAX_RECEIPT + 1) if args.receipt == "-" else open(args.receipt, "rb").read(
            MAX_RECEIPT + 1)
        if len(data) > MAX_RECEIPT:
            raise _UsageError(f"{args.receipt} is larger than {MAX_RECEIPT >> 20} MiB: not a receipt")
        receipt = loads(data)
    except OSError as exc:
        raise _UsageError(f"cannot read {args.receipt}: {exc.strerror}") from None
    except ValueError as exc:
        raise _UsageError(f"{args.receipt} is not JSON: {exc}") from None
    if isinstance(receipt, dict) and isinstance(receipt.get("receipt"), dict):
        receipt = receipt["receipt"]  # an erasure request as the admin API returns it
    fleet = isinstance(receipt, dict) and receipt.get("format") == FLEET_RECEIPT_FORMAT
    try:
        if fleet:
            records = verify_fleet_receipt(receipt, keys)
            parts = receipt["receipts"]
        else:
            by_id = {k.key_id: k for k in keys}
            key_id = receipt.get("record", {}).get("key_id") if isinstance(receipt, dict) else None
            records, parts = [verify_receipt(receipt, by_id.get(key_id, keys[0]))], [receipt]
        # each origin's checkpoint cosigned by the witnesses required
        cosigned = [len(require_cosignatures(p["checkpoint"], witnesses, count)) for p in parts] if count else None
    except VerificationError as exc:
        if args.json:
            print(json.dumps({"verified": False, "receipt": args.receipt, "error": exc.to_dict()}, indent=2))
        else:
            print(f"NOT VERIFIED  {args.receipt}")
            _print_failure(exc, 11)
        return EXIT_FAILED
    out = [{"origin": r.origin, "seq": r.seq, "request": r.details.get("request"), "time": r.time,
            "tree_size": p["tree_size"], **({"cosignatures": cosigned[i]} if cosigned else {})}
           for i, (r, p) in enumerate(zip(records, parts))]
    if args.json:
        print(json.dumps({"verified": True, "receipt": args.receipt, "records": out}, indent=2))
    else:
        print(f"VERIFIED  {args.receipt}: {len(records)} erase record(s)")
        for o in out:
            line = f"  {o['origin']}  record #{o['seq']}  request {o['request']}  checkpoint tree size {o['tree_size']}"
            if cosigned:
                line += f"  {o['cosignatures']} valid cosignature(s)"
            print(line)
    return EXIT_OK


def _time(text: str | None, flag: str) -> int | None:
    if text is None:
        return None
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        raise _UsageError(f"{flag} {text!r} is not an RFC 3339 time") from None
    if dt.tzinfo is None:
        raise _UsageError(f"{flag} {text!r} needs a time zone (e.g. Z)")
    return int(dt.timestamp() * 1000)


if __name__ == "__main__":
    sys.exit(main())
