"""FP8 e4m3: INT8's layout with float8 codes and scales = max|x| / 448."""

from dataclasses import dataclass

import torch

from .int8 import Int8Codec


@dataclass(frozen=True)
class Fp8Codec(Int8Codec):
    name = "fp8"
    code_dtype = torch.float8_e4m3fn
