"""A policy put to work on the cache: the CacheConfig it sizes for a model, and its
calibration, whose outcome is an auditable `PolicyDecision` event.

`calibrate` checks measured fidelity against the policy's bound and accepts,
downgrades or refuses the policy. This module imports the cache (torch); the
schema it reads (policy.schema) does not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import kvguard.audit.ops as ops

from ..cache.config import CacheConfig
from ..cache.events import CacheEvent, EventQueue
from ..errors import ConfigError
from ..types import Subject
from .schema import Layers, Measurement, ModelShape, Policy


def cache_config(policy: Policy, shape: ModelShape, **overrides) -> CacheConfig:
    """A CacheConfig for a model of this shape (overrides: dtype, device, num_pages, ...)."""
    return CacheConfig(**shape.as_config_fields(), **(policy.cache_options() | overrides))


@dataclass(frozen=True, slots=True)
class PolicyDecision(CacheEvent):
    """The outcome of calibrating a policy: accept, downgrade or refuse, with the
    numbers it was decided on. An event like the cache's, so the sidecar records it."""

    op = ops.POLICY
    policy: str = ""
    outcome: str = ""  # "accept" | "downgrade" | "refuse"
    step: int = -1  # index into Policy.steps() in force; -1 when refused
    config: str = ""  # Layers.key of the configuration in force ("" when refused)
    deviation: float = 0.0  # measured for the configuration as written
    ppl_delta: float = 0.0
    max_attention_deviation: float = 0.0
    max_ppl_increase: float = 0.0

    @property
    def refused(self) -> bool:
        return self.outcome == "refuse"


Measure = Measurement | Mapping[str, Measurement] | Callable[[Layers], Measurement]


def calibrate(policy: Policy, measured: Measure, *, tenant: str = "*",
              events: EventQueue | None = None) -> PolicyDecision:
    """Decide on a policy from measured fidelity.

    `measured` is the measurement of the configuration as written, or a mapping
    (by `Layers.key`) or function giving one per configuration, so downgrade steps
    are checked too. Within the bound: accept. Beyond it: refuse, or (on_violation:
    downgrade) take the first downgrade step that is within the bound, or the first
    step at all when only the written configuration was measured; refuse when no
    measured step is within it. The decision is emitted into `events` when given."""
    def measure(step: Layers) -> Measurement | None:
        if isinstance(measured, Measurement):
            return measured if step.key == policy.steps()[0].key else None
        if isinstance(measured, Mapping):
            return measured.get(step.key)
        return measured(step)

    steps = policy.steps()
    first = measure(steps[0])
    if first is None:
        raise ConfigError(f"no measurement for policy {policy.name!r} as written ({steps[0].key})")
    outcome, step = "refuse", -1
    if first.within(policy.fidelity):
        outcome, step = "accept", 0
    elif policy.on_violation == "downgrade":
        for i, s in enumerate(steps[1:], start=1):
            m = measure(s)
            if m is None and isinstance(measured, Measurement):
                outcome, step = "downgrade", i  # unmeasured: trust the policy's own order of safety
                break
            if m is not None and m.within(policy.fidelity):
                outcome, step = "downgrade", i
                break
    decision = PolicyDecision(
        seq=None, subject=Subject(tenant, "*", "*"), pages=(), n_tokens=0, bytes=0, policy=policy.name,
        outcome=outcome, step=step, config=steps[step].key if step >= 0 else "", deviation=first.deviation,
        ppl_delta=first.ppl_delta, max_attention_deviation=policy.fidelity.max_attention_deviation,
        max_ppl_increase=policy.fidelity.max_ppl_increase)
    if events is not None:
        events.emit(decision)
    return decision
