"""kvguard inside vLLM: a KV connector that audits every block and erases a subject's blocks.

Loaded by vLLM itself, no patch:

    --kv-transfer-config '{"kv_connector": "KVGuardConnector",
                           "kv_connector_module_path": "kvguard.vllm.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"socket": "/run/kvguard/ingest.sock",
                                                         "api_url": "http://127.0.0.1:8001"}}'

with the ingest token in KVGUARD_INGEST_TOKEN. vLLM makes one instance on its scheduler
side (one per engine core: each data-parallel rank) and one in every worker (each tensor-
and pipeline-parallel rank).

Scheduler side: learns each request's subject from the `kv_transfer_params` that kvguard's
front set (`{"kvguard": {"tenant", "user", "session"}}`; a request without them is recorded
under the subject "vllm-direct"), follows the blocks the scheduler allocates and frees
(kvguard.vllm.ledger), and sends the events to the sidecar as any inference process does
(kvguard.client). It carries out the sidecar's erase commands at the next scheduler step:
the subject's blocks leave vLLM's prefix cache (`BlockPool.evict_blocks`) and their ids go
to the workers with the step's metadata. An idle engine takes no step, so the connector
sends vLLM's own API a one-token request to wake it (`api_url`).

Worker side: holds the registered KV tensors and overwrites the listed blocks with zeros in
every layer before the step's forward pass, reads them back, and reports to the scheduler
side through the step's worker metadata, which vLLM aggregates over all workers. An erasure
is acknowledged only once every worker has reported its zeroed blocks.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch

from . import check_version

check_version()

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from ..cache import events as ev  # noqa: E402
from ..client import SidecarClient  # noqa: E402
from ..types import Subject  # noqa: E402
from .ledger import BlockLedger, Erasure, pages  # noqa: E402
from .overwrite import block_dims, overwrite  # noqa: E402

_log = logging.getLogger("kvguard.vllm")
DIRECT = Subject("vllm-direct", "vllm-direct", "vllm-direct")  # requests that did not come through the front
ERASE_TIMEOUT_S = 60.0


@dataclass
class StepMeta(KVConnectorMetadata):
    step: int
    zero: list[int]
    check: bool = False  # an erasure's blocks are among them: read them back


@dataclass
class ZeroReport(KVConnectorWorkerMetadata):
    """What the workers overwrote in a step: blocks per step, how many workers, and the largest
    magnitude any of them read back from those blocks afterwards (0.0: nothing left)."""

    steps: dict[int, int] = field(default_factory=dict)
    workers: int = 1
    residue: float = 0.0

    def aggregate(self, other: ZeroReport) -> ZeroReport:
        steps = dict(self.steps)
        for s, n in other.steps.items():
            steps[s] = steps.get(s, 0) + n
        return ZeroReport(steps, self.workers + other.workers, max(self.residue, other.residue))


@dataclass
class _Pending:
    scope: str
    tenant: str
    target: str
    done: threading.Event = field(default_factory=threading.Event)
    erasure: Erasure | None = None
    step: int | None = None  # the step whose workers overwrite its blocks
    workers: int = 0
    residue: float = 0.0


class KVGuardConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._num_blocks = kv_cache_config.num_blocks
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise RuntimeError("kvguard's vLLM connector follows one KV-cache group (full attention in every "
                               f"layer); this model has {len(groups)} (sliding-window or hybrid layers)")
        if role == KVConnectorRole.SCHEDULER:
            self._side = _SchedulerSide(vllm_config, kv_cache_config, extra)
        else:
            self._side = _WorkerSide(self._num_blocks)

    # --- worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._side.register(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, StepMeta) and meta.zero:
            self._side.zero(meta.step, meta.zero, meta.check)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self):
        return

    def build_connector_worker_meta(self) -> ZeroReport | None:
        return self._side.report()

    # --- scheduler side ---------------------------------------------------------------------------

    def on_new_request(self, request) -> None:
        self._side.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False  # nothing is loaded from outside vLLM's own pool

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        return

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self._side.step(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        report = connector_output.kv_connector_worker_meta
        if isinstance(report, ZeroReport):
            self._side.reported(report)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._side.finished(request.request_id)
        return False, None

    def has_pending_push_work(self) -> bool:
        return self._side.erasing()

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        self._side.pool = gpu_block_pool

    def shutdown(self):
        self._side.close()


class _WorkerSide:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.layers: list[tuple[torch.Tensor, int]] = []  # (tensor, its block dimension)
        self._report: ZeroReport | None = None

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.layers = block_dims(kv_caches, self.num_blocks)

    def zero(self, step: int, blocks: list[int], check: bool) -> None:
        residue = overwrite(self.layers, blocks, read_back=check)
        r = self._report or ZeroReport()
        r.steps[step] = r.steps.get(step, 0) + len(blocks)
        r.residue = max(r.residue, residue)
        self._report = r

    def report(self) -> ZeroReport | None:
        r, self._report = self._report, None
        return r

    def close(self) -> None:
        return


class _Engine:
    """The inference process as kvguard.client sees it: a queue of events, statistics, and an
    erase that returns once vLLM's workers have overwritten the subject's blocks."""

    def __init__(self, side: _SchedulerSide) -> None:
        self.side = side
        self.events = ev.EventQueue()

    def sequences(self) -> list:
        return []

    def stats(self):
        return _Stats(self.side)

    def erase_user(self, tenant: str, user: str) -> ev.SubjectErased:
        return self.side.erase("user", tenant, user)

    def erase_session(self, tenant: str, session: str) -> ev.SubjectErased:
        return self.side.erase("session", tenant, session)


class _Stats:
    codec = None  # vLLM's own blocks, in its KV dtype

    def __init__(self, side: _SchedulerSide) -> None:
        with side.lock:
            held = len(side.ledger.owners)
        self.pages_used = {"main": held}
        self.pages_offloaded: dict[str, int] = {}
        self.tokens_held = held * side.ledger.block_size


class _SchedulerSide:
    def __init__(self, vllm_config, kv_cache_config, extra: dict) -> None:
        block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        total = sum(t.size for t in kv_cache_config.kv_cache_tensors)
        self.ledger = BlockLedger(block_size, total // max(1, kv_cache_config.num_blocks))
        self.world = vllm_config.parallel_config.world_size
        self.lock = threading.Lock()
        self.subjects: dict[str, Subject | None] = {}  # request -> subject (None: a wake-up)
        self.pool = None
        self.warned = False
        self.steps = 0
        self.pending: list[_Pending] = []
        self.zero_next: list[int] = []  # freed blocks to overwrite in the next step
        self.api_url = extra.get("api_url") or os.environ.get("KVGUARD_VLLM_API_URL")
        self.model = vllm_config.model_config.served_model_name
        if isinstance(self.model, list | tuple):
            self.model = self.model[0]
        token = os.environ.get("KVGUARD_INGEST_TOKEN", "")
        socket = extra.get("socket") or os.environ.get("KVGUARD_SOCKET")
        url = extra.get("sidecar_url")
        if not token or not (socket or url):
            raise RuntimeError("kvguard's vLLM connector needs the sidecar: set KVGUARD_INGEST_TOKEN and the "
                               "ingest socket (kv_connector_extra_config 'socket' or KVGUARD_SOCKET)")
        rank = vllm_config.parallel_config.data_parallel_rank
        self.engine = _Engine(self)
        self.client = SidecarClient(self.engine, token=token, socket=socket, url=url,
                                    client_id=extra.get("client_id") or f"vllm-dp{rank}", on_full="block",
                                    poll_wait_s=float(extra.get("poll_wait_s", 5.0))).start()

    # --- the scheduler's thread ---------------------------------------------------------------------

    def on_new_request(self, request) -> None:
        params = (request.kv_transfer_params or {}).get("kvguard") if request.kv_transfer_params else None
        subject: Subject | None = DIRECT
        if isinstance(params, dict) and params.get("wake"):
            subject = None
        elif isinstance(params, dict):
            try:
                subject = Subject(params["tenant"], params["user"], params["session"])
            except (KeyError, ValueError, TypeError):
                subject = DIRECT
        if subject is DIRECT and not self.warned:  # once: a log line per request would cost the engine
            self.warned = True
            _log.warning("a request reached vLLM without kvguard's subject; its blocks, and those of any "
                         "such request after it, are recorded under 'vllm-direct'")
        with self.lock:
            self.subjects[request.request_id] = subject

    def step(self, out) -> StepMeta:
        with self.lock:
            self.steps += 1
            zero = set(self.zero_next)
            self.zero_next = []
            for new in out.scheduled_new_reqs:
                subject = self.subjects.get(new.req_id, DIRECT)
                if subject is None:
                    continue
                hits = new.num_computed_tokens // self.ledger.block_size
                zero.update(self.ledger.admit(new.req_id, subject, list(new.block_ids[0]), hits))
            cached = out.scheduled_cached_reqs
            for i, (req, blocks) in enumerate(zip(cached.req_ids, cached.new_block_ids)):
                subject = self.subjects.get(req)
                if blocks is None or subject is None:
                    continue
                if req in cached.resumed_req_ids:  # preempted, scheduled again with all its blocks
                    hits = cached.num_computed_tokens[i] // self.ledger.block_size
                    zero.update(self.ledger.admit(req, subject, list(blocks[0]), hits))
                else:
                    zero.update(self.ledger.grow(req, list(blocks[0])))
            check = False
            for p in self.pending:
                if p.erasure is None:
                    check |= self._erase_now(p, zero)
            self._emit()
            return StepMeta(self.steps, sorted(zero), check)

    def _erase_now(self, p: _Pending, zero: set[int]) -> bool:
        """True when the erasure's blocks go to the workers in this step."""
        in_use = (lambda b: self.pool.blocks[b].ref_cnt > 0) if self.pool is not None else (lambda b: False)
        erasure = self.ledger.erase(p.scope, p.tenant, p.target, in_use)
        if erasure is None:
            return False  # a request of the subject still runs (the front aborts it); again next step
        if self.pool is not None and erasure.overwritten:
            cached = [b for b in erasure.overwritten if self.pool.blocks[b].block_hash is not None]
            self.pool.evict_blocks(set(cached))
            erasure.evicted = len(cached)
        zero.update(erasure.overwritten)
        p.erasure, p.step = erasure, self.steps
        if not erasure.overwritten:
            p.done.set()
        return bool(erasure.overwritten)

    def reported(self, report: ZeroReport) -> None:
        with self.lock:
            for p in self.pending:
                if p.step is not None and p.step in report.steps:
                    p.workers, p.residue = report.workers, report.residue
                    p.done.set()

    def finished(self, req: str) -> None:
        with self.lock:
            subject = self.subjects.pop(req, None)
            if subject is None:
                return
            pool = self.pool
            cached = (lambda b: pool.blocks[b].block_hash is not None) if pool is not None else (lambda b: False)
            self.zero_next.extend(self.ledger.finish(req, cached))
            self._emit()

    def erasing(self) -> bool:
        with self.lock:
            return any(not p.done.is_set() for p in self.pending)

    def _emit(self) -> None:
        for e in self.ledger.events:
            self.engine.events.emit(e)
        self.ledger.events.clear()

    # --- the sidecar client's command thread --------------------------------------------------------

    def erase(self, scope: str, tenant: str, target: str) -> ev.SubjectErased:
        """Carried out by the scheduler's thread at its next step; waits for every worker."""
        p = _Pending(scope, tenant, target)
        with self.lock:
            self.pending.append(p)
        try:
            deadline = time.monotonic() + ERASE_TIMEOUT_S
            while not p.done.wait(0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError("vLLM took no step to carry out the erasure")
                self._wake()
        finally:
            with self.lock:
                self.pending.remove(p)
        e = p.erasure
        if e.overwritten and (p.workers < self.world or p.residue != 0.0):
            raise RuntimeError(f"{p.workers} of {self.world} workers reported the erased blocks overwritten "
                               f"(largest value read back {p.residue})")
        event = ev.SubjectErased(None, e.subject, pages(e.overwritten), len(e.overwritten) * self.ledger.block_size,
                                 len(e.overwritten) * self.ledger.block_bytes, scope=scope, sequences=0,
                                 shared_pages=e.shared, tier_copies=0, prefix_entries=e.evicted)
        self.engine.events.emit(event)
        return event

    def _wake(self) -> None:
        """An idle engine core waits for a request before it takes a step: send vLLM one."""
        if not self.api_url:
            return  # a busy engine steps anyway; an idle one waits for the next request
        body = {"model": self.model, "prompt": "0", "max_tokens": 1,
                "kv_transfer_params": {"kvguard": {"wake": True}}}
        try:
            httpx.post(self.api_url.rstrip("/") + "/v1/completions", json=body, timeout=10.0)
        except httpx.HTTPError as exc:
            _log.warning("could not wake vLLM for an erasure (%s)", type(exc).__name__)

    def close(self) -> None:
        self.client.close()
