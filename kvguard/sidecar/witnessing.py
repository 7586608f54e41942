"""Submitting each signed checkpoint to the configured witnesses (C2SP tlog-witness).

A thread of its own, so signing never waits on a witness. The backlog is the
checkpoints table itself: each pass reads at most MAX_BATCH checkpoints after the
last one a witness cosigned, so nothing is held in memory and nothing is lost on a
crash or an outage; cosignatures go to the `cosignatures` table. An idle log's
latest checkpoint is re-submitted every `refresh_s`, so its cosignatures stay
fresh: an auditor's `verify --witness-key` requires fresh ones on a bundle's
checkpoint, which is what exposes a log rolled back to an older checkpoint.

Failures back off exponentially (to `retry_max_s`) and show in the metrics and in
/readyz's `witnesses` detail; they never stop the log.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from kvguard.audit.cosignature import Witness, cosignatures
from kvguard.audit.cosigstore import add_cosignature, checkpoints_after, witnessed_state

from .logs import log

MAX_BATCH = 64
MAX_ANSWER = 16 * 1024  # a witness's answer: a few signature lines


class _TooLarge(Exception):
    pass
SIZE_MEDIA = "text/x.tlog.size"


@dataclass
class _Target:
    url: str  # the witness's submission prefix
    witness: Witness
    size: int | None = None  # the largest size it cosigned, as far as we know (None: not read yet)
    cosigned_at: float = 0.0  # when we got that cosignature, by our clock (the witness's may differ)
    status: str = "not contacted yet"
    failures: int = 0
    next_try: float = 0.0


class Witnessing:
    def __init__(self, log_, targets: list[tuple[str, Witness]], metrics=None, *, timeout_s: float = 5.0,
                 refresh_s: float = 60.0, retry_max_s: float = 60.0, poll_s: float = 0.5,
                 client_for: Callable[[str], httpx.Client] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.log, self.store, self.origin = log_, log_.store, log_.origin
        self.targets = [_Target(url.rstrip("/"), w) for url, w in targets]
        self.metrics, self.refresh_s, self.retry_max_s, self.poll_s = metrics, refresh_s, retry_max_s, poll_s
        self._clock = clock
        self._clients = {t.url: (client_for(t.url) if client_for else httpx.Client(timeout=timeout_s))
                         for t in self.targets}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"witness[{self.origin}]", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for client in self._clients.values():
            client.close()

    def status(self) -> dict[str, str]:
        return {t.witness.name: t.status for t in self.targets}

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.run_once()
            except Exception as exc:  # noqa: BLE001 - e.g. the database is down: try again next pass
                log.warning("witness submission pass failed", error=f"{type(exc).__name__}: {exc}"[:300])

    def run_once(self) -> None:
        """One pass: each witness gets the checkpoints it has not cosigned yet (or a refresh)."""
        head = self.store.latest_checkpoint(self.origin)
        if head is None:
            return
        for t in self.targets:
            if self._clock() >= t.next_try:
                self._sync(t, head)
            self._gauges(t, head.size)

    def _sync(self, t: _Target, head) -> None:
        if t.size is None:
            state = witnessed_state(self.store, self.origin, t.witness.name, t.witness.key_id)
            t.size, t.cosigned_at = state or (0, 0)
        if t.size > head.size:
            return self._fail(t, "rollback", f"the witness cosigned size {t.size}, beyond this log's latest "
                              f"checkpoint ({head.size}): the log was rolled back", retry=False)
        pending = checkpoints_after(self.store, self.origin, t.size, MAX_BATCH)
        if not pending and t.size == head.size and self._clock() - t.cosigned_at >= self.refresh_s:
            pending = [head]  # re-cosigned with a new time: the cosignature stays fresh
        for cp in pending:
            if not self._submit(t, cp):
                return

    def _submit(self, t: _Target, cp) -> bool:
        old = t.size
        proof = [] if old in (0, cp.size) else self.log.consistency_proof(old, cp.size)
        body = f"old {old}\n" + "".join(base64.b64encode(h).decode() + "\n" for h in proof) + "\n" + cp.note
        try:
            r, text = self._post(t, body)
        except httpx.HTTPError as exc:
            return self._fail(t, "unreachable", f"unreachable: {type(exc).__name__}")
        except _TooLarge:
            return self._fail(t, "bad_cosignature", f"answered more than {MAX_ANSWER} bytes")
        if r.status_code == 409 and r.headers.get("content-type", "").startswith(SIZE_MEDIA):
            return self._conflict(t, text, cp)
        if r.status_code == 422:
            return self._fail(t, "inconsistent", f"refuses checkpoint {cp.size}: not consistent with the "
                              f"checkpoint {old} it cosigned (a fork or a rollback of this log)")
        if r.status_code in (403, 404):
            return self._fail(t, f"http_{r.status_code}", f"answered {r.status_code}: it is not configured with "
                              f"this log (--log {self.origin}=<this sidecar's public key>)")
        if r.status_code != 200:
            return self._fail(t, f"http_{r.status_code}", f"answered {r.status_code} to checkpoint {cp.size}")
        try:
            found = cosignatures(cp.note + text, [t.witness])
        except Exception:  # noqa: BLE001 - a malformed or forged answer: not a cosignature
            found = []
        if not found:
            return self._fail(t, "bad_cosignature", f"answered checkpoint {cp.size} without a valid cosignature "
                              "by its key")
        add_cosignature(self.store, self.origin, cp.size, found[0])
        t.size, t.cosigned_at, t.failures, t.status = cp.size, self._clock(), 0, "ok"
        if self.metrics is not None:
            self.metrics.witness_cosigned.labels(t.witness.name).set(cp.size)
        return True

    def _post(self, t: _Target, body: str) -> tuple[httpx.Response, str]:
        """POST add-checkpoint; the answer is read up to MAX_ANSWER bytes, never more."""
        with self._clients[t.url].stream("POST", f"{t.url}/add-checkpoint", content=body.encode(),
                                         headers={"Content-Type": "text/plain; charset=utf-8"}) as r:
            data = bytearray()
            for chunk in r.iter_bytes():
                data += chunk
                if len(data) > MAX_ANSWER:
                    raise _TooLarge
        return r, data.decode("utf-8", "replace")

    def _conflict(self, t: _Target, text: str, cp) -> bool:
        """409: the witness's latest size is not the one we sent (our cosignature table lags it, or
        it was reset); resume from its size if that is one of our checkpoints."""
        size = text.strip()
        if not size.isdigit():
            return self._fail(t, "http_409", "answered 409 without its size")
        size = int(size)
        if size > self.log.size:
            return self._fail(t, "rollback", f"the witness cosigned size {size}, beyond this log's size "
                              f"{self.log.size}: the log was rolled back", retry=False)
        if size == t.size:  # same size, another root: a fork
            return self._fail(t, "inconsistent", f"holds another tree of size {size} than this log")
        known = checkpoints_after(self.store, self.origin, size - 1, 1) if size else []
        if size and (not known or known[0].size != size):
            return self._fail(t, "http_409", f"cosigned size {size}, which is no checkpoint of this log")
        t.size, t.cosigned_at = size, 0.0  # at the head, the next pass re-submits that checkpoint
        log.info("witness resumed", witness=t.witness.name, size=size)
        return False

    def _fail(self, t: _Target, reason: str, message: str, retry: bool = True) -> bool:
        t.failures += 1
        delay = min(self.retry_max_s, 0.5 * 2 ** min(t.failures, 16)) if retry else self.retry_max_s
        t.next_try = self._clock() + delay
        first = not t.status.endswith(message)
        t.status = f"failing: {message}"
        if first:
            (log.error if reason in ("rollback", "inconsistent") else log.warning)(
                "witness submission failed", witness=t.witness.name, reason=reason, detail=message)
        if self.metrics is not None:
            self.metrics.witness_failures.labels(t.witness.name, reason).inc()
        return False

    def _gauges(self, t: _Target, head_size: int) -> None:
        if self.metrics is not None and t.size is not None:
            self.metrics.witness_lag.labels(t.witness.name).set(max(head_size - t.size, 0))
            self.metrics.witness_ok.labels(t.witness.name).set(1 if t.status == "ok" else 0)
