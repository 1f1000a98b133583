"""DeepSeek-V3 (MLA, YaRN with mscale, grouped noaux_tc MoE with a shared expert, dense first
layer): specdec equals transformers on tiny random models transformers itself wrote
(``hf_deepseek``) -- greedy tokens through ``LLM`` (the paged latent cache, absorbed MLA) and
last-position logits of the dense path -- the cache keeps one latent row per token, and the
config keys DeepSeek does not implement are refused by name."""

import json

import hf_deepseek as D
import hf_models as H
from helpers import folder_builder
import pytest
import torch

from specdec import LLM
from specdec.models import checkpoint, load_model
from specdec.models.registry import ARCHITECTURE_OF_MODEL_TYPE

CASES = ["deepseek_v3", "deepseek_v3_noq", "deepseek_v3_t4"]
MAX_NEW = 32
PARALLEL_NEW = 16  # tokens per prompt of the multi-process runs (the suite's time)
TOL = 1e-4
_gen = torch.Generator().manual_seed(20240607)
PROMPTS = [torch.randint(3, 500, (n,), generator=_gen).tolist() for n in (5, 17, 40)]
LOGIT_PROMPT = torch.randint(3, 500, (80,), generator=_gen).tolist()  # > original_max 64


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="session")
def ds_dir(tmp_path_factory):
    return folder_builder(D.BUILDERS, tmp_path_factory)


@pytest.fixture(scope="session")
def ds_reference(ds_dir):
    return H.reference_cache(lambda name: H.hf_model(ds_dir(name)), PROMPTS, MAX_NEW,
                             LOGIT_PROMPT)


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_match_transformers(case, ds_dir, ds_reference):
    llm = LLM(model=str(ds_dir(case)), max_num_seqs=4, max_model_len=256)
    got = [o.token_ids for o in llm.generate(PROMPTS, max_tokens=MAX_NEW, ignore_eos=True)]
    assert got == ds_reference(case)["tokens"]


@pytest.mark.parametrize("case", CASES[:2])
def test_last_logits_match_transformers(case, ds_dir, ds_reference):
    model = load_model(ds_dir(case))
    ids = torch.tensor(LOGIT_PROMPT)
    with torch.inference_mode():
        hidden, _ = model(ids[None, :], torch.arange(len(ids))[None, :])
        logits = model.compute_logits(hidden[0, -1])
    diff = (logits - ds_reference(case)["logits"]).abs().max().item()
    assert diff <= TOL, f"{case}: max |dlogit| {diff:.3g}"


def test_paged_prefill_logits_match_the_dense_path(ds_dir):
    """The absorbed form over the latent cache (one prefill of 80 tokens in blocks of 16)
    equals the expanded dense path at every position."""
    from specdec.attention import AttentionMetadata, KVCache

    model = load_model(ds_dir("deepseek_v3"))
    ids = torch.tensor(LOGIT_PROMPT)
    n = len(ids)
    cache = KVCache(model.kv_cache_spec(), 6, 16, torch.float32, "cpu")
    meta = AttentionMetadata(slot_mapping=torch.arange(n),
                             query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                             seq_lens=torch.tensor([n], dtype=torch.int32),
                             block_table=torch.arange(6, dtype=torch.int32)[None],
                             max_seq_len=n)
    with torch.inference_mode():
        dense, _ = model(ids[None], torch.arange(n)[None])
        paged, _ = model(ids, torch.arange(n), kv=cache.bind(meta))
    torch.testing.assert_close(paged, dense[0], rtol=1e-5, atol=1e-5)


def test_cache_is_one_latent_row_per_token_per_layer(ds_dir):
    """kv_lora_rank 32 + qk_rope_head_dim 16 = 48 values per token per layer (192 bytes in
    float32, 576 for 3 layers); a GQA model of the same width (4 kv heads of qk_head_dim 48)
    would keep 2 * 4 * 48 = 384 values per layer: 8x more."""
    model = load_model(ds_dir("deepseek_v3"))
    specs = model.kv_cache_spec()
    assert [(s.num_kv_heads, s.head_dim, s.value_dim) for s in specs] == [(1, 48, 32)] * 3
    assert sum(s.bytes_per_token(torch.float32) for s in specs) == 3 * 48 * 4
    from specdec.attention import KVCacheSpec
    assert KVCacheSpec(4, 48).bytes_per_token(torch.float32) == 8 * specs[0].bytes_per_token(
        torch.float32)


def test_layers_are_what_the_config_says(ds_dir):
    from specdec.models.layers.mlp import MLP
    from specdec.models.layers.moe import MoEMLP

    model = load_model(ds_dir("deepseek_v3"))
    mlps = [layer.mlp for layer in model.model.layers]
    assert isinstance(mlps[0], MLP) and all(isinstance(m, MoEMLP) for m in mlps[1:])
    assert all(hasattr(m, "shared_experts") and m.topk_method == "noaux_tc" for m in mlps[1:])
    assert mlps[1].e_score_correction_bias.abs().max() > 0.05  # loaded from mlp.gate.*
    attn = model.model.layers[0].self_attn
    assert hasattr(attn, "q_a_proj") and not hasattr(load_model(
        ds_dir("deepseek_v3_noq")).model.layers[0].self_attn, "q_a_proj")
    # 48 ** -0.5 * (0.1 * 0.8 * ln 4 + 1) ** 2
    assert attn.scale == pytest.approx(48 ** -0.5 * (0.08 * torch.log(torch.tensor(4.0)).item()
                                                     + 1) ** 2)


# ---- the reference depends on what DeepSeek adds -----------------------------------------------
def _mutate(path, edit):
    cfg = H.read_config(path)
    edit(cfg)
    H.write_config(path, cfg)
    return path


@pytest.mark.parametrize("what,edit", [
    ("mscale_all_dim ignored", lambda c: c["rope_parameters"].update(mscale_all_dim=1.0)),
    ("groups ignored", lambda c: c.update(topk_group=2)),
    ("routed_scaling_factor ignored", lambda c: c.update(routed_scaling_factor=1.0)),
])
def test_reference_is_sensitive_to_the_deepseek_feature(what, edit, ds_dir, ds_reference,
                                                        tmp_path):
    path = _mutate(H.copy_folder(ds_dir("deepseek_v3"), tmp_path / "m"), edit)
    diff = (H.hf_last_logits(path, LOGIT_PROMPT) - ds_reference("deepseek_v3")["logits"])
    assert diff.abs().max() > 100 * TOL, what


# ---- block-quantized FP8 ---------------------------------------------------------------------
FP8_BLOCK = [32, 32]  # DeepSeek-V3 publishes [128, 128]; the tiny weights need smaller blocks


def quantize_blocks(w: torch.Tensor, block=FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [O, I] float -> (e4m3 weight, weight_scale_inv [ceil(O/bo), ceil(I/bi)]), as
    DeepSeek's published weights are: per block, scale_inv = amax / 448."""
    bo, bi = block
    o, i = w.shape
    scale = torch.zeros(-(-o // bo), -(-i // bi))
    for r in range(scale.shape[0]):
        for c in range(scale.shape[1]):
            scale[r, c] = w[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi].abs().max() / 448
    full = scale.repeat_interleave(bo, 0)[:o].repeat_interleave(bi, 1)[:, :i]
    return (w / full).to(torch.float8_e4m3fn), scale


def fp8_folders(src, tmp_path, block=FP8_BLOCK):
    """(a copy of ``src`` with every linear weight stored as e4m3 + weight_scale_inv in
    ``block`` blocks, with ``quantization_config``; a float copy of the dequantized weights)."""
    from safetensors.torch import load_file, save_file
    fp8, dequant = H.copy_folder(src, tmp_path / "fp8"), H.copy_folder(src, tmp_path / "f32")
    quantized = 0
    for shard in sorted(src.glob("model-*.safetensors")):
        tensors = load_file(shard)
        q, d = {}, {}
        for name, t in tensors.items():
            linear = t.dim() == 2 and "embed_tokens" not in name and "lm_head" not in name \
                and not name.endswith("mlp.gate.weight")
            if linear:
                w8, scale = quantize_blocks(t.float(), block)
                q[name], q[name.removesuffix(".weight") + ".weight_scale_inv"] = w8, scale
                d[name] = checkpoint.dequantize_blocks(w8, scale, tuple(block))
                quantized += 1
            else:
                q[name] = d[name] = t
        save_file(q, fp8 / shard.name)
        save_file(d, dequant / shard.name)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    for name in list(index["weight_map"]):
        if name.endswith(".weight") and (name.removesuffix(".weight") + ".weight_scale_inv"
                                         ) in load_file(fp8 / index["weight_map"][name]):
            index["weight_map"][name.removesuffix(".weight") + ".weight_scale_inv"] = \
                index["weight_map"][name]
    (fp8 / "model.safetensors.index.json").write_text(json.dumps(index))
    _mutate(fp8, lambda c: c.update(quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": list(block)}))
    assert quantized > 10
    return fp8, dequant


def test_fp8_block_quantized_copy_equals_the_dequantized_model(ds_dir, tmp_path):
    """Every linear weight of the tiny DeepSeek-V3 stored as e4m3 + weight_scale_inv (with
    ``quantization_config``) loads into exactly the float model of the dequantized weights."""
    src = ds_dir("deepseek_v3")
    fp8, dequant = fp8_folders(src, tmp_path)
    a, b = load_model(fp8), load_model(dequant)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sb)
    # and the quantization really changed the weights (the test can fail)
    orig = load_model(src).state_dict()
    assert not all(torch.equal(orig[k], sb[k]) for k in sb)
    ids = torch.tensor(LOGIT_PROMPT[:20])
    with torch.no_grad():
        ha, _ = a(ids[None], torch.arange(20)[None])
        hb, _ = b(ids[None], torch.arange(20)[None])
    assert torch.equal(a.compute_logits(ha), b.compute_logits(hb))


def test_fp8_under_tensor_parallelism_each_rank_reads_its_weight_and_scale_blocks(ds_dir,
                                                                                 tmp_path):
    """16x16 blocks, T=2: each rank's slices (MLA heads, expert and MLP halves) start and end
    on block edges; a rank reads its slice of each fp8 weight and of its weight_scale_inv and
    holds exactly its slice of the dequantized model -- its MTP layer too (loaded over the
    rank's target; unsharded as well)."""
    from specdec.distributed import TPContext
    fp8, dequant = fp8_folders(ds_dir("deepseek_v3_mtp"), tmp_path, [16, 16])
    for tp in (TPContext(0, 2), TPContext(1, 2), None):
        target = load_model(fp8, tp=tp)
        a, b = target.state_dict(), load_model(dequant, tp=tp).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in b)
        rows = 112 if tp else 224
        assert a["model.layers.1.self_attn.kv_b_proj.weight"].shape == (rows, 32)
        a, b = _mtp_head(fp8, target).state_dict(), _mtp_head(dequant, target).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)
        assert a["model.layers.3.self_attn.kv_b_proj.weight"].shape == (rows, 32)


def test_fp8_slice_that_cuts_a_scale_block_is_refused_by_name(ds_dir, tmp_path):
    """32x32 blocks, T=2: a rank's 112 kv_b_proj rows (2 heads of nope 32 + v 24) end inside
    a block whose scale the other rank needs too: refused, naming the tensor and the size --
    the target's, and the MTP layer's over a target that loaded (from the dequantized copy)."""
    from specdec.distributed import TPContext
    fp8, dequant = fp8_folders(ds_dir("deepseek_v3_mtp"), tmp_path, [32, 32])
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.\d\.[a-z_.]+weight'.* cuts a "
                                         r"32x32 FP8 scale block.*multiples of 32"):
        load_model(fp8, tp=TPContext(0, 2))
    target = load_model(dequant, tp=TPContext(0, 2))
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.3\.[a-z0-9_.]+weight'.* cuts a "
                                         r"32x32 FP8 scale block.*multiples of 32"):
        _mtp_head(fp8, target)


def test_fp8_under_expert_parallelism_a_rank_reads_only_its_experts_blocks(ds_dir, tmp_path,
                                                                          monkeypatch):
    """Expert parallelism on the fp8 folder (16x16 blocks; the routed experts 32 x 64, 4 of
    them): at D=2 x T=2 (ranks 1 and 2) and D=4 x T=1 (rank 3) a rank reads the fp8 weight and
    the weight_scale_inv of its one expert only (the target's MoE layers and the MTP layer's),
    and holds exactly what the same placement holds of the dequantized model: its expert whole,
    equal to the full dequantized model's, the rest its TP slice. An expert is never cut (EP
    keeps experts whole, so no expert slice can cut a scale block): with 32x32 blocks, DP=4 +
    EP loads; DP=2 x TP=2 + EP is refused for a tensor TP splits (the dense MLP's width, the
    attention heads, the shared expert's width), never for an expert."""
    import re

    from specdec.distributed import TPContext
    from specdec.models.layers.parallel import ExpertPlacement
    fp8, dequant = fp8_folders(ds_dir("deepseek_v3_mtp"), tmp_path / "b16", [16, 16])
    full = load_model(dequant)
    full_head = _mtp_head(dequant, full)
    expert = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.\w+\.(weight|weight_scale_inv)")
    read, iter_tensors = [], checkpoint.iter_tensors

    def reading(*args, **kwargs):  # the tensors a load takes out of the files (a meta
        for name, tensor in iter_tensors(*args, **kwargs):  # tensor: a header, not read)
            if not tensor.is_meta:
                read.append(name)
            yield name, tensor
    monkeypatch.setattr(checkpoint, "iter_tensors", reading)
    for dp, tp, d, t in ((2, 2, 0, 1), (2, 2, 1, 0), (4, 1, 3, 0)):
        ctx = TPContext(t, tp)
        placement = ExpertPlacement.of(ctx, d, dp, expert_parallel=True)
        read.clear()
        target = load_model(fp8, tp=ctx, experts=placement)
        head = _mtp_head(fp8, target)
        mine = d * tp + t  # 4 experts over 4 ranks
        assert {(int(m[1]), int(m[2]), m[3]) for n in read if (m := expert.fullmatch(n))} == \
            {(layer, mine, kind) for layer in (1, 2, 3) for kind in ("weight",
                                                                     "weight_scale_inv")}
        for got, want in ((target, load_model(dequant, tp=ctx, experts=placement)),
                          (head, _mtp_head(dequant, load_model(dequant, tp=ctx,
                                                               experts=placement)))):
            a, b = got.state_dict(), want.state_dict()
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)
        whole = {**full.state_dict(), **full_head.state_dict()}
        mine_tensors = {**target.state_dict(), **head.state_dict()}
        held = [k for k in mine_tensors if ".mlp.experts." in k]
        assert len(held) == 3 * 3 and all(f".experts.{mine}." in k for k in held)
        assert all(torch.equal(mine_tensors[k], whole[k]) for k in held)
    monkeypatch.undo()
    fp8, dequant = fp8_folders(ds_dir("deepseek_v3_mtp"), tmp_path / "b32", [32, 32])
    ctx = TPContext(0, 1)
    placement = ExpertPlacement.of(ctx, 3, 4, expert_parallel=True)
    a = load_model(fp8, tp=ctx, experts=placement).state_dict()
    b = load_model(dequant, tp=ctx, experts=placement).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)
    ctx = TPContext(1, 2)
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.\d\.[a-z_.]+weight'.* cuts a "
                                         r"32x32 FP8 scale block") as refused:
        load_model(fp8, tp=ctx, experts=ExpertPlacement.of(ctx, 0, 2, expert_parallel=True))
    assert ".experts." not in str(refused.value)


# ---- refusals ----------------------------------------------------------------------------
@pytest.mark.parametrize("key,value", [("topk_method", "greedy"), ("scoring_func", "softmax"),
                                       ("moe_layer_freq", 2), ("qk_head_dim", 40),
                                       ("n_group", 3), ("quantization_config", {"x": 1})])
def test_refuses_what_is_not_implemented_naming_the_key(key, value, ds_dir, tmp_path):
    path = _mutate(H.copy_folder(ds_dir("deepseek_v3"), tmp_path / "m"),
                   lambda c: c.update({key: value}))
    with pytest.raises(ValueError, match=key):
        load_model(path)


# ---- the MTP layer (model.layers.L.* of the target folder) ---------------------------------------
def _mtp_head(path, target):
    from specdec.models.heads import load_head as load_deepseek_mtp
    return load_deepseek_mtp(path, target)


@pytest.mark.parametrize("case", ["deepseek_v3_mtp", "deepseek_v3_mtp_nocopies"])
def test_mtp_draft_logits_equal_transformers_layer_plus_mtp_math(case, ds_dir):
    """The target loader skips layer L; the head reads only it (own embedding / head copies
    when present, else the target's) and equals the reference assembled from transformers'
    DeepseekV3DecoderLayer, at every position of a 40-token sequence (position 0 masked)."""
    path = ds_dir(case)
    target = load_model(path)
    head = _mtp_head(path, target)
    own = case == "deepseek_v3_mtp"
    assert hasattr(head.layer, "embed_tokens") == own == hasattr(head.layer.shared_head, "head")
    ids = torch.tensor(PROMPTS[2])
    pos = torch.arange(len(ids))
    nxt = torch.cat([ids[1:], ids[:1]])
    with torch.inference_mode():
        hidden, _ = target(ids[None], pos[None])
        out, _ = head(nxt[None], pos[None], hidden)
        got = head.compute_logits(out[0])
    if not own:  # the reference reads the copies: give it the target's
        path = H.copy_folder(path, path.parent / "with_copies")
        H.add_shard(path, {"model.layers.3.embed_tokens.weight": target.model.embed_tokens.weight,
                           "model.layers.3.shared_head.head.weight": target.lm_head.weight})
    want = D.hf_mtp_reference(path, nxt, hidden[0], pos)
    assert (got - want).abs().max().item() <= TOL
    assert head.kv_cache_spec() == [target.kv_cache_spec()[0]]


@pytest.mark.parametrize("dp,tp,ep", [(1, 2, False), (2, 2, True), (2, 2, False),
                                      (4, 1, True)])
def test_mtp_layer_is_placed_like_the_target(dp, tp, ep, ds_dir):
    """Each rank's MTP layer, loaded over that rank's target as its engine loads it: MLA split
    by heads (its q_b_proj / kv_b_proj rows and o_proj columns of heads t*4/T.., the latent
    projection whole), the target's own routed experts (EP: one whole expert of 4 per rank;
    else E/D, at width 1/T), the shared expert at width 1/T, its own embedding and lm_head
    copies by vocabulary; every tensor this rank's slice of the full layer's, 1/(D x T) of
    its routed-expert bytes."""
    from specdec.distributed import TPContext
    from specdec.models.layers.parallel import ExpertPlacement
    path = ds_dir("deepseek_v3_mtp")
    full = _mtp_head(path, load_model(path)).state_dict()
    p, nh, v = "model.layers.3.", 4 // tp, 512 // tp

    def routed(state):
        return sum(t.numel() for k, t in state.items() if ".experts." in k)
    for d in range(dp):
        for t in range(tp):
            ctx = TPContext(t, tp)
            target = load_model(path, tp=ctx if tp > 1 else None,
                                experts=ExpertPlacement.of(ctx, d, dp, ep))
            head = _mtp_head(path, target)
            got = head.state_dict()
            rows = {"self_attn.q_b_proj.weight": (0, 48), "self_attn.kv_b_proj.weight": (0, 56),
                    "self_attn.o_proj.weight": (1, 24)}  # per head
            for name, (dim, per) in rows.items():
                want = full[p + name].narrow(dim, t * nh * per, nh * per)
                assert torch.equal(got[p + name], want), name
            for name in ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
                         "eh_proj.weight", "mlp.gate.weight"):
                assert torch.equal(got[p + name], full[p + name]), name
            for name in ("embed_tokens.weight", "shared_head.head.weight"):
                assert torch.equal(got[p + name], full[p + name][t * v:(t + 1) * v]), name
            held = set(head.layer.mlp.experts)
            assert held == set(target.model.layers[1].mlp.experts)
            assert len(held) == (4 // (dp * tp) if ep else 4 // dp)
            width = 32 if ep or tp == 1 else 32 // tp
            i0 = 0 if width == 32 else t * width
            for e in held:
                w = f"mlp.experts.{e}.gate_proj.weight"
                assert torch.equal(got[p + w], full[p + w][i0:i0 + width]), w
            w = "mlp.shared_experts.down_proj.weight"
            assert torch.equal(got[p + w], full[p + w][:, t * (32 // tp):(t + 1) * (32 // tp)])
            assert routed(got) * dp * tp == routed(full)


@pytest.fixture(scope="session")
def ds_plain(ds_dir):
    return [o.token_ids for o in LLM(model=str(ds_dir("deepseek_v3_mtp")), max_num_seqs=4,
                                     max_model_len=256).generate(PROMPTS, max_tokens=MAX_NEW,
                                                                 ignore_eos=True)]


@pytest.mark.parametrize("k,ragged,backend", [(1, False, None), (2, False, None),
                                              (3, False, None), (1, True, None),
                                              (2, True, None), (3, True, None),
                                              (2, False, "replay")])
def test_deepseek_mtp_speculative_greedy_equals_plain(k, ragged, backend, ds_dir, ds_plain):
    """The MTP layer is found in the target folder (method deepseek_mtp, no head folder)."""
    path = ds_dir("deepseek_v3_mtp")
    llm = LLM(model=str(path), max_num_seqs=4, max_model_len=256, graph_backend=backend,
              speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": k,
                                  "disable_padded_drafter_batch": ragged})
    assert type(llm.runner.proposer.head).__name__ == "DeepseekMtpHead"
    outs = llm.generate(PROMPTS, max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.token_ids for o in outs] == ds_plain
    assert sum(sum(o.num_drafted) for o in outs) > 0


@pytest.mark.parametrize("backend,tree", [
    (None, {"speculative_token_tree": [(0,), (1,), (0, 0), (1, 0)]}),
    ("replay", {"speculative_token_tree": [(0,), (1,), (0, 0), (1, 0)]}),
    (None, {"tree_topk": 2, "num_draft_tokens": 5})], ids=["static", "static-replay", "dynamic"])
def test_deepseek_mtp_draft_tree_greedy_equals_plain(backend, tree, ds_dir, ds_plain):
    """MLA target and MTP head verifying and drafting a tree (the latent cache's accepted rows
    moved after the root)."""
    llm = LLM(model=str(ds_dir("deepseek_v3_mtp")), max_num_seqs=4, max_model_len=256,
              graph_backend=backend, check_host_syncs=True,
              speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 2,
                                  **tree})
    outs = llm.generate(PROMPTS, max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.token_ids for o in outs] == ds_plain
    assert sum(sum(o.num_accepted) for o in outs) > 0


def test_mtp_on_a_folder_without_its_mtp_tensors_says_so(ds_dir):
    """The config announces an MTP layer (num_nextn_predict_layers, as save_pretrained writes
    it) but the files hold none: the error names the architecture and the missing tensors,
    not only a head folder to look for."""
    with pytest.raises(ValueError, match=r"is a DeepseekV3ForCausalLM checkpoint, but its "
                                         r"files hold no MTP layer's tensors"):
        LLM(model=str(ds_dir("deepseek_v3")), max_model_len=64,
            speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_a_config_without_architectures_is_read_by_its_model_type(ds_dir, tmp_path):
    """As transformers' AutoModelForCausalLM: the class from model_type; an unsupported
    model_type is named."""
    path = H.copy_folder(ds_dir("deepseek_v3"), tmp_path / "m")
    config = {k: v for k, v in H.read_config(path).items() if k != "architectures"}
    H.write_config(path, config)
    assert checkpoint.load_config(path, ARCHITECTURE_OF_MODEL_TYPE)["architectures"] == [
        "DeepseekV3ForCausalLM"]
    assert type(load_model(path)).__name__ == "DeepseekV3ForCausalLM"
    H.write_config(path, {**config, "model_type": "falcon"})
    with pytest.raises(ValueError, match="names no architectures, and model_type='falcon' is "
                                         "not a supported one; allowed: "):
        checkpoint.load_config(path, ARCHITECTURE_OF_MODEL_TYPE)


@pytest.mark.parametrize("ragged", [False, True])
def test_an_exact_mtp_layer_is_always_accepted(ragged, ds_dir):
    """A cycle target with an MTP layer that predicts it exactly (hf_deepseek): every draft
    accepted, acceptance length K + 1, and the tokens are the cycle's."""
    k = 3
    llm = LLM(model=str(ds_dir("deepseek_v3_mtp_cycle")), max_num_seqs=4, max_model_len=256,
              speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": k,
                                  "disable_padded_drafter_batch": ragged})
    outs = llm.generate(PROMPTS, max_tokens=24, ignore_eos=True)
    for prompt, out in zip(PROMPTS, outs):
        expected, t = [], prompt[-1]
        for _ in range(24):
            t = H.cycle_next(t)
            expected.append(t)
        assert out.token_ids == expected
        assert out.num_accepted == out.num_drafted and sum(out.num_drafted) > 0
        # every verifying step but the last (cut by max_tokens) accepts all K drafts
        assert out.acceptance_length >= k + 1 - k / out.num_decode_steps


# ---- graph capture and data parallelism ---------------------------------------------------------
def test_deepseek_mtp_k2_under_compile_equals_plain(ds_dir, ds_plain):
    """graph_backend="compile" (dynamo tracing, ``compile_backend="eager"`` as test_graphs:
    inductor's codegen is too slow for a CPU test), padded drafter batch, K=2."""
    llm = LLM(model=str(ds_dir("deepseek_v3_mtp")), max_num_seqs=4, max_model_len=256,
              graph_backend="compile", compile_backend="eager",
              speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 2})
    outs = llm.generate(PROMPTS, max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.token_ids for o in outs] == ds_plain
    assert sum(sum(o.num_drafted) for o in outs) > 0


def test_deepseek_mtp_k2_async_scheduling_equals_plain(ds_dir, ds_plain):
    """Async scheduling over MLA (latent rows written by the step launched before the host
    read) and MoE, captured (replay): plain greedy's tokens, decodes overlapped."""
    llm = LLM(model=str(ds_dir("deepseek_v3_mtp")), max_num_seqs=4, max_model_len=256,
              graph_backend="replay", async_scheduling=True,
              speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 2})
    outs = llm.generate(PROMPTS, max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.token_ids for o in outs] == ds_plain
    assert any(s.overlapped for s in llm.steps)


def test_deepseek_mtp_k2_dp2_with_an_idle_rank_equals_dp1(ds_dir, ds_plain):
    """DP=2, one rank never gets a request (it runs dummy steps: the target's MoE layers and
    the MTP layer's MoE exchange tokens across ranks), the other all of them: no hang (the
    spawn has a timeout) and the tokens of DP=1."""
    from specdec.engine.dp_engine import DPJob, run_data_parallel
    from specdec.engine.sequence import SamplingParams

    kw = dict(model=str(ds_dir("deepseek_v3_mtp")), max_num_seqs=4, max_model_len=256,
              speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 2})
    job = DPJob(kw, PROMPTS, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True),
                [list(range(len(PROMPTS))), []])
    run, = run_data_parallel([job], 2, engine=LLM, timeout=240)
    assert [o.token_ids for o in run.outputs] == ds_plain
    busy, idle = run.ranks
    assert all(s.num_reqs == 0 for s in idle.steps) and len(idle.steps) == len(busy.steps)
    assert idle.collectives == busy.collectives
    assert any(op.startswith("moe_") for step in busy.collectives for op, _ in step)


def tp_ops(step: list, op: str) -> int:
    return sum(1 for name, _ in step if name == op)


@pytest.mark.parametrize("tp", [2, 4])
def test_deepseek_mtp_under_tensor_parallelism_equals_one_rank(tp, ds_dir):
    """MLA split by heads (each rank 4 / tp of them; the latent projection and cache
    replicated), the MoE experts and dense MLP split, the MTP layer sharded the same way (its
    own embedding and lm_head copies, or the target's, by vocabulary): plain and padded MTP
    at K=1 and K=3 give one rank's tokens and acceptance counters (one launch of the tp ranks
    for the jobs); the exact MTP layer over the cycle target accepts every draft, as on one
    rank. Every step's TP collectives: the target's 1 (embedding) + 2 per layer all-reduces
    and its logits' all-gather, and per MTP-layer forward (K a step) 3 all-reduces (its
    embedding, attention and MoE: the layer is sharded) and its logits' all-gather."""
    from specdec.engine.dp_engine import DPJob, run_data_parallel
    from specdec.engine.sequence import SamplingParams

    mtp = [{"method": "deepseek_mtp", "num_speculative_tokens": k} for k in (1, 3)]
    jobs = [("deepseek_v3_mtp", s) for s in [None] + mtp] + [("deepseek_v3_mtp_cycle", mtp[1])]
    if tp == 4:  # the suite's time: plain and K=3 (TP=2 runs all four)
        jobs = [jobs[0], jobs[-1]]
    params = SamplingParams(max_tokens=PARALLEL_NEW, ignore_eos=True)

    def kw(folder, spec):
        return dict(model=str(ds_dir(folder)), max_num_seqs=4, max_model_len=256,
                    speculative_config=spec)
    runs = run_data_parallel([DPJob(dict(kw(*job), tensor_parallel_size=tp), PROMPTS, params)
                              for job in jobs], 1, engine=LLM, tp_size=tp, timeout=300)
    for (folder, spec), run in zip(jobs, runs):
        one = LLM(**kw(folder, spec)).generate(PROMPTS, params)
        assert [(o.token_ids, o.num_drafted, o.num_accepted) for o in run.outputs] == \
            [(o.token_ids, o.num_drafted, o.num_accepted) for o in one]
        assert spec is None or sum(sum(o.num_drafted) for o in one) > 0
        k = spec["num_speculative_tokens"] if spec else 0
        steps = run.ranks[0].collectives[:-1]  # the final stop step runs no forward
        assert {(tp_ops(s, "tp_all_reduce"), tp_ops(s, "tp_all_gather")) for s in steps} == \
            {(1 + 2 * 3 + 3 * k, 1 + k)}
    assert all(o.num_accepted == o.num_drafted for o in runs[-1].outputs)


@pytest.mark.parametrize("dp,tp", [(2, 2), (4, 1)])
def test_deepseek_mtp_with_expert_parallelism_equals_one_rank(dp, tp, ds_dir):
    """The seed's layouts at test size, with expert parallelism: DP=2 x TP=2 (each of the 4
    ranks one whole routed expert of 4, MLA split by heads within a DP rank, the MTP layer's
    too: its attention, MoE and embedding reduce over the TP group) and DP=4 with
    data-parallel attention (each rank its own requests and one expert; 3 prompts, so one
    rank is idle for the whole run and the others for their last steps, running every MoE
    exchange of the target and the MTP layer in its dummy steps). Padded MTP at K=1 and K=3:
    one rank's tokens and counters; every DP rank issues the same DP-group collectives each
    step (the plan's all-reduce, each MoE layer's gather and reduce-scatter; the TP ones carry
    each DP rank's own batch)."""
    from specdec.engine.dp_engine import DPJob, run_data_parallel
    from specdec.engine.sequence import SamplingParams

    params = SamplingParams(max_tokens=PARALLEL_NEW, ignore_eos=True)
    kw = [dict(model=str(ds_dir("deepseek_v3_mtp")), max_num_seqs=4, max_model_len=256,
               speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": k})
          for k in (1, 3)]
    runs = run_data_parallel([DPJob(dict(job, tensor_parallel_size=tp,
                                         enable_expert_parallel=True), PROMPTS, params)
                              for job in kw], dp, engine=LLM, tp_size=tp, timeout=300)
    for job, run in zip(kw, runs):
        one = LLM(**job).generate(PROMPTS, params)
        assert [(o.token_ids, o.num_drafted, o.num_accepted) for o in run.outputs] == \
            [(o.token_ids, o.num_drafted, o.num_accepted) for o in one]
        assert len({tuple(tuple(c for c in step if not c[0].startswith("tp_"))
                          for step in r.collectives) for r in run.ranks}) == 1
        assert any(op == "moe_all_gather" for step in run.ranks[0].collectives
                   for op, _ in step)
        k = job["speculative_config"]["num_speculative_tokens"]
        assert {tp_ops(step, "tp_all_reduce") for r in run.ranks
                for step in r.collectives[:-1]} == {(1 + 2 * 3 + 3 * k) if tp > 1 else 0}
    if dp == 4:
        assert all(s.num_reqs == 0 for s in runs[0].ranks[3].steps)


def test_expert_parallelism_is_refused_for_a_dense_target(ds_dir):
    with pytest.raises(ValueError, match="enable_expert_parallel=True: LlamaForCausalLM has no "
                                         "MoE layers; allowed: False"):
        LLM(enable_expert_parallel=True, max_model_len=64)
