"""Key rows and subject secrets enter only through functions of the tables' owner that check them.

The runtime role could insert any row into `keys` (an attacker's key beside the log's) and
into `subject_keys` (a destroyed secret put back from a backup, which links an erased
person's pseudonyms again). On PostgreSQL it now may not: it calls

* `kvguard_add_key(...)`: a log's first key only while the log has no key and no record;
  any other key only with its stored `key_rotation` record, which names that key and hands
  over at the row's `valid_from_seq`; the key id is the SHA-256 of the key;
* `kvguard_add_subject_key(...)`: inserts the row unless one exists under the index
  (returns whether it inserted);

both SECURITY DEFINER, owned by the owner, EXECUTE only for roles granted it
(`kvguard db grant`). A trigger on `subject_keys`, which no role but the owner can drop,
refuses a secret (inserted or re-wrapped) whose shred tag an erase record lists
(docs/audit-format.md §11). The upgrade moves roles that held INSERT on `keys` or
`subject_keys` to the functions, and UPDATE of `subject_keys` to its two re-wrapped
columns. Both dialects get an index of the erase records. SQLite has no roles: there the writer's
checks are the defence.

Revision ID: 0124
Revises: 0123
Create Date: 2027-01-15
"""

from __future__ import annotations

from alembic import op

revision = "0124"
down_revision = "0123"
branch_labels = None
depends_on = None

ERASE_OPS = ("erase", "retention_erase")  # audit.ops.ERASE_OPS, as of this revision
_ERASE = "op IN ('erase', 'retention_erase')"

SHREDDED = f"""
CREATE FUNCTION kvguard_shredded(secret bytea) RETURNS boolean LANGUAGE sql STABLE
SET search_path = {{schema}}, pg_temp AS $$
    SELECT EXISTS (SELECT 1 FROM records WHERE {_ERASE}
        AND (body::jsonb -> 'details' -> 'shredded') ? substr(encode(sha256(
            convert_to('kvguard shredded secret', 'UTF8') || '\\x00'::bytea || secret), 'hex'), 1, 32))
$$
"""

REFUSE_SHREDDED = """
CREATE FUNCTION kvguard_refuse_shredded() RETURNS trigger LANGUAGE plpgsql
SET search_path = {schema}, pg_temp AS $$
BEGIN
    IF kvguard_shredded(NEW.secret) THEN
        RAISE EXCEPTION 'kvguard: this subject secret was destroyed by an erasure (an erase record lists its '
            'shred tag); it is never stored again' USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN NEW;
END
$$
"""

ADD_KEY = """
CREATE FUNCTION kvguard_add_key(p_origin text, p_key_id text, p_public_key bytea, p_valid_from_seq bigint,
                                p_rotation_seq bigint, p_created_ms bigint) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {schema}, pg_temp AS $$
DECLARE
    details jsonb;
BEGIN
    IF p_key_id IS DISTINCT FROM encode(sha256(p_public_key), 'hex') THEN
        RAISE EXCEPTION 'kvguard: key id % is not the SHA-256 of the key', p_key_id
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF p_rotation_seq IS NULL THEN
        IF p_valid_from_seq <> 0 OR EXISTS (SELECT 1 FROM keys WHERE origin = p_origin)
                OR EXISTS (SELECT 1 FROM records WHERE origin = p_origin) THEN
            RAISE EXCEPTION 'kvguard: log % has a first key already: another key enters only with its '
                'key_rotation record', p_origin USING ERRCODE = 'insufficient_privilege';
        END IF;
    ELSE
        SELECT body::jsonb -> 'details' INTO details FROM records
            WHERE origin = p_origin AND seq = p_rotation_seq AND op = 'key_rotation';
        IF details IS NULL OR p_valid_from_seq IS DISTINCT FROM p_rotation_seq + 1
                OR details ->> 'new_key_id' IS DISTINCT FROM p_key_id
                OR details ->> 'new_public_key' IS DISTINCT FROM encode(p_public_key, 'base64') THEN
            RAISE EXCEPTION 'kvguard: no key_rotation record %#% hands over to key %', p_origin, p_rotation_seq,
                p_key_id USING ERRCODE = 'insufficient_privilege';
        END IF;
    END IF;
    INSERT INTO keys (origin, key_id, public_key, valid_from_seq, rotation_seq, created_ms)
        VALUES (p_origin, p_key_id, p_public_key, p_valid_from_seq, p_rotation_seq, p_created_ms);
END
$$
"""

ADD_SUBJECT_KEY = """
CREATE FUNCTION kvguard_add_subject_key(p_idx bytea, p_kind text, p_secret bytea, p_kek_id text,
                                        p_created_ms bigint) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {schema}, pg_temp AS $$
BEGIN
    INSERT INTO subject_keys (idx, kind, secret, kek_id, created_ms)
        VALUES (p_idx, p_kind, p_secret, p_kek_id, p_created_ms) ON CONFLICT (idx) DO NOTHING;
    RETURN FOUND;
END
$$
"""

FUNCTIONS = ("kvguard_add_key(text, text, bytea, bigint, bigint, bigint)",
             "kvguard_add_subject_key(bytea, text, bytea, text, bigint)")

# Roles granted by an earlier `kvguard db grant`: their INSERT becomes EXECUTE of the function,
# their UPDATE of subject_keys an UPDATE of the columns a re-wrap writes.
MOVE_GRANTS = """
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT DISTINCT grantee, table_name, privilege_type FROM information_schema.role_table_grants
             WHERE table_schema = current_schema() AND grantee NOT IN (current_user, 'PUBLIC')
               AND ((table_name IN ('keys', 'subject_keys') AND privilege_type = 'INSERT')
                    OR (table_name = 'subject_keys' AND privilege_type = 'UPDATE')) LOOP
        EXECUTE format('REVOKE %s ON TABLE %I FROM %I', r.privilege_type, r.table_name, r.grantee);
        IF r.privilege_type = 'UPDATE' THEN
            EXECUTE format('GRANT UPDATE (kek_id, secret) ON TABLE subject_keys TO %I', r.grantee);
        ELSIF r.table_name = 'keys' THEN
            EXECUTE format('GRANT EXECUTE ON FUNCTION kvguard_add_key(text, text, bytea, bigint, bigint, bigint) '
                           'TO %I', r.grantee);
        ELSE
            EXECUTE format('GRANT EXECUTE ON FUNCTION kvguard_add_subject_key(bytea, text, bytea, text, bigint) '
                           'TO %I', r.grantee);
        END IF;
    END LOOP;
END
$$
"""


def upgrade() -> None:
    # erase records are few: the writer and the function below read their shred tags alone
    op.execute(f"CREATE INDEX ix_records_erase ON records (origin, seq) WHERE {_ERASE}")
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    schema = bind.exec_driver_sql("SELECT current_schema()").scalar()
    for sql in (SHREDDED, REFUSE_SHREDDED, ADD_KEY, ADD_SUBJECT_KEY):
        op.execute(sql.replace("{schema}", f'"{schema}"'))
    op.execute("CREATE TRIGGER subject_keys_not_shredded BEFORE INSERT OR UPDATE OF secret ON subject_keys "
               "FOR EACH ROW EXECUTE FUNCTION kvguard_refuse_shredded()")
    for function in FUNCTIONS:  # PostgreSQL lets PUBLIC execute a new function
        op.execute(f"REVOKE ALL ON FUNCTION {function} FROM PUBLIC")
    op.execute(MOVE_GRANTS)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER subject_keys_not_shredded ON subject_keys")
        for function in FUNCTIONS:
            op.execute(f"DROP FUNCTION {function}")
        op.execute("DROP FUNCTION kvguard_refuse_shredded()")
        op.execute("DROP FUNCTION kvguard_shredded(bytea)")
    op.execute("DROP INDEX ix_records_erase")
