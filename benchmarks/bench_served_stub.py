"""Which process caps ``specdec serve``: the served path over a stub engine, in CPU per token.

    python -m benchmarks.bench_served_stub [--concurrency 1,16,64] [--output-len 64]
        [--tokens-per-step 4] [--duration 8] [--client-procs 1]

Starts ``specdec serve --stub-engine N`` (``specdec/entrypoints/stub_engine.py``: the real
engine process loop and pipe, the real API process, a step that takes no model time and gives
each request N tokens) and drives it with ``specdec bench serve``'s client at each
concurrency: a calibration run (2 requests per stream, at least 16; also the warm-up), then
enough requests for about ``--duration`` seconds. Per concurrency: client-side tokens/s, the
engine's steps/s (``/metrics``), and per process (engine, API, client: /proc and getrusage
deltas over the run) CPU seconds per 1000 tokens and its share of one core. The busiest
process per token is the likely cap, if it is near 100% of a core; if the shares add up to
the machine's cores, the machine is. ``--client-procs N`` splits the streams over N forked
client processes (their CPU is summed), to see what the server does when one client process
is not the limit.
"""

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import resource
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from specdec.bench import serve as bench_serve
from specdec.bench.sweep import PromptSource
from specdec.flags import ints

PROCESSES = ("engine", "api", "client")
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


def machine_busy_s() -> float:
    """CPU seconds all CPUs spent busy (not idle or waiting for I/O), from /proc/stat."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) * TICK_S


def engine_pid(api_pid: int) -> int:
    """The engine process: the API process's child that multiprocessing forked (the same
    command line) or spawned, not the resource tracker it may start beside it."""
    own = Path(f"/proc/{api_pid}/cmdline").read_bytes()
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
            if ppid == api_pid and (cmdline == own or b"--multiprocessing-fork" in cmdline):
                return int(entry.name)
        except (OSError, ValueError):
            continue
    raise RuntimeError(f"no engine process under the API process {api_pid}")


def cpu_now(pids: dict) -> dict:
    """CPU seconds so far: the engine and API processes, and this process with its waited-for
    children (the forked clients)."""
    me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return dict(engine=proc_cpu_s(pids["engine"]), api=proc_cpu_s(pids["api"]),
                client=me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime,
                machine=machine_busy_s())


def _client_process(conn, url: str, body: dict, prompts: list, concurrency: int) -> None:
    conn.send(asyncio.run(bench_serve.run_once(url, body, prompts, concurrency, None, 0)))


def run_clients(url: str, body: dict, prompts: list, concurrency: int,
                procs: int) -> tuple[list[dict], float, float]:
    """``bench_serve.run_once`` in this process, or its streams split over ``procs`` forked
    processes; -> (request records, first send, last arrival)."""
    procs = min(procs, concurrency)
    if procs == 1:
        return asyncio.run(bench_serve.run_once(url, body, prompts, concurrency, None, 0))
    ctx = multiprocessing.get_context("fork")
    jobs = []
    for i in range(procs):
        recv, send = ctx.Pipe(duplex=False)
        share = concurrency // procs + (i < concurrency % procs)
        job = ctx.Process(target=_client_process, args=(send, url, body, prompts[i::procs], share))
        job.start()
        jobs.append((job, recv))
    results = [recv.recv() for _, recv in jobs]
    for job, _ in jobs:
        job.join()
    return ([r for records, _, _ in results for r in records],
            min(r[1] for r in results), max(r[2] for r in results))


def measure(url: str, body: dict, prompts: list[list[int]], concurrency: int, pids: dict,
            client_procs: int = 1) -> dict:
    """One run of the client; -> tokens/s, engine steps, CPU seconds per process."""
    before, cpu0, t0 = bench_serve.scrape(url), cpu_now(pids), time.perf_counter()
    records, start, end = run_clients(url, body, prompts, concurrency, client_procs)
    wall, cpu1 = time.perf_counter() - t0, cpu_now(pids)
    steps = bench_serve.engine_deltas(before, bench_serve.scrape(url))["num_steps"]
    tokens = sum(r["output_tokens"] for r in records)
    return dict(concurrency=concurrency, client_procs=min(client_procs, concurrency),
                requests=len(records), tokens=tokens, seconds=end - start,
                tokens_per_s=tokens / (end - start), steps=steps,
                steps_per_s=steps / (end - start), cpu_wall_s=wall,
                cpu_s={p: cpu1[p] - cpu0[p] for p in PROCESSES},
                machine_busy_cores=(cpu1["machine"] - cpu0["machine"]) / wall, records=records)


@contextlib.contextmanager
def stub_server(tokens_per_step: int, max_num_seqs: int, max_model_len: int):
    """``specdec serve --stub-engine``; yields (base URL, {"api", "engine": pid})."""
    proc, url = bench_serve.launch(["--stub-engine", str(tokens_per_step), "--max-num-seqs",
                                    str(max_num_seqs), "--max-model-len", str(max_model_len)])
    try:
        yield url, dict(api=proc.pid, engine=engine_pid(proc.pid))
    finally:
        bench_serve.stop(proc)


def stream_body(url: str, output_len: int) -> dict:
    """A streamed completion of exactly ``output_len`` tokens, counted per chunk."""
    return dict(model=bench_serve.served_model(url), max_tokens=output_len, temperature=0.0,
                stream=True, ignore_eos=True,
                stream_options=dict(include_usage=True, continuous_usage_stats=True))


def bench(opts: dict, console: Console) -> list[dict]:
    """Launch the stub server, measure each concurrency, stop it; -> one row per concurrency."""
    from specdec.engine.llm import DEFAULT_MODEL
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(Path(DEFAULT_MODEL) / "tokenizer.json"))
    source = PromptSource(tok, tok.get_vocab_size())
    rows = []
    with stub_server(opts["tokens_per_step"], max(opts["concurrency"]),
                     opts["prompt_len"] + opts["output_len"] + 1) as (url, pids):
        body = stream_body(url, opts["output_len"])
        for c in opts["concurrency"]:
            n = opts["requests"]
            for seed in (c, 0):  # the calibration run (also the warm-up), then the measured one
                prompts = source.prompts(n or max(16, 2 * c), opts["prompt_len"], seed)
                row = measure(url, body, prompts, c, pids, opts["client_procs"])
                n = n or max(c, round(opts["duration"] * row["tokens_per_s"]
                                      / opts["output_len"]))
            rows.append(row)
            console.print(f"concurrency {c}: {n} requests, {rows[-1]['tokens_per_s']:,.0f} "
                          "tok/s", highlight=False)
    return rows


def busiest(row: dict) -> str:
    """The process with the most CPU per token, and its share of one core."""
    name = max(PROCESSES, key=lambda p: row["cpu_s"][p])
    return f"{name} ({100 * row['cpu_s'][name] / row['cpu_wall_s']:.0f}% of a core)"


def table(rows: list[dict], tokens_per_step: int) -> Table:
    t = Table(title=f"specdec serve, stub engine ({tokens_per_step} tokens/step), "
                    f"{os.cpu_count()} CPUs", caption="per process: CPU ms per token "
                    "(= s per 1000 tokens), % of one core")
    for col in ("streams", "clients", "requests", "tok/s", "steps/s", *PROCESSES):
        t.add_column(col, justify="right")
    for r in rows:
        cpu = [f"{1e3 * r['cpu_s'][p] / r['tokens']:.3f} "
               f"{100 * r['cpu_s'][p] / r['cpu_wall_s']:.0f}%" for p in PROCESSES]
        t.add_row(str(r["concurrency"]), str(r["client_procs"]), str(r["requests"]),
                  f"{r['tokens_per_s']:,.0f}", f"{r['steps_per_s']:,.0f}", *cpu)
    return t


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=ints, default=[1, 16, 64], help="comma list of streams")
    p.add_argument("--output-len", type=int, default=64, help="tokens per request")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens")
    p.add_argument("--tokens-per-step", type=int, default=4, help="stub tokens per step")
    p.add_argument("--duration", type=float, default=8.0, help="seconds per concurrency")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per concurrency (default: about --duration seconds' worth)")
    p.add_argument("--client-procs", type=int, default=1, metavar="N",
                   help="split the streams over N forked client processes (default 1: this "
                        "process, as specdec bench serve)")
    opts = vars(p.parse_args(argv))
    console = Console(width=max(Console().width, 100))
    rows = bench(opts, console)
    console.print(table(rows, opts["tokens_per_step"]))
    for r in rows:
        console.print(f"{r['concurrency']} streams: busiest per token: {busiest(r)}; the "
                      f"three: {sum(r['cpu_s'].values()) / r['cpu_wall_s']:.2f} cores; the "
                      f"machine: {r['machine_busy_cores']:.2f} of {os.cpu_count()} cores busy",
                      highlight=False)


if __name__ == "__main__":
    main()
