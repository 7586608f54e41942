"""The witness's HTTP API: `POST /add-checkpoint` (C2SP tlog-witness), `/healthz`.

Requests are authenticated the way the spec does it: the checkpoint must be signed by
a key configured for its origin, so only the log's holder can move the witness's
state. Bodies are bounded (63 proof lines and a small note fit in a few KiB). The
status codes are the spec's; every error but the 409 size answer is problem+json.
"""

from __future__ import annotations

import base64
import binascii
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool

from kvguard.audit.checkpoint import Checkpoint, open_checkpoint, split_note
from kvguard.audit.cosignature import Witness, cosign
from kvguard.audit.errors import VerificationError
from kvguard.audit.keys import PublicKey, SigningKey
from kvguard.audit.merkle import verify_consistency

from .. import __version__
from .store import WitnessStore

log = structlog.get_logger("kvguard.witness")
MAX_PROOF_LINES = 63
MAX_BODY_BYTES = 16 * 1024
SIZE_MEDIA = "text/x.tlog.size"
_OLD = re.compile(r"old (0|[1-9][0-9]{0,19})")


@dataclass
class WitnessConfig:
    name: str
    key: SigningKey
    logs: dict[str, list[PublicKey]]  # origin (or "<prefix>*") -> the log keys it trusts for it
    max_body_bytes: int = MAX_BODY_BYTES
    clock: Callable[[], float] = field(default=time.time)  # POSIX seconds, for the cosignatures

    @property
    def witness(self) -> Witness:
        return Witness(self.name, self.key.public_key)

    def keys_for(self, origin: str) -> list[PublicKey] | None:
        """The log keys configured for `origin`: by its exact name, else by the longest
        pattern `<prefix>*` it starts with (a fleet whose pods name their logs as they start)."""
        if origin in self.logs:
            return self.logs[origin]
        prefixes = [p for p in self.logs if p.endswith("*") and origin.startswith(p[:-1])]
        return self.logs[max(prefixes, key=len)] if prefixes else None


class _Refused(Exception):
    def __init__(self, status: int, detail: str) -> None:
        self.status, self.detail = status, detail


def _problem(status: int, title: str, detail: str) -> JSONResponse:
    return JSONResponse({"type": "about:blank", "title": title, "status": status, "detail": detail},
                        status_code=status, media_type="application/problem+json")


TITLES = {400: "Bad Request", 403: "Forbidden", 404: "Not Found", 409: "Conflict", 413: "Content Too Large",
          415: "Unsupported Media Type", 422: "Unprocessable Content", 503: "Service Unavailable"}


def parse_request(body: str) -> tuple[int, list[bytes], str]:
    """(old size, consistency proof, checkpoint note) of an add-checkpoint body."""
    head, sep, note = body.partition("\n")
    m = _OLD.fullmatch(head)
    if not sep or not m:
        raise _Refused(400, "the body must start with an 'old <size>' line")
    proof: list[bytes] = []
    while True:
        line, sep, note = note.partition("\n")
        if not sep:
            raise _Refused(400, "no empty line between the proof and the checkpoint")
        if not line:
            break
        if len(proof) == MAX_PROOF_LINES:
            raise _Refused(400, f"more than {MAX_PROOF_LINES} consistency proof lines")
        try:
            h = base64.b64decode(line, validate=True)
        except binascii.Error:
            raise _Refused(400, "a consistency proof line is not base64") from None
        if len(h) != 32:
            raise _Refused(400, "a consistency proof hash is not 32 bytes")
        proof.append(h)
    return int(m.group(1)), proof, note


def create_app(config: WitnessConfig, store: WitnessStore) -> FastAPI:
    app = FastAPI(title="kvguard witness", version=__version__, openapi_url=None, docs_url=None, redoc_url=None,
                  description="A C2SP tlog-witness: cosigns a log's checkpoint only if it extends the last one "
                              "it cosigned for that log.")
    app.state.config, app.state.store = config, store

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/add-checkpoint")
    async def add_checkpoint(request: Request) -> Response:
        try:
            body = await _read(request, config.max_body_bytes)
            return await run_in_threadpool(_add, config, store, body)  # the database is synchronous
        except _Refused as r:
            return _problem(r.status, TITLES[r.status], r.detail)
        except _Conflict as c:
            # exactly the spec's media type: PlainTextResponse would add "; charset=utf-8"
            return Response(f"{c.size}\n".encode(), status_code=409, headers={"Content-Type": SIZE_MEDIA})
        except SQLAlchemyError as exc:  # nothing was cosigned: the client retries later
            log.error("witness storage unreachable", error=type(exc).__name__)
            return _problem(503, TITLES[503], "the witness's storage is unreachable; nothing was cosigned")

    return app


class _Conflict(Exception):
    def __init__(self, size: int) -> None:
        self.size = size


async def _read(request: Request, limit: int) -> str:
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise _Refused(413, f"the body may hold at most {limit} bytes")
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise _Refused(413, f"the body may hold at most {limit} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise _Refused(400, "the body is not UTF-8") from None


def _add(config: WitnessConfig, store: WitnessStore, body: str) -> Response:
    old, proof, note = parse_request(body)
    try:
        text, _ = split_note(note)
        cp = Checkpoint.parse_text(text)
    except VerificationError as exc:
        raise _Refused(400, f"not a signed checkpoint: {exc.message}") from None
    keys = config.keys_for(cp.origin)
    if keys is None:
        raise _Refused(404, f"this witness is not configured for log {cp.origin!r}")
    try:  # the spec's authentication: a signature by a configured key of the origin
        open_checkpoint(note, keys, cp.origin)
    except VerificationError as exc:
        raise _Refused(403, f"the checkpoint is not signed by a key of {cp.origin}: {exc.message}") from None
    if old > cp.size:
        raise _Refused(400, f"old size {old} is larger than the checkpoint's size {cp.size}")
    latest = store.latest(cp.origin)
    where = dict(origin=cp.origin, old=old, size=cp.size, witnessed=latest.size)
    if old != latest.size:
        log.info("witness conflict", reason="old size is not the latest cosigned", **where)
        raise _Conflict(latest.size)
    if old == cp.size and cp.root != latest.root:
        log.warning("witness refused", reason="two roots for one size", **where)
        raise _Conflict(latest.size)
    try:
        if old == 0 and proof:
            raise VerificationError("consistency", "the proof must be empty when the old size is 0")
        if old:
            verify_consistency(old, cp.size, latest.root, cp.root, proof)
    except VerificationError as exc:
        # the request is signed by the log: evidence of a rollback or a fork, so it is logged
        log.warning("witness refused", reason="inconsistent", detail=exc.message, checkpoint=note, **where)
        raise _Refused(422, f"not consistent with the checkpoint of size {latest.size} this witness "
                            f"cosigned for {cp.origin}: {exc.message}") from None
    now = config.clock()
    if not store.advance(cp.origin, latest, cp.size, cp.root, note, int(now * 1000)):
        raise _Conflict(store.latest(cp.origin).size)  # another request moved it meanwhile
    log.info("witness cosigned", **where)
    return PlainTextResponse(cosign(config.key, config.name, text, int(now)))
