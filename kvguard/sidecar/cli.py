"""`kvguard serve`, `kvguard token create`, `kvguard keygen`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _settings(args: argparse.Namespace):
    from .settings import load_settings

    if getattr(args, "config", None):
        os.environ["KVGUARD_CONFIG"] = str(args.config)
    overrides = {k: v for k, v in {
        "data_dir": args.data_dir, "database_url": args.database_url,
        "environment": "development" if getattr(args, "dev", False) else None,
        "host": getattr(args, "host", None), "port": getattr(args, "port", None),
    }.items() if v is not None}
    return load_settings(**overrides)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="YAML settings file (also KVGUARD_CONFIG)")
    p.add_argument("--data-dir", type=Path, help="keys, SQLite database, socket (KVGUARD_DATA_DIR; default ./.data)")
    p.add_argument("--database-url", help="SQLAlchemy URL of the audit store (KVGUARD_DATABASE_URL; "
                                          "default SQLite in the data directory)")


def _cmd_serve(args: argparse.Namespace) -> int:
    from .server import serve

    return serve(_settings(args))


def _cmd_token(args: argparse.Namespace) -> int:
    from kvguard.audit.store import migrate
    from sqlalchemy.orm import Session

    from kvguard.audit.store import make_engine

    from .auth import create_token
    from .service import load_or_create_secret

    settings = _settings(args)
    settings.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    # the index key first: a token bound to tenants keeps their indexes under it
    index_key = load_or_create_secret(settings.index_key_path) if args.tenant else None
    migrate(settings.db_url)
    engine = make_engine(settings.db_url)
    try:
        with Session(engine) as db:
            token = create_token(db, args.name, args.scope, tenants=args.tenant, index_key=index_key)
    finally:
        engine.dispose()
    print(token)
    bound = f"; bound to {len(set(args.tenant))} tenant(s)" if args.tenant else ""
    print(f"(scopes: {' '.join(args.scope)}{bound}; shown once, stored only as a hash)", file=sys.stderr)
    return 0


def _cmd_keygen(args: argparse.Namespace) -> int:
    from kvguard.audit.keys import SigningKey

    args.out.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if args.secret:
        import secrets

        from kvguard.audit.keys import write_private_file

        write_private_file(args.out, secrets.token_bytes(32).hex().encode() + b"\n", overwrite=args.force)
        print(f"32-byte secret in {args.out} (mode 0600)")
        return 0
    key = SigningKey.generate()
    key.save(args.out, overwrite=args.force)
    if args.public:
        args.public.write_text(key.public_key.to_pem())
    print(f"key id {key.key_id}; private key in {args.out} (mode 0600)")
    return 0


def register(sub) -> None:
    from .auth import SCOPES

    p = sub.add_parser("serve", help="run the sidecar: admin API, audit log, erasure",
                       description="Run the sidecar beside an inference process: the admin REST API on TCP "
                                   "(default 127.0.0.1:8470), the ingest API for inference processes on a Unix "
                                   "socket, the signed audit log in SQLite (default) or PostgreSQL. Settings come "
                                   "from KVGUARD_* variables and a YAML file; outside development, insecure "
                                   "settings are refused.")
    _common(p)
    p.add_argument("--host", help="admin API address (KVGUARD_HOST)")
    p.add_argument("--port", type=int, help="admin API port (KVGUARD_PORT)")
    p.add_argument("--dev", action="store_true", help="development mode: allows starting without admin tokens")
    p.set_defaults(func=_cmd_serve)

    t = sub.add_parser("token", help="manage admin API tokens")
    tsub = t.add_subparsers(dest="token_command", metavar="ACTION", required=True)
    c = tsub.add_parser("create", help="create a token and print it once",
                        description="Create a bearer token for the admin API. It is printed once; only its "
                                    "SHA-256 is stored.")
    _common(c)
    c.add_argument("--scope", action="append", required=True, choices=SCOPES,
                   help="a scope to grant (repeat for several)")
    c.add_argument("--name", default="admin", help="a label for the token (default: admin)")
    c.add_argument("--tenant", action="append", metavar="TENANT",
                   help="bind an ingest token to this tenant (repeat for several): its processes may send "
                        "events of these tenants only and receive only their erase commands; stored as keyed "
                        "indexes under the index key, so give the sidecar's index key (--data-dir)")
    c.set_defaults(func=_cmd_token)

    k = sub.add_parser("keygen", help="create an Ed25519 signing key file (mode 0600)",
                       description="Create the sidecar's Ed25519 signing key, or with --secret a 32-byte secret "
                                   "(the pseudonyms' index key or the seal key), in a file of mode 0600.")
    k.add_argument("out", type=Path, help="where to write the private key")
    k.add_argument("--public", type=Path, help="also write the public key (PEM) here")
    k.add_argument("--force", action="store_true", help="overwrite an existing file")
    k.add_argument("--secret", action="store_true", help="a 32-byte secret (index or seal key) instead")
    k.set_defaults(func=_cmd_keygen)
