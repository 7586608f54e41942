"""`kvguard db upgrade|grant` and `kvguard keys rotate`: what an operator runs, not the sidecar.

`db upgrade` runs the migrations as the role of the URL it is given, which then owns the
tables (run it once per release, e.g. as a Kubernetes Job); `db grant ROLE` gives the
sidecar's runtime role what it needs (kvguard.sidecar.roles). `keys rotate` rotates the
signing key of a running sidecar through its admin API, or with --offline that of a
stopped one, directly in its database.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from ..errors import ConfigError
from .options import add_common, settings_from


def _cmd_upgrade(args: argparse.Namespace) -> int:
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    from kvguard.audit.store import alembic_config, make_engine, migrate

    from .service import private_files, secure_data_dir, secure_sqlite_files

    settings = settings_from(args)
    url = settings.db_url
    if not settings.postgres:
        secure_data_dir(settings.data_dir)
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            current = MigrationContext.configure(conn).get_current_revision()
            role = conn.exec_driver_sql("SELECT current_user").scalar() if settings.postgres else None
    finally:
        engine.dispose()
    script = ScriptDirectory.from_config(alembic_config())
    head = script.get_current_head()
    steps = list(reversed(list(script.iterate_revisions(head, current or "base"))))
    steps = [s for s in steps if s.revision != current]
    if not steps:
        print(f"the audit store is at {head}, the newest migration: nothing to do")
        return _run_grant(settings, args.grant) if args.grant else 0
    who = f" as role {role}, which will own the tables" if role else ""
    print(f"upgrading the audit store from {current or 'an empty database'} to {head}{who}: "
          f"{len(steps)} migration(s)")
    with private_files():
        for i, step in enumerate(steps, 1):
            title = (step.doc or "").strip().splitlines()[0] if step.doc else ""
            print(f"[{i}/{len(steps)}] {step.revision} {title} ...", end=" ", flush=True)
            started = time.monotonic()
            migrate(url, step.revision)
            print(f"done ({time.monotonic() - started:.2f} s)", flush=True)
    secure_sqlite_files(url)
    if args.grant:
        return _run_grant(settings, args.grant)
    if role:
        print("next: 'kvguard db grant ROLE' for the role the sidecars run as (docs/operations-roles.md)")
    return 0


def _cmd_grant(args: argparse.Namespace) -> int:
    from . import roles

    if args.print:
        sys.stdout.write(roles.grant_sql(args.role))
        return 0
    return _run_grant(settings_from(args), args.role)


def _run_grant(settings, role: str) -> int:
    from kvguard.audit.store import check_current, make_engine

    from . import roles

    if not settings.postgres:
        raise ConfigError("grants are for PostgreSQL: give --database-url postgresql+psycopg://OWNER@HOST/DB "
                          "(SQLite has no roles; its file's mode 0600 is its access control)")
    roles.check_role_name(role)
    check_current(settings.db_url)  # grants name the tables of the newest schema
    engine = make_engine(settings.db_url)
    try:
        with engine.begin() as conn:
            statements = roles.grant(conn, role)
            uncovered = roles.tables_without_grant(conn)
    finally:
        engine.dispose()
    for statement in statements:
        print(statement)
    if uncovered:
        print(f"warning: no grant is known for table(s) {', '.join(uncovered)}: role {role} cannot use "
              "them", file=sys.stderr)
    return 0


def _cmd_rotate(args: argparse.Namespace) -> int:
    return _rotate_offline(args) if args.offline else _rotate_online(args)


def _rotate_offline(args: argparse.Namespace) -> int:
    from kvguard.audit.log import AuditLog, LogConfig
    from kvguard.audit.store import AuditStore, check_current

    from .server import lock_data_dir
    from .signing import finish_rotation, rotate_signing_key

    settings = settings_from(args)
    locks = lock_data_dir(settings)  # no sidecar may sign on this data directory meanwhile
    try:
        check_current(settings.db_url)
        store = AuditStore(settings.db_url)
        try:
            key_path = settings.signing_key_path
            finish_rotation(key_path, store, settings.origin)
            from kvguard.audit.keys import SigningKey

            if not store.has_log(settings.origin):
                raise ConfigError(f"there is no log {settings.origin} in this database yet: nothing to rotate")
            log = AuditLog(store, settings.origin, SigningKey.load(key_path), LogConfig(sign_process=False))
            try:
                old = log.key.key_id
                new, record = rotate_signing_key(key_path, log)
            finally:
                log.close()
        finally:
            store.dispose()
    finally:
        for fd in locks:
            os.close(fd)
    _print_rotated(settings.origin, old, new.key_id, new.public_key.to_base64(), record.seq)
    return 0


def _rotate_online(args: argparse.Namespace) -> int:
    import httpx

    token = _token(args)
    url = args.url
    if url is None:
        settings = settings_from(args)
        url = f"http://{settings.host}:{settings.port}"
    try:
        r = httpx.post(url.rstrip("/") + "/v1/keys/signing/rotate", headers={"Authorization": f"Bearer {token}"},
                       timeout=60)
    except httpx.HTTPError as e:
        raise ConfigError(f"no sidecar answered at {url} ({type(e).__name__}): give its admin address with "
                          "--url, or rotate a stopped sidecar's key with --offline") from None
    if r.status_code != 200:
        detail = r.json().get("detail") if r.headers.get("content-type", "").endswith("json") else r.text[:200]
        raise ConfigError(f"the sidecar at {url} refused the rotation: {r.status_code} {detail}")
    body = r.json()
    _print_rotated(body["origin"], body["old_key_id"], body["new_key_id"], body["new_public_key"],
                   body["rotation_seq"])
    return 0


def _token(args: argparse.Namespace) -> str:
    if args.token_file is not None:
        from kvguard.audit.keys import read_private_file

        token = read_private_file(args.token_file).decode().strip()
    else:
        token = os.environ.get("KVGUARD_ADMIN_TOKEN", "").strip()
    if not token:
        raise ConfigError("an admin token is needed to ask the sidecar: --token-file FILE (mode 0600) or "
                          "KVGUARD_ADMIN_TOKEN ('kvguard token create --scope admin')")
    return token


def _print_rotated(origin: str, old: str, new: str, public_key: str, seq: int) -> None:
    print(f"log {origin}: key {old[:16]}... signed rotation record #{seq}; key {new[:16]}... signs from "
          f"#{seq + 1}")
    print(f"new public key (base64): {public_key}")
    print("auditors keep trusting the log's first key: bundles carry the rotation record", file=sys.stderr)


def register(sub) -> None:
    d = sub.add_parser("db", help="migrate the audit store and grant the sidecar's database role",
                       description="Database administration, run as the role that owns the tables (not the "
                                   "sidecar's).")
    dsub = d.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    u = dsub.add_parser("upgrade", help="run the migrations (idempotent)",
                        description="Run the audit store's migrations up to the newest, one progress line each. "
                                    "Run it as the role that is to own the tables, once per release (e.g. a "
                                    "Kubernetes Job) before the sidecars start: in production on PostgreSQL "
                                    "'kvguard serve' does not migrate, and refuses to run as that owner.")
    add_common(u)
    u.add_argument("--grant", metavar="ROLE",
                   help="then grant ROLE what the sidecar needs, as 'kvguard db grant ROLE' does")
    u.set_defaults(func=_cmd_upgrade)
    g = dsub.add_parser("grant", help="grant a role what the sidecar needs (PostgreSQL)",
                        description="Grant ROLE the privileges the sidecar needs and nothing more: SELECT and "
                                    "INSERT, UPDATE and DELETE only where the schema changes rows "
                                    "(docs/operations-roles.md). Run as the owner after 'kvguard db upgrade'. "
                                    "With --print, only print the SQL.")
    add_common(g)
    g.add_argument("role", help="the role the sidecars connect as (create it first: CREATE ROLE ... LOGIN)")
    g.add_argument("--print", action="store_true", help="print the GRANT statements instead of running them")
    g.set_defaults(func=_cmd_grant)

    k = sub.add_parser("keys", help="rotate the log's signing key",
                       description="Key management of a sidecar's log.")
    ksub = k.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    r = ksub.add_parser("rotate", help="rotate the signing key (running sidecar, or --offline)",
                        description="Rotate the log's Ed25519 signing key: the current key signs a key_rotation "
                                    "record naming a new one, which signs from then on and replaces the key "
                                    "file. By default the running sidecar does it (POST /v1/keys/signing/rotate "
                                    "on its admin API, admin token from --token-file or KVGUARD_ADMIN_TOKEN); "
                                    "with --offline this command does it on a stopped sidecar's data directory "
                                    "and database.")
    add_common(r)
    r.add_argument("--url", help="the sidecar's admin API (default: http://HOST:PORT from the settings)")
    r.add_argument("--token-file", type=Path, help="a file (mode 0600) holding an admin token")
    r.add_argument("--offline", action="store_true",
                   help="the sidecar is stopped: rotate in its data directory and database directly")
    r.set_defaults(func=_cmd_rotate)
