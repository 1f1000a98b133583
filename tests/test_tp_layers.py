"""Tensor-parallel layers with real processes (2 gloo ranks, one spawn for the module): each
rank loads only its slice of tiny transformers checkpoints, and the sharded forward (paged
path, sequence parallelism off and on) equals the full model's on the same rank; each rank
holds about half the parameter bytes. The same for the MTP layers those folders hold
(DeepSeek-V3's, GLM-4.5's), loaded over the sharded target as the engine loads them. One
launch of 4 ranks checks expert parallelism: each MoE family's MoE layer (and the MTP layers')
with whole experts over DP=2 x TP=2 (SP off and on), TP=4 and DP=4 equals the full layer, each
DP rank on its own tokens. Shape errors are checked in-process."""

import tempfile
import traceback
from pathlib import Path

import hf_deepseek
import hf_glm4_moe
import hf_gpt_oss
import hf_models
import pytest
import torch
import torch.distributed as dist
from helpers import moe_target, run_ranks, tiny_target

from specdec.attention import AttentionMetadata, KVCache
from specdec.distributed import TPContext, init_grid
from specdec.models.config import ModelConfig
from specdec.models.layers.parallel import shard_from, shard_model
from specdec.models.heads import load_head
from specdec.models.llama import LlamaForCausalLM
from specdec.models.registry import load_model

TIMEOUT = 180


def build_llama_tied_mqa(path) -> Path:
    """Llama with ONE KV head (replicated on both ranks) and tied embeddings."""
    return hf_models._llama(path, num_key_value_heads=1, tie_word_embeddings=True, max_position_embeddings=256,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def build_minimax_mqa(path) -> Path:
    """MiniMax-M2 with one KV head: its k_norm over the whole projection is replicated."""
    return hf_models._build(
        path, "MiniMaxM2Config", "MiniMaxM2ForCausalLM", post=hf_models._routing_bias,
        vocab_size=hf_models.VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, hidden_act="silu",
        rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False,
        num_local_experts=8, num_experts_per_tok=2, rotary_dim=16, rope_theta=5000000.0,
        scoring_func="sigmoid", use_routing_bias=True, use_qk_norm=True,
        qk_norm_type="per_layer", shared_intermediate_size=0, attn_type_list=[1, 1],
        router_jitter_noise=0.0, bos_token_id=hf_models.MINIMAX_BOS,
        eos_token_id=hf_models.MINIMAX_EOS)


BUILDERS = {"llama3": hf_models.build_llama3, "qwen25": hf_models.build_qwen25,
            "qwen3": hf_models.build_qwen3,
            "qwen3_moe": hf_models.build_qwen3_moe, "minimax_m2": hf_models.build_minimax_m2,
            "llama_tied_mqa": build_llama_tied_mqa, "minimax_mqa": build_minimax_mqa,
            "glm4_moe": hf_glm4_moe.build_glm, "gemma2": hf_models.build_gemma2,
            "gemma3": hf_models.build_gemma3, "deepseek_v3": hf_deepseek.build_deepseek_v3,
            "deepseek_v3_noq": hf_deepseek.build_deepseek_v3_noq, "gpt_oss": hf_gpt_oss.build,
            "gpt_oss_mxfp4": lambda path: hf_gpt_oss.to_mxfp4(
                hf_gpt_oss.build(path.with_name("gpt_oss_bf16")), path),
            "phi3": hf_models.build_phi3}
# folders holding an MTP layer (model.layers.L.*, with its own embedding and lm_head copies):
# DeepSeek-V3's (MLA + MoE) and GLM-4.5's (GQA + MoE, the "glm4_moe" folder above)
MTP_BUILDERS = {"deepseek_v3_mtp": hf_deepseek.build_deepseek_v3_mtp}
MTP_FOLDERS = ["deepseek_v3_mtp", "glm4_moe"]
N = 10  # tokens: two requests of 6 and 4


def _paged(model):
    """A fresh cache for ``model`` and the metadata of two requests of 6 and 4 tokens."""
    kv = KVCache(model.kv_cache_spec(), 4, 16, torch.float32, torch.device("cpu"))
    attn = AttentionMetadata(torch.cat([torch.arange(6), 16 + torch.arange(4)]),
                             torch.tensor([0, 6, 10], dtype=torch.int32),
                             torch.tensor([6, 4], dtype=torch.int32),
                             torch.tensor([[0, 2], [1, 3]], dtype=torch.int32), 6)
    return kv.bind(attn)


def paged_forward(model, ids, positions):
    """logits [N, V] and aux [N, 2, H] of one paged forward over two fresh requests."""
    with torch.inference_mode():
        hidden, aux = model(ids, positions, kv=_paged(model), aux_layer_ids=(0, 1))
        return model.compute_logits(hidden), aux


def head_forward(head, ids, positions, hidden):
    """An MTP layer's draft logits [N, V] and next hidden [N, H] of one paged step over two
    fresh requests (its own cache)."""
    with torch.inference_mode():
        out, nxt = head(ids, positions, hidden, kv=_paged(head))
        return head.compute_logits(out), nxt


def _nbytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _rank(rank, store, paths, results):
    try:
        torch.set_num_threads(1)
        out = {}
        ids = torch.tensor([3, 500, 17, 255, 256, 9, 1, 511, 44, 300])
        positions = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 3])
        for sp in (False, True):
            grid = init_grid(1, 2, rank, init_method=f"file://{store}", sequence_parallel=sp)
            for name, path in paths.items():
                full = load_model(path, torch.float32)
                part = load_model(path, torch.float32, tp=grid.tp)
                start = len(grid.dp.collectives)
                got = paged_forward(part, ids, positions)
                ops = sorted({op for op, _ in grid.dp.collectives[start:]})
                nbytes = [sum(p.numel() * p.element_size() for p in m.parameters())
                          for m in (part, full)]
                # numpy: pickled by value (a torch tensor would be shared through this process)
                out[name, sp] = ([t.numpy() for t in paged_forward(full, ids, positions)],
                                 [t.numpy() for t in got], nbytes, ops)
            hidden = torch.randn(N, 64, generator=torch.Generator().manual_seed(5))
            for name in MTP_FOLDERS:  # the MTP layer over the full / the sharded target
                full = load_head(paths[name], load_model(paths[name], torch.float32))
                part = load_head(paths[name], load_model(paths[name], torch.float32, tp=grid.tp))
                start = len(grid.dp.collectives)
                got = head_forward(part, ids, positions, hidden)
                ops = sorted({op for op, _ in grid.dp.collectives[start:]})
                out[f"{name} MTP", sp] = (
                    [t.numpy() for t in head_forward(full, ids, positions, hidden)],
                    [t.numpy() for t in got], [_nbytes(part), _nbytes(full)], ops)
        dist.destroy_process_group()
        results.put((rank, out))
    except BaseException:  # noqa: BLE001 (the parent reports it)
        results.put((rank, traceback.format_exc()))


@pytest.fixture(scope="module")
def folders():
    """(a scratch folder, {name: the checkpoint folder of each builder}), for both launches."""
    with tempfile.TemporaryDirectory(prefix="specdec-tp-") as tmp:
        yield tmp, {name: build(Path(tmp) / name)
                    for name, build in {**BUILDERS, **MTP_BUILDERS}.items()}


@pytest.fixture(scope="module")
def ranks(folders):
    """{rank: {(model, sp): ((logits, aux) full, (logits, aux) TP=2, [bytes TP, bytes full],
    TP ops)}}."""
    tmp, paths = folders
    got = run_ranks(_rank, (f"{tmp}/store", paths), 2, TIMEOUT)
    for rank, out in got.items():
        assert not isinstance(out, str), f"rank {rank} failed:\n{out}"
        for key, (full, part, nbytes, ops) in out.items():
            out[key] = ([torch.from_numpy(a) for a in full], [torch.from_numpy(a) for a in part],
                        nbytes, ops)
    return got


# ---- expert parallelism over a D x T grid: the MoE layers alone, one launch of 4 ranks -------
# the MoE families (DeepSeek-V3's folder with its MTP layer; GLM-4.5's holds one too)
EP_FOLDERS = ["qwen3_moe", "minimax_m2", "glm4_moe", "deepseek_v3_mtp", "gpt_oss"]
EP_LAYERS = EP_FOLDERS + [f"{n} MTP" for n in MTP_FOLDERS]
EP_GRIDS = [(2, 2, False), (2, 2, True), (1, 4, False), (4, 1, False)]  # D, T, SP
EP_TOKENS = (1, 2, 3, 5, 8)  # the token counts a DP rank brings (SP: N*T of them, N a rank)


def _moe_layer(model, name: str):
    """The MoE layer checked for ``name``: the target's first, or its MTP layer's."""
    from specdec.models.layers.moe import MoEMLP
    if name.endswith(" MTP"):
        return model.layer.mlp
    return next(m for m in model.modules() if isinstance(m, MoEMLP))


def _ep_input(d: int, count: int, hidden: int) -> torch.Tensor:
    """DP rank d's ``count`` tokens (each DP rank its own)."""
    return torch.randn(count, hidden, generator=torch.Generator().manual_seed(1000 * d + count))


def _ep_rank(rank, store, paths, results):
    """Each grid D x T (+SP) of the 4 ranks, each family: the target's first MoE layer (and an
    MTP layer's, placed over that target) loaded with expert parallelism, run on this rank's
    tokens for each token count; -> its outputs, held experts and collectives."""
    try:
        from specdec.models.layers.parallel import ExpertPlacement
        torch.set_num_threads(1)
        out = {}
        for dp, tp, sp in EP_GRIDS:
            grid = init_grid(dp, tp, rank, init_method=f"file://{store}", sequence_parallel=sp)
            d, t = grid.dp.rank, grid.tp.rank
            placement = ExpertPlacement.of(grid.tp, d, dp, expert_parallel=True)
            for name in EP_LAYERS if not sp else EP_FOLDERS:  # an MTP layer runs without SP
                folder = name.removesuffix(" MTP")
                model = load_model(paths[folder], torch.float32,
                                   tp=grid.tp if tp > 1 else None, experts=placement)
                if name.endswith(" MTP"):
                    model = load_head(paths[folder], model)
                moe = _moe_layer(model, name)
                moe.set_parallel(grid.dp)  # as the engine attaches it: placed, kept
                got, ops = [], []
                for n in EP_TOKENS:
                    x = _ep_input(d, n * tp if sp else n, moe.gate.in_features)
                    start = len(grid.dp.collectives)
                    with torch.inference_mode():
                        got.append(moe(x[t * n:(t + 1) * n] if sp else x).numpy())
                    ops.append(sorted(op for op, _ in grid.dp.collectives[start:]))
                out[name, dp, tp, sp] = (got, sorted(map(int, moe.experts)), ops)
        dist.destroy_process_group()
        results.put((rank, out))
    except BaseException:  # noqa: BLE001 (the parent reports it)
        results.put((rank, traceback.format_exc()))


@pytest.fixture(scope="module")
def ep_ranks(folders):
    """{rank: {(layer, D, T, SP): ([this rank's MoE output per token count], held expert ids,
    [collectives per forward])}} of the 4-rank launch, and {layer: the full MoE layer}."""
    tmp, paths = folders
    got = run_ranks(_ep_rank, (f"{tmp}/ep_store", paths), 4, TIMEOUT)
    for rank, out in got.items():
        assert not isinstance(out, str), f"rank {rank} failed:\n{out}"
    full = {}
    for name in EP_LAYERS:
        folder = name.removesuffix(" MTP")
        model = load_model(paths[folder], torch.float32)
        full[name] = _moe_layer(load_head(paths[folder], model) if name.endswith(" MTP")
                                else model, name)
    return got, full


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_sharded_forward_equals_the_full_model(ranks, name, sp):
    for rank in (0, 1):
        (logits, aux), (tp_logits, tp_aux), _, ops = ranks[rank][name, sp]
        torch.testing.assert_close(tp_logits, logits, rtol=0, atol=1e-4)
        torch.testing.assert_close(tp_aux, aux, rtol=0, atol=1e-4)
        assert tp_logits.argmax(-1).tolist() == logits.argmax(-1).tolist()
        expected = {"tp_all_reduce", "tp_all_gather"} | ({"tp_reduce_scatter"} if sp else set())
        assert set(ops) == expected
    # both ranks gathered the same logits, bit for bit
    assert torch.equal(ranks[0][name, sp][1][0], ranks[1][name, sp][1][0])


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("name", MTP_FOLDERS)
def test_sharded_mtp_layer_equals_the_full_one(ranks, name, sp):
    """The MTP layer loaded over each rank's sharded target (MLA or GQA split by heads, MoE
    experts and the shared expert by width, its own embedding / lm_head copies by vocabulary)
    gives the full layer's draft logits and next hidden; it reduces over the TP group (its
    attention, its MoE, its embedding) and gathers its logits, and never runs the sequence-
    parallel collectives (its input is the target's gathered hidden, every token on every
    rank); each rank holds about half its bytes."""
    for rank in (0, 1):
        (logits, nxt), (tp_logits, tp_nxt), (tp_bytes, full_bytes), ops = \
            ranks[rank][f"{name} MTP", sp]
        torch.testing.assert_close(tp_logits, logits, rtol=0, atol=1e-4)
        torch.testing.assert_close(tp_nxt, nxt, rtol=0, atol=1e-4)
        assert set(ops) == {"tp_all_reduce", "tp_all_gather"}
        assert 0.5 <= tp_bytes / full_bytes < 0.56
    assert torch.equal(ranks[0][f"{name} MTP", sp][1][0], ranks[1][f"{name} MTP", sp][1][0])


@pytest.mark.parametrize("name", EP_LAYERS)
def test_expert_parallel_moe_layer_equals_the_full_layer(ep_ranks, name):
    """Expert parallelism (``enable_expert_parallel``): at DP=2 x TP=2 (SP off and on), TP=4
    and DP=4, rank r = d*T + t holds experts [r*E/4, (r+1)*E/4) whole; its MoE layer (the
    target's first, and the MTP layer's, placed over that target; an MTP layer runs without
    SP, its input the gathered hidden) run on DP rank d's own tokens (SP: this TP rank's N of
    them) equals the full layer's rows for each token count a rank brings; one forward issues
    the DP exchange (all-gather, reduce-scatter) when D > 1 and the one TP reduction (SP: the
    input's all-gather and a reduce-scatter) when T > 1, nothing else."""
    got, full = ep_ranks
    whole = full[name]
    for dp, tp, sp in EP_GRIDS:
        if sp and name.endswith(" MTP"):
            continue
        for rank, out in got.items():
            outputs, held, ops = out[name, dp, tp, sp]
            per = whole.num_experts // 4
            assert held == list(range(rank * per, (rank + 1) * per))
            d, t = divmod(rank, tp)
            for n, y in zip(EP_TOKENS, outputs):
                with torch.inference_mode():
                    want = whole(_ep_input(d, n * tp if sp else n, whole.gate.in_features))
                torch.testing.assert_close(
                    torch.from_numpy(y), want[t * n:(t + 1) * n] if sp else want, rtol=0,
                    atol=1e-5, msg=lambda m: f"{dp}x{tp} sp={sp} rank {rank} N={n}: {m}")
            dp_ops = ["moe_all_gather", "moe_reduce_scatter"] if dp > 1 else []
            tp_ops = (["tp_all_gather", "tp_reduce_scatter"] if sp else ["tp_all_reduce"]) \
                if tp > 1 else []
            assert ops == [sorted(dp_ops + tp_ops)] * len(EP_TOKENS)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_each_rank_holds_about_half_the_parameter_bytes(ranks, name):
    """Everything but the norms and the MoE routers is split in two; a replicated KV head,
    and MLA's latent projections (``q_a_proj``, ``kv_a_proj_with_mqa``), are held whole on
    both ranks."""
    tp_bytes, full_bytes = ranks[0][name, False][2]
    replicated = name.endswith("mqa") or name.startswith("deepseek")
    assert 0.5 <= tp_bytes / full_bytes < (0.56 if replicated else 0.51)


def test_head_and_vocab_counts_must_divide():
    target = tiny_target()  # 4 heads, 2 KV heads, vocab 96
    with pytest.raises(ValueError, match="num_attention_heads=4 must be a multiple of "
                                         "tensor_parallel_size=3"):
        shard_model(target, TPContext(0, 3))
    target.config.vocab_size = 97
    with pytest.raises(ValueError, match="vocab_size=97 must be a multiple of "
                                         "tensor_parallel_size=2"):
        shard_model(target, TPContext(0, 2))


def test_kv_heads_that_do_not_divide_the_tp_size_are_refused():
    target = tiny_target()
    target.config.vocab_size = 96
    for layer in target.model.layers:
        layer.self_attn.n_kv = 3
    with pytest.raises(ValueError, match="num_key_value_heads=3: tensor_parallel_size=4"):
        shard_model(target, TPContext(0, 4))


def test_a_family_not_sharded_yet_is_refused_by_name(tmp_path):
    import hf_qwen3_5
    model = load_model(hf_qwen3_5.build_qwen3_5(tmp_path / "q35"), torch.float32)
    with pytest.raises(ValueError, match="Qwen3_5ForCausalLM family is not sharded yet"):
        shard_model(model, TPContext(0, 2))


def test_a_fused_tensor_is_read_as_its_parts_rows():
    """Phi-3's fused qkv_proj at T=2, rank 1 (Hq=Hkv=4, D=16): q rows 32..64, k rows
    64+32..64+64, v rows 128+32..128+64, one tensor; gate_up_proj: gate then up rows."""
    from specdec.models.config import ModelConfig
    from specdec.models.phi3 import Phi3ForCausalLM
    config = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                         architectures=["Phi3ForCausalLM"])
    full = Phi3ForCausalLM(config)
    twin = Phi3ForCausalLM(config)
    twin.load_state_dict(full.state_dict())
    part = shard_from(twin, TPContext(1, 2))
    w, got = full.model.layers[0].self_attn.qkv_proj.weight, \
        part.model.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(got, torch.cat([w[32:64], w[96:128], w[160:192]]))
    gu, got = full.model.layers[0].mlp.gate_up_proj.weight, \
        part.model.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(got, torch.cat([gu[16:32], gu[48:64]]))


@pytest.mark.parametrize("build", ["deepseek_v3", "deepseek_v3_noq"])
def test_mla_is_split_by_heads_with_the_latent_replicated(tmp_path, build):
    """T=2, rank 1 of 4 heads (nope 32 + rope 16 = 48 query rows a head, nope 32 + v 24 = 56
    kv_b rows, 24 o_proj columns): heads 2-3's rows and columns; the latent projection and
    its norm whole."""
    path = hf_deepseek.BUILDERS[build](tmp_path / build)
    full, part = load_model(path, torch.float32), load_model(path, torch.float32)
    shard_from(part, TPContext(1, 2))
    a, b = full.model.layers[1].self_attn, part.model.layers[1].self_attn
    q = "q_b_proj" if build == "deepseek_v3" else "q_proj"
    assert torch.equal(getattr(b, q).weight, getattr(a, q).weight[96:])
    assert torch.equal(b.kv_b_proj.weight, a.kv_b_proj.weight[112:])
    assert torch.equal(b.o_proj.weight, a.o_proj.weight[:, 48:])
    assert torch.equal(b.kv_a_proj_with_mqa.weight, a.kv_a_proj_with_mqa.weight)
    assert torch.equal(b.kv_a_layernorm.weight, a.kv_a_layernorm.weight)
    assert b.n_heads == 2 and b.kv_cache_spec() == a.kv_cache_spec()


def test_in_memory_model_is_sliced_like_the_checkpoint():
    """shard_from (an in-memory target): rank 1's q_proj rows and o_proj columns."""
    full = moe_target()
    part = shard_from(moe_target(), TPContext(1, 2))
    a, b = full.model.layers[0].self_attn, part.model.layers[0].self_attn
    d = a.head_dim
    assert torch.equal(b.qkv_proj.weight[:2 * d], a.qkv_proj.weight[2 * d:4 * d])
    assert torch.equal(b.o_proj.weight, a.o_proj.weight[:, 2 * d:])
    assert part.model.layers[0].mlp.experts["0"].down_proj.weight.shape == (32, 12)


@pytest.mark.parametrize("kv_heads,k_rows", [(2, (0, 8, 16)), (1, (0, 0, 8))])
def test_slices_of_the_docstring_example(kv_heads, k_rows):
    """T=2, rank 1, Hq=4, D=8, H=32: q rows 16..32, o_proj columns 16..32; k rows per KV
    heads (one KV head: replicated, rows 0..8 on both ranks)."""
    cfg = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=kv_heads)
    with torch.device("meta"):
        slices = shard_model(LlamaForCausalLM(cfg), TPContext(1, 2))
    attn = "model.layers.0.self_attn."
    assert slices[attn + "q_proj.weight"] == (0, 16, 32)
    assert slices[attn + "k_proj.weight"] == slices[attn + "v_proj.weight"] == k_rows
    assert slices[attn + "o_proj.weight"] == (1, 16, 32)
    assert slices["model.layers.0.mlp.down_proj.weight"] == (1, 32, 64)
    assert slices["lm_head.weight"] == slices["model.embed_tokens.weight"] == (0, 48, 96)
