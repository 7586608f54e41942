"""`kvguard serve`, `kvguard token create|list|revoke`, `kvguard keygen`, `kvguard erasure exclude`,
`kvguard fleet status`; `kvguard db` and `kvguard keys` are in dbcli."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .options import add_common, settings_from


def _cmd_serve(args: argparse.Namespace) -> int:
    from .server import serve

    return serve(settings_from(args))


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

    settings = settings_from(args)
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


def _fleet_db(args: argparse.Namespace):
    """A session factory on the settings' database, which must be migrated already (these
    commands run as the sidecars' role, which may not own the schema)."""
    from sqlalchemy.orm import sessionmaker

    from kvguard.audit.store import check_current, make_engine

    settings = settings_from(args)
    check_current(settings.db_url)
    engine = make_engine(settings.db_url)
    return engine, sessionmaker(engine), settings


def _cmd_exclude(args: argparse.Namespace) -> int:
    from .erasure import exclude

    engine, sessions, _ = _fleet_db(args)
    try:
        with sessions() as db:
            exclude(db, args.request, args.origin, args.reason)
    finally:
        engine.dispose()
    print(f"{args.origin} excluded from request {args.request}; every record of the request states the reason",
          file=sys.stderr)
    return 0


def _cmd_fleet_status(args: argparse.Namespace) -> int:
    import time

    from sqlalchemy import func, select

    from .fleet import is_down, now_ms
    from .models import ErasurePart, ErasureRequest, FleetSidecar

    engine, sessions, settings = _fleet_db(args)
    try:
        with sessions() as db:
            sidecars = db.scalars(select(FleetSidecar).order_by(FleetSidecar.origin)).all()
            waiting = dict(db.execute(select(ErasurePart.origin, func.count()).join(
                ErasureRequest, ErasureRequest.id == ErasurePart.request_id).where(
                ErasurePart.state.in_(("pending", "erased")), ErasureRequest.state.in_(("received", "executing"))
            ).group_by(ErasurePart.origin)).all())
    finally:
        engine.dispose()
    now = now_ms()
    rows = [("ORIGIN", "STATE", "LAST HEARTBEAT", "STARTED", "KEY ID", "ERASURES WAITING")]
    for sc in sidecars:
        state = "left" if sc.left_ms is not None else "down" if is_down(sc, settings.fleet_deadline_s, now) else "live"
        rows.append((sc.origin, state, f"{(now - sc.heartbeat_ms) / 1000:.0f}s ago",
                     time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(sc.started_ms / 1000)), sc.key_id[:16],
                     str(waiting.get(sc.origin, 0))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    return 0


def _cmd_fleet_remove(args: argparse.Namespace) -> int:
    from .fleet import now_ms
    from .models import FleetSidecar

    engine, sessions, _ = _fleet_db(args)
    try:
        with sessions() as db:
            row = db.get(FleetSidecar, args.origin)
            if row is None:
                from ..errors import InputError

                raise InputError(f"no sidecar {args.origin} in this database ('kvguard fleet status' lists them)")
            if row.left_ms is None:
                row.left_ms = now_ms()
                db.commit()
    finally:
        engine.dispose()
    print(f"{args.origin} marked as left: new erasure requests will not wait for it (a start under this origin "
          "joins again); its open requests still do: 'kvguard erasure exclude' each", file=sys.stderr)
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
    add_common(p)
    p.add_argument("--host", help="admin API address (KVGUARD_HOST)")
    p.add_argument("--port", type=int, help="admin API port (KVGUARD_PORT)")
    p.add_argument("--dev", action="store_true", help="development mode: allows starting without admin tokens")
    p.set_defaults(func=_cmd_serve)

    t = sub.add_parser("token", help="manage API tokens (admin API, ingest, inference keys)")
    tsub = t.add_subparsers(dest="token_command", metavar="ACTION", required=True)
    c = tsub.add_parser("create", help="create a token and print it once",
                        description="Create a bearer token for the admin API. It is printed once; only its "
                                    "SHA-256 is stored.")
    add_common(c)
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
    add_common(ls)
    ls.set_defaults(func=_cmd_token)
    rv = tsub.add_parser("revoke", help="revoke a token by its id",
                         description="Revoke a token by the id 'kvguard token list' shows: from the next "
                                     "request on it gets 401. A revoked token stays listed.")
    add_common(rv)
    rv.add_argument("id", help="the token's id (kvguard token list)")
    rv.set_defaults(func=_cmd_token)

    e = sub.add_parser("erasure", help="operate on fleet erasure requests")
    esub = e.add_subparsers(dest="erasure_command", metavar="ACTION", required=True)
    x = esub.add_parser("exclude", help="close a request without one origin, for a recorded reason",
                        description="An erasure request completes when every sidecar of the fleet has carried "
                                    "out its part. When a sidecar (a pod) is gone for good, its part would wait "
                                    "forever: exclude it, with a reason that every erase record of the request "
                                    "states. Refused once that origin's processes have erased, and for the last "
                                    "origin taking part.")
    add_common(x)
    x.add_argument("request", help="the request's id")
    x.add_argument("origin", help="the origin (sidecar) to exclude, as the request's pending_origins name it")
    x.add_argument("--reason", required=True, help="why (at most 200 characters, stated in the signed records: "
                                                   "name no person)")
    x.set_defaults(func=_cmd_exclude)

    f = sub.add_parser("fleet", help="the sidecars sharing the database")
    fsub = f.add_subparsers(dest="fleet_command", metavar="ACTION", required=True)
    st = fsub.add_parser("status", help="each sidecar: live, down or left, and the erasures waiting for it",
                         description="List the sidecars registered in the database: live (heartbeat within "
                                     "fleet_deadline_s), down (silent longer: erasures wait for it) or left "
                                     "(stopped cleanly), with the open erasure requests waiting for each.")
    add_common(st)
    st.set_defaults(func=_cmd_fleet_status)
    rm = fsub.add_parser("remove", help="mark a sidecar gone for good as left",
                         description="Mark a sidecar that will not come back as left, as a clean stop would: "
                                     "new erasure requests no longer wait for it. Requests already waiting for "
                                     "it are closed one by one with 'kvguard erasure exclude'. A sidecar that "
                                     "starts again under this origin joins again.")
    add_common(rm)
    rm.add_argument("origin", help="the sidecar's origin, as 'kvguard fleet status' lists it")
    rm.set_defaults(func=_cmd_fleet_remove)

    k = sub.add_parser("keygen", help="create an Ed25519 signing key file (mode 0600)",
                       description="Create the sidecar's Ed25519 signing key, or with --secret a 32-byte secret "
                                   "(the pseudonyms' index key or the seal key), in a file of mode 0600.")
    k.add_argument("out", type=Path, help="where to write the private key")
    k.add_argument("--public", type=Path, help="also write the public key (PEM) here")
    k.add_argument("--force", action="store_true", help="overwrite an existing file")
    k.add_argument("--secret", action="store_true", help="a 32-byte secret (index or seal key) instead")
    k.set_defaults(func=_cmd_keygen)
    dbcli.register(sub)
