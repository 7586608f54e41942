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
every layer before the step's forward pass (when the runner binds the step's metadata), reads them back, and reports to the scheduler
side through the step's worker metadata, which vLLM aggregates over all workers. An erasure
is acknowledged only once every worker has reported its zeroed blocks.

With `"offload_blocks": N` in the extra config, a block vLLM evicts from its prefix cache to
reuse it is first copied, as INT8, into N slots of kvguard's host tier in each worker
(kvguard.vllm.offload), an `offload` record per earlier owner; a later request whose prompt
hashes to it (same tokens, same cache salt) has it loaded back instead of computed, a
`fetch` record, and vLLM counts those tokens as cached. The worker's order in a step: copy
out what is evicted, overwrite, drop erased copies, load. An erasure drops the subject's
copies too (the receipt's `tier_copies`); a full tier replaces its least recently used copy
(an `evict` record of pages `vllm-cpu:<slot>`). `"offload_tier": "disk"` (with
`"offload_dir"`) or `"redis"` (with `"offload_redis"`, a URL) keeps the copies in kvguard's
sealed disk or Redis tier instead of host memory.
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
from vllm.v1.core.kv_cache_utils import get_block_hash  # noqa: E402

from ..cache import events as ev  # noqa: E402
from ..client import SidecarClient  # noqa: E402
from ..types import Subject  # noqa: E402
from .ledger import BlockLedger, Erasure, erased, pages  # noqa: E402
from .offload import HostIndex, check_tier, make_store  # noqa: E402
from .overwrite import block_dims, overwrite  # noqa: E402

_log = logging.getLogger("kvguard.vllm")
DIRECT = Subject("vllm-direct", "vllm-direct", "vllm-direct")  # requests that did not come through the front
ERASE_TIMEOUT_S = 60.0


@dataclass
class StepMeta(KVConnectorMetadata):
    step: int
    zero: list[int]
    check: bool = False  # an erasure's blocks or copies are among them: read them back
    save: list[tuple[int, int]] = field(default_factory=list)  # (block, host slot): copy out first
    drop: list[int] = field(default_factory=list)  # host slots an erasure empties
    load: list[tuple[int, int]] = field(default_factory=list)  # (host slot, block): copy in last


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
        slots = int(extra.get("offload_blocks", 0) or 0)
        if slots:
            check_offload(vllm_config, kv_cache_config)
            check_tier(extra)
        if role == KVConnectorRole.SCHEDULER:
            self._side = _SchedulerSide(vllm_config, kv_cache_config, extra, slots)
        else:
            self._side = _WorkerSide(self._num_blocks, slots, vllm_config.model_config.get_head_size(), extra)

    # --- worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._side.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The step's moves run here, where the model runner hands over the step's metadata,
        before it launches the forward pass: vLLM calls start_load_kv after that launch unless
        the step has a synchronous load, and a block reused in this step must be copied out and
        overwritten before the forward writes the new owner's tokens into it, not after."""
        super().bind_connector_metadata(connector_metadata)
        meta = connector_metadata
        if isinstance(meta, StepMeta) and (meta.zero or meta.save or meta.drop or meta.load):
            self._side.run(meta)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return  # done at bind_connector_metadata

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
        return self._side.matched(request, num_computed_tokens), False  # loaded in the step, before its forward

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self._side.allocated(request, blocks, num_external_tokens)

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


def check_offload(vllm_config, kv_cache_config) -> None:
    """The host tier copies whole blocks found by their hash: refuse a configuration where a
    block's hash covers less than the block, or where vLLM clears new blocks before the
    connector could copy out what they held."""
    block = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
    hashed = getattr(vllm_config.cache_config, "hash_block_size", None)
    if hashed not in (None, block) or getattr(kv_cache_config, "needs_kv_cache_zeroing", False):
        raise RuntimeError(f"kvguard's offload_blocks needs one prefix-cache hash per KV block ({block} tokens; "
                           f"this engine hashes every {hashed}) and blocks vLLM does not clear on allocation")


class _WorkerSide:
    def __init__(self, num_blocks: int, slots: int, head_size: int, extra: dict | None = None) -> None:
        self.num_blocks, self.slots, self.head_size, self.extra = num_blocks, slots, head_size, extra or {}
        self.layers: list[tuple[torch.Tensor, int]] = []  # (tensor, its block dimension)
        self.host = None  # the tier's store (kvguard.vllm.offload)
        self._report: ZeroReport | None = None

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.layers = block_dims(kv_caches, self.num_blocks)
        if self.slots:
            self.host = make_store(self.layers, self.slots, self.head_size, self.extra)

    def run(self, meta: StepMeta) -> None:
        """A step's moves, before its forward pass: copy out what is evicted, overwrite, drop an
        erasure's copies, load hits."""
        if self.host is not None:
            self.host.save(meta.save)
        residue = overwrite(self.layers, meta.zero, read_back=meta.check) if meta.zero else 0.0
        if self.host is not None:
            residue = max(residue, self.host.drop(meta.drop))
            self.host.load(meta.load)
        r = self._report or ZeroReport()
        r.steps[meta.step] = r.steps.get(meta.step, 0) + len(meta.zero) + len(meta.drop)
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
        self.pages_offloaded = {side.tier: len(side.index)} if side.index is not None else {}
        self.tokens_held = held * side.ledger.block_size


class _SchedulerSide:
    def __init__(self, vllm_config, kv_cache_config, extra: dict, slots: int = 0) -> None:
        block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        total = sum(t.size for t in kv_cache_config.kv_cache_tensors)
        self.ledger = BlockLedger(block_size, total // max(1, kv_cache_config.num_blocks))
        # the host tier: its index, each cached block's hash (known when its request ends), the
        # hits found for a request being scheduled, and this step's loads
        self.index = HostIndex(slots) if slots else None
        self.tier = check_tier(extra) if slots else "cpu"  # named in records and statistics
        self.copy_bytes = self.ledger.block_bytes // 2  # int8 codes of 16-bit values; scales aside
        self.hashes: dict[int, bytes] = {}
        self.hits: dict[str, tuple[int, list[int]]] = {}
        self.external: dict[str, int] = {}
        self.loads: list[tuple[str, list[tuple[int, int]]]] = []
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

    def matched(self, request, computed: int) -> int:
        """Tokens past `computed` whose blocks the host tier holds (whole blocks, never the last
        prompt token: vLLM computes it for the logits)."""
        self.hits.pop(request.request_id, None)
        bs = self.ledger.block_size
        if self.index is None or computed % bs or self.subjects.get(request.request_id, DIRECT) is None:
            return 0
        start = computed // bs
        slots = self.index.match(request.block_hashes[start:], (request.num_tokens - 1 - computed) // bs)
        if slots:
            self.hits[request.request_id] = (start, slots)
        return len(slots) * bs

    def allocated(self, request, blocks, external: int) -> None:
        found = self.hits.pop(request.request_id, None)
        if not external or found is None:
            return
        start, slots = found
        ids = blocks.get_block_ids()[0]
        slots = slots[:external // self.ledger.block_size]
        self.index.use(slots)  # no copy made in this step replaces them
        with self.lock:
            self.external[request.request_id] = external
            self.loads.append((request.request_id, [(s, ids[start + i]) for i, s in enumerate(slots)]))

    def step(self, out) -> StepMeta:
        with self.lock:
            self.steps += 1
            zero = set(self.zero_next)
            self.zero_next = []
            for new in out.scheduled_new_reqs:
                subject = self.subjects.get(new.req_id, DIRECT)
                if subject is None:  # a wake-up: whatever its block held is gone, no copy of it is made
                    for b in new.block_ids[0]:
                        self.hashes.pop(b, None)
                    continue
                hits = (new.num_computed_tokens - self.external.pop(new.req_id, 0)) // self.ledger.block_size
                zero.update(self.ledger.admit(new.req_id, subject, list(new.block_ids[0]), hits))
            cached = out.scheduled_cached_reqs
            for i, (req, blocks) in enumerate(zip(cached.req_ids, cached.new_block_ids)):
                subject = self.subjects.get(req)
                if blocks is None or subject is None:
                    continue
                if req in cached.resumed_req_ids:  # preempted, scheduled again with all its blocks
                    hits = (cached.num_computed_tokens[i] - self.external.pop(req, 0)) // self.ledger.block_size
                    zero.update(self.ledger.admit(req, subject, list(blocks[0]), hits))
                else:
                    zero.update(self.ledger.grow(req, list(blocks[0])))
            save, load = self._offload(), self._fetch()
            check, drop = False, []
            for p in self.pending:
                if p.erasure is None:
                    check |= self._erase_now(p, zero, drop)
            self._emit()
            if self.index is not None:
                self.index.unpin()
            return StepMeta(self.steps, sorted(zero), check, save, drop, load)

    def _offload(self) -> list[tuple[int, int]]:
        """Copies of the cached blocks vLLM reused this step, to make before they are overwritten."""
        save, moved = [], {}
        for b, owners in self.ledger.reused:
            key = self.hashes.pop(b, None)
            put = self.index.put(key, owners) if key is not None and self.index is not None else None
            if put is None:
                continue
            slot, replaced = put
            save.append((b, slot))
            for o in owners:
                moved.setdefault(o, []).append(b)
            if replaced is not None:
                for o in replaced[1]:
                    self.engine.events.emit(ev.TokensEvicted(
                        None, o, (f"vllm-{self.tier}:{replaced[0]}",), self.ledger.block_size, self.copy_bytes,
                        evictor="cpu-lru"))
        self.ledger.reused.clear()
        for o, blocks in moved.items():
            self.ledger.events.append(ev.PagesOffloaded(
                None, o, pages(blocks), len(blocks) * self.ledger.block_size, len(blocks) * self.ledger.block_bytes,
                src="vllm", dst=self.tier, stored_bytes=len(blocks) * self.copy_bytes))
        return save

    def _fetch(self) -> list[tuple[int, int]]:
        load = []
        for req, pairs in self.loads:
            subject = self.subjects.get(req)
            if subject is None or req not in self.ledger.running:
                continue  # not scheduled after all: its blocks are computed, not loaded
            load.extend(pairs)
            n = len(pairs)
            self.ledger.events.append(ev.PagesFetched(
                None, subject, pages(b for _, b in pairs), n * self.ledger.block_size, n * self.ledger.block_bytes,
                src=self.tier, dst="vllm"))
        self.loads.clear()
        return load

    def _erase_now(self, p: _Pending, zero: set[int], drop: list[int]) -> bool:
        """True when the erasure's blocks or host copies go to the workers in this step."""
        in_use = (lambda b: self.pool.blocks[b].ref_cnt > 0) if self.pool is not None else (lambda b: False)
        erasure = self.ledger.erase(p.scope, p.tenant, p.target, in_use)
        if erasure is None:
            return False  # a request of the subject still runs (the front aborts it); again next step
        if self.pool is not None and erasure.overwritten:
            cached = [b for b in erasure.overwritten if self.pool.blocks[b].block_hash is not None]
            self.pool.evict_blocks(set(cached))
            erasure.evicted = len(cached)
        for b in erasure.overwritten:
            self.hashes.pop(b, None)
        if self.index is not None:
            slots, shared = self.index.erase(erased(p.scope, p.tenant, p.target))
            erasure.copies, erasure.shared = slots, erasure.shared + shared
            drop.extend(slots)
        zero.update(erasure.overwritten)
        p.erasure, p.step = erasure, self.steps
        if not erasure.overwritten and not erasure.copies:
            p.done.set()
        return bool(erasure.overwritten or erasure.copies)

    def reported(self, report: ZeroReport) -> None:
        with self.lock:
            for p in self.pending:
                if p.step is not None and p.step in report.steps:
                    p.workers, p.residue = report.workers, report.residue
                    p.done.set()

    def finished(self, req: str) -> None:
        with self.lock:
            self.hits.pop(req, None)
            self.external.pop(req, None)
            subject = self.subjects.pop(req, None)
            if subject is None:
                return
            pool = self.pool
            cached = (lambda b: pool.blocks[b].block_hash is not None) if pool is not None else (lambda b: False)
            if self.index is not None and pool is not None and req in self.ledger.running:
                for b in self.ledger.running[req].blocks:  # what a later reuse of the block copies out
                    key = pool.blocks[b].block_hash
                    if key is not None:
                        self.hashes[b] = get_block_hash(key)
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
        if (e.overwritten or e.copies) and (p.workers < self.world or p.residue != 0.0):
            raise RuntimeError(f"{p.workers} of {self.world} workers reported the erased blocks overwritten "
                               f"(largest value read back {p.residue})")
        event = ev.SubjectErased(None, e.subject, pages(e.overwritten), len(e.overwritten) * self.ledger.block_size,
                                 len(e.overwritten) * self.ledger.block_bytes, scope=scope, sequences=0,
                                 shared_pages=e.shared, tier_copies=len(e.copies), prefix_entries=e.evicted)
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
