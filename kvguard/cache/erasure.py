"""Erasure: ending a sequence (`free`) and erasing everything of a user or a session.

Every lower-tier copy of the sequences goes first: a tier that fails raises TierError with
nothing released and nothing recorded, and the operation can simply be run again (a tier erases
an absent key without error). Then their device pages are released: a page nobody else holds is
overwritten and freed; a shared one loses the subject. An erased subject's pages also lose their
prefix-index entries. Each operation is reported in one event.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import TierError
from ..types import Subject
from . import events as ev
from .pages import PageStore
from .residency import Residency
from .sequence import Sequence, Sequences


class Eraser:
    def __init__(self, seqs: Sequences, store: PageStore, residency: Residency,
                 emit: Callable[[ev.CacheEvent], None]):
        self.seqs = seqs
        self.store = store
        self.residency = residency
        self.emit = emit

    def free(self, seq: Sequence) -> ev.SequenceFreed:
        """End a sequence: its pages are overwritten and freed unless another sequence shares
        them; its prefix-index entries stay for the pages still shared."""
        copies = self._erase_copies([seq])
        freed, _ = self._drop(seq)
        event = ev.SequenceFreed(seq=seq.id, subject=seq.subject, pages=tuple(freed), n_tokens=max(seq.lengths),
                                 bytes=self.store.bytes_of(freed), tier_copies=copies)
        self.emit(event)
        return event

    def erase(self, scope: str, match: Callable[[Subject], bool], who: Subject) -> ev.SubjectErased:
        """Erase every sequence of a subject: pages nobody else holds are overwritten and
        freed; shared pages lose the subject and their prefix-index entries."""
        seqs = self.seqs.owned_by(match)
        tiers = self._erase_copies(seqs)
        freed, shared, prefix, tokens = [], 0, 0, 0
        for seq in seqs:
            prefix += self.store.forget(seq.pages)
            f, sh = self._drop(seq)
            freed += f
            shared += sh
            tokens += max(seq.lengths)
        event = ev.SubjectErased(seq=None, subject=who, pages=tuple(freed), n_tokens=tokens,
                                 bytes=self.store.bytes_of(freed), scope=scope, sequences=len(seqs),
                                 shared_pages=shared, tier_copies=tiers, prefix_entries=prefix)
        self.emit(event)
        return event

    def _drop(self, seq: Sequence) -> tuple[list[str], int]:
        """Release every device page of a sequence (its tier copies erased before), wipe its
        attention statistics and close it: (freed pages, shared pages kept for others)."""
        self.residency.closing(seq)
        freed, shared = self.store.release_refs(seq.pages, seq.subject)
        seq.mass_buf.zero_()
        self.seqs.remove(seq)
        return freed, shared

    def _erase_copies(self, seqs: list[Sequence]) -> int:
        """Erase every lower-tier copy of the sequences, before anything else of theirs is
        released. Returns the copies erased; raises TierError, having tried every copy."""
        n, failed, first = 0, 0, None
        for seq in seqs:
            for tier, key in self.residency.tier_copies(seq):
                try:
                    self.residency.tiers[tier].erase(key)
                    n += 1
                except Exception as e:
                    failed, first = failed + 1, first or e
        if failed:
            raise TierError(f"{failed} of {n + failed} lower-tier copies could not be erased "
                            f"({type(first).__name__}); nothing was released: retry when the tier is back") from first
        return n
