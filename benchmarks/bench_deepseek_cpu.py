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

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import hf_deepseek as D  # noqa: E402

from benchmarks import mtp_cpu  # noqa: E402
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
    args = mtp_cpu.parse_args(__doc__)
    prompts = mtp_cpu.prompts(args.prompts)
    print(f"tiny DeepSeek-V3 + MTP (hidden 64, 3 layers, MLA, MoE), CPU, "
          f"{torch.get_num_threads()} thread(s), {len(prompts)} prompts x {args.max_tokens} "
          f"tokens, greedy, median of {args.repeats} (warm-up excluded)")
    with tempfile.TemporaryDirectory() as tmp:
        for folder, label in FOLDERS.items():
            path = D.BUILDERS[folder](Path(tmp) / folder)
            print(f"\n{label} ({folder}):")
            mtp_cpu.compare_mtp(path, prompts, "deepseek_mtp", args.max_tokens, args.repeats)
        print()
        for dtype in (torch.float32, torch.bfloat16):
            print("\n".join(kv_table(path, dtype)))


if __name__ == "__main__":
    main()
