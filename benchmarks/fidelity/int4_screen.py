"""Screen 4-bit KV formats on SmolLM2's own queries, keys and values, attention only.

    python benchmarks/fidelity/int4_screen.py [--texts austen,python-docs,stdlib-code] [--tokens 2048]

`kvguard eval` measures what the cache's codecs do to the whole model (deviation, ΔPPL, KL,
top-1). Formats that would need another page layout (keys per token, symmetric codes, 16-bit
outlier channels, pre-RoPE keys, 16-bit heavy hitters) are screened here first, on Q/K/V
captured from one forward pass of the real model on real text (kvguard/eval/texts.py): for the
last half of the tokens, 16 queries at a time, each layer's attention output over keys and values
quantized page by page (16 tokens; the first page and the last 128 tokens stay 16-bit, as in the
eval's int4 method) against the same attention in 16-bit. Deviation is ‖O′ − O‖ / ‖O‖ per layer
(mean and worst over the 30 layers), as in docs/fidelity.md. It ignores how one layer's error
changes the next layer's input, so its numbers sit a little under the eval's (int4: 2.04 % here,
2.17 % there, on austen). Bytes are per token and KV head over 16-bit's 256 (head_dim 64).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

from kvguard.compress.codecs.rotation import hadamard

S, D = 16, 64


def f16(x):
    return x.half().float()


def asym(x, dim):  # 4-bit min/max codes, fp16 scale and zero
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    s, z = f16(((hi - lo) / 15).clamp(min=2**-14)), f16(lo)
    return ((x - z) / s).round().clamp(0, 15) * s + z


def sym(x, dim):  # 4-bit codes -8..7, fp16 scale
    s = f16((x.abs().amax(dim, keepdim=True) / 7).clamp(min=2**-14))
    return (x / s).round().clamp(-8, 7) * s


def per_token(group, fn=asym):
    return lambda x: fn(x.reshape(*x.shape[:-1], D // group, group), -1).reshape(x.shape)


def per_channel(fn=asym):  # over the 16 tokens of a page
    return lambda x: fn(x.reshape(x.shape[0], -1, S, D), 2).reshape(x.shape)


def outliers(n, base):  # the n channels of largest |k| in each page and head kept 16-bit
    def quant(x):
        q = base(x).reshape(x.shape[0], -1, S, D)
        xp = x.reshape(q.shape)
        top = xp.abs().amax(2).topk(n, -1).indices
        keep = torch.zeros(q.shape[0], q.shape[1], D, dtype=torch.bool).scatter_(-1, top, True)
        return torch.where(keep.unsqueeze(2), xp, q).reshape(x.shape)
    return quant


# name: (rotate, keys, values, bytes per token and head, what it changes)
KIVI_K, KIVI_V = per_channel(), per_token(32)
VARIANTS = {
    "kivi": (False, KIVI_K, KIVI_V, 88, "today's int4: keys per channel over the page, values per token, groups of 32"),
    "kivi-v64": (False, KIVI_K, per_token(64), 84, "value groups of 64"),
    "rot": (True, KIVI_K, KIVI_V, 88, "Hadamard-rotated (int4-rot)"),
    "rot-v64": (True, KIVI_K, per_token(64), 84, "rotated, value groups of 64 (int4-rot-g64)"),
    "rot-ktok64": (True, per_token(64), per_token(64), 72, "rotated, keys per token too (groups of 64)"),
    "rot-ktok32": (True, per_token(32), per_token(32), 80, "rotated, keys per token (groups of 32)"),
    "rot-sym": (True, per_token(64, sym), per_token(64, sym), 68, "rotated, symmetric per token"),
    "rot-ksym": (True, per_channel(sym), per_token(64), 76, "rotated, symmetric keys per channel"),
    "kivi-out2": (False, outliers(2, KIVI_K), KIVI_V, 88 + 2 * 2 * 2 + 2,
                  "2 outlier key channels per page 16-bit (+ indices)"),
    "rot-v64-out2": (True, outliers(2, KIVI_K), per_token(64), 84 + 2 * 2 * 2 + 2, "rotated, v64, 2 outlier channels"),
    "prerope": ("prerope", KIVI_K, KIVI_V, 88, "keys quantized before RoPE (RoPE applied on read)"),
}


def capture(model, tok, text: str, tokens: int):
    """Per layer: q [Hq, T, D], k [H, T, D] (post-RoPE), v, k_pre (pre-RoPE), and RoPE's cos/sin."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    got, pre = {}, {}

    def attn(module, query, key, value, attention_mask, **kw):
        got[module.layer_idx] = (query[0].half(), key[0].half(), value[0].half())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("kvguard_screen", attn)
    hooks = [layer.self_attn.k_proj.register_forward_hook(lambda m, a, o, i=i: pre.__setitem__(i, o[0]))
             for i, layer in enumerate(model.model.layers)]
    before = model.config._attn_implementation
    model.config._attn_implementation = "kvguard_screen"
    try:
        ids = tok(text, return_tensors="pt").input_ids[:, :tokens]
        with torch.no_grad():
            model(ids)
            cos, sin = model.model.rotary_emb(torch.zeros(1, ids.shape[1], D), torch.arange(ids.shape[1])[None])
    finally:
        model.config._attn_implementation = before
        for h in hooks:
            h.remove()
    n = ids.shape[1]
    return {i: (*got[i], pre[i].reshape(n, -1, D).transpose(0, 1).half()) for i in got}, cos[0], sin[0]


def rope(k, cos, sin):
    half = D // 2
    return k * cos + torch.cat([-k[..., half:], k[..., :half]], -1) * sin


def deviation(layers, cos, sin, rotate, kq_fn, vq_fn, window=128):
    r = hadamard(D)
    devs = []
    for i in sorted(layers):
        q, k, v, k_pre = (t.float() for t in layers[i])
        hq, n, _ = q.shape
        h = k.shape[0]
        g = hq // h
        if rotate is True:
            q, k, v = q @ r, k @ r, v @ r
        kk, vv = f16(k), f16(v)
        kq = rope(kq_fn(f16(k_pre)), cos, sin) if rotate == "prerope" else kq_fn(kk)
        vq = vq_fn(vv)
        num = den = 0.0
        for c0 in range(n // 2, n, S):
            cut = max(S, ((c0 - window) // S) * S)  # whole pages older than the window
            km, vm = kk.clone(), vv.clone()
            km[:, S:cut], vm[:, S:cut] = kq[:, S:cut], vq[:, S:cut]
            end = c0 + S
            qq = q[:, c0:end].reshape(h, g * S, D)
            mask = (torch.arange(end)[None, :] <= torch.arange(c0, end)[:, None]).repeat(g, 1)

            def attend(kx, vx, qq=qq, mask=mask, end=end):
                s = (qq @ kx[:, :end].transpose(1, 2)) / math.sqrt(D)
                return s.masked_fill(~mask, float("-inf")).softmax(-1) @ vx[:, :end]

            o, o2 = attend(kk, vv), attend(km, vm)
            num += (o2 - o).pow(2).sum().item()
            den += o.pow(2).sum().item()
        devs.append(math.sqrt(num / den))
    return sum(devs) / len(devs), max(devs), devs.index(max(devs))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", default="austen,python-docs,stdlib-code")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of each text (the second half is scored)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"from: {', '.join(VARIANTS)}")
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    if unknown := [n for n in names if n not in VARIANTS]:
        ap.error(f"unknown variant(s) {unknown}")
    if args.tokens < 4 * S or args.tokens % S:
        ap.error("--tokens must be a multiple of 16, at least 64")
    torch.set_num_threads(int(os.environ.get("KVGUARD_THREADS", "1")))
    from kvguard.eval.texts import load_texts
    from kvguard.hf.model import load_model, smollm2_folder

    model, tok = load_model(str(smollm2_folder()), attn_implementation="sdpa")
    texts = load_texts(args.texts.split(","))
    results = {n: [] for n in names}
    for tname, text in texts.items():
        layers, cos, sin = capture(model, tok, text, args.tokens)
        for n in names:
            rotate, kf, vf, _, _ = VARIANTS[n]
            results[n].append((tname, *deviation(layers, cos, sin, rotate, kf, vf)))
            print(f"{tname:12s} {n:14s} mean {results[n][-1][1]:.2%} worst {results[n][-1][2]:.2%}",
                  file=sys.stderr, flush=True)
    print(f"| variant | bytes/token/head | of 16-bit | {' | '.join(texts)} (mean, worst layer) | what |")
    print("|---|---|---|" + "---|" * len(texts) + "---|")
    for n in names:
        rotate, _, _, nbytes, what = VARIANTS[n]
        cells = " | ".join(f"{m:.2%}, {w:.2%} (L{li})" for _, m, w, li in results[n])
        print(f"| {n} | {nbytes} | {nbytes / 256:.3f} | {cells} | {what} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
