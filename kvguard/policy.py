"""Cache policies: one YAML file per serving scenario.

(ModelShape only for now; the schema follows.)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """The attention shape of a model, all a policy needs to size a cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_query_heads: int

    @classmethod
    def from_hf_config(cls, config) -> ModelShape:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads, head_dim, heads)

    def as_config_fields(self) -> dict:
        return {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "num_query_heads": self.num_query_heads}
