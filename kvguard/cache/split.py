"""The K/V split tier: keys stay on the device, the values of cold pages live in CPU memory.

For a sequence whose policy enables it (`CacheConfig.kv_split`), the values of its full pages
older than the last `window` tokens move, between steps (`settle`), into a CPU store (pinned
memory when CUDA is present): one blob of every layer's value fields per page, in the page's
codec, as the CPU tier holds whole pages (in this process's memory; nothing of it leaves the
process). The page stays in its device pool with its keys; its value fields there are zeroed,
and its `PageRef.values` names the copy.

A read (`attend`) scores every key on the device exactly (q·k over the decoded keys of every
page) and takes the softmax over all of them. The cold pages whose attention mass matters are
picked, per block of queries, from those scores: the `top_k` pages with the largest mass (the
largest over query heads and queries of the probability that falls in the page), a `fraction`
of the cold pages, or every page whose mass reaches `mass`. Only their values are fetched and
decoded; the pages not fetched keep their share of the softmax normalization and contribute no
value, so the one approximation is the values skipped: with every page fetched the output is
full attention's.

On CUDA the values are staged in pinned memory and copied on a side stream, which the compute
stream waits for; while a layer attends, the same pages of the next layer are fetched ahead
(`prefetch`), which overlaps the copy with the layer's work.

Every move is an event: `settle` one `offload` (`fields: ["v"]`, the device page ids), a read
one `fetch` per step of a sequence across all layers (the pages read in any layer, the bytes of
all of them), emitted after the last layer. Anything that needs whole pages (the dense K/V of
`kv`, the kernel path, compaction) brings the values back first (`join`, one `fetch`).
Erasure erases the CPU copies with the sequence's tier copies, before its device pages (keys)
are overwritten.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable

import torch

from ..types import PageId, SeqId
from .attention import MAX_SCORES
from .config import CacheConfig
from .pages import PageStore
from .sequence import PageRef, Sequence, page_name
from .tiers import CpuTier

VALUES = "cpu-values"  # the value store among a sequence's tier copies (Residency.tier_copies)


class ValueSplit:
    def __init__(self, cfg: CacheConfig, store: PageStore, offloaded: Callable[..., None],
                 fetched: Callable[..., None]):
        self.cfg = cfg
        self.rule = cfg.kv_split
        self.store = store
        self.offloaded, self.fetched = offloaded, fetched  # Residency.report_offload, report_fetch
        self.values = CpuTier(pin=True)  # pinned where CUDA is present
        self.cuda = cfg.device.type == "cuda" and torch.cuda.is_available()
        self.prefetch = self.cuda  # fetch the next layer's pages while this one attends
        self._stream = torch.cuda.Stream(device=cfg.device) if self.cuda else None
        # seq -> (layer, {value key: {field: device tensor}}, the side stream's event or None)
        self._ahead: dict[SeqId, tuple[int, dict[str, dict[str, torch.Tensor]], object]] = {}
        self._moved: dict[SeqId, tuple[dict[str, None], int]] = {}  # seq -> (pages read, bytes) this step
        self.last_read = 1.0  # fraction of the keys of the last read whose values were read

    def away(self, seq: Sequence) -> bool:
        """Whether some of the sequence's values live in the CPU store."""
        return any(r.values is not None for r in seq.pages)

    # --- between steps --------------------------------------------------------------------------

    def settle(self, seq: Sequence) -> int:
        """Move the values of the sequence's full pages older than the window to the CPU store:
        pages on the device that no other sequence shares and the prefix index does not offer.
        Returns how many pages moved. Only between steps (every layer holds the same tokens)."""
        if self.rule is None or len(set(seq.lengths)) != 1:
            return 0
        s, pools, prefix = self.cfg.page_size, self.store.pools, self.store.prefix
        cold = max(0, (seq.lengths[0] - self.rule.window) // s)
        cand = [i for i, r in enumerate(seq.pages[:cold])
                if r.where in pools and r.values is None and pools[r.where].ref[int(r.page)] == 1
                and prefix.hash_of((r.where, int(r.page))) is None]
        moved, nbytes, stored = [], 0, 0
        try:
            for i in cand:
                r = seq.pages[i]
                pool, page = pools[r.where], PageId(int(r.page))
                key = f"{seq.id}-v-{uuid.uuid4().hex}"
                try:
                    stored += self.values.put(key, pool.value_blob(page))
                except BaseException:
                    self.values.erase(key)
                    raise
                pool.wipe_values([page])
                seq.pages[i] = PageRef(r.where, r.page, r.pool, values=key)
                moved.append(page_name(r.where, r.page))
                nbytes += pool.value_bytes()
        finally:  # pages moved before a failure are recorded too
            if moved:
                self.offloaded(seq, moved, nbytes, "cpu", stored, ("v",))
        return len(moved)

    def join(self, seq: Sequence) -> None:
        """Bring every value the CPU store holds for the sequence back into its device pages
        (before a read of whole pages); one `fetch` event."""
        pools, got, nbytes = self.store.pools, [], 0
        self.flush(seq)
        try:
            for i, r in enumerate(seq.pages):
                if r.values is None:
                    continue
                pool = pools[r.where]
                pool.load_values(PageId(int(r.page)), self.values.get(r.values))
                seq.pages[i] = PageRef(r.where, r.page, r.pool)
                self.values.erase(r.values)
                got.append(page_name(r.where, r.page))
                nbytes += pool.value_bytes()
        finally:
            if got:
                self.fetched(seq, got, nbytes, "cpu", ("v",))

    def flush(self, seq: Sequence) -> None:
        """Emit the `fetch` of the values read for the sequence since the last one, and drop
        what was fetched ahead for it."""
        ahead = self._ahead.pop(seq.id, None)
        if ahead is not None:
            if ahead[2] is not None:  # the copy may still be under way on the side stream
                torch.cuda.current_stream(self.cfg.device).wait_event(ahead[2])
            for fields in ahead[1].values():
                for t in fields.values():
                    t.zero_()
        moved = self._moved.pop(seq.id, None)
        if moved and moved[0]:
            names, nbytes = moved
            self.fetched(seq, list(names), nbytes, "cpu", ("v",))

    # --- reads ----------------------------------------------------------------------------------

    def attend(self, seq: Sequence, layer: int, q: torch.Tensor, causal: bool, scale: float | None,
               mass_queries: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of q [T, Hq, D] (the last T positions) over what the sequence holds, the
        cold pages' values fetched as the rule picks them. Returns (out [T, Hq, D] in q's dtype,
        each key's mass [H, L] summed over the last `mass_queries` queries, or None); the mass
        is the exact softmax's, whatever was fetched."""
        c = self.cfg
        s = c.page_size
        refs = list(seq.pages)
        n = seq.lengths[layer]
        k, v = self.store.gather(refs, layer, torch.float32)  # a cold page's values: zeros here
        k, v = k[:, :n], v[:, :n]
        t, hq, d = q.shape
        h = k.shape[0]
        g = hq // h
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        cold = [i for i, r in enumerate(refs) if r.values is not None and (i + 1) * s <= n]
        qf = q.float().reshape(t, h, g, d).permute(1, 2, 0, 3)  # [H, g, T, D]
        out = torch.empty(h, g, t, d, device=q.device)
        mass = torch.zeros(h, n, device=q.device) if mass_queries > 0 else None
        fetched: dict[int, torch.Tensor] = {}  # page index -> its values [H, S, D], fetched once per read
        block = max(1, MAX_SCORES // max(1, h * g * n))
        read = 0
        for lo in range(0, t, block):
            hi = min(t, lo + block)
            scores = torch.einsum("hgtd,hld->hgtl", qf[:, :, lo:hi], k) * scale  # [H, g, hi - lo, L]
            if causal and t > 1:
                pos_q = torch.arange(n - t + lo, n - t + hi, device=q.device).unsqueeze(1)
                pos_k = torch.arange(n, device=q.device).unsqueeze(0)
                scores = scores.masked_fill(pos_k > pos_q, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            first = max(lo, t - mass_queries)
            if mass is not None and first < hi:
                mass += probs[:, :, first - lo:].sum(dim=(1, 2))
            vb, skipped = v, []
            if cold:
                chosen = self._pick(probs, cold)
                need = [i for i in chosen if i not in fetched]
                if need:
                    fetched.update(zip(need, self._fetch(seq, layer, refs, need), strict=True))
                skipped = [i for i in cold if i not in set(chosen)]
                if chosen:
                    vb = v.clone()
                    for i in chosen:
                        vb[:, i * s:(i + 1) * s] = fetched[i]
                if skipped:
                    keep = torch.ones(n, device=q.device)
                    for i in skipped:
                        keep[i * s:(i + 1) * s] = 0
                    probs = probs * keep  # skipped values: their weight stays in the normalization
            read += (hi - lo) * (n - len(skipped) * s)
            out[:, :, lo:hi] = torch.einsum("hgtl,hld->hgtd", probs, vb)
        self.last_read = read / (t * n) if n else 1.0
        if cold and self.prefetch and layer + 1 < c.num_layers:
            self._fetch_ahead(seq, layer + 1, [refs[i] for i in sorted(fetched)])
        if layer == c.num_layers - 1:
            self.flush(seq)
        return out.permute(2, 0, 1, 3).reshape(t, hq, d).to(q.dtype), mass

    def _pick(self, probs: torch.Tensor, cold: list[int]) -> list[int]:
        """The cold pages (indices into the sequence's pages) whose values a block of queries
        reads, ascending: by each page's largest attention mass over query heads and queries."""
        s = self.cfg.page_size
        h, g, t, _ = probs.shape
        tok = (torch.tensor(cold, device=probs.device)[:, None] * s + torch.arange(s, device=probs.device)).flatten()
        per_page = probs[..., tok].reshape(h, g, t, len(cold), s).sum(-1).amax(dim=(0, 1, 2))  # [cold]
        k = self.rule.pages(len(cold))
        if k is None:
            pick = (per_page >= self.rule.mass).nonzero().flatten().tolist()
        elif k >= len(cold):
            pick = list(range(len(cold)))
        else:
            pick = per_page.topk(k).indices.tolist()
        return sorted(cold[j] for j in pick)

    def _fetch(self, seq: Sequence, layer: int, refs: list[PageRef], idx: list[int]) -> list[torch.Tensor]:
        """The values [H, S, D] fp32 of pages idx of the sequence at one layer, from the CPU
        store (or what was fetched ahead), decoded with their device keys' codec fields."""
        pools = self.store.pools
        fields = self._load(seq, layer, [refs[i] for i in idx])
        out: list[torch.Tensor | None] = [None] * len(idx)
        for name, pool in pools.items():
            at = [j for j, i in enumerate(idx) if refs[i].where == name]
            if not at:
                continue
            f = pool.read(layer, [PageId(int(refs[idx[j]].page)) for j in at])
            for fname in pool.value_fields():
                dtype = pool.fields[layer][fname].dtype
                f[fname] = torch.stack([fields[j][fname] for j in at]).view(dtype)
            _, vv = pool.codec.decode(f, torch.float32)  # [n, H, S, D]
            for j, x in zip(at, vv):
                out[j] = x
        return out

    def _load(self, seq: Sequence, layer: int, refs: list[PageRef]) -> list[dict[str, torch.Tensor]]:
        """Each page's value fields at one layer, on the device: from what was fetched ahead
        for this layer, the rest copied now. Counted into the step's `fetch` event."""
        ahead = self._ahead.pop(seq.id, None)
        have: dict[str, dict[str, torch.Tensor]] = {}
        if ahead is not None and ahead[0] == layer:
            if ahead[2] is not None:
                torch.cuda.current_stream(self.cfg.device).wait_event(ahead[2])
            have = ahead[1]
        missing = [r for r in refs if r.values not in have]
        if missing:
            got, event = self._copy(seq, layer, missing)
            if event is not None:
                torch.cuda.current_stream(self.cfg.device).wait_event(event)
            have = {**have, **got}
        return [have[r.values] for r in refs]

    def _fetch_ahead(self, seq: Sequence, layer: int, refs: list[PageRef]) -> None:
        """Start fetching these pages' values of `layer` (the next layer's likely pages)."""
        if refs:
            got, event = self._copy(seq, layer, refs)
            self._ahead[seq.id] = (layer, got, event)

    def _copy(self, seq: Sequence, layer: int, refs: list[PageRef]):
        """Copy the pages' value fields of one layer to the device: on CUDA staged in pinned
        memory and copied on the side stream (returns the event to wait for), else at once."""
        dev = self.cfg.device
        names, nbytes = self._moved.setdefault(seq.id, ({}, 0))
        got: dict[str, dict[str, torch.Tensor]] = {}
        event = None
        for r in refs:
            blob = self.values.get(r.values)
            prefix = f"{layer}."
            got[r.values] = {key[len(prefix):]: x for key, x in blob.items() if key.startswith(prefix)}
            names[page_name(r.where, r.page)] = None
            nbytes += sum(x.numel() * x.element_size() for x in got[r.values].values())
        self._moved[seq.id] = (names, nbytes)
        if self.cuda:
            with torch.cuda.stream(self._stream):
                got = {key: {n: x.to(dev, non_blocking=True) for n, x in f.items()} for key, f in got.items()}
                event = torch.cuda.Event()
                event.record(self._stream)
            for f in got.values():
                for x in f.values():
                    x.record_stream(torch.cuda.current_stream(dev))
        else:
            got = {key: {n: x.to(dev, copy=True) for n, x in f.items()} for key, f in got.items()}
        return got, event
