"""gpt-oss (``GptOssForCausalLM``) against transformers: greedy tokens (3 prompts x 32 tokens,
every prompt longer than the sliding window) and last-position logits within 1e-4, from the
bf16-copy layout and from MXFP4 experts (then against transformers run on its own
dequantization of them); the MXFP4 decode equals transformers'; attention sinks in the Triton
paged kernel (interpreted) equal the torch path; greedy ngram speculation equals plain
decoding, and so does EAGLE-3 with a random head; refusals name their key.

Tiny models (``hf_gpt_oss.build``): hidden 64, 3 layers sliding / full / sliding, 4 experts,
top-2, float32, saved by transformers in the published layout.
"""

import pytest
import torch

from specdec import LLM
from specdec.kernels import paged_attention_torch as ref
from specdec.models import checkpoint, load_model
from specdec.models.config import ModelConfig
from specdec.models.heads.training import build_head
from specdec.models.layers.parallel import check_shardable

import hf_gpt_oss as G
import hf_models as H

MAX_NEW = 32
TOL = 1e-4
_gen = torch.Generator().manual_seed(38)
PROMPTS = [torch.randint(3, 500, (n,), generator=_gen).tolist() for n in (20, 27, 35)]
LOGIT_PROMPT = torch.randint(3, 500, (40,), generator=_gen).tolist()
assert min(map(len, PROMPTS)) > G.WINDOW


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{"bf16": the bf16-copy layout, "mxfp4": the same weights with MXFP4 experts}."""
    root = tmp_path_factory.mktemp("gpt_oss")
    plain = G.build(root / "bf16")
    return {"bf16": plain, "mxfp4": G.to_mxfp4(plain, root / "mxfp4")}


def _transformers_dequantize():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    return lambda blocks, scales: mxfp4.convert_moe_packed_tensors(blocks, scales,
                                                                   dtype=torch.float32)


@pytest.fixture(scope="module")
def reference(folders):
    """layout -> transformers' greedy tokens for PROMPTS and last logits for LOGIT_PROMPT
    (MXFP4: transformers' model with its own dequantization of the experts)."""
    return H.reference_cache(
        lambda layout: H.hf_model(folders["bf16"]) if layout == "bf16" else
        G.dequantized_reference(folders["bf16"], folders["mxfp4"], _transformers_dequantize()),
        PROMPTS, MAX_NEW, LOGIT_PROMPT)


def dense_last_logits(model, prompt) -> torch.Tensor:
    ids = torch.tensor(prompt)
    with torch.inference_mode():
        hidden, _ = model(ids[None], torch.arange(len(ids))[None])
        return model.compute_logits(hidden[0, -1])


# ---- against transformers ------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["bf16", "mxfp4"])
def test_greedy_tokens_and_logits_match_transformers(layout, folders, reference):
    path, want = folders[layout], reference(layout)
    model = load_model(path)
    assert model.config.layer_types == ["sliding_attention", "full_attention",
                                        "sliding_attention"]
    diff = (dense_last_logits(model, LOGIT_PROMPT) - want["logits"]).abs().max().item()
    assert diff <= TOL, f"{layout}: max |dlogit| {diff:.3g} > {TOL}"
    outs = LLM(model=str(path), max_num_seqs=4, max_model_len=256).generate(
        PROMPTS, max_tokens=MAX_NEW, ignore_eos=True)
    for i, (o, w) in enumerate(zip(outs, want["tokens"])):
        assert o.token_ids == w, f"{layout}: prompt {i} (len {len(PROMPTS[i])}) diverges"


def test_mxfp4_experts_are_quantized_and_matter(folders, reference):
    """The MXFP4 folder holds only blocks/scales for the experts, and its reference moves."""
    names = set(H.tensor_names(folders["mxfp4"]))
    assert {"model.layers.0.mlp.experts.gate_up_proj_blocks",
            "model.layers.0.mlp.experts.down_proj_scales"} <= names
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names
    assert (reference("mxfp4")["logits"] - reference("bf16")["logits"]).abs().max() > 1e-2


def test_mxfp4_decode_equals_transformers():
    """Every e2m1 code in both nibbles, scales 2^-8 .. 2^7: transformers' values exactly."""
    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (2, 3, 4, 16), generator=g, dtype=torch.uint8)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # 0x00, 0x11, ..., 0xFF
    scales = torch.randint(119, 135, (2, 3, 4), generator=g, dtype=torch.uint8)
    want = _transformers_dequantize()(blocks, scales)  # [2, 4 * 32, 3]
    torch.testing.assert_close(checkpoint.dequantize_mxfp4(blocks, scales).transpose(1, 2),
                               want, rtol=0, atol=0)
    first = checkpoint.dequantize_mxfp4(blocks[:1, :1, :1], scales[:1, :1, :1])
    assert first[0, 0, :4].tolist() == [v * 2.0 ** (scales[0, 0, 0].item() - 127)
                                        for v in (0.0, 0.0, 0.5, 0.5)]


# ---- attention sinks in the Triton paged kernel, interpreted --------------------------------
@pytest.fixture(scope="module")
def triton_attention():
    pytest.importorskip("triton")
    from triton_interpret import load_interpreted
    return load_interpreted("triton_paged_attention")


@pytest.mark.parametrize("window", [None, 5])
def test_triton_sinks_equal_torch(triton_attention, window):
    """Requests of 2 and 1 tokens after 9 and 5 cached keys (scattered blocks of 4) and a
    padding token, 4 query heads over 2 KV heads: the interpreted kernel equals the torch
    path, which the sinks change; the torch path equals the dense formula."""
    g = torch.Generator().manual_seed(7)
    seq_lens = torch.tensor([11, 6], dtype=torch.int32)
    table = torch.randperm(8, generator=g).to(torch.int32).view(2, 4)
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32)
    k_cache, v_cache = (torch.randn(8 * 4 + 1, 2, 16, generator=g) for _ in range(2))
    q = torch.randn(4, 4, 16, generator=g) * 2
    sinks = torch.randn(4, generator=g) * 2
    got, want, unsunk = (impl.paged_attention(q, k_cache, v_cache, impl.plan_paged_attention(
        qsl, seq_lens, table, 4, 11, 4), sliding_window=window, sinks=s)
        for impl, s in ((triton_attention, sinks), (ref, sinks), (ref, None)))
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert (unsunk - want).abs().max() > 1e-2
    # token 2 (request 1's decode at position 5): sees its 6 keys (the last `window`)
    keys = table[1].long().repeat_interleave(4) * 4 + torch.arange(4).repeat(4)
    keys = keys[:6][-(window or 6):]
    k, v = k_cache[keys].repeat_interleave(2, 1), v_cache[keys].repeat_interleave(2, 1)
    scores = torch.einsum("hd,khd->hk", q[2], k) * 16 ** -0.5
    weights = torch.cat([scores, sinks[:, None]], 1).softmax(-1)[:, :-1]
    torch.testing.assert_close(want[2], torch.einsum("hk,khd->hd", weights, v))


# ---- speculative decoding ----------------------------------------------------------------------
def test_ngram_speculation_equals_plain_greedy(folders, reference):
    """Padded ngram drafts through sinks, windows and the MoE: transformers' greedy tokens,
    with drafts accepted."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    llm = LLM(model=str(folders["bf16"]), speculative_config=spec, max_num_seqs=4,
              max_model_len=256)
    outs = llm.generate(PROMPTS, max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.token_ids for o in outs] == reference("bf16")["tokens"]
    assert sum(sum(o.num_accepted) for o in outs) > 0


def test_eagle3_speculation_equals_plain_greedy(folders, reference):
    """A random Llama-style EAGLE-3 head (the published gpt-oss heads' form: no attention
    biases) over aux layers 0, 1, 2: transformers' greedy tokens."""
    target = load_model(folders["bf16"])
    head = build_head("eagle3", target, eagle_aux_hidden_state_layer_ids=[0, 1, 2])
    assert not head.config.attention_bias
    llm = LLM(target=target, draft_head=head, max_num_seqs=4, max_model_len=256,
              speculative_config={"method": "eagle3", "num_speculative_tokens": 3})
    outs = llm.generate(PROMPTS[:2], max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.token_ids for o in outs] == reference("bf16")["tokens"][:2]


# ---- refusals ------------------------------------------------------------------------------------
def _set(**keys):
    return lambda cfg: cfg.update(keys)


@pytest.mark.parametrize("edit,key", [
    (_set(experts_per_token=3), "experts_per_token"),
    (_set(swiglu_limit=0), "swiglu_limit"),
    (_set(swiglu_alpha="1.7"), "swiglu_alpha"),
])
def test_refusals_name_the_key(edit, key, folders, tmp_path):
    path = H.copy_folder(folders["mxfp4"], tmp_path / "m")
    cfg = H.read_config(path)
    edit(cfg)
    H.write_config(path, cfg)
    with pytest.raises(ValueError, match=key):
        load_model(path)


def test_mxfp4_is_refused_for_other_families():
    with pytest.raises(ValueError, match="quantization_config"):
        ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 8,
                               "hidden_size": 8, "intermediate_size": 8,
                               "num_hidden_layers": 1, "num_attention_heads": 1,
                               "quantization_config": {"quant_method": "mxfp4"}})


def test_tensor_parallel_and_expert_parallel_equal_transformers(folders, reference):
    """The MXFP4 checkpoint on 2 TP ranks (sinks split with their heads, o_proj's bias added
    once, experts split by width with their down bias on rank 0), and with expert
    parallelism (2 whole experts a rank) under ngram speculation: transformers' tokens."""
    from specdec.engine.dp_engine import DPJob, run_data_parallel
    from specdec.engine.sequence import SamplingParams

    check_shardable(load_model(folders["mxfp4"]), 2, 1, True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    kw = dict(model=str(folders["mxfp4"]), max_num_seqs=4, max_model_len=256,
              tensor_parallel_size=2)
    jobs = [DPJob(dict(kw, enable_expert_parallel=ep, speculative_config=spec), PROMPTS,
                  SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)) for ep in (False, True)]
    for run in run_data_parallel(jobs, 1, engine=LLM, tp_size=2, timeout=240):
        assert [o.token_ids for o in run.outputs] == reference("mxfp4")["tokens"]


@pytest.mark.parametrize("layout", ["bf16", "mxfp4"])
@pytest.mark.parametrize("rank", [0, 1])
def test_an_expert_parallel_rank_reads_only_its_experts_rows(layout, rank, folders,
                                                             monkeypatch):
    """Expert parallelism over 2 TP ranks: every stacked expert tensor (a bf16 copy, or each
    MXFP4 half) comes out of the files as this rank's experts' rows only (E / 2 of them), and
    the rank holds exactly those experts, equal to the full model's."""
    from specdec.distributed import TPContext
    from specdec.models.layers.parallel import ExpertPlacement
    path, tp = folders[layout], TPContext(rank, 2)
    full = load_model(path)
    rows, iter_tensors = {}, checkpoint.iter_tensors

    def reading(*args, **kw):  # what the load takes out of the files
        for name, t in iter_tensors(*args, **kw):
            rows[name] = t.shape[0]
            yield name, t
    with monkeypatch.context() as patched:
        patched.setattr(checkpoint, "iter_tensors", reading)
        part = load_model(path, tp=tp, experts=ExpertPlacement.of(tp, expert_parallel=True))
    total = full.model.layers[0].mlp.num_experts
    mine = list(range(rank * total // 2, (rank + 1) * total // 2))
    stacked = {n: r for n, r in rows.items() if ".mlp.experts." in n}
    assert stacked and set(stacked.values()) == {total // 2}
    for layer, whole in zip(part.model.layers, full.model.layers):
        assert sorted(map(int, layer.mlp.experts)) == mine
        for e in mine:
            want = whole.mlp.experts[str(e)].state_dict()
            got = layer.mlp.experts[str(e)].state_dict()
            assert got.keys() == want.keys()
            # whole experts; the down bias is added once, on TP rank 0
            assert all(torch.equal(got[k], want[k]) or (k == "down_proj.bias" and rank > 0)
                       for k in want)
