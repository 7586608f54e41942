"""`kvguard serve`, `kvguard token create|list|revoke`, `kvguard keygen`; `kvguard db` and
`kvguard keys` are in dbcli."""

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


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400}


def duration(text: str) -> float:
    """'90s', '15m', '12h', '30d' or a number of seconds."""
    unit = _UNITS.get(text[-1:].lower())
    try:
        value = float(text[:-1] if unit else text) * (unit or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: give e.g. 90s, 15m, 12h or 30d") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError("a duration must be positive")
    return value


def _token_db(args: argparse.Namespace, *, index_key: bool = False):
    """The settings' database, migrated (production on PostgreSQL: checked to be current,
    `kvguard db upgrade` migrates it), as a session factory; and the index key if asked."""
    from sqlalchemy.orm import sessionmaker

    from kvguard.audit.store import check_current, make_engine, migrate

    from .service import load_or_create_secret, private_files, secure_data_dir, secure_sqlite_files

    settings = _settings(args)
    secure_data_dir(settings.data_dir)
    with private_files():
        # the index key first: a token bound to tenants keeps their indexes under it
        key = load_or_create_secret(settings.index_key_path) if index_key else None
        if settings.migrates_at_start:
            migrate(settings.db_url)
        check_current(settings.db_url)
    secure_sqlite_files(settings.db_url)
    return make_engine(settings.db_url), sessionmaker(), key


def _cmd_token(args: argparse.Namespace) -> int:
    from .auth import create_token, list_tokens, revoke_token

    engine, sessions, index_key = _token_db(args, index_key=bool(getattr(args, "tenant", None)))
    try:
        with sessions(bind=engine) as db:
            if args.token_command == "list":
                _print_tokens(list_tokens(db))
                return 0
            if args.token_command == "revoke":
                revoke_token(db, args.id)
                print(f"token {args.id} revoked", file=sys.stderr)
                return 0
            token = create_token(db, args.name, args.scope, tenants=args.tenant, index_key=index_key,
                                 expires_in_s=args.expires_in)
    finally:
        engine.dispose()
    print(token)
    bound = f"; bound to {len(set(args.tenant))} tenant(s)" if args.tenant else ""
    expires = f"; expires in {args.expires_in:g} s" if args.expires_in else ""
    print(f"(scopes: {' '.join(args.scope)}{bound}{expires}; shown once, stored only as a hash)", file=sys.stderr)
    return 0


def _print_tokens(tokens) -> None:
    import time

    def when(ms: int | None) -> str:
        return "-" if ms is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000))

    now = time.time_ns() // 1_000_000
    rows = [("ID", "NAME", "SCOPES", "TENANTS", "CREATED", "EXPIRES", "STATE")]
    for t in tokens:
        state = "revoked" if t.revoked else "expired" if t.expires_ms is not None and t.expires_ms <= now else "active"
        rows.append((t.id, t.name, ",".join(t.scopes.split()), "all" if t.tenants is None else str(t.tenants),
                     when(t.created_ms), when(t.expires_ms), state))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())


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
    from . import dbcli
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

    t = sub.add_parser("token", help="manage API tokens (admin API, ingest, inference keys)")
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
                        "indexes under the index key, so give the sidecar's index key (--data-dir). An infer "
                        "token (an API key of 'kvguard serve-llm') takes exactly one: the tenant of its requests")
    c.add_argument("--expires-in", type=duration, metavar="DURATION",
                   help="the token stops working after this long: 90s, 15m, 12h, 30d (default: never)")
    c.set_defaults(func=_cmd_token)

    ls = tsub.add_parser("list", help="list tokens (never their secrets)",
                         description="List the tokens: id, name, scopes, how many tenants an ingest token is "
                                     "bound to, when it was created and expires, and whether it is active, "
                                     "expired or revoked. Tokens are stored as hashes; none can be shown again.")
    _common(ls)
    ls.set_defaults(func=_cmd_token)
    rv = tsub.add_parser("revoke", help="revoke a token by its id",
                         description="Revoke a token by the id 'kvguard token list' shows: from the next "
                                     "request on it gets 401. A revoked token stays listed.")
    _common(rv)
    rv.add_argument("id", help="the token's id (kvguard token list)")
    rv.set_defaults(func=_cmd_token)

    k = sub.add_parser("keygen", help="create an Ed25519 signing key file (mode 0600)",
                       description="Create the sidecar's Ed25519 signing key, or with --secret a 32-byte secret "
                                   "(the pseudonyms' index key or the seal key), in a file of mode 0600.")
    k.add_argument("out", type=Path, help="where to write the private key")
    k.add_argument("--public", type=Path, help="also write the public key (PEM) here")
    k.add_argument("--force", action="store_true", help="overwrite an existing file")
    k.add_argument("--secret", action="store_true", help="a 32-byte secret (index or seal key) instead")
    k.set_defaults(func=_cmd_keygen)
    dbcli.register(sub, _common)
