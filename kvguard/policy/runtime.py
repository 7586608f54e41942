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
    """A CacheConfig for a model of this shape (overrides: dtype, device, num_pages, ...):
    `Policy.cache_config`."""
    return policy.cache_config(shape, **overrides)


# what a decision says of the evictor of the configuration as written: none in it, measured (it
# dropped tokens while scoring), not measured (it never fired: the run was shorter than its
# budget), or unreported (the caller's Measurement did not say)
EVICTOR_NONE, EVICTOR_MEASURED, EVICTOR_NOT_MEASURED, EVICTOR_UNREPORTED = (
    "none", "measured", "not measured", "unreported")


@dataclass(frozen=True, slots=True)
class PolicyDecision(CacheEvent):
    """The outcome of calibrating a policy: accept, downgrade or refuse, with the
    numbers it was decided on (those of the configuration as written, on the worst
    text). An event like the cache's, so the sidecar records it."""

    op = ops.POLICY
    policy: str = ""
    outcome: str = ""  # "accept" | "downgrade" | "refuse"
    step: int = -1  # index into Policy.steps() in force; -1 when refused
    config: str = ""  # Layers.key of the configuration in force ("" when refused)
    mean_layer_deviation: float = 0.0  # attention deviation, mean over layers
    ppl_delta: float = 0.0
    worst_layer_deviation: float | None = None  # None: not measured
    ppl_increase_rel: float | None = None
    evictor: str = EVICTOR_UNREPORTED  # of the configuration as written: EVICTOR_* above
    max_attention_deviation: float = 0.0
    max_ppl_increase: float = 0.0
    max_layer_deviation: float | None = None
    max_ppl_increase_rel: float | None = None

    @property
    def refused(self) -> bool:
        return self.outcome == "refuse"

    @classmethod
    def from_details(cls, d: dict, subject: Subject) -> PolicyDecision:
        """A decision back from its `details()` (a report's JSON), older records included:
        those named the mean over layers `deviation` and had no worst layer."""
        d = {k: v for k, v in d.items() if k != "op"}
        if "deviation" in d:
            d["mean_layer_deviation"] = d.pop("deviation")
        return cls(**d | {"subject": subject, "pages": tuple(d.get("pages") or ())})

Measure = Measurement | Mapping[str, Measurement] | Callable[[Layers], Measurement]


def calibrate(policy: Policy, measured: Measure, *, tenant: str = "*",
              events: EventQueue | None = None) -> PolicyDecision:
    """Decide on a policy from measured fidelity.

    `measured` is the measurement of the configuration as written, or a mapping
    (by `Layers.key`) or function giving one per configuration, so downgrade steps
    are checked too. Within the bound: accept. Beyond it: refuse, or (on_violation:
    downgrade) take the first downgrade step that is within the bound, or the first
    step at all when only the written configuration was measured; refuse when no
    measured step is within it. A step whose evictor never fired while measuring
    (`Measurement.evictor_fired` False) is not within the bound: its evictor was not
    measured. Greedy agreement plays no part. The decision is emitted into `events`
    when given."""
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
    evictor = (EVICTOR_NONE if steps[0].evictor is None else EVICTOR_UNREPORTED if first.evictor_fired is None
               else EVICTOR_MEASURED if first.evictor_fired else EVICTOR_NOT_MEASURED)
    bound = policy.fidelity
    decision = PolicyDecision(
        seq=None, subject=Subject(tenant, "*", "*"), pages=(), n_tokens=0, bytes=0, policy=policy.name,
        outcome=outcome, step=step, config=steps[step].key if step >= 0 else "",
        mean_layer_deviation=first.mean_layer_deviation, ppl_delta=first.ppl_delta,
        worst_layer_deviation=first.worst_layer_deviation, ppl_increase_rel=first.ppl_increase_rel,
        evictor=evictor, max_attention_deviation=bound.max_attention_deviation,
        max_ppl_increase=bound.max_ppl_increase, max_layer_deviation=bound.max_layer_deviation,
        max_ppl_increase_rel=bound.max_ppl_increase_rel)
    if events is not None:
        events.emit(decision)
    return decision
