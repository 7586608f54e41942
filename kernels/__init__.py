"""Triton kernels of kvguard's hot path, each beside its PyTorch reference.

Importing this package imports torch but not triton: the references run
anywhere, and each kernel module imports triton itself.

Page layout shared by every kernel (one tensor per layer and field; P pages,
H KV heads, S tokens per page, D head_dim, G channels per INT4 value group):

    16-bit  k, v            [P, H, S, D]     fp16 / bf16
    int8    k               [P, H, S, D]     int8     k_scale [P, H, D] fp16 (per channel over the page)
            v               [P, H, D, S]     int8     v_scale [P, H, S] fp16 (per token)
    fp8     as int8 with float8_e4m3fn codes and scales = max|x| / 448
    int4    k               [P, H, S, D//2]  uint8    k_scale, k_zero [P, H, D]     fp16
            v               [P, H, D, S//2]  uint8    v_scale, v_zero [P, H, D//G, S] fp16
            two codes a byte: keys channel 2i in the low nibble, 2i+1 in the high one; values
            token 2j in the low nibble, 2j+1 in the high one; x ≈ code * scale + zero, code 0..15.

Value codes are channel-major (a channel's S tokens contiguous): the decode kernels compute
V^T @ p^T, whose tensor-core operand pairs run along tokens, and read it straight from the page
without a transpose through shared memory. INT4 value scales and zeros are group-major for the
same reason: two tokens' scales, which dequantize one register of V^T, are one 32-bit word.
"""

__all__ = ["quantize"]
