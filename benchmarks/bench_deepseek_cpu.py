"""CPU ms per generated token of the tiny DeepSeek-V3 (MLA + MoE, tests/hf_deepseek.py) with
its MTP layer: plain greedy vs ``deepseek_mtp`` K=1, 2, 3, and the latent KV cache's bytes per
token vs a GQA cache of the same width.

Every configuration is one ``LLM`` built up front; each is warmed up once (not timed), then
the repeats run round-robin over the configurations (side by side in the same run, so a slow
patch of the machine hits them all) and the median is reported. ms/token = wall time of one
``generate`` of all prompts / tokens generated. The weights are random (the MTP layer too), so
acceptance is ~0 there (the overhead); the cycle folder's exact MTP layer (every draft
accepted) shows the other end. accept = accepted / drafted.

    python -m benchmarks.bench_deepseek_cpu [--prompts 4] [--max-tokens 32] [--repeats 5]
        [--threads 1]

Needs transformers (the folder is written by transformers' DeepseekV3ForCausalLM, as the
tests build it).
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import hf_deepseek as D  # noqa: E402

from specdec import LLM  # noqa: E402
from specdec.attention import KVCacheSpec  # noqa: E402
from specdec.models import load_model  # noqa: E402


FOLDERS = {"deepseek_v3_mtp": "random MTP layer (drafts ~never accepted: the overhead)",
           "deepseek_v3_mtp_cycle": "exact MTP layer on a cycle target (every draft accepted)"}


def kv_table(path: Path, dtype: torch.dtype) -> list[str]:
    import json
    cfg = json.loads((path / "config.json").read_text())
    model = load_model(path)
    specs = model.kv_cache_spec()
    mla = sum(s.bytes_per_token(dtype) for s in specs)
    qk_head_dim = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    gqa_layer = KVCacheSpec(cfg["num_key_value_heads"], qk_head_dim).bytes_per_token(dtype)
    gqa = gqa_layer * len(specs)
    mla_label = (f"MLA latent (1 x {specs[0].head_dim} per layer: kv_lora_rank "
                 f"{cfg['kv_lora_rank']} + rope {cfg['qk_rope_head_dim']})")
    gqa_label = f"GQA, same width ({cfg['num_key_value_heads']} kv heads x {qk_head_dim}, K and V)"
    return [
        f"KV cache bytes/token ({dtype}, {len(specs)} target layers):",
        f"  {mla_label:<62}{mla:6d}",
        f"  {gqa_label:<62}{gqa:6d}  ({gqa / mla:.1f}x)",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist()
               for n in [5, 17, 40, 29, 11, 63, 8, 50][:args.prompts]]
    print(f"tiny DeepSeek-V3 + MTP (hidden 64, 3 layers, MLA, MoE), CPU, "
          f"{torch.get_num_threads()} thread(s), {len(prompts)} prompts x {args.max_tokens} "
          f"tokens, greedy, median of {args.repeats} (warm-up excluded)")
    with tempfile.TemporaryDirectory() as tmp:
        for folder, label in FOLDERS.items():
            path = D.BUILDERS[folder](Path(tmp) / folder)
            print(f"\n{label} ({folder}):")
            bench(path, prompts, args)
        print()
        for dtype in (torch.float32, torch.bfloat16):
            print("\n".join(kv_table(path, dtype)))


def bench(path: Path, prompts: list, args) -> None:
    configs = {"plain": None}
    for k in (1, 2, 3):
        configs[f"deepseek_mtp K={k}"] = {"method": "deepseek_mtp", "num_speculative_tokens": k}
    llms = {name: LLM(model=str(path), max_num_seqs=len(prompts), max_model_len=256,
                      speculative_config=spec) for name, spec in configs.items()}

    def run(llm):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, max_tokens=args.max_tokens, ignore_eos=True)
        return time.perf_counter() - t0, outs

    first = {name: run(llm)[1] for name, llm in llms.items()}  # warm-up, not timed
    times = {name: [] for name in llms}
    for _ in range(args.repeats):  # round-robin: the configurations side by side
        for name, llm in llms.items():
            times[name].append(run(llm)[0])
    tokens = sum(len(o.token_ids) for o in first["plain"])
    plain_ms = statistics.median(times["plain"]) / tokens * 1e3
    print(f"  {'config':<20}{'ms/token':>10}{'vs plain':>10}{'accept':>8}{'accept len':>12}"
          f"{'== plain':>10}")
    for name in llms:
        outs = first[name]
        ms = statistics.median(times[name]) / tokens * 1e3
        drafted = sum(sum(o.num_drafted) for o in outs)
        accepted = sum(sum(o.num_accepted) for o in outs)
        rate = f"{accepted / drafted:.2f}" if drafted else "-"
        alen = f"{statistics.mean(o.acceptance_length for o in outs):.2f}" if drafted else "-"
        same = [o.token_ids for o in outs] == [o.token_ids for o in first["plain"]]
        print(f"  {name:<20}{ms:>10.2f}{plain_ms / ms:>9.2f}x{rate:>8}{alen:>12}{str(same):>10}")


if __name__ == "__main__":
    main()
