"""Page codecs by name."""

from __future__ import annotations

from ...errors import ConfigError
from .base import Codec
from .fp8 import Fp8Codec
from .fp16 import Fp16Codec
from .int4 import Int4Codec
from .int8 import Int8Codec
from .mixed import MixedCodec

CODECS: dict[str, type[Codec]] = {c.name: c for c in (Fp16Codec, Int8Codec, Int4Codec, Fp8Codec)}
ALIASES = {"none": "fp16", "bf16": "fp16", "16bit": "fp16"}


def make_codec(name: str, **options) -> Codec:
    key = ALIASES.get(name, name)
    if key not in CODECS:
        raise ConfigError(f"unknown codec {name!r}; choose one of {sorted(CODECS)}")
    try:
        return CODECS[key](**options)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"bad options for codec {name!r}: {e}") from None


__all__ = ["CODECS", "Codec", "Fp16Codec", "Int8Codec", "Int4Codec", "Fp8Codec", "MixedCodec", "make_codec"]
