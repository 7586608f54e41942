"""serve-llm's CPU path: a model's linear layers through oneDNN over weights packed once give the
model's own logits, keep its weights (tied embeddings included), and leave autograd to F.linear."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvguard.hf.cpu import PackedLinear, cpu_flags, default_dtype, pack_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


def tiny(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=300, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("tied", [True, False])
def test_packed_layers_give_the_models_logits_and_keep_its_weights(tied):
    model = tiny(tied)
    ids = torch.randint(0, 300, (3, 11))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert pack_linears(model, rows=3) == linears == 2 * 7 + 1
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    with torch.no_grad():
        got = model(input_ids=ids).logits
        one = model(input_ids=ids[:1, :1]).logits  # another batch than the packing's
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(one, want[:1, :1], rtol=1e-4, atol=1e-4)
    assert set(model.state_dict()) == set(tiny(tied).state_dict())


def test_autograd_goes_through_the_plain_weights():
    model = tiny(False)
    pack_linears(model)
    model(input_ids=torch.randint(0, 300, (1, 5))).logits.sum().backward()
    assert model.lm_head.weight.grad is not None and model.model.layers[0].mlp.down_proj.weight.grad is not None


def test_a_weight_onednn_cannot_reorder_stays_unpacked(monkeypatch):
    def refuse(*_a, **_k):
        raise RuntimeError("bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    model = tiny(True)
    assert pack_linears(model) == 0
    assert isinstance(model.lm_head, torch.nn.Linear) and PackedLinear.of(model.lm_head, 8) is None


def test_bfloat16_is_the_default_only_where_the_cpu_multiplies_it(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n\nprocessor\t: 1\n")
    assert {"avx2", "avx512_bf16"} <= cpu_flags(info)
    assert cpu_flags(tmp_path / "absent") == set()
    assert default_dtype({"avx2", "avx512f", "avx512_bf16"}) == torch.bfloat16
    assert default_dtype({"avx2", "amx_bf16", "amx_tile"}) == torch.bfloat16
    assert default_dtype({"avx2", "avx512f", "avx512_vnni"}) == torch.float32  # bf16 emulated there
    assert default_dtype(set()) == torch.float32


@pytest.mark.skipif(default_dtype() != torch.bfloat16, reason="this CPU does not multiply bfloat16 natively")
def test_bfloat16_layers_pack_and_give_the_models_logits_where_bfloat16_is_the_default():
    model = tiny(True).to(torch.bfloat16)
    ids = torch.randint(0, 300, (3, 11))
    with torch.no_grad():
        want = model(input_ids=ids).logits.float()
    assert pack_linears(model, rows=3) == 2 * 7 + 1
    with torch.no_grad():
        got = model(input_ids=ids).logits.float()
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * float(want.abs().max()))
