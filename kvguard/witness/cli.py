"""`kvguard witness keygen` and `kvguard witness serve`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_PORT = 8471


def _cmd_keygen(args: argparse.Namespace) -> int:
    from kvguard.audit.cosignature import Witness
    from kvguard.audit.keys import SigningKey

    args.out.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = SigningKey.generate()
    vkey = Witness(args.name, key.public_key).vkey()  # checks the name before anything is written
    key.save(args.out, overwrite=args.force)
    if args.vkey:
        args.vkey.write_text(vkey + "\n")
    print(vkey)
    print(f"(the witness key above is public: give it to the logs and auditors; private key in {args.out}, "
          "mode 0600)", file=sys.stderr)
    return 0


def _logs(items: list[str]) -> dict:
    from kvguard.audit.errors import KeyFileError
    from kvguard.audit.keys import PublicKey

    logs: dict[str, list] = {}
    for item in items:
        origin, sep, key = item.partition("=")
        if not sep or not origin or not key:
            raise SystemExit(f"kvguard witness serve: --log {item!r}: give ORIGIN=PUBLIC_KEY_FILE")
        try:
            public = PublicKey.load(key) if Path(key).is_file() else PublicKey.from_text(key)
        except KeyFileError as exc:
            raise SystemExit(f"kvguard witness serve: --log {origin}: {exc}") from None
        logs.setdefault(origin, []).append(public)
    return logs


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvguard.audit.keys import SigningKey
    from kvguard.sidecar.logs import configure, log

    from .app import WitnessConfig, create_app
    from .store import WitnessStore

    configure(args.log_format)
    if not args.log:
        raise SystemExit("kvguard witness serve: no --log ORIGIN=KEY: a witness cosigns only logs it knows")
    key = SigningKey.load(args.key)  # refuses a file others can read
    config = WitnessConfig(args.name, key, _logs(args.log), max_body_bytes=args.max_body_bytes)
    url = args.database_url or f"sqlite:///{Path(args.key).resolve().parent / 'witness.db'}"
    old = os.umask(0o077)  # a SQLite file of the witness's state: its owner's only
    try:
        store = WitnessStore(url)
    finally:
        os.umask(old)
    log.info("witness ready", vkey=config.witness.vkey(), logs=sorted(config.logs), host=args.host, port=args.port)
    # the servers' h11 protocol: a request must arrive whole within the read timeout, so clients
    # sending a byte at a time cannot hold the witness's connections
    from kvguard.connections import MAX_HEADER_BYTES, protocol

    uvicorn.run(create_app(config, store), host=args.host, port=args.port, log_config=None, access_log=False,
                server_header=False, http=protocol(args.read_timeout_s), timeout_keep_alive=5,
                limit_concurrency=args.max_connections, h11_max_incomplete_event_size=MAX_HEADER_BYTES)
    store.dispose()
    return 0


def register(sub) -> None:
    w = sub.add_parser("witness", help="run a C2SP tlog-witness that cosigns kvguard checkpoints",
                       description="A witness: a separate service with its own key and storage that cosigns a "
                                   "log's checkpoint only if it is consistent with the last one it cosigned for "
                                   "that log (C2SP tlog-witness, tlog-cosignature).")
    wsub = w.add_subparsers(dest="witness_command", metavar="ACTION", required=True)
    k = wsub.add_parser("keygen", help="create the witness's Ed25519 key; prints its public witness key",
                        description="Create the witness's private key (PEM, mode 0600) and print its public "
                                    "witness key <name>+<key id>+<key> (a C2SP vkey), which sidecars "
                                    "(KVGUARD_WITNESSES) and auditors (--witness-key) are given.")
    k.add_argument("out", type=Path, help="where to write the private key")
    k.add_argument("--name", required=True, help="the witness's name, e.g. witness.example.com/w1")
    k.add_argument("--vkey", type=Path, help="also write the public witness key to this file")
    k.add_argument("--force", action="store_true", help="overwrite an existing key file")
    k.set_defaults(func=_cmd_keygen)

    s = wsub.add_parser("serve", help="serve POST /add-checkpoint",
                        description="Serve the tlog-witness API: POST /add-checkpoint cosigns a checkpoint of a "
                                    "configured log if a consistency proof links it to the last one cosigned "
                                    "for that log (409 with the witness's size if the client's old size is "
                                    "not it, 422 if the proof fails, 403 if the log's signature does).")
    s.add_argument("--name", required=True, help="the witness's name (as given to keygen)")
    s.add_argument("--key", required=True, help="the witness's private key file (kvguard witness keygen)")
    s.add_argument("--log", action="append", default=[], metavar="ORIGIN=KEY",
                   help="a log to witness: its origin and a public key file (PEM, base64 or hex) or the key "
                        "itself; repeat per log, and per key of a log whose key rotated. ORIGIN may end in '*': "
                        "every origin starting with the rest, signed by that key (pods naming their own logs)")
    s.add_argument("--database-url", default=os.environ.get("KVGUARD_WITNESS_DATABASE_URL"),
                   help="where the witness keeps its state: a SQLAlchemy URL (default: witness.db beside the "
                        "key; $KVGUARD_WITNESS_DATABASE_URL)")
    s.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    s.add_argument("--max-body-bytes", type=int, default=16 * 1024, help="largest request body (default 16384)")
    s.add_argument("--max-connections", type=int, default=64, help="concurrent connections (default 64)")
    s.add_argument("--read-timeout-s", type=float, default=10.0,
                   help="a request's headers and body must arrive within this (default 10)")
    s.add_argument("--log-format", choices=("json", "console", "auto"), default="auto")
    s.set_defaults(func=_cmd_serve)
