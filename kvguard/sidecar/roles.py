"""Database roles on PostgreSQL: the owner that migrates, and the runtime role the sidecar runs as.

The owner of a table can `ALTER TABLE ... DISABLE TRIGGER` and `DROP TRIGGER`, so a
sidecar running as the owner of the audit tables could switch their append-only
triggers off. In production the sidecar therefore runs as a role that owns nothing
and holds only the privileges below (docs/operations-roles.md), and refuses to start
as an owner or a superuser (`check_runtime_role`, read from the catalog).
"""

from __future__ import annotations

import re

from sqlalchemy import Connection, text

from ..errors import ConfigError

# What the runtime role may do, table by table. UPDATE and DELETE appear only where the
# sidecar changes rows: the append-only tables get neither, except `logs`, where the writer
# locks its log's row with SELECT ... FOR UPDATE, which PostgreSQL allows only with UPDATE
# privilege; the append-only trigger still refuses every UPDATE of the row.
GRANTS: dict[str, tuple[str, ...]] = {
    "alembic_version": ("SELECT",),  # readiness: is the schema current
    "logs": ("SELECT", "INSERT", "UPDATE (created_ms)"),
    "keys": ("SELECT",),  # a rotated-in key through kvguard_add_key, which checks its rotation record
    "records": ("SELECT", "INSERT"),
    "checkpoints": ("SELECT", "INSERT"),
    # new secrets through kvguard_add_subject_key; re-wrapped on KEK rotation (a trigger refuses a
    # secret an erase record destroyed); shredded
    "subject_keys": ("SELECT", "UPDATE (kek_id, secret)", "DELETE"),
    "keks": ("SELECT", "INSERT", "UPDATE (destroyed_ms)"),  # which key-encryption key wraps; when one was destroyed
    "api_tokens": ("SELECT", "INSERT", "UPDATE"),  # revocation
    "erasure_requests": ("SELECT", "INSERT", "UPDATE"),  # state, progress, receipt
    "subject_links": ("SELECT", "INSERT", "DELETE"),  # a user's sessions, forgotten with the user
    "ingest_progress": ("SELECT", "INSERT", "UPDATE"),
    "cosignatures": ("SELECT", "INSERT", "DELETE"),  # a witness's newest cosignature replaces its older one
    "fleet_sidecars": ("SELECT", "INSERT", "UPDATE"),  # registration, heartbeats, leaving
    "erasure_parts": ("SELECT", "INSERT", "UPDATE"),  # each sidecar's part of a request
}
# The owner's functions that insert checked rows where the role may not insert (migration 0124)
FUNCTIONS = ("kvguard_add_key(text, text, bytea, bigint, bigint, bigint)",
             "kvguard_add_subject_key(bytea, text, bytea, text, bigint)")
APPEND_ONLY = ("logs", "keys", "records", "checkpoints")
_ROLE = re.compile(r"[a-z_][a-z0-9_$]{0,62}")


def check_role_name(role: str) -> str:
    if not _ROLE.fullmatch(role):
        raise ConfigError(f"{role!r} is not a plain role name: use lower-case letters, digits and _ "
                          "(at most 63 characters, not starting with a digit)")
    return role


def grant_sql(role: str) -> str:
    """The statements that give `role` what the sidecar needs, and nothing more: what an
    earlier version granted beyond that is revoked first."""
    role = check_role_name(role)
    lines = [f"GRANT USAGE ON SCHEMA public TO {role};",
             f"REVOKE ALL ON TABLE {', '.join(GRANTS)} FROM {role};"]
    lines += [f"GRANT {', '.join(privs)} ON TABLE {table} TO {role};" for table, privs in GRANTS.items()]
    lines += [f"GRANT EXECUTE ON FUNCTION {function} TO {role};" for function in FUNCTIONS]
    return "\n".join(lines) + "\n"


def tables_without_grant(conn: Connection) -> list[str]:
    """Tables of the schema the grants do not cover: a migration added a table that the
    runtime role cannot use until GRANTS names it."""
    names = conn.scalars(text("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"))
    return sorted(set(names) - set(GRANTS))


def grant(conn: Connection, role: str) -> list[str]:
    """Run `grant_sql(role)` (as the owner); returns the statements run."""
    if conn.scalar(text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": role}) is None:
        raise ConfigError(f"role {role} does not exist: create it first (CREATE ROLE {role} LOGIN; "
                          "see docs/operations-roles.md)")
    statements = [s for s in grant_sql(role).splitlines() if s]
    for statement in statements:
        conn.execute(text(statement))
    return statements


def check_runtime_role(conn: Connection) -> None:
    """Refuse a role that is a superuser, or that owns (or is a member of the role owning)
    an audit table: either could disable or drop the append-only triggers."""
    user, superuser = conn.execute(text(
        "SELECT current_user, rolsuper FROM pg_roles WHERE rolname = current_user")).one()
    owners = conn.execute(text(
        "SELECT c.relname, pg_get_userbyid(c.relowner) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = current_schema() AND c.relkind = 'r' "
        "AND c.relname = ANY(:tables) AND pg_has_role(current_user, c.relowner, 'MEMBER') ORDER BY c.relname"),
        {"tables": list(APPEND_ONLY)}).all()
    fix = ("run the migrations as the owner ('kvguard db upgrade'), grant a runtime role what the sidecar "
           "needs ('kvguard db grant ROLE', docs/operations-roles.md) and start the sidecar as that role")
    if superuser:
        raise ConfigError(f"refusing to start in production as role {user}: it is a superuser, which may "
                          f"disable the audit tables' append-only triggers; {fix}")
    if owners:
        owned = ", ".join(f"{table} (owner {owner})" for table, owner in owners)
        raise ConfigError(f"refusing to start in production as role {user}: it owns, or is a member of the "
                          f"role owning, the audit tables {owned}, so it may disable or drop their "
                          f"append-only triggers; {fix}")
