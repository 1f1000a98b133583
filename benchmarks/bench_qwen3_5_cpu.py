"""CPU ms per generated token of the tiny Qwen3.5 (gated DeltaNet + gated attention,
tests/hf_qwen3_5.py) with its MTP layer: plain greedy vs ``mtp`` K=1, 2, 3; and what the hybrid
cache keeps: state bytes per request (1 + K slots of conv window + recurrent state per linear
layer) vs KV bytes per token (the full-attention layers).

Every configuration is one ``LLM`` built up front, warmed up once (not timed), then the
repeats run round-robin over the configurations and the median is reported. ms/token = wall
time of one ``generate`` of all prompts / tokens generated. The random MTP layer is ~never
accepted (the overhead); the near-cycle folder's MTP layer is right where the target stays on
its cycle (some positions). accept = accepted / drafted.

    python -m benchmarks.bench_qwen3_5_cpu [--prompts 4] [--max-tokens 32] [--repeats 5]
        [--threads 1]

Needs transformers (the folders are written by transformers' Qwen3_5ForCausalLM, as the tests
build them).
"""

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import hf_qwen3_5 as Q

from benchmarks import mtp_cpu
from specdec.linear_state import LinearStateSpec
from specdec.models import load_model

FOLDERS = {"qwen3_5_mtp": "random MTP layer (drafts ~never accepted: the overhead)",
           "qwen3_5_mtp_cycle": "MTP layer sometimes right (near-cycle target)"}


def cache_table(path: Path, dtype: torch.dtype) -> list[str]:
    """KV bytes per token of the full layers vs state bytes per request of the linear ones."""
    specs = load_model(path).kv_cache_spec()
    linear = [s for s in specs if isinstance(s, LinearStateSpec)]
    kv = sum(s.bytes_per_token(dtype) for s in specs)
    slot = sum(s.bytes_per_slot() for s in linear)
    lines = [(f"cache ({dtype} KV, float32 state; {len(specs) - len(linear)} full + "
              f"{len(linear)} linear layers):"),
             f"  {'KV bytes per token (full-attention layers)':<52}{kv:8d}",
             (f"  {'state bytes per request slot (linear layers)':<52}{slot:8d}"
              f"  (= the KV of {slot / kv:.0f} tokens)")]
    for k in (0, 1, 3):
        lines.append(f"  {f'state bytes per request, K={k} ({1 + k} slots)':<52}"
                     f"{(1 + k) * slot:8d}")
    return lines


def main() -> None:
    args = mtp_cpu.parse_args(__doc__)
    prompts = mtp_cpu.prompts(args.prompts)
    print(f"tiny Qwen3.5 + MTP (hidden 64, layers [linear, full, linear]), CPU, "
          f"{torch.get_num_threads()} thread(s), {len(prompts)} prompts x {args.max_tokens} "
          f"tokens, greedy, median of {args.repeats} (warm-up excluded)")
    with tempfile.TemporaryDirectory() as tmp:
        for folder, label in FOLDERS.items():
            path = Q.BUILDERS[folder](Path(tmp) / folder / "model")
            print(f"\n{label} ({folder}):")
            mtp_cpu.compare_mtp(path, prompts, "mtp", args.max_tokens, args.repeats)
        print()
        for dtype in (torch.float32, torch.bfloat16):
            print("\n".join(cache_table(path, dtype)))


if __name__ == "__main__":
    main()
