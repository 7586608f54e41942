"""Key rotation on a running sidecar: `kvguard keys rotate` calls these (admin scope)."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from ..logs import log
from ..signing import rotate_signing_key
from .deps import Admin, SidecarDep
from .problems import Problem, documented

router = APIRouter(prefix="/v1/keys", tags=["keys"], responses=documented(401, 403, 503))


class SigningKeyRotated(BaseModel):
    origin: str
    old_key_id: str
    new_key_id: str
    new_public_key: str  # base64 of the 32 raw bytes, as keys.json and the rotation record give it
    rotation_seq: int


class KekRotated(BaseModel):
    kek_id: str


@router.post("/signing/rotate", response_model=SigningKeyRotated,
             summary="Rotate the log's Ed25519 signing key",
             description="The current key signs a key_rotation record naming a new key, which signs from the "
                         "next record on and replaces the key file. Auditors keep trusting the log's first key: "
                         "bundles carry the rotation records.")
def rotate_signing(sidecar: SidecarDep, _: Admin) -> SigningKeyRotated:
    with sidecar.key_lock:
        old = sidecar.key
        new, record = rotate_signing_key(sidecar.settings.signing_key_path, sidecar.log)
        sidecar.key = new
    log.info("signing key rotated", old_key_id=old.key_id, new_key_id=new.key_id, rotation_seq=record.seq)
    return SigningKeyRotated(origin=sidecar.settings.origin, old_key_id=old.key_id, new_key_id=new.key_id,
                             new_public_key=new.public_key.to_base64(), rotation_seq=record.seq)


@router.post("/kek/rotate", response_model=KekRotated,
             summary="Rotate the key-encryption key of the pseudonym secrets now",
             description="A new key-encryption key; every live secret re-wrapped under it; the old one destroyed. "
                         "The sidecar also does this on its own every kek_rotation_s. 409 while another "
                         "sidecar of the database is rotating.", responses=documented(409))
def rotate_kek(sidecar: SidecarDep, _: Admin) -> KekRotated:
    new = sidecar.rotate_kek_if_due(force=True)
    if new is None:
        raise Problem(409, "Conflict", "another sidecar of this database is rotating the key-encryption key; "
                                       "try again when it is done")
    return KekRotated(kek_id=new)
