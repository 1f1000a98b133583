"""The tiny DeepSeek-V3 with its MTP layer over parallel layouts (one rank, TP=4, DP=2 x TP=2
+ EP, DP=4 + EP and the same without EP), plain greedy and padded MTP K=3: the collectives of
a decode step by kind, the bytes they carry, each rank's weight bytes against the unsharded
model, and tokens/s against one rank (about 40 s on a 2-core CPU). ``--plan``: the paper plan
for the real DeepSeek-R1 on 16 accelerators (pure arithmetic, no model run). Results and the
plan's sources: docs/benchmarks.md.

    python -m benchmarks.bench_deepseek_parallel [--prompts 4] [--max-tokens 16] [-k 3]
        [--layouts tp4,dp2tp2ep,dp2tp2,dp4ep,dp4] [--markdown]
    python -m benchmarks.bench_deepseek_parallel --plan [--markdown]

What is measured (the folder: ``tests/hf_deepseek.build_deepseek_v3_mtp``, hidden 64, 3 layers:
layer 0 dense, layers 1-2 MoE of 4 routed experts + 1 shared, 4 MLA heads, and one MTP layer
(MLA + MoE) whose folder holds its own copies of the embedding and lm_head, as R1's does):

- collectives: the (op, shape) log of world rank 0 (TP rank 0 of DP rank 0: its DP-group ops
  and its TP-group ops) for every decode step (every step after the first, the prefill of all
  prompts, and before the final stop step), per step: the mean count of each kind, and whether
  every decode step had the same counts. Kinds: ``plan AR`` the DP plan's packed all-reduce,
  ``MoE AG`` / ``MoE RS`` each MoE layer's all-gather / reduce-scatter on the DP group,
  ``TP AR`` / ``TP AG`` / ``TP BC`` the TP group's all-reduce / all-gather / broadcast.
- ``MoE fwd``: MoE layer forwards per decode step, counted with forward hooks in the one-rank
  run (target MoE layers + one per MTP-layer forward); ``check``: at D > 1 plan AR == 1 and
  MoE AG == MoE RS == MoE fwd (2 DP collectives per MoE layer forward), and at T > 1 TP AR ==
  1 (embedding) + one per attention layer + one per dense MLP + one per target MoE layer,
  + 3 per MTP-layer forward (the layer is sharded like the target's: its embedding copy,
  its attention's o_proj, its MoE), and TP AG == 1 + one per MTP-layer forward (logits).
- bytes per step: the recorded shape's element count x the element size. Rule: the plan's
  all-reduce is int32 (4 B); a step's first TP broadcast is the step's host buffer (uint8, 1
  B), a second one (a step that brings new prompts) int32; every other collective carries
  activations or logits in the model's dtype (float32 here, 4 B). The shape logged is the
  tensor a rank hands in: all-gather its own part, reduce-scatter the full input, all-reduce
  and broadcast the tensor. ``ring B/rank``: what one rank sends with ring algorithms over a
  group of n: all-reduce 2(n-1)/n x S, all-gather (n-1) x S, reduce-scatter (n-1)/n x S,
  broadcast S.
- weights: each rank's model built in this process as its engine builds it
  (``registry.load_model(path, tp=TPContext(t, T), experts=ExpertPlacement.of(...))`` and the
  MTP layer loaded over it, placed like it, its MoE given the rank's DP context) --
  parameters + routing biases, bytes.
- tokens/s: generated tokens of all DP ranks / the longest DP rank's summed step wall time
  (start-up and load excluded; one launch per layout, no repeats). Every rank runs one torch
  thread, and the ranks of a layout share this machine's cores (2 here): multi-rank figures
  show the collectives' cost on a CPU, NOT what a cluster with one accelerator per rank does.
  The collective counts and bytes are the figures that carry over.
"""

from __future__ import annotations

import argparse
import collections
import math
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import hf_deepseek as D  # noqa: E402

from specdec import LLM, SamplingParams  # noqa: E402
from specdec.distributed import TPContext  # noqa: E402
from specdec.dp import DPContext  # noqa: E402
from specdec.engine.dp_engine import DPJob, run_data_parallel  # noqa: E402
from specdec.models.heads.deepseek_mtp import DeepseekMtpHead  # noqa: E402
from specdec.models.layers.moe import MoEMLP, attach_parallel  # noqa: E402
from specdec.models.layers.parallel import ExpertPlacement  # noqa: E402
from specdec.models.registry import load_model  # noqa: E402


@dataclass(frozen=True)
class Layout:
    name: str
    dp: int
    tp: int
    ep: bool

    @property
    def ranks(self) -> int:
        return self.dp * self.tp


LAYOUTS = {"one": Layout("1 rank", 1, 1, False), "tp4": Layout("TP=4", 1, 4, False),
           "dp2tp2ep": Layout("DP=2 x TP=2 + EP", 2, 2, True),
           "dp2tp2": Layout("DP=2 x TP=2", 2, 2, False),
           "dp2ep": Layout("DP=2 + EP", 2, 1, True), "tp2": Layout("TP=2", 1, 2, False),
           "dp4ep": Layout("DP=4 + EP", 4, 1, True), "dp4": Layout("DP=4", 4, 1, False)}
DEFAULT_LAYOUTS = "tp4,dp2tp2ep,dp2tp2,dp4ep,dp4"
KINDS = {"all_reduce": "plan AR", "moe_all_gather": "MoE AG",
         "moe_reduce_scatter": "MoE RS", "tp_all_reduce": "TP AR",
         "tp_all_gather": "TP AG", "tp_broadcast": "TP BC", "tp_reduce_scatter": "TP RS"}


# ---- bytes of a step's collectives -------------------------------------------------------
def step_bytes(step: list[tuple[str, tuple[int, ...]]], dtype_size: int, dp: int, tp: int
               ) -> tuple[int, int, float]:
    """(DP-group payload bytes, TP-group payload bytes, ring bytes one rank sends) of one
    step's log (the rule in the module docstring)."""
    dp_b = tp_b = 0
    ring = 0.0
    broadcasts = 0
    for op, shape in step:
        n = math.prod(shape)
        if op == "all_reduce":
            size, group = 4 * n, dp
        elif op == "tp_broadcast":
            size, group = (1 if broadcasts == 0 else 4) * n, tp
            broadcasts += 1
        else:
            size, group = dtype_size * n, dp if op.startswith("moe_") else tp
        if op.startswith("tp_"):
            tp_b += size
        else:
            dp_b += size
        kind = op.removeprefix("tp_").removeprefix("moe_")
        ring += {"all_reduce": 2 * (group - 1) / group * size,
                 "all_gather": (group - 1) * size,
                 "reduce_scatter": (group - 1) / group * size,
                 "broadcast": size}[kind]
    return dp_b, tp_b, ring


# ---- weights of each rank ----------------------------------------------------------------
def weight_bytes(module: torch.nn.Module) -> tuple[int, int]:
    """(bytes of every weight: parameters + routing biases, of which routed experts')."""
    total = routed = 0
    named = list(module.named_parameters()) + [
        (n, b) for n, b in module.named_buffers() if n.endswith("e_score_correction_bias")]
    for name, t in named:
        b = t.numel() * t.element_size()
        total += b
        if ".experts." in name:
            routed += b
    return total, routed


def rank_weights(path: Path, layout: Layout) -> list[dict]:
    """Per world rank: target / MTP layer / routed bytes, as that rank's engine holds them."""
    out = []
    for d in range(layout.dp):
        for t in range(layout.tp):
            tp = TPContext(t, layout.tp)
            target = load_model(path, tp=tp if layout.tp > 1 else None,
                                experts=ExpertPlacement.of(tp, d, layout.dp, layout.ep))
            head = DeepseekMtpHead.load(path, target)
            attach_parallel(target, DPContext(d, layout.dp))
            attach_parallel(head, DPContext(d, layout.dp))
            (tb, tr), (hb, hr) = weight_bytes(target), weight_bytes(head)
            experts = sorted(int(e) for m in target.modules() if isinstance(m, MoEMLP)
                             for e in m.experts)
            out.append({"target": tb, "head": hb, "routed": tr, "head_routed": hr,
                        "experts": sorted(set(experts))})
    return out


# ---- runs -------------------------------------------------------------------------------
@dataclass
class Measured:
    tokens: list[list[int]]
    drafted: int
    accepted: int
    tok_s: float
    decode: list[list[tuple[str, tuple[int, ...]]]]  # rank 0's decode steps' logs
    moe_fwd: float | None = None  # one rank: MoE layer forwards per decode step


def one_rank(kw: dict, prompts, params) -> Measured:
    """The reference: one in-process engine, stepped by hand to count the MoE layer
    forwards of each step (forward hooks on the target's and the MTP layer's MoE layers)."""
    llm = LLM(**kw)
    calls = [0]
    models = [llm.runner.target, getattr(llm.runner.proposer, "head", None)]
    for m in (mod for model in models if model is not None for mod in model.modules()):
        if isinstance(m, MoEMLP):
            m.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    reqs = [llm.add_request(p, params, request_id=str(i)) for i, p in enumerate(prompts)]
    per_step = []
    while True:
        before = calls[0]
        if llm.step() is None:
            break
        per_step.append(calls[0] - before)
    from specdec.engine.outputs import RequestOutput
    outs = [RequestOutput.of(r, llm.tokenizer) for r in reqs]
    steps = llm.steps
    tokens = sum(sum(s.new_tokens.values()) for s in steps)
    return Measured([o.token_ids for o in outs], sum(sum(o.num_drafted) for o in outs),
                    sum(sum(o.num_accepted) for o in outs),
                    tokens / sum(s.seconds for s in steps), [],
                    statistics.mean(per_step[1:]))


def from_run(run) -> Measured:
    tokens = sum(sum(s.new_tokens.values()) for r in run.ranks for s in r.steps)
    seconds = max(sum(s.seconds for s in r.steps) for r in run.ranks)
    return Measured([o.token_ids for o in run.outputs],
                    sum(sum(o.num_drafted) for o in run.outputs),
                    sum(sum(o.num_accepted) for o in run.outputs), tokens / seconds,
                    run.ranks[0].collectives[1:-1])


def expected_tp_all_reduces(path: Path) -> tuple[int, int]:
    """(the target's TP all-reduces per forward: 1 (embedding) + one per attention layer
    (o_proj) + one per dense MLP (down_proj) + one per MoE layer (its single reduction), its
    MoE layers). An MTP-layer forward adds 3 (its embedding, o_proj and MoE)."""
    target = load_model(path)
    layers = target.model.layers
    return 1 + len(layers) + len(layers), sum(isinstance(m, MoEMLP) for m in target.modules())


# ---- tables -----------------------------------------------------------------------------
def fmt_bytes(b: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def print_table(title: str, header: list[str], rows: list[list[str]], markdown: bool) -> None:
    if markdown:
        print(f"\n{title}\n")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
        return
    from rich.console import Console
    from rich.table import Table
    table = Table(title=title)
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i < 2 else "right")
    for row in rows:
        table.add_row(*row)
    Console(width=200).print(table)


COLLECTIVE_HEADER = ["layout", "method", *[KINDS[k] for k in KINDS if k != "tp_reduce_scatter"],
                     "MoE fwd", "check", "same every step", "DP B/step", "TP B/step",
                     "ring B/rank", "== 1 rank", "tok/s", "vs 1 rank"]
WEIGHT_HEADER = ["layout", "ranks", "target", "MTP layer", "total", "/ unsharded",
                 "target routed / all", "MTP routed / all", "target experts held"]


def collect(path: Path, layouts: list[Layout], prompts: list, max_tokens: int, k: int
            ) -> tuple[list[list[str]], list[list[str]]]:
    """Run one rank and every layout (plain and padded MTP K=k) on the folder ``path``;
    -> (collective rows, weight rows) under COLLECTIVE_HEADER / WEIGHT_HEADER."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    methods = {"plain": None,
               f"MTP K={k}": {"method": "deepseek_mtp", "num_speculative_tokens": k}}
    base = dict(model=str(path), max_num_seqs=len(prompts), max_model_len=256)
    one = {m: one_rank(dict(base, speculative_config=s), prompts, params)
           for m, s in methods.items()}
    runs = {}
    for lay in layouts:
        jobs = [DPJob(dict(base, speculative_config=s, tensor_parallel_size=lay.tp,
                           enable_expert_parallel=lay.ep), prompts, params)
                for s in methods.values()]
        got = run_data_parallel(jobs, lay.dp, engine=LLM, tp_size=lay.tp, timeout=600)
        for m, run in zip(methods, got):
            runs[lay.name, m] = from_run(run)
    tp_ar, target_moe = expected_tp_all_reduces(path)

    rows = []
    for lay in [LAYOUTS["one"]] + layouts:
        for m in methods:
            ref = one[m]
            if lay.name == "1 rank":
                rows.append([lay.name, m] + ["0"] * 6 + [f"{ref.moe_fwd:g}", "-", "-", "0",
                                                        "0", "0", "-", f"{ref.tok_s:.0f}",
                                                        "1.00x"])
                continue
            r = runs[lay.name, m]
            counts = [collections.Counter(op for op, _ in step) for step in r.decode]
            mean = {kind: statistics.mean(c[kind] for c in counts) for kind in KINDS}
            same = all(c == counts[0] for c in counts)
            ok = mean["tp_reduce_scatter"] == 0
            if lay.dp > 1:  # the plan's one all-reduce, 2 DP collectives per MoE forward
                ok &= mean["all_reduce"] == 1
                ok &= mean["moe_all_gather"] == mean["moe_reduce_scatter"] == ref.moe_fwd
            if lay.tp > 1:  # + one TP reduction per MoE layer; 3 + 1 per MTP-layer forward
                mtp_fwd = ref.moe_fwd - target_moe
                ok &= mean["tp_all_reduce"] == tp_ar + 3 * mtp_fwd
                ok &= mean["tp_all_gather"] == 1 + mtp_fwd
            b = [step_bytes(step, 4, lay.dp, lay.tp) for step in r.decode]
            dp_b, tp_b, ring = (statistics.mean(x[i] for x in b) for i in range(3))
            equal = (r.tokens, r.drafted, r.accepted) == (ref.tokens, ref.drafted, ref.accepted)
            rows.append([lay.name, m,
                         *[f"{mean[kind]:g}" for kind in KINDS if kind != "tp_reduce_scatter"],
                         f"{ref.moe_fwd:g}", "ok" if ok else "MISMATCH",
                         f"yes ({len(counts)})" if same else f"no ({len(counts)})",
                         fmt_bytes(dp_b), fmt_bytes(tp_b), fmt_bytes(ring),
                         "yes" if equal else "NO", f"{r.tok_s:.0f}",
                         f"{r.tok_s / ref.tok_s:.2f}x"])

    weights = {lay.name: rank_weights(path, lay) for lay in [LAYOUTS["one"]] + layouts}
    full = weights["1 rank"][0]
    full_total = full["target"] + full["head"]
    wrows = []
    for name, per_rank in weights.items():
        top = max(per_rank, key=lambda w: w["target"] + w["head"])
        total = top["target"] + top["head"]
        held = sorted({len(w["experts"]) for w in per_rank})
        wrows.append([name, str(len(per_rank)), fmt_bytes(top["target"]),
                      fmt_bytes(top["head"]), fmt_bytes(total), f"{total / full_total:.3f}",
                      f"{top['routed'] / full['routed']:.3f}",
                      f"{top['head_routed'] / full['head_routed']:.3f}",
                      ",".join(map(str, held))])
    return rows, wrows


def measure(args) -> None:
    torch.set_num_threads(1)
    layouts = [LAYOUTS[name] for name in args.layouts.split(",")]
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist()
               for n in (5, 9, 17, 7, 12, 4, 20, 6)[:args.prompts]]
    with tempfile.TemporaryDirectory() as tmp:
        path = D.build_deepseek_v3_mtp(Path(tmp) / "deepseek_v3_mtp")
        rows, wrows = collect(path, layouts, prompts, args.max_tokens, args.k)
        target = load_model(path)
        n_moe = sum(isinstance(m, MoEMLP) for m in target.modules())
        full_t, _ = weight_bytes(target)
        full_h, _ = weight_bytes(DeepseekMtpHead.load(path, target))
        copies = 2 * target.lm_head.weight.numel() * target.lm_head.weight.element_size()
    print(f"tiny DeepSeek-V3 + MTP layer (hidden 64, 3 layers: 1 dense + {n_moe} MoE of 4 "
          f"routed experts + 1 shared, 4 MLA heads), CPU float32, {len(prompts)} prompts x "
          f"{args.max_tokens} tokens, greedy; world rank 0's decode steps")
    print_table("collectives per decode step (mean over the decode steps), bytes, tokens/s",
                COLLECTIVE_HEADER, rows, args.markdown)
    print_table(f"weight bytes of the largest rank (float32; unsharded: target "
                f"{fmt_bytes(full_t)} + MTP layer {fmt_bytes(full_h)}, of which its own "
                f"embedding and head copies {fmt_bytes(copies)})", WEIGHT_HEADER, wrows,
                args.markdown)
    print("\ntok/s: CPU, one torch thread per rank, the ranks of a layout sharing this "
          "machine's cores; they price gloo collectives on a CPU, not a cluster.")


# ---- the paper plan for DeepSeek-R1 on 16 accelerators ------------------------------------
# Shapes: transformers' DeepseekV3Config defaults (its docstring: the defaults are
# DeepSeek-V3's), equal to the published config.json (R1 has the same architecture keys);
# deepseek-ai/DeepSeek-V3 README_WEIGHTS.md: 671B main model, 1 MTP module of 11.5B unique
# parameters, fp8 e4m3 weights with a float32 weight_scale_inv per 128 x 128 block. As
# published, the fp8 tensors are the attention / MLP / expert projections; embeddings, lm_head,
# norms, routers and eh_proj are bf16; the MTP layer ships its own embed_tokens and
# shared_head.head copies (model.layers.61.*, bf16).
R1 = dict(vocab=129280, hidden=7168, inter=18432, moe_inter=2048, layers=61, dense=3,
          heads=128, q_lora=1536, kv_lora=512, rope=64, nope=128, v=128, experts=256,
          shared=1, block=128)
# assumptions (datasheet figures, not measured here): SXM parts, bf16 dense tensor peak
GPUS = {"H100": dict(hbm=80e9, bw=3.35e12, flops=989e12),
        "H200": dict(hbm=141e9, bw=4.8e12, flops=989e12)}
NVLINK, IB = 450e9, 50e9  # B/s one way per GPU: NVLink 4 inside a node of 8, a 400 Gb/s NIC
LATENCY = 20e-6  # s per collective: an assumed small-message floor
PLAN_LAYOUTS = [("TP16 (the seed)", 1, 16, False), ("DP2 x TP8 + EP", 2, 8, True),
                ("DP16 + EP", 16, 1, True)]


def r1_parts(D: int, T: int, ep: bool, c=R1) -> dict[str, dict[str, float]]:
    """Parameters one rank holds, as this project places them, by part -> {'fp8': .., 'bf16':
    ..}: MLA split by heads (q_b_proj, kv_b_proj, o_proj / T; q_a_proj, kv_a_proj_with_mqa
    and the norms replicated), dense MLP, shared expert, embedding and lm_head / T, routers
    replicated, routed experts E/(D*T) whole (EP) or E/D at width 1/T (the same count); the
    MTP layer placed the same way (``heads.deepseek_mtp``: MLA by heads, its experts E/(D*T),
    shared expert / T, ``eh_proj``, norms and router replicated), its own embedding and head
    copies / T (vocab-parallel, as the target's)."""
    h, E, L = c["hidden"], c["experts"], c["layers"]
    moe = L - c["dense"]
    q_b = c["heads"] * (c["nope"] + c["rope"]) * c["q_lora"]
    kv_b = c["heads"] * (c["nope"] + c["v"]) * c["kv_lora"]
    o = h * c["heads"] * c["v"]
    latent = c["q_lora"] * h + (c["kv_lora"] + c["rope"]) * h
    mla_norms = c["q_lora"] + c["kv_lora"]
    expert = 3 * h * c["moe_inter"]
    shared = c["shared"] * expert
    return {
        "attention": {"fp8": L * (latent + (q_b + kv_b + o) / T), "bf16": L * (mla_norms + 2 * h)},
        "dense MLP": {"fp8": c["dense"] * 3 * h * c["inter"] / T, "bf16": 0},
        "routed experts": {"fp8": moe * expert * E / (D * T), "bf16": 0},
        "shared experts + routers": {"fp8": moe * shared / T, "bf16": moe * E * h},
        "embedding": {"fp8": 0, "bf16": c["vocab"] * h / T},
        "lm_head + norm": {"fp8": 0, "bf16": c["vocab"] * h / T + h},
        "MTP layer": {"fp8": latent + (q_b + kv_b + o) / T + expert * E / (D * T) + shared / T,
                      "bf16": 2 * h * h + E * h + mla_norms + 5 * h},
        "MTP embedding": {"fp8": 0, "bf16": c["vocab"] * h / T},
        "MTP head": {"fp8": 0, "bf16": c["vocab"] * h / T},
    }


def plan_rows(K: int, reqs: int = 32, ctx: int = 4096, c=R1) -> tuple[list, list]:
    """(memory rows, step rows) of the paper plan for padded MTP K."""
    h, L, V = c["hidden"], c["layers"], c["vocab"]
    moe = L - c["dense"]
    cache_row = (c["kv_lora"] + c["rope"]) * 2  # bf16 latent + rope key per token per layer
    scale = 1 + 4 / c["block"] ** 2  # fp8 byte + a float32 scale per 128 x 128 block
    mem, step = [], []
    for name, D, T, ep in PLAN_LAYOUTS:
        parts = r1_parts(D, T, ep)
        mtp = ("MTP layer", "MTP embedding", "MTP head")
        tgt = {k: v for k, v in parts.items() if k not in mtp}
        params = sum(v["fp8"] + v["bf16"] for v in tgt.values())
        mparams = sum(parts[k]["fp8"] + parts[k]["bf16"] for k in mtp)
        ckpt = sum(v["fp8"] * scale + 2 * v["bf16"] for v in parts.values())
        resident = 2 * (params + mparams)  # the loader dequantizes fp8 into the bf16 model
        B = reqs // D  # requests per DP rank, each at ctx tokens
        cache = B * ctx * cache_row * (L + 1)  # + the MTP layer's own latent cache
        fits = " / ".join(f"{g}: {'yes' if resident + cache < s['hbm'] else 'no'}"
                          for g, s in GPUS.items())
        held_fp8 = "yes" if ckpt + cache < GPUS["H100"]["hbm"] else "no"
        mem.append([name, f"{params / 1e9:.1f}B + {mparams / 1e9:.1f}B",
                    f"{ckpt / 1e9:.0f} GB", f"{2 * params / 1e9:.0f} GB",
                    f"{2 * mparams / 1e9:.1f} GB", f"{cache / 1e9:.2f} GB", fits, held_fp8])
        # one decode step: the target on N = B(K+1) tokens, the MTP layer on N then K-1 x B
        N = B * (K + 1)
        mtp_tokens = [N] + [B] * (K - 1)
        # HBM reads: every weight but the embedding tables (rows only) per forward -- the MoE
        # runs every local expert on every gathered token -- and the rank's latent cache
        t_w = 2 * (params - parts["embedding"]["bf16"])
        m_w = 2 * (parts["MTP layer"]["fp8"] + parts["MTP layer"]["bf16"]
                   + parts["MTP head"]["bf16"])
        reads = t_w + K * m_w + B * ctx * cache_row * (L + 1)
        # FLOPs: 2 x params x tokens; the routed experts on the D x tokens gathered
        routed = parts["routed experts"]["fp8"]
        per_tok = t_w / 2 - routed
        m_routed = c["experts"] / (D * T) * 3 * h * c["moe_inter"]
        flops = 2 * (per_tok * N + routed * D * N) + sum(
            2 * ((m_w / 2 - m_routed) * n + m_routed * D * n) for n in mtp_tokens)
        # collectives: DP per MoE forward an all-gather and a reduce-scatter (+ the plan's
        # all-reduce); TP per target forward 1 + L + dense + MoE all-reduces and the logits'
        # all-gather, per MTP-layer forward 3 all-reduces (its embedding copy, attention,
        # MoE) and its logits' all-gather, and the step's broadcast
        moe_fwd = [N] * moe + mtp_tokens
        dp_ops = 1 + 2 * len(moe_fwd) if D > 1 else 0
        tp_ar = 1 + L + c["dense"] + moe if T > 1 else 0
        tp_ops = tp_ar + 3 * K + (1 + K) + 1 if T > 1 else 0
        dp_bytes = sum(2 * (D - 1) * n * h * 2 for n in moe_fwd)
        tp_bytes = sum(2 * (T - 1) / T * n * h * 2 * ar + (T - 1) * n * V / T * 2
                       for n, ar in [(N, tp_ar)] + [(n, 3) for n in mtp_tokens]) if T > 1 else 0
        tp_bw = NVLINK if T <= 8 else IB  # TP16 spans the 2 nodes
        comm = dp_bytes / IB + tp_bytes / tp_bw + (dp_ops + tp_ops) * LATENCY
        g = GPUS["H200"]
        t_mem, t_flops = reads / g["bw"], flops / g["flops"]
        step.append([name, str(N), f"{dp_ops} + {tp_ops}", fmt_bytes(dp_bytes),
                     fmt_bytes(tp_bytes), f"{comm * 1e3:.1f} ms", fmt_bytes(reads),
                     f"{t_mem * 1e3:.1f} ms", f"{flops / 1e12:.1f} T",
                     f"{t_flops * 1e3:.1f} ms", f"{(max(t_mem, t_flops) + comm) * 1e3:.0f} ms"])
    return mem, step


def plan(args) -> None:
    K = args.k
    full = r1_parts(1, 1, False)
    main_p = sum(v["fp8"] + v["bf16"] for k, v in full.items() if not k.startswith("MTP"))
    print(f"DeepSeek-R1: {main_p / 1e9:.1f}B parameters in the main model, MTP layer "
          f"{(full['MTP layer']['fp8'] + full['MTP layer']['bf16']) / 1e9:.1f}B + its own "
          f"embedding and head copies {2 * full['MTP head']['bf16'] / 1e9:.2f}B")
    mem, step = plan_rows(K)
    print_table("per rank: parameters (target + MTP layer), fp8 checkpoint bytes read, bf16 "
                "bytes held (target, MTP layer), MLA cache (32 requests x 4096 tokens, bf16)",
                ["layout", "params", "fp8 read", "bf16 target", "bf16 MTP", "MLA cache",
                 "fits (bf16 held)", "H100 if fp8 were held"], mem, args.markdown)
    print_table(f"one decode step, padded MTP K={K}, 32 requests, per rank (H200)",
                ["layout", "tokens/DP rank", "collectives DP + TP", "DP ring B", "TP ring B",
                 "comm", "HBM reads", "reads time", "FLOPs", "FLOPs time", "bound"],
                step, args.markdown)
    gpus = "; ".join(f"{g} {s['hbm'] / 1e9:.0f} GB, {s['bw'] / 1e12:.2f} TB/s, "
                     f"{s['flops'] / 1e12:.0f} TFLOP/s bf16" for g, s in GPUS.items())
    print(f"\nassumed: {gpus}; NVLink {NVLINK / 1e9:.0f} GB/s one way inside a node of 8, "
          f"{IB / 1e9:.0f} GB/s between the 2 nodes (the DP groups and TP16 span them); "
          f"{LATENCY * 1e6:.0f} us per collective; bound = max(reads, FLOPs) + comm (this "
          "engine does not overlap its collectives with compute).")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("-k", type=int, default=3, help="MTP's num_speculative_tokens")
    ap.add_argument("--layouts", default=DEFAULT_LAYOUTS,
                    help=f"comma-separated, of {sorted(LAYOUTS)} (one rank always runs)")
    ap.add_argument("--plan", action="store_true", help="the R1 paper plan only")
    ap.add_argument("--markdown", action="store_true", help="markdown tables (for the docs)")
    args = ap.parse_args()
    if args.plan:
        plan(args)
    else:
        measure(args)


if __name__ == "__main__":
    main()
