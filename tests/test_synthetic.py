"""Synthetic targets and heads: shape, parameter count without allocation, seeding, the
published EAGLE-3 draft vocabulary, the DeepSeek shape, and the engine running speculative
decoding on them losslessly (zero weights: every draft accepted)."""

import pytest
import torch
from torch import nn

from specdec.engine.llm import LLM
from specdec.models.heads.deepseek_mtp import DeepseekMtpHead
from specdec.models.layers.mla import MLAttention
from specdec.models.layers.moe import MoEMLP
from specdec.models.synthetic import (build_synthetic, draft_vocab_ids, head_methods,
                                      synthetic_config, weight_bytes)


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
    head = syn.heads["eagle3"]
    assert head.aux_layer_ids == (2, 16, 29)
    # yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: draft_vocab_size 32000, lm_head [32000, 4096], d2t
    assert head.draft_vocab_size == 32000 and head.config.extra["draft_vocab_size"] == 32000
    assert head.lm_head.weight.shape == (32000, 4096)
    assert head.d2t.shape == (32000,) and head.d2t.dtype == torch.int64
    assert sum(p.numel() for p in head.parameters()) == 424_689_664


def test_draft_vocab_ids_are_sorted_distinct_and_start_at_the_tied_argmax():
    assert draft_vocab_ids(4, 10).tolist() == [0, 2, 5, 7]
    ids = draft_vocab_ids(32000, 128256)
    assert ids[0] == 0 and ids[-1] < 128256 and bool((ids.diff() > 0).all())


@pytest.mark.parametrize("init", ["random", "zeros"])
def test_tiny_eagle3_head_has_the_published_draft_vocab_at_its_scale(init):
    """llama-tiny's head: 64 of 256 ids (the published 32000 of 128256, rounded), d2t =
    the ids' offsets whatever the init (a buffer no init randomises), id 0 drafted as id 0."""
    head = build_synthetic("llama-tiny", torch.float32, "cpu", methods=("eagle3",),
                           init=init).heads["eagle3"]
    assert head.draft_vocab_size == 64 == round(256 * 32000 / 128256)
    assert head.lm_head.weight.shape == (64, 64)
    assert torch.equal(head.draft_to_target_ids(torch.arange(64)), 4 * torch.arange(64))
    head.check_d2t()
    t2d = torch.zeros(256, dtype=torch.bool).index_fill(0, head.draft_to_target_ids(
        torch.arange(64)), True)  # the published head's t2d mask of these ids
    assert int(t2d.sum()) == 64 and bool(t2d[0])


def test_deepseek_16b_shape_and_count_on_meta():
    """MLA, MoE with shared experts after one dense layer, one MTP layer on the target's
    embedding and lm_head; 32.6 GB in bf16 (fits an 80 GB GPU)."""
    syn = build_synthetic("deepseek-16b", torch.bfloat16, "meta")
    target, head = syn.target, syn.heads["mtp"]
    c = target.config
    assert (c.hidden_size, c.num_hidden_layers, c.vocab_size) == (2048, 27, 102400)
    layers = target.model.layers
    assert all(isinstance(layer.self_attn, MLAttention) for layer in layers)
    assert not isinstance(layers[0].mlp, MoEMLP)
    assert all(isinstance(layer.mlp, MoEMLP) and len(layer.mlp.experts) == 64
               and hasattr(layer.mlp, "shared_experts") for layer in layers[1:])
    assert type(head) is DeepseekMtpHead and isinstance(head.layer.mlp, MoEMLP)
    assert head.shared.lm_head is target.lm_head
    assert head_methods("deepseek-16b") == ("mtp",)
    assert sum(p.numel() for p in target.parameters()) == 15_706_484_224
    assert sum(p.numel() for p in head.parameters()) == 593_242_624
    assert weight_bytes(target) + weight_bytes(head) < 33e9


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
    with pytest.raises(ValueError, match=r"methods \['eagle3'\]: allowed \('mtp',\)"):
        build_synthetic("deepseek-tiny", methods=("eagle3",))


@pytest.mark.parametrize("name, method", [("llama-tiny", "mtp"), ("llama-tiny", "eagle"),
                                          ("llama-tiny", "eagle3"), ("deepseek-tiny", "mtp")])
def test_engine_speculation_on_tiny_is_lossless(name, method):
    syn = build_synthetic(name, torch.float64, "cpu", seed=3, methods=(method,))
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


@pytest.mark.parametrize("name, method", [("llama-tiny", "eagle3"), ("deepseek-tiny", "mtp")])
def test_zero_weights_accept_every_draft(name, method):
    """Zero weights: plain and speculative greedy give the same tokens, and every verifying
    step accepts all K drafts (acceptance length K + 1), EAGLE-3 through its draft vocabulary
    (draft id 0 -> target id 0)."""
    syn = build_synthetic(name, torch.float32, "cpu", init="zeros", methods=(method,))
    prompts, k = [[1, 2, 3, 4, 5], [9, 8, 7]], 3
    kw = dict(target=syn.target, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16)
    plain = LLM(**kw).generate(prompts, max_tokens=1 + 2 * (k + 1), ignore_eos=True)
    out = LLM(**kw, draft_head=syn.heads[method], speculative_config={
        "method": method, "num_speculative_tokens": k}).generate(
        prompts, max_tokens=1 + 2 * (k + 1), ignore_eos=True)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert all(o.num_decode_steps == 2 and o.acceptance_length == k + 1 for o in out)


def test_a_draft_profile_is_accepted_at_its_rates_per_position():
    """EAGLE-3 on Llama-3.1-8B's profile (.75, .6, .45 per position) on the zero-weight tiny
    Llama with its MTP head: the engine's acceptance counts per draft position match the rates
    within four binomial standard deviations (about 170 verifying steps), the tokens stay the
    target's (all 0); padded and ragged drafting alike."""
    rates = (0.75, 0.6, 0.45)
    for padded in (True, False):
        syn = build_synthetic("llama-tiny", torch.float32, "cpu", init="zeros",
                              methods=("mtp",), acceptance=rates)
        llm = LLM(target=syn.target, draft_head=syn.heads["mtp"], max_num_seqs=8,
                  max_model_len=96, speculative_config={
                      "method": "mtp", "num_speculative_tokens": 3,
                      "disable_padded_drafter_batch": not padded})
        out = llm.generate([[1, 2, 3]] * 8, max_tokens=60, ignore_eos=True)
        assert {t for o in out for t in o.token_ids} == {0}
        for d, rate in enumerate(rates):
            drafted = sum(o.num_drafted[d] for o in out)
            accepted = sum(o.num_accepted[d] for o in out)
            sigma = (rate * (1 - rate) / drafted) ** 0.5
            assert drafted > 150 and abs(accepted / drafted - rate) < 4 * sigma, \
                (padded, d, accepted, drafted)


@pytest.mark.parametrize("kw, says", [
    (dict(acceptance=(0.5, 0.7)), "must not increase"),
    (dict(acceptance=(1.5,)), r"each in \[0, 1\]"),
    (dict(acceptance=(0.5,), init="random"), "needs init='zeros'"),
])
def test_a_draft_profile_refuses_rates_it_cannot_give(kw, says):
    with pytest.raises(ValueError, match=says):
        build_synthetic("llama-tiny", torch.float32, "cpu", **{"init": "zeros", **kw})
