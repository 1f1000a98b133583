"""MoE MLP (single process): routing, the SP shard contract, expert split, engine wiring.

The multi-process dispatch (all-gather + reduce-scatter over DP ranks) is tested end to end in
tests/test_dp.py.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

from specdec.dp import DPContext
from specdec.engine.llm import LLM
from specdec.models.heads import build_head
from specdec.models.llama import LlamaForCausalLM
from specdec.models.layers.moe import MoEMLP, attach_parallel, has_cross_rank_layers

from helpers import PROMPTS, dense_greedy, moe_config, moe_target

def reference_moe(moe: MoEMLP, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax router, the k most probable experts (Python sort), weighted sum."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = F.softmax(x[t] @ moe.gate.weight.T, dim=-1).tolist()
        top = sorted(range(len(probs)), key=lambda e: -probs[e])[:moe.top_k]
        total = sum(probs[e] for e in top) if moe.norm_topk_prob else 1.0
        for e in top:
            w = moe.experts[str(e)].state_dict()  # HF names: gate_proj, up_proj, down_proj
            y = w["down_proj.weight"] @ (F.silu(w["gate_proj.weight"] @ x[t]) * (w["up_proj.weight"] @ x[t]))
            out[t] += probs[e] / total * y
    return out


@given(e=st.sampled_from([1, 2, 4, 8]), k=st.integers(1, 8), n=st.integers(1, 12),
       norm=st.booleans(), seed=st.integers(0, 2**16))
def test_dp1_moe_equals_the_per_token_reference(e, k, n, norm, seed):
    torch.manual_seed(seed)
    moe = MoEMLP(moe_config(e, min(k, e), norm)).to(torch.float64)
    x = torch.randn(n, 32, dtype=torch.float64)
    torch.testing.assert_close(moe(x), reference_moe(moe, x), rtol=1e-10, atol=1e-12)


def test_batched_leading_dims_are_flattened():
    torch.manual_seed(0)
    moe = MoEMLP(moe_config()).to(torch.float64)
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    torch.testing.assert_close(moe(x), moe(x.view(10, 32)).view(2, 5, 32))


@pytest.mark.parametrize("extra,field", [
    ({"num_experts_per_tok": 7}, "num_experts_per_tok=7"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok=0"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size=0"),
])
def test_bad_moe_config_names_the_field(extra, field):
    cfg = moe_config()
    cfg.extra.update(extra)
    with pytest.raises(ValueError, match=field):
        MoEMLP(cfg)


def test_experts_split_across_dp_ranks():
    moe = MoEMLP(moe_config(), DPContext(rank=1, size=3))
    assert sorted(moe.experts) == ["2", "3"]
    assert "experts.2.up_proj.weight" in moe.state_dict()  # global names are kept
    with pytest.raises(ValueError, match=r"needs experts \[0, 1\]"):
        moe.keep_experts(moe.local_experts(0, 3))
    moe.set_parallel(DPContext(rank=0, size=3))  # placed already: attached, nothing dropped
    assert sorted(moe.experts) == ["2", "3"]
    with pytest.raises(ValueError, match="num_experts=6 .*data_parallel_size=4"):
        MoEMLP(moe_config(), DPContext(rank=0, size=4))


def load_reading(monkeypatch, path, **kwargs):
    """``load_model(path, **kwargs)`` and the names of the tensors it took out of the files."""
    from specdec.models import checkpoint
    from specdec.models.registry import load_model
    read, iter_tensors = [], checkpoint.iter_tensors

    def reading(*args, **kw):
        for name, t in iter_tensors(*args, **kw):
            read.append(name)
            yield name, t
    with monkeypatch.context() as patched:
        patched.setattr(checkpoint, "iter_tensors", reading)
        return load_model(path, **kwargs), read


@pytest.mark.parametrize("dp_rank,tp_rank,ep,held,width", [
    (1, 0, False, [2, 3], 16), (1, 1, False, [2, 3], 16), (0, 1, True, [1], 32),
    (1, 1, True, [3], 32)])
def test_routed_experts_placed_over_the_grid_load_only_their_tensors(
        tmp_path, monkeypatch, dp_rank, tp_rank, ep, held, width):
    """DeepSeek-V3 (4 routed experts of width 32, a shared expert), D=2 x T=2: DP rank d keeps
    experts 2d, 2d+1 split in half over its TP ranks; with expert parallelism rank 2d+t keeps
    expert 2d+t whole. Each rank holds 1/4 of the routed experts' bytes, reads none of the
    others' tensors (none comes out of the files, and a checkpoint without them loads), and its
    shared expert is split over TP."""
    import hf_deepseek
    from specdec.distributed import TPContext
    from specdec.models.layers.parallel import ExpertPlacement
    from specdec.models.registry import load_model
    path = hf_deepseek.build_deepseek_v3(tmp_path / "ds")
    placement = ExpertPlacement.of(TPContext(tp_rank, 2), dp_rank, 2, ep)
    full = load_model(path)
    part, read = load_reading(monkeypatch, path, tp=TPContext(tp_rank, 2), experts=placement)
    experts_read = {int(n.split(".mlp.experts.")[1].split(".")[0]) for n in read
                    if ".mlp.experts." in n}
    assert experts_read == set(held)
    for moe, whole in ((m.mlp, f.mlp) for m, f in zip(part.model.layers[1:],
                                                       full.model.layers[1:])):
        assert sorted(map(int, moe.experts)) == held
        routed = sum(p.numel() for p in moe.experts.parameters())
        assert routed * 4 == sum(p.numel() for p in whole.experts.parameters())
        assert moe.experts[str(held[0])].down_proj.weight.shape == (64, width)
        assert moe.shared_experts.down_proj.weight.shape == (64, 16)
    # the dropped experts' tensors are never read: a folder without them loads the same
    import json

    from safetensors.torch import load_file, save_file
    keep = {f"mlp.experts.{e}." for e in held}

    def kept(name: str) -> bool:
        return ".mlp.experts." not in name or any(s in name for s in keep)
    for shard in path.glob("model-*.safetensors"):
        save_file({k: v for k, v in load_file(shard).items() if kept(k)}, shard)
    index = path / "model.safetensors.index.json"
    d = json.loads(index.read_text())
    d["weight_map"] = {k: v for k, v in d["weight_map"].items() if kept(k)}
    index.write_text(json.dumps(d))
    again = load_model(path, tp=TPContext(tp_rank, 2), experts=placement)
    a, b = again.state_dict(), part.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """family -> its tiny checkpoint folder, built once: Qwen3-MoE (8 experts, layers 1-2),
    MiniMax-M2 (8, ``block_sparse_moe.experts.E.w1..3``, layers 0-1), GLM-4.5 (4 and a
    shared expert, layer 1; its MTP layer, model.layers.2, is the head's)."""
    import hf_glm4_moe
    import hf_models
    from helpers import folder_builder
    return folder_builder({"qwen3_moe": hf_models.build_qwen3_moe,
                           "minimax_m2": hf_models.build_minimax_m2,
                           "glm4_moe": hf_glm4_moe.build_glm}, tmp_path_factory)


EP_LAYOUTS = [(1, 2, 0, 1), (2, 2, 1, 0), (4, 1, 2, 0)]  # (D, T, d, t)


@pytest.mark.parametrize("family,layout", [
    (f, lay) for f in ("qwen3_moe", "minimax_m2", "glm4_moe")
    for lay in EP_LAYOUTS + ([(2, 4, 1, 3)] if f != "glm4_moe" else [])])
def test_expert_parallel_rank_loads_only_its_whole_experts_per_family(
        moe_dir, monkeypatch, family, layout):
    """Expert parallelism (ExpertPlacement.of(TPContext(t, T), d, D, True)) on each MoE family
    as loaded from its folder: rank d*T + t keeps experts [r*E/(D*T), (r+1)*E/(D*T)) whole in
    every MoE layer, 1/(D x T) of the routed experts' bytes; the only expert tensors that come
    out of the files are those (by layer and id); each held expert equals the full model's,
    and every other tensor this rank's TP slice of the full model (the in-memory split)."""
    import re

    from specdec.distributed import TPContext
    from specdec.models.layers.parallel import ExpertPlacement, shard_from
    from specdec.models.registry import load_model
    big_d, big_t, d, t = layout
    path = moe_dir(family)
    tp = TPContext(t, big_t)
    placement = ExpertPlacement.of(tp, d, big_d, expert_parallel=True)
    full = load_model(path)
    part, read = load_reading(monkeypatch, path, tp=tp, experts=placement)
    moes = {name: m for name, m in part.named_modules() if isinstance(m, MoEMLP)}
    whole = dict(full.named_modules())
    e = next(iter(moes.values())).num_experts
    per, rank = e // (big_d * big_t), d * big_t + t
    held = list(range(rank * per, (rank + 1) * per))
    layers = {int(name.split(".")[2]) for name in moes}
    expert = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.")
    assert {(int(m[1]), int(m[2])) for n in read if (m := expert.match(n))} == \
        {(layer, i) for layer in layers for i in held}
    assert len(moes) == (2 if family != "glm4_moe" else 1)
    for name, moe in moes.items():
        ref = whole[name]
        assert sorted(map(int, moe.experts)) == held
        nbytes = [sum(p.numel() * p.element_size() for p in m.experts.parameters())
                  for m in (moe, ref)]
        assert nbytes[0] * big_d * big_t == nbytes[1]
        for i in held:
            a, b = moe.experts[str(i)].state_dict(), ref.experts[str(i)].state_dict()
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)
    sliced = shard_from(load_model(path), tp, placement).state_dict()
    got = part.state_dict()
    assert got.keys() == sliced.keys() and all(torch.equal(got[k], sliced[k]) for k in got)


def test_moe_target_checkpoint_round_trip(tmp_path):
    target = moe_target()
    target.save_pretrained(tmp_path, dtype=torch.float32)
    loaded = LlamaForCausalLM.load_pretrained(tmp_path, dtype=torch.float64)
    assert isinstance(loaded.model.layers[3].mlp, MoEMLP)
    ids = torch.tensor([PROMPTS[3]])
    pos = torch.arange(ids.shape[1])[None]
    torch.testing.assert_close(loaded(ids, pos)[0], target(ids, pos)[0], rtol=1e-5, atol=1e-5)


def test_heads_of_a_moe_target_are_moe_and_graph_modes_refuse_them_under_dp(tmp_path):
    """A head built from a MoE config has a MoE layer (like DeepSeek's MTP layer): it
    exchanges tokens across DP ranks, so a graph mode cannot capture its step under DP."""
    target = moe_target()
    mtp = build_head("mtp", target)
    eagle3 = build_head("eagle3", target, eagle_aux_hidden_state_layer_ids=[1, 2, 3],
                        num_experts=0)
    assert isinstance(mtp.model.mtp_layers[0].mlp, MoEMLP)
    assert not attach_parallel(eagle3, DPContext())
    aux = {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}
    cases = [("mtp", mtp, {}, True), ("eagle3", eagle3, aux, False),
             ("extract_hidden_states", None, dict(aux, output_dir=str(tmp_path)), False)]
    for method, head, dmc, cross in cases:
        spec = {"method": method, "num_speculative_tokens": 1, "draft_model_config": dmc}
        llm = LLM(target=target, draft_head=head, speculative_config=spec, dtype=torch.float64,
                  max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16)
        assert has_cross_rank_layers(getattr(llm.runner.proposer, "head", eagle3)) is cross
    with pytest.raises(ValueError, match="MoE.*data_parallel_size=1, got 2"):
        LLM(target=target, draft_head=mtp, dtype=torch.float64, max_model_len=64,
            speculative_config={"method": "mtp", "num_speculative_tokens": 1,
                                "graph_mode": "torchair"}, dp=DPContext(0, 2))


@pytest.mark.parametrize("k", [1, 3])
def test_moe_engine_with_moe_mtp_head_is_lossless(k):
    target = moe_target()
    torch.manual_seed(1)
    head = build_head("mtp", target).to(torch.float64).eval()
    spec = {"method": "mtp", "num_speculative_tokens": k}
    llm = LLM(target=target, draft_head=head, speculative_config=spec, dtype=torch.float64,
              max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16)
    outs = llm.generate(PROMPTS, max_tokens=16)
    assert [o.token_ids for o in outs] == [dense_greedy(target, p, 16, 64) for p in PROMPTS]
