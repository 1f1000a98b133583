"""Synthetic targets and heads: shape, parameter count without allocation, seeding, and the
engine running speculative decoding on them losslessly."""

import pytest
import torch
from torch import nn

from specdec.engine.llm import LLM
from specdec.models.synthetic import build_synthetic, synthetic_config, weight_bytes


def test_llama_1b_shape_and_count_on_meta():
    syn = build_synthetic("llama-1b", torch.bfloat16, "meta")
    c = syn.target.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.vocab_size) == (2048, 16, 16, 4, 5632, 32000)
    count = sum(p.numel() for p in syn.target.parameters())
    per_layer = 2048 * 3072 + 2048 * 2048 + 3 * 2048 * 5632 + 2 * 2048
    assert count == 2 * 32000 * 2048 + 16 * per_layer + 2048 == 852_559_872
    assert 0.85e9 <= count <= 1.1e9
    assert weight_bytes(syn.target) == 2 * count
    assert all(p.device.type == "meta" for p in syn.target.parameters())
    assert syn.heads["eagle3"].aux_layer_ids == (2, 8, 13)


def test_llama_8b_shape_and_count_on_meta():
    syn = build_synthetic("llama-8b", torch.bfloat16, "meta", methods=("eagle3",))
    c = syn.target.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.vocab_size) == (4096, 32, 32, 8, 14336, 128256)
    count = sum(p.numel() for p in syn.target.parameters())
    assert count == 8_030_261_248  # Llama-3.1-8B's published parameter count
    assert syn.heads["eagle3"].aux_layer_ids == (2, 16, 29)


def test_weight_bytes_counts_tied_storage_once():
    assert weight_bytes(nn.Linear(4, 2, bias=False).to(torch.bfloat16)) == 16
    tied = nn.Module()
    tied.a = nn.Linear(4, 2, bias=False)
    tied.b = nn.Linear(4, 2, bias=False)
    tied.b.weight = tied.a.weight
    assert weight_bytes(tied) == 4 * 2 * 4


def test_tiny_is_seeded_and_initialised():
    a = build_synthetic("llama-tiny", torch.float32, "cpu", seed=0)
    b = build_synthetic("llama-tiny", torch.float32, "cpu", seed=0)
    c = build_synthetic("llama-tiny", torch.float32, "cpu", seed=1)
    sa, sb, sc = (s.target.state_dict() for s in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])
    assert torch.equal(sa["model.norm.weight"], torch.ones(64))
    assert abs(sa["model.embed_tokens.weight"].std().item() - 0.02) < 0.002
    for head in a.heads.values():  # heads share the target's embedding and lm_head
        assert head.shared.embed_tokens is a.target.model.embed_tokens
        assert all(torch.isfinite(p).all() for p in head.parameters())
    assert a.target.lm_head.weight.dtype == torch.float32


def test_unknown_names_raise():
    with pytest.raises(ValueError, match="allowed"):
        synthetic_config("llama-7b")
    with pytest.raises(ValueError, match="methods"):
        build_synthetic("llama-tiny", methods=("medusa",))


@pytest.mark.parametrize("method", ["mtp", "eagle", "eagle3"])
def test_engine_speculation_on_tiny_is_lossless(method):
    syn = build_synthetic("llama-tiny", torch.float64, "cpu", seed=3, methods=(method,))
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    kw = dict(target=syn.target, dtype=torch.float64, max_model_len=64, max_num_seqs=2,
              max_num_batched_tokens=16)
    plain = LLM(**kw).generate(prompts, max_tokens=12, ignore_eos=True)
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "eagle3":
        spec["draft_model_config"] = {"eagle_aux_hidden_state_layer_ids": [2, 3, 3]}
    out = LLM(**kw, draft_head=syn.heads[method], speculative_config=spec).generate(
        prompts, max_tokens=12, ignore_eos=True)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert all(len(o.token_ids) == 12 for o in out)
