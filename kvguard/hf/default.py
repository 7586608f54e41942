"""A KVGuardCache for every `generate` call that brings none: a `pipeline("text-generation")`'s,
for one, which passes no cache.

transformers builds a call's default cache inside `generate` (a DynamicCache, which the
"kvguard" attention refuses) and offers no hook to free one after the call; its generation
config takes only its own cache names. So `use_default_cache(model, ...)` wraps the model's
`generate` instead: a call that passes no cache gets a new KVGuardCache, made from
`model.kvguard_default_cache` (the subject and options given here), and its rows are freed
(pages overwritten, one `free` event each) when the call returns or fails. `load_smollm2`
does this for the models it loads, with the default subject.

    model, tok = load_smollm2()
    use_default_cache(model, Subject("acme", "alice", "s-1"), codec="int8", fp_sink=4)
    pipeline("text-generation", model=model, tokenizer=tok)("def add(a, b):", max_new_tokens=16)

Everything generated this way belongs to one subject: a process that serves several people
passes each call its own cache (`cache=KVGuardCache(model.config, subject, manager=...)`).
`manager=` here, or there, opens the rows in a pool shared with the sidecar, where an erasure
finds them.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass, field

from ..cache import CacheManager, EventQueue
from ..errors import InputError
from ..types import Subject
from .cache import ATTN_IMPLEMENTATION, KVGuardCache, cache_kwarg

ATTR = "kvguard_default_cache"  # where a model keeps its DefaultCache
# The owner of what a model generates when nobody was named: erasing this user erases it all.
DEFAULT_SUBJECT = Subject("default", "default", "default")
_CACHE_KWARGS = ("cache", "past_key_values")  # the current keyword and the one transformers < 5.24 takes


@dataclass(frozen=True)
class DefaultCache:
    """What a model's `generate` makes a cache from when a call passes none.

    subject: who every row belongs to. manager: a CacheManager to open the rows in (else each
    call's cache makes its own from `options`). events: the queue a cache's own manager emits
    into (default: a new one per call). options: KVGuardCache options (codec, evictor, ...).
    """

    subject: Subject = DEFAULT_SUBJECT
    manager: CacheManager | None = None
    events: EventQueue | None = None
    options: dict = field(default_factory=dict)

    def new(self, config) -> KVGuardCache:
        return KVGuardCache(config, self.subject, manager=self.manager, events=self.events, **self.options)


def use_default_cache(model, subject: Subject = DEFAULT_SUBJECT, *, manager: CacheManager | None = None,
                      events: EventQueue | None = None, **options) -> DefaultCache:
    """Give every `model.generate` call that passes no cache a new KVGuardCache for `subject`,
    freed when the call returns (a cache that generate returns, with return_dict_in_generate,
    is empty by then: pass your own to keep one). Calling it again replaces the subject and
    options. Returns the DefaultCache, kept as `model.kvguard_default_cache`."""
    if not isinstance(subject, Subject):
        raise InputError(f"subject must be a kvguard.types.Subject, got {type(subject).__name__}")
    default = DefaultCache(subject, manager, events, dict(options))
    default.new(model.config)  # checks the options and the manager's shape now, not at the first call
    setattr(model, ATTR, default)
    if getattr(model.__dict__.get("generate"), "__func__", None) is not _generate:
        model.generate = types.MethodType(_generate, model)
    return default


def _wants_default(model, kwargs: dict) -> bool:
    """Whether a generate call should get the model's default cache: the model attends through
    kvguard, the call brings no cache and does not turn caching off or pick a transformers cache."""
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        return False
    if any(kwargs.get(k) is not None for k in _CACHE_KWARGS):
        return False
    config = kwargs.get("generation_config") or model.generation_config
    use_cache = kwargs.get("use_cache", config.use_cache)
    cache_implementation = kwargs.get("cache_implementation", config.cache_implementation)
    return use_cache is not False and cache_implementation is None


def _generate(model, *args, **kwargs):
    generate = functools.partial(type(model).generate, model)
    default = getattr(model, ATTR, None)
    if default is None or not _wants_default(model, kwargs):
        return generate(*args, **kwargs)
    for k in _CACHE_KWARGS:  # `cache=None` asks for the default too
        kwargs.pop(k, None)
    with default.new(model.config) as cache:
        return generate(*args, **kwargs, **{cache_kwarg(model): cache})
