"""Cache policies: the YAML schema (policy.schema, no torch) and putting a policy to
work on a cache (policy.runtime: its CacheConfig, calibration as an event).

Importing this package loads the schema alone; the runtime's names load the cache
(torch) when first used, so `from kvguard.policy import load_policy` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .schema import (
    NO_H2O,
    SCENARIOS,
    TIERS,
    UNITS,
    Codec,
    Evictor,
    Fidelity,
    Layers,
    Measurement,
    ModelShape,
    Policy,
    PolicyError,
    Retention,
    config_key,
    load_policies,
    load_policy,
    parse_policy,
)

if TYPE_CHECKING:
    from .runtime import Measure, PolicyDecision, cache_config, calibrate

_RUNTIME = ("Measure", "PolicyDecision", "cache_config", "calibrate")


def __getattr__(name: str):
    if name in _RUNTIME:
        from . import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "NO_H2O", "SCENARIOS", "TIERS", "UNITS", "Codec", "Evictor", "Fidelity", "Layers", "Measure",
    "Measurement", "ModelShape", "Policy", "PolicyDecision", "PolicyError", "Retention", "cache_config",
    "calibrate", "config_key", "load_policies", "load_policy", "parse_policy",
]
