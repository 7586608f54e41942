"""Stored witness cosignatures (table `cosignatures`): what sidecars write, exports read.

The newest cosignature of each witness on each checkpoint is kept (a witness re-cosigns
the latest checkpoint of an idle log, with a newer time).
"""

from __future__ import annotations

from sqlalchemy import delete, func, insert, select

from .cosignature import Cosigned
from .models import CosignatureRow
from .store import AuditStore

C = CosignatureRow


def add_cosignature(store: AuditStore, origin: str, size: int, cosigned: Cosigned) -> None:
    w = cosigned.witness
    key = (C.origin == origin, C.tree_size == size, C.witness == w.name, C.key_id == w.key_id.hex())
    with store.write() as conn:
        conn.execute(delete(C).where(*key, C.time_s <= cosigned.timestamp))
        if conn.execute(select(func.count()).select_from(C).where(*key)).scalar():
            return  # a newer one is stored already
        conn.execute(insert(C).values(origin=origin, tree_size=size, witness=w.name, key_id=w.key_id.hex(),
                                      time_s=cosigned.timestamp, line=cosigned.line))


def cosignature_lines(store: AuditStore, origin: str, min_size: int = 0,
                      max_size: int | None = None) -> dict[int, list[str]]:
    """Tree size -> the stored cosignature lines on that checkpoint, in a stable order."""
    q = select(C.tree_size, C.line).where(C.origin == origin, C.tree_size >= min_size)
    if max_size is not None:
        q = q.where(C.tree_size <= max_size)
    out: dict[int, list[str]] = {}
    with store.read() as conn:
        for size, line in conn.execute(q.order_by(C.tree_size, C.witness, C.key_id)):
            out.setdefault(size, []).append(line)
    return out


def witnessed_state(store: AuditStore, origin: str, name: str, key_id: bytes) -> tuple[int, int] | None:
    """(tree size, time) of the largest checkpoint this witness cosigned, as stored."""
    with store.read() as conn:
        row = conn.execute(select(C.tree_size, C.time_s).where(
            C.origin == origin, C.witness == name, C.key_id == key_id.hex())
            .order_by(C.tree_size.desc()).limit(1)).first()
    return None if row is None else (row[0], row[1])


def checkpoints_after(store: AuditStore, origin: str, size: int, limit: int) -> list:
    """The first `limit` checkpoints of the log larger than `size`, smallest first."""
    from .models import CheckpointRow
    from .store import _entry

    q = (select(CheckpointRow).where(CheckpointRow.origin == origin, CheckpointRow.tree_size > size)
         .order_by(CheckpointRow.tree_size).limit(limit))
    with store.read() as conn:
        return [_entry(r) for r in conn.execute(q).all()]


def latest_cosigned_size(store: AuditStore, origin: str, min_size: int = 0) -> int | None:
    """The largest stored checkpoint with a stored cosignature (None if none is >= min_size)."""
    from .models import CheckpointRow as K

    with store.read() as conn:
        return conn.execute(select(func.max(C.tree_size)).join(
            K, (K.origin == C.origin) & (K.tree_size == C.tree_size)).where(
            C.origin == origin, C.tree_size >= min_size)).scalar()
