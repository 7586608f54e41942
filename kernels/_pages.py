"""Device functions shared by the paged kernels: read tokens out of pages and
dequantize them, quantize one page exactly as kernels/quantize.py does, and one
step of online-softmax attention.

Layout and field names are those of kernels/__init__.py. KIND: 0 = 16-bit,
1 = int8 or fp8 (symmetric; the code dtype comes from the pointer), 2 = int4.
Offsets are int64: a 40 GB pool has more elements than int32 can count.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import _interpreter  # noqa: F401  (loop bounds under Triton 3.6's interpreter with NumPy >= 2.4)

FP16_MIN_NORMAL = tl.constexpr(2.0**-14)
FP16_MAX = tl.constexpr(65504.0)

# ON_GPU (a constexpr every kernel takes) selects PTX fast paths that compute the same values
# as the portable code beside them, which the interpreter runs: inline assembly and libdevice
# do not exist there. load_pages_f16 also takes ON_GPU = 2: int8/fp8 codes loaded as int32
# words (rows must be 4-byte aligned), and for int4 ON_GPU = 3: bytes to channel-ordered fp16
# pairs (u4_pairs_to_f16), -3 the same by portable code.


@triton.jit
def i8_to_f16(c):
    """int8 codes -> fp16, exactly, four per instruction group: c ^ 0x80 becomes the low byte
    of 0x64xx, the fp16 number 1152 + c, and one packed subtraction leaves c."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t, k;\n"
        "xor.b32 t, $2, 0x80808080;\n"
        "mov.b32 k, 0x64806480;\n"
        "prmt.b32 $0, t, 0x64646464, 0x4140;\n"
        "prmt.b32 $1, t, 0x64646464, 0x4342;\n"
        "sub.f16x2 $0, $0, k;\n"
        "sub.f16x2 $1, $1, k; }",
        "=r,=r,r", [c], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def u4_to_f16(b):
    """bytes -> (low nibbles, high nibbles) as fp16, exactly, four bytes per instruction group:
    each nibble becomes the low bits of 0x6400 (fp16 1024 + c), then 1024 is subtracted."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 a, c, k;\n"
        "mov.b32 k, 0x64006400;\n"
        "prmt.b32 a, $4, 0, 0x4140;\n"
        "prmt.b32 c, $4, 0, 0x4342;\n"
        "lop3.b32 $0, a, 0x000f000f, k, 0xea;\n"
        "lop3.b32 $1, c, 0x000f000f, k, 0xea;\n"
        "shr.b32 a, a, 4;\n"
        "shr.b32 c, c, 4;\n"
        "lop3.b32 $2, a, 0x000f000f, k, 0xea;\n"
        "lop3.b32 $3, c, 0x000f000f, k, 0xea;\n"
        "sub.f16x2 $0, $0, k;\n"
        "sub.f16x2 $1, $1, k;\n"
        "sub.f16x2 $2, $2, k;\n"
        "sub.f16x2 $3, $3, k; }",
        "=r,=r,=r,=r,r", [b], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


@triton.jit
def u4_pairs_to_f16(b, ON_GPU: tl.constexpr):
    """bytes [..., D/2] of 4-bit codes (channel 2i in the low nibble of byte i) -> [..., D/2, 2]
    fp16 (reshape to [..., D]: channel order), exactly. On the GPU each byte becomes one 32-bit
    register holding its two channels as an fp16 pair, the pair the tensor cores take: one PRMT
    puts the byte into both halves, one LOP3 keeps the low nibble in the low half under 0x6400
    (the fp16 number 1024 + c, ulp 1) and the high nibble, in place at bits 4-7, in the high
    half under 0x5400 (64 + c, ulp 1/16), and one packed subtraction of (1024, 64) leaves the
    two codes; four bytes per instruction group. The second asm only names the two halves of
    that register (no instruction). u4_to_f16 returns low and high nibbles as separate
    results, whose registers then need a PRMT each to be paired again."""
    if ON_GPU:
        w = tl.inline_asm_elementwise(
            "{ .reg .b32 t, k;\n"
            "mov.b32 k, 0x54006400;\n"
            "prmt.b32 t, $4, 0, 0x4040;\n"
            "lop3.b32 t, t, 0x00f0000f, k, 0xea;\n"
            "sub.f16x2 $0, t, k;\n"
            "prmt.b32 t, $4, 0, 0x4141;\n"
            "lop3.b32 t, t, 0x00f0000f, k, 0xea;\n"
            "sub.f16x2 $1, t, k;\n"
            "prmt.b32 t, $4, 0, 0x4242;\n"
            "lop3.b32 t, t, 0x00f0000f, k, 0xea;\n"
            "sub.f16x2 $2, t, k;\n"
            "prmt.b32 t, $4, 0, 0x4343;\n"
            "lop3.b32 t, t, 0x00f0000f, k, 0xea;\n"
            "sub.f16x2 $3, t, k; }",
            "=r,=r,=r,=r,r", [b], dtype=tl.int32, is_pure=True, pack=4)
        lo, hi = tl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [w],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
    else:
        lo, hi = codes_to_f16(b & 15, 0.0), codes_to_f16(b >> 4, 0.0)
    return tl.join(lo, hi)


@triton.jit
def _join4(a0, a1, a2, a3):
    """Four tensors [..., W] -> [..., W, 2, 2] that reshapes to [..., 4 W] as a0, a1, a2, a3 of
    word 0, then of word 1, ...: join(x, y) adds an innermost axis holding [x, y], so element
    [..., m, n] of join(join(a0, a2), join(a1, a3)) is a(2m + n)."""
    return tl.join(tl.join(a0, a2), tl.join(a1, a3))


@triton.jit
def i8_words_to_f16(w, FP8: tl.constexpr):
    """int32 words of four int8 (or float8_e4m3fn) codes -> [..., W, 2, 2] fp16 (see _join4),
    exactly, byte 0 first. Loading words instead of bytes keeps the codes packed: Triton holds
    a tensor of 8-bit elements as one register per byte and packs them again for the asm."""
    if FP8:
        a0, a1, a2, a3 = tl.inline_asm_elementwise(
            "{ .reg .b16 l, h;\n"
            ".reg .b32 lo, hi;\n"
            "mov.b32 {l, h}, $4;\n"
            "cvt.rn.f16x2.e4m3x2 lo, l;\n"
            "cvt.rn.f16x2.e4m3x2 hi, h;\n"
            "mov.b32 {$0, $1}, lo;\n"
            "mov.b32 {$2, $3}, hi; }",
            "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
    else:  # as i8_to_f16
        a0, a1, a2, a3 = tl.inline_asm_elementwise(
            "{ .reg .b32 t, k, lo, hi;\n"
            "xor.b32 t, $4, 0x80808080;\n"
            "mov.b32 k, 0x64806480;\n"
            "prmt.b32 lo, t, 0x64646464, 0x4140;\n"
            "prmt.b32 hi, t, 0x64646464, 0x4342;\n"
            "sub.f16x2 lo, lo, k;\n"
            "sub.f16x2 hi, hi, k;\n"
            "mov.b32 {$0, $1}, lo;\n"
            "mov.b32 {$2, $3}, hi; }",
            "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
    return _join4(a0, a1, a2, a3)


@triton.jit
def codes_to_f16(c, BIAS: tl.constexpr):
    """uint8 codes -> fp16 (c - BIAS), exactly: 0x6400 | c is the fp16 number 1024 + c. Bit
    operations and one fp16 subtraction instead of an int-to-float conversion, which runs at
    a quarter of the rate on Hopper and would bound the int4 kernel."""
    return (c.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - (1024.0 + BIAS)


@triton.jit
def _ld(ptr, mask, other):
    """tl.load, unmasked when mask is None (a constexpr: the steps of a loop that are known full)."""
    if mask is None:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=mask, other=other)


@triton.jit
def _keep(ok, x, other):
    if ok is None:
        return x
    else:
        return tl.where(ok, x, other)


@triton.jit
def load_pages_f16(kp, ksp, kzp, vp, vsp, vzp, page, ok, h,
                   H: tl.constexpr, S: tl.constexpr, D: tl.constexpr, PAGES: tl.constexpr,
                   KIND: tl.constexpr, GROUP: tl.constexpr, ON_GPU: tl.constexpr,
                   VKIND: tl.constexpr, VON_GPU: tl.constexpr):
    """page [PAGES] int64 page ids, ok [PAGES, S] which tokens exist (None: all of them) ->
    k, v [PAGES*S, D] fp16 and vs [PAGES*S] fp32, the per-token V scale still to apply (int8/fp8;
    ones otherwise): load_keys_f16 and load_values_f16 together.

    fp16 is what the tensor cores take: codes are exact in it and a dequantized key rounds
    once or twice (2^-11 relative). int8/fp8 values stay exact codes; their per-token scale
    goes into the probabilities instead. Per-page key scales are loaded once per page
    ([PAGES, 1, D]) and broadcast over its tokens. V of missing tokens is zero so that
    0-probability x garbage never makes a NaN; K of missing tokens is masked by the caller.
    KIND, ON_GPU are the keys' codec and loads, VKIND, VON_GPU the values' (they differ in a K/V
    split's pages, whose keys may be in a smaller codec).
    """
    k = load_keys_f16(kp, ksp, kzp, page, ok, h, H, S, D, PAGES, KIND, ON_GPU)
    v, vs = load_values_f16(vp, vsp, vzp, page, ok, h, H, S, D, PAGES, VKIND, GROUP, VON_GPU)
    return k, v, vs


@triton.jit
def load_keys_f16(kp, ksp, kzp, page, ok, h, H: tl.constexpr, S: tl.constexpr, D: tl.constexpr,
                  PAGES: tl.constexpr, KIND: tl.constexpr, ON_GPU: tl.constexpr):
    """K of load_pages_f16: [PAGES*S, D] fp16, dequantized."""
    ph = page * H + h  # [PAGES] (page, head) rows of the scale tensors
    rows = ph[:, None] * S + tl.arange(0, S)[None, :]  # [PAGES, S] token rows of the pool
    d = tl.arange(0, D)
    if ok is None:
        m3 = None
    else:
        m3 = ok[:, :, None]
    if KIND == 0:
        k = _ld(kp + rows[:, :, None] * D + d[None, None, :], m3, 0.0)
        if kp.dtype.element_ty == tl.bfloat16:  # via fp32: the interpreter has no bf16 arithmetic
            k = k.to(tl.float32)
        k = k.to(tl.float16)
    elif KIND == 1:
        ks = tl.load(ksp + ph[:, None, None] * D + d[None, None, :])  # [PAGES, 1, D]
        k = _codes8_f16(kp, rows, m3, D, ON_GPU) * ks
    else:  # int4; ON_GPU 3 (-3: by portable code) converts keys straight to channel-ordered pairs
        D2: tl.constexpr = D // 2
        kb = _ld(kp + rows[:, :, None] * D2 + tl.arange(0, D2)[None, None, :], m3, 0)  # [PAGES, S, D/2] u8
        ks = tl.load(ksp + ph[:, None, None] * D + d[None, None, :])  # [PAGES, 1, D]
        kz = tl.load(kzp + ph[:, None, None] * D + d[None, None, :])
        if ON_GPU == 3 or ON_GPU == -3:
            kc = u4_pairs_to_f16(kb, ON_GPU > 0).reshape(PAGES, S, D)
        else:
            if ON_GPU > 0:
                klo, khi = u4_to_f16(kb)
            else:
                klo, khi = codes_to_f16(kb & 15, 0.0), codes_to_f16(kb >> 4, 0.0)
            kc = tl.join(klo, khi).reshape(PAGES, S, D)  # low nibble = even channel
        k = kc * ks + kz
    return k.reshape(PAGES * S, D)


@triton.jit
def load_values_f16(vp, vsp, vzp, page, ok, h, H: tl.constexpr, S: tl.constexpr, D: tl.constexpr,
                    PAGES: tl.constexpr, KIND: tl.constexpr, GROUP: tl.constexpr, ON_GPU: tl.constexpr,
                    VT: tl.constexpr = False):
    """V of load_pages_f16: v [PAGES*S, D] fp16 (int8/fp8: the codes) and vs [PAGES*S] fp32.
    VT (quantized codecs): v as stored, channel-major [PAGES, D, S], for V^T @ p^T."""
    rows = (page * H + h)[:, None] * S + tl.arange(0, S)[None, :]  # [PAGES, S] token rows of the pool
    d = tl.arange(0, D)
    if ok is None:
        m3 = None
    else:
        m3 = ok[:, :, None]
    vs = tl.full([PAGES * S], 1.0, tl.float32)
    if KIND == 0:
        v = _ld(vp + rows[:, :, None] * D + d[None, None, :], m3, 0.0)
        if vp.dtype.element_ty == tl.bfloat16:
            v = v.to(tl.float32)
        v = v.to(tl.float16)
    else:  # channel-major: codes [PAGES, D, S] of the channel rows [PAGES, D] of the page-heads
        crow = (page * H + h)[:, None] * D + d[None, :]
        if KIND == 1:
            v = _codes8_f16(vp, crow, None, S, ON_GPU)
            # a page's 16 scales in one unmasked load (a per-token mask would split it into 2-byte
            # loads, which the loop's software pipeline cannot prefetch); missing tokens are zeroed
            vs = _keep(ok, tl.load(vsp + rows).to(tl.float32), 0.0).reshape(PAGES * S)
        else:  # int4: bytes [PAGES, D, S/2], each the fp16 token pair of V^T's operand
            S2: tl.constexpr = S // 2
            NG: tl.constexpr = D // GROUP
            vb = tl.load(vp + crow[:, :, None] * S2 + tl.arange(0, S2)[None, None, :])
            vc = u4_pairs_to_f16(vb, ON_GPU > 0).reshape(PAGES, NG, GROUP, S)
            # group-major scales: [PAGES, NG, 1, S] rows of (page-head, group), the page's tokens along them
            gi = (((page * H + h) * NG)[:, None, None, None] + tl.arange(0, NG)[None, :, None, None]) * S \
                + tl.arange(0, S)[None, None, None, :]
            v = (vc * tl.load(vsp + gi) + tl.load(vzp + gi)).reshape(PAGES, D, S)
        # a page's codes all exist in memory: loaded whole, missing tokens zeroed here
        if ok is not None:
            v = tl.where(ok[:, None, :], v, 0.0)
        if not VT:
            v = tl.permute(v, (0, 2, 1))
    if VT:
        tl.static_assert(KIND != 0, "VT: quantized values only")
        return v, vs
    else:
        return v.reshape(PAGES * S, D), vs


@triton.jit
def _codes8_f16(cp, rows, m3, N: tl.constexpr, ON_GPU: tl.constexpr):
    """int8 or fp8 codes of the rows [R0, R1] (N codes each) -> [R0, R1, N] fp16, exactly.
    ON_GPU >= 2: as int32 words (4-byte aligned rows) and inline PTX; 1: bytes and inline PTX;
    0: portable. m3 [R0, R1, 1]: which rows to load (None: all; the others read as 0)."""
    n = tl.arange(0, N)
    if ON_GPU >= 2:
        W: tl.constexpr = N // 4
        wi = rows[:, :, None] * W + tl.arange(0, W)[None, None, :]  # [R0, R1, N/4] int32 words
        w = _ld(cp.to(tl.pointer_type(tl.int32)) + wi, m3, 0)
        c = i8_words_to_f16(w, cp.dtype.element_ty != tl.int8).reshape(rows.shape[0], rows.shape[1], N)
    else:
        c = _ld(cp + rows[:, :, None] * N + n[None, None, :], m3, 0.0)  # [R0, R1, N]
        if cp.dtype.element_ty == tl.int8:
            if ON_GPU:
                c = i8_to_f16(c)
            else:  # c + 128 as a byte is c ^ 0x80
                c = codes_to_f16(c.to(tl.uint8, bitcast=True) ^ 0x80, 128.0)
        c = c.to(tl.float16)
    return c


@triton.jit
def load_tokens_f32(kp, ksp, kzp, vp, vsp, vzp, page, slot, ok, h,
                    H: tl.constexpr, S: tl.constexpr, D: tl.constexpr, N: tl.constexpr,
                    KIND: tl.constexpr, GROUP: tl.constexpr):
    """Tokens at (page [N], slot [N]) of head h -> k, v [N, D] fp32, dequantized exactly as
    kernels/quantize.py's decode functions do (a product of a code and an fp16 scale is exact
    in fp32). For compaction and gathers, not for the attention hot loop."""
    ph = page * H + h
    row = ph * S + slot  # [N]
    d = tl.arange(0, D)
    m2 = ok[:, None]
    if KIND == 0:
        k = tl.load(kp + row[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        v = tl.load(vp + row[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
    elif KIND == 1:
        kc = tl.load(kp + row[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        ks = tl.load(ksp + ph[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        vc = tl.load(vp + (ph[:, None] * D + d[None, :]) * S + slot[:, None], mask=m2, other=0.0).to(tl.float32)
        vs = tl.load(vsp + row, mask=ok, other=0.0).to(tl.float32)
        k = kc * ks
        v = vc * vs[:, None]
    else:
        D2: tl.constexpr = D // 2
        c = tl.arange(0, D2)
        kb = tl.load(kp + row[:, None] * D2 + c[None, :], mask=m2, other=0)
        kc = tl.join(kb & 15, kb >> 4).reshape(N, D).to(tl.float32)
        ks = tl.load(ksp + ph[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        kz = tl.load(kzp + ph[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        k = kc * ks + kz
        # values channel-major: token slot of channel d is a nibble of byte (ph*D + d)*S/2 + slot/2
        vb = tl.load(vp + (ph[:, None] * D + d[None, :]) * (S // 2) + (slot // 2)[:, None], mask=m2, other=0)
        vc = tl.where((slot % 2 == 0)[:, None], vb & 15, vb >> 4).to(tl.float32)
        gi = (ph[:, None] * (D // GROUP) + d[None, :] // GROUP) * S + slot[:, None]  # [N, D] each channel's group scale
        vs = tl.load(vsp + gi, mask=m2, other=0.0).to(tl.float32)
        vz = tl.load(vzp + gi, mask=m2, other=0.0).to(tl.float32)
        v = vc * vs + vz
    return k, v


# --- quantization of one page, bit-exact with kernels/quantize.py -------------------------------


@triton.jit
def round_half_even(y):
    """torch.round on fp32: nearest integer, ties to even. floor(y + 0.5) is wrong just
    below 0.5, where y + 0.5 rounds up to 1."""
    r = tl.floor(y)
    f = y - r  # exact
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    return tl.where((f > 0.5) | ((f == 0.5) & odd), r + 1.0, r)


@triton.jit
def rint(y, ON_GPU: tl.constexpr):
    if ON_GPU:
        return libdevice.rint(y)  # cvt.rni: nearest, ties to even
    else:
        return round_half_even(y)


@triton.jit
def divide(x, s, ON_GPU: tl.constexpr):
    """x / s rounded to nearest, as torch divides. On the GPU without div.rn's per-element
    slow-path check: q0 = x * RN(1/s), then one exact-residual correction step, which gives
    the correctly rounded quotient (Markstein) for the normal-range operands seen here."""
    if ON_GPU:
        r = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
        q0 = x * r
        q = tl.fma(tl.fma(-q0, s, x), r, q0)
        return tl.where(q0 == 0.0, q0, q)  # the correction turns -0 into +0; fp8 stores the sign
    else:
        return tl.math.div_rn(x, s)


@triton.jit
def fp16_scale(amax, qmax: tl.constexpr):
    """quantize._scale: fp32 division rounded to nearest (div_rn, not the approximate '/'),
    clamped to fp16's normal range, rounded to fp16. Returns the fp16 scale."""
    s = tl.math.div_rn(amax, tl.full(amax.shape, qmax, tl.float32))
    return tl.minimum(tl.maximum(s, FP16_MIN_NORMAL), FP16_MAX).to(tl.float16)


@triton.jit
def quant_sym(x, AXIS: tl.constexpr, QMAX: tl.constexpr, ROUND: tl.constexpr, ON_GPU: tl.constexpr):
    """x fp32 -> (codes fp32, fp16 scale reduced over AXIS). ROUND for int8; fp8 codes are
    clamped here and rounded by the caller's cast."""
    scale = fp16_scale(tl.max(tl.abs(x), AXIS), QMAX)
    y = divide(x, tl.expand_dims(scale.to(tl.float32), AXIS), ON_GPU)
    if ROUND:
        y = rint(y, ON_GPU)
    return tl.minimum(tl.maximum(y, -QMAX), QMAX), scale


@triton.jit
def quant_asym4(x, AXIS: tl.constexpr, ON_GPU: tl.constexpr):
    """x fp32 -> (codes fp32 in 0..15, fp16 scale, fp16 zero), min/max over AXIS."""
    lo = tl.min(x, AXIS)
    scale = fp16_scale(tl.max(x, AXIS) - lo, 15.0)
    zero = tl.minimum(tl.maximum(lo, -FP16_MAX), FP16_MAX).to(tl.float16)
    y = divide(x - tl.expand_dims(zero.to(tl.float32), AXIS), tl.expand_dims(scale.to(tl.float32), AXIS), ON_GPU)
    return tl.minimum(tl.maximum(rint(y, ON_GPU), 0.0), 15.0), scale, zero


@triton.jit
def pack4(codes, S: tl.constexpr, D: tl.constexpr):
    """codes [S, D] (any shape of S*D elements) in 0..15 -> [S, D/2] bytes, even channel low."""
    lo, hi = tl.split(codes.to(tl.uint8).reshape(S, D // 2, 2))
    return lo | (hi << 4)


@triton.jit
def store_page(kq, ksp, kzp, vq, vsp, vzp, ph, xk, xv,
               S: tl.constexpr, D: tl.constexpr, KIND: tl.constexpr, QMAX: tl.constexpr,
               ROUND: tl.constexpr, GROUP: tl.constexpr, ON_GPU: tl.constexpr):
    """Quantize one page-head, xk, xv [S, D] fp32, into row ph = page * H + head of the fields."""
    if KIND == 1:
        kc, ks = quant_sym(xk, 0, QMAX, ROUND, ON_GPU)  # per channel over the page: ks [D]
        vc, vs = quant_sym(xv, 1, QMAX, ROUND, ON_GPU)  # per token: vs [S]
        store_fields(kq, ksp, kzp, vq, vsp, vzp, ph, kc, ks, ks, vc, vs, vs, S, D, KIND, GROUP)
    else:
        NG: tl.constexpr = D // GROUP
        kc, ks, kz = quant_asym4(xk, 0, ON_GPU)  # ks, kz [D]
        vc, vs, vz = quant_asym4(xv.reshape(S, NG, GROUP), 2, ON_GPU)  # vs, vz [S, NG]
        store_fields(kq, ksp, kzp, vq, vsp, vzp, ph, kc, ks, kz, vc.reshape(S, D), vs, vz, S, D, KIND, GROUP)


@triton.jit
def store_fields(kq, ksp, kzp, vq, vsp, vzp, ph, kc, ks, kz, vc, vs, vz,
                 S: tl.constexpr, D: tl.constexpr, KIND: tl.constexpr, GROUP: tl.constexpr):
    """Store one page-head's codes kc, vc [S, D] (fp32, in range) and fp16 scales into row ph of
    the fields: KIND 1 ks [D], vs [S] (kz, vz unused); KIND 2 ks, kz [D], vs, vz [S, D // GROUP]."""
    s = tl.arange(0, S)
    d = tl.arange(0, D)
    if KIND == 1:
        tok = (ph * S + s)[:, None] * D + d[None, :]
        tl.store(kq + tok, kc.to(kq.dtype.element_ty))
        tl.store(vq + (ph * D + d[None, :]) * S + s[:, None], vc.to(vq.dtype.element_ty))  # channel-major
        tl.store(ksp + ph * D + d, ks)
        tl.store(vsp + ph * S + s, vs)
    else:
        NG: tl.constexpr = D // GROUP
        c = tl.arange(0, D // 2)
        tok = (ph * S + s)[:, None] * (D // 2) + c[None, :]
        tl.store(kq + tok, pack4(kc, S, D))
        j = tl.arange(0, S // 2)  # values channel-major: [D, S/2] bytes, token 2j in the low nibble
        tl.store(vq + (ph * D + d[:, None]) * (S // 2) + j[None, :], pack4(tl.trans(vc), D, S))
        tl.store(ksp + ph * D + d, ks)
        tl.store(kzp + ph * D + d, kz)
        g = (ph * NG + tl.arange(0, NG)[None, :]) * S + s[:, None]  # group-major [NG, S] of the page-head
        tl.store(vsp + g, vs)
        tl.store(vzp + g, vz)


# --- attention ----------------------------------------------------------------------------------


@triton.jit
def attend_block(acc, m, l, q, k, v, vs, visible, qk_scale, VSCALE: tl.constexpr, GUARD: tl.constexpr = False):
    """One online-softmax step in base 2. q [M, D], k, v [N, D] fp16; visible [M, N] (None:
    every row sees every key); vs [N] per-key V scale (applied when VSCALE) folded into the
    probabilities; acc [M, D], m, l [M] fp32; qk_scale = sm_scale * log2(e), applied in fp32
    after the dot so that fp16 q and K give exact products. Without GUARD every row must see at least
    one key by its first block (m stays finite); with it a row may see none in any block (its
    m stays -inf, l and acc 0). Returns acc, m, l and the base-2 logits."""
    s = tl.dot(q, tl.trans(k)) * qk_scale  # [M, N] fp32
    if visible is not None:  # None: every row sees every key
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    if GUARD:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: exp2(-inf - 0) = 0
    else:
        m_use = m_new
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None])
    l = l * alpha + tl.sum(p, 1)
    if VSCALE:
        pv = (p * vs[None, :]).to(tl.float16)
    else:
        pv = p.to(tl.float16)
    acc = acc * alpha[:, None] + tl.dot(pv, v)
    return acc, m_new, l, s
