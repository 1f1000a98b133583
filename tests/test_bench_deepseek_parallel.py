"""benchmarks/bench_deepseek_parallel at test size: DP=2 x TP=2 + EP, 2 prompts x 4 tokens,
plain and padded MTP K=1 -- every row's collective check holds (the plan's one all-reduce,
2 DP collectives per MoE forward, the TP reductions), the tokens equal one rank's, a rank
holds 1/4 of the target's routed experts and of its MTP layer's; and the R1 paper plan's
arithmetic (671B in the main model, the collective counts per step, the MTP layer per rank)."""

import pytest

import hf_deepseek as D
from benchmarks import bench_deepseek_parallel as B

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_reduced_run_checks_out(tmp_path):
    path = D.build_deepseek_v3_mtp(tmp_path / "m")
    rows, wrows = B.collect(path, [B.LAYOUTS["dp2tp2ep"]], [[5, 9, 13], [7, 21, 4, 40]], 4, 1)
    col = {name: i for i, name in enumerate(B.COLLECTIVE_HEADER)}
    sharded = [r for r in rows if r[0] != "1 rank"]
    assert [(r[0], r[1]) for r in sharded] == [("DP=2 x TP=2 + EP", "plain"),
                                               ("DP=2 x TP=2 + EP", "MTP K=1")]
    for r in sharded:
        assert (r[col["check"]], r[col["== 1 rank"]]) == ("ok", "yes"), r
        assert r[col["same every step"]].startswith("yes"), r
    # MoE forwards per step: the 2 target MoE layers, + 1 per MTP-layer forward (K=1)
    assert [r[col["MoE fwd"]] for r in sharded] == ["2", "3"]
    assert [r[col["MoE AG"]] for r in sharded] == ["2", "3"]
    wcol = {name: i for i, name in enumerate(B.WEIGHT_HEADER)}
    ep = next(r for r in wrows if r[0] == "DP=2 x TP=2 + EP")
    # the MTP layer placed like the target: 1/(D x T) of its routed experts too
    assert (ep[wcol["target routed / all"]], ep[wcol["MTP routed / all"]],
            ep[wcol["target experts held"]]) == ("0.250", "0.250", "1")


def test_r1_paper_plan_arithmetic():
    full = B.r1_parts(1, 1, False)
    main = sum(v["fp8"] + v["bf16"] for k, v in full.items() if not k.startswith("MTP"))
    assert round(main / 1e9, 1) == 671.0
    mem, step = B.plan_rows(3)
    counts = {r[0]: r[2] for r in step}
    # TP16: 1 + 61 + 3 + 58 all-reduces, + 3 per MTP-layer forward (K = 3), the logits'
    # all-gathers (the target's + one per MTP-layer forward), the step broadcast;
    # DP16 + EP: the plan's all-reduce + 2 x (58 target + 3 MTP-layer MoE forwards)
    assert counts == {"TP16 (the seed)": "0 + 137", "DP2 x TP8 + EP": "123 + 137",
                      "DP16 + EP": "123 + 0"}
    # the MTP layer placed like the target: at TP16 1/16 of it (and of its embedding and
    # head copies) but the replicated latent projections, eh_proj, router and norms
    mtp = {r[0]: r[1].split(" + ")[1] for r in mem}
    assert mtp == {"TP16 (the seed)": "1.0B", "DP2 x TP8 + EP": "1.1B", "DP16 + EP": "2.9B"}
