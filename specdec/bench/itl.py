"""ITL (inter-token latency) harness: speculative methods x padded/ragged x K x concurrency.

    specdec bench --quick --out /tmp/bench           # or: python -m specdec.bench.itl --quick ...
    specdec bench --sweep specdec/bench/sweeps/concurrency.yaml --out /tmp/bench
    specdec bench --methods none,eagle3 --modes padded,ragged -k 1,3 --concurrency 1,4,16

How one run is measured: ``concurrency`` requests (held-out prompts of ``prompt_len`` tokens,
``ignore_eos``, exactly ``output_len`` output tokens) are added at t0, then ``llm.step()`` is
called until the engine is idle. A request's *chunks* are the steps that emitted tokens for it,
stamped when ``step()`` returns. Per request: TTFT = first chunk - t0; E2E = last chunk - t0;
TPOT = (E2E - TTFT) / (tokens - 1); every token of a later chunk gets ITL = (chunk gap) /
(tokens in the chunk), so the ITL samples of a request add up to its decode time E2E - TTFT.
Acceptance length = 1 + accepted drafts / verifying steps (the engine's per-request
definition, pooled over requests: a verifying step is one request in one step that verified
drafts). Engines are built once per (method, mode, K), warmed up (warm-up runs excluded), then
the repeats are interleaved across configurations (odd repeats in reverse order) so drift of
the machine hits every configuration alike.

Output: a rich table, ``OUT/results.json`` (every figure, per repeat and pooled, and the
environment) and PNG plots (ITL distribution per config, ITL and throughput vs concurrency).
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from itertools import product
from pathlib import Path

import numpy as np
import torch
import yaml
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from specdec.cli import UsageError, build_llm, speculative_config
from specdec.engine.config import DTYPES
from specdec.engine.llm import DEFAULT_MODEL
from specdec.graphs import BACKENDS
from specdec.models.synthetic import SHAPES, build_synthetic, weight_bytes
from specdec.platform import torch_device
from specdec.engine.sequence import SamplingParams
from specdec.train import data

SCHEMA_VERSION = 2
METHODS = ("none", "mtp", "eagle", "eagle3", "torchair-mtp")
MODES = ("padded", "ragged")
# sweep keys -> defaults (the full CPU sweep); lists are crossed, scalars apply to every config
DEFAULT_SWEEP = dict(methods=list(METHODS), modes=list(MODES), k=[1, 3, 5],
                     concurrency=[1, 4, 16, 64], prompt_len=[64], output_len=[64], repeats=3,
                     warmup=1, seed=0, temperature=0.0, model=None, dp=1, device="cpu",
                     dtype="float32", synthetic=None, graph_backend="eager")
# --quick: every method and mode at one K, two concurrencies, short requests (< 2 min on 2 CPUs)
# (about 1 min on the embedded default, most of it compiling the torchair-mtp graphs in warm-up)
QUICK_SWEEP = dict(DEFAULT_SWEEP, k=[3], concurrency=[1, 4], prompt_len=[32], output_len=[32],
                   repeats=4)
LIST_KEYS = ("methods", "modes", "k", "concurrency", "prompt_len", "output_len")
DEFINITIONS = {
    "itl": "per output token after a request's first chunk: (gap to the previous chunk) / "
           "(tokens in the chunk); per request they add up to e2e - ttft",
    "ttft": "first chunk arrival - t0 (all requests of a run are added at t0)",
    "e2e": "last chunk arrival - t0",
    "tpot": "(e2e - ttft) / (output tokens - 1), per request",
    "output_tokens_per_s": "output tokens of the run / (last step end - t0)",
    "acceptance_length": "1 + accepted / verify_steps, pooled over requests; verify_steps = "
                         "(request, step) pairs that verified drafts (the engine's "
                         "RequestOutput.acceptance_length, pooled)",
    "acceptance_rate": "accepted / drafted tokens",
    "per_position_acceptance_rate": "accepted[j] / drafted[j] for draft position j",
    "drafter_share": "sum of drafter host wall time / sum of step wall time (on an accelerator "
                     "the drafter's launch time only)",
    "step_over_weight_read": "mean step time / weights.weight_read_ms (CUDA): 1 = the floor",
    "host_syncs_per_step": "host-device syncs inside the device part of a step (padded: 0), "
                           "from one separate untimed pass per config with the check on",
    "collectives_per_step": "DP collectives issued per step",
    "dp": "with dp > 1 each rank runs its share of the requests (round-robin); its chunk "
          "arrivals are its cumulative step seconds; steps and requests are pooled over ranks",
    "spread": "std / min / max / p10 / p90 over repeats of the per-repeat value",
    "warnings": "load on the machine during the run, and padded/ragged pairs whose "
                "difference in mean ITL is smaller than the spread of either",
}


@dataclass(frozen=True)
class BenchConfig:
    method: str  # one of METHODS
    padded: bool
    k: int  # 0 for "none"
    concurrency: int
    prompt_len: int
    output_len: int

    @property
    def mode(self) -> str:
        return "-" if self.method == "none" else ("padded" if self.padded else "ragged")

    @property
    def engine_key(self) -> tuple[str, bool, int]:
        return self.method, self.padded, self.k

    @property
    def name(self) -> str:
        head = "none" if self.method == "none" else f"{self.method}-{self.mode}-k{self.k}"
        return f"{head}-c{self.concurrency}-p{self.prompt_len}-o{self.output_len}"


# ---- sweep ------------------------------------------------------------------------------------
def load_sweep(path: str | Path) -> dict:
    """A sweep file: JSON, or YAML (``.yaml`` / ``.yml``) with the keys of DEFAULT_SWEEP."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"--sweep={str(path)!r} does not exist")
    text = path.read_text()
    try:
        data = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise UsageError(f"--sweep={str(path)!r} does not parse: {e}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--sweep={str(path)!r} must hold a mapping, got {type(data).__name__}")
    return data


def check_sweep(sweep: dict) -> dict:
    """Fill defaults and validate; -> the sweep with every key of DEFAULT_SWEEP."""
    unknown = sorted(set(sweep) - set(DEFAULT_SWEEP))
    if unknown:
        raise UsageError(f"unknown sweep keys {unknown}; allowed: {sorted(DEFAULT_SWEEP)}")
    s = {**DEFAULT_SWEEP, **sweep}
    for key in LIST_KEYS:
        v = s[key]
        s[key] = v = list(v) if isinstance(v, (list, tuple)) else [v]
        if not v:
            raise UsageError(f"sweep {key}=[] is empty; give at least one value")
    if bad := [m for m in s["methods"] if m not in METHODS]:
        raise UsageError(f"sweep methods={bad} not supported; allowed: {list(METHODS)}")
    if bad := [m for m in s["modes"] if m not in MODES]:
        raise UsageError(f"sweep modes={bad} not supported; allowed: {list(MODES)}")
    for key, low in (("k", 1), ("concurrency", 1), ("prompt_len", 1), ("output_len", 2)):
        if bad := [v for v in s[key] if not isinstance(v, int) or isinstance(v, bool) or v < low]:
            raise UsageError(f"sweep {key}={bad}: allowed ints >= {low}")
    for key, low in (("repeats", 1), ("warmup", 0), ("dp", 1)):
        v = s[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise UsageError(f"sweep {key}={v!r}: allowed an int >= {low}")
    if not isinstance(s["temperature"], (int, float)) or s["temperature"] < 0:
        raise UsageError(f"sweep temperature={s['temperature']!r}: allowed a number >= 0")
    if s["dtype"] not in DTYPES:
        raise UsageError(f"sweep dtype={s['dtype']!r}: allowed {sorted(DTYPES)}")
    if s["synthetic"] is not None and s["synthetic"] not in SHAPES:
        raise UsageError(f"sweep synthetic={s['synthetic']!r}: allowed {sorted(SHAPES)}")
    if s["synthetic"] is not None and (s["model"] is not None or s["dp"] > 1):
        raise UsageError("sweep synthetic= builds its own target: give no model, and dp=1")
    if s["graph_backend"] not in BACKENDS:
        raise UsageError(f"sweep graph_backend={s['graph_backend']!r}: allowed {BACKENDS}")
    try:  # before anything is written: a CPU-only torch asked for cuda is one line
        torch_device(s["device"])
    except (ValueError, TypeError) as e:
        raise UsageError(f"sweep device={s['device']!r}: {e}") from None
    return s


def expand(sweep: dict) -> list[BenchConfig]:
    """The configurations of a checked sweep; "none" has no mode or K, so it appears once per
    (concurrency, prompt_len, output_len)."""
    configs = []
    for method, mode, k in product(sweep["methods"], sweep["modes"], sweep["k"]):
        for c, p, o in product(sweep["concurrency"], sweep["prompt_len"], sweep["output_len"]):
            cfg = (BenchConfig("none", True, 0, c, p, o) if method == "none"
                   else BenchConfig(method, mode == "padded", k, c, p, o))
            if cfg not in configs:
                configs.append(cfg)
    return configs


# ---- prompts ----------------------------------------------------------------------------------
class PromptSource:
    """Deterministic prompts: windows of the held-out stdlib files (``specdec.train.data`` split
    rule) when the model has a tokenizer, else seeded random ids."""

    def __init__(self, tokenizer, vocab_size: int):
        self.vocab_size = vocab_size
        self.stream = None
        if tokenizer is not None:
            _, held = data.list_files()
            self.stream = data.encode_stream(tokenizer, data.read_texts(held))
        self.kind = "held-out stdlib files" if self.stream is not None else "random token ids"

    def prompts(self, n: int, length: int, seed: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(seed)
        if self.stream is None or len(self.stream) <= length:
            return torch.randint(1, self.vocab_size, (n, length), generator=gen).tolist()
        return data.sample_windows(self.stream, n, length, gen).tolist()


# ---- one run ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReqStats:
    """What a finished request contributes (from an engine Request or a RequestOutput)."""

    request_id: str
    num_output: int
    drafted: list[int]  # per draft position
    accepted: list[int]  # per draft position
    verify_steps: int  # steps in which this request verified drafts


def measure(llm, prompts: list[list[int]], output_len: int, temperature: float) -> dict:
    """Run one batch to completion on a single-rank engine; -> raw figures (see run_figures)."""
    params = SamplingParams(max_tokens=output_len, temperature=temperature, ignore_eos=True)
    first_step = len(llm.steps)
    t0 = time.perf_counter()
    reqs = [llm.add_request(p, params) for p in prompts]
    times = []  # end of each step, seconds after t0
    while llm.step() is not None:
        times.append(time.perf_counter() - t0)
    stats = [ReqStats(r.request_id, len(r.output_token_ids), r.num_drafted, r.num_accepted,
                      r.num_steps_decoding) for r in reqs]
    return run_figures(stats, llm.steps[first_step:], times)


def run_figures(reqs: list[ReqStats], steps: list, times: list[float]) -> dict:
    """Raw figures of one run (seconds). ``steps[i]`` (a StepRecord) ended ``times[i]`` s after
    t0, the moment all requests were added; a request's chunks are its steps with new tokens."""
    chunks = {r.request_id: [] for r in reqs}  # request id -> [(arrival, tokens)]
    for rec, t in zip(steps, times, strict=True):
        for rid, n in rec.new_tokens.items():
            if n and rid in chunks:
                chunks[rid].append((t, n))
    itl, ttft, e2e, tpot = [], [], [], []
    for r in reqs:
        arrivals = chunks[r.request_id]
        ttft.append(arrivals[0][0])
        e2e.append(arrivals[-1][0])
        tpot.append((e2e[-1] - ttft[-1]) / max(r.num_output - 1, 1))
        for (prev, _), (t, n) in zip(arrivals, arrivals[1:]):
            itl += [(t - prev) / n] * n
    k = max((len(r.drafted) for r in reqs), default=0)
    return dict(
        wall_s=max(times, default=0.0), output_tokens=sum(r.num_output for r in reqs),
        itl_s=itl, ttft_s=ttft, e2e_s=e2e, tpot_s=tpot,
        decode_time_s=sum(b - a for a, b in zip(ttft, e2e)),
        num_steps=len(steps), step_seconds=sum(s.seconds for s in steps),
        draft_seconds=sum(s.draft_seconds for s in steps),
        host_syncs=sum(s.host_syncs for s in steps) if steps and all(
            s.host_syncs is not None for s in steps) else None,
        collectives=sum(s.collectives for s in steps),
        verify_steps=sum(r.verify_steps for r in reqs),
        drafted=[sum(r.drafted[j] for r in reqs if j < len(r.drafted)) for j in range(k)],
        accepted=[sum(r.accepted[j] for r in reqs if j < len(r.accepted)) for j in range(k)])


def merge_ranks(raws: list[dict]) -> dict:
    """One run's figures from its DP ranks' figures: requests and steps pooled, wall = slowest."""
    k = max(len(r["drafted"]) for r in raws)
    out = dict(wall_s=max(r["wall_s"] for r in raws),
               drafted=[sum(r["drafted"][j] for r in raws if j < len(r["drafted"])) for j in range(k)],
               accepted=[sum(r["accepted"][j] for r in raws if j < len(r["accepted"]))
                         for j in range(k)])
    for key in ("itl_s", "ttft_s", "e2e_s", "tpot_s"):
        out[key] = [x for r in raws for x in r[key]]
    for key in ("output_tokens", "decode_time_s", "num_steps", "step_seconds", "draft_seconds",
                "collectives", "verify_steps"):
        out[key] = sum(r[key] for r in raws)
    syncs = [r["host_syncs"] for r in raws]
    out["host_syncs"] = None if None in syncs else sum(syncs)
    return out


def measure_dp(jobs: list, dp_size: int) -> list[dict]:
    """Run DPJobs on ``dp_size`` rank processes (one spawn); -> raw figures per job. A rank's
    chunk arrival times are its cumulative step seconds (each rank starts at its t0)."""
    from specdec.engine.dp_engine import run_data_parallel
    raws = []
    for run in run_data_parallel(jobs, dp_size):
        per_rank = []
        for rank in run.ranks:
            stats = [ReqStats(o.request_id, len(o.token_ids), o.num_drafted, o.num_accepted,
                              o.num_decode_steps) for o in rank.outputs.values()]
            times = np.cumsum([s.seconds for s in rank.steps]).tolist()
            per_rank.append(run_figures(stats, rank.steps, times))
        raws.append(merge_ranks(per_rank))
    return raws


def _ms(xs) -> list[float]:
    return [1e3 * x for x in xs]


def _dist(xs_ms: list[float]) -> dict:
    a = np.asarray(xs_ms, dtype=np.float64)
    if a.size == 0:
        return dict(n=0, mean=None, p50=None, p90=None, p99=None, min=None, max=None)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return dict(n=int(a.size), mean=float(a.mean()), p50=float(p50), p90=float(p90),
                p99=float(p99), min=float(a.min()), max=float(a.max()))


def repeat_figures(raw: dict) -> dict:
    """The JSON record of one repeat (latencies in ms)."""
    drafted, accepted, vs = sum(raw["drafted"]), sum(raw["accepted"]), raw["verify_steps"]
    steps = max(raw["num_steps"], 1)
    return dict(
        itl_ms=_ms(raw["itl_s"]), ttft_ms=_ms(raw["ttft_s"]), e2e_ms=_ms(raw["e2e_s"]),
        tpot_ms=_ms(raw["tpot_s"]), decode_time_s=raw["decode_time_s"], wall_s=raw["wall_s"],
        output_tokens=raw["output_tokens"], output_tokens_per_s=raw["output_tokens"] / raw["wall_s"],
        num_steps=raw["num_steps"], step_seconds=raw["step_seconds"],
        draft_seconds=raw["draft_seconds"], collectives=raw["collectives"],
        collectives_per_step=raw["collectives"] / steps,
        drafter_share=raw["draft_seconds"] / raw["step_seconds"] if raw["step_seconds"] else 0.0,
        num_drafted=raw["drafted"], num_accepted=raw["accepted"], verify_steps=vs,
        acceptance_length=1.0 + sum(raw["accepted"]) / vs if vs else 1.0,
        acceptance_rate=accepted / drafted if drafted else None,
        itl_mean_ms=float(np.mean(_ms(raw["itl_s"]))) if raw["itl_s"] else None)


def _spread(values: list) -> dict:
    v = np.asarray([x for x in values if x is not None], dtype=np.float64)
    if v.size == 0:
        return dict(mean=None, std=None, min=None, max=None, p10=None, p90=None)
    p10, p90 = np.percentile(v, [10, 90])
    return dict(mean=float(v.mean()), std=float(v.std(ddof=1)) if v.size > 1 else 0.0,
                min=float(v.min()), max=float(v.max()), p10=float(p10), p90=float(p90))


def summarize(reps: list[dict]) -> dict:
    """Pool the repeats of one configuration; ``spread`` = variation of per-repeat values."""
    pool = lambda key: [x for r in reps for x in r[key]]  # noqa: E731
    k = max(len(r["num_drafted"]) for r in reps)
    drafted = [sum(r["num_drafted"][j] for r in reps if j < len(r["num_drafted"])) for j in range(k)]
    accepted = [sum(r["num_accepted"][j] for r in reps if j < len(r["num_accepted"]))
                for j in range(k)]
    vs = sum(r["verify_steps"] for r in reps)
    steps = sum(r["num_steps"] for r in reps)
    step_s = sum(r["step_seconds"] for r in reps)
    return dict(
        itl_ms=_dist(pool("itl_ms")), tpot_ms=_dist(pool("tpot_ms")),
        ttft_ms=_dist(pool("ttft_ms")), e2e_ms=_dist(pool("e2e_ms")),
        output_tokens_per_s=float(np.mean([r["output_tokens_per_s"] for r in reps])),
        output_tokens=sum(r["output_tokens"] for r in reps),
        decode_time_s=sum(r["decode_time_s"] for r in reps),
        num_steps=steps, ms_per_step=1e3 * step_s / max(steps, 1),
        collectives=sum(r["collectives"] for r in reps),
        collectives_per_step=sum(r["collectives"] for r in reps) / max(steps, 1),
        drafter_share=sum(r["draft_seconds"] for r in reps) / step_s if step_s else 0.0,
        num_drafted=sum(drafted), num_accepted=sum(accepted), verify_steps=vs,
        num_drafted_per_position=drafted, num_accepted_per_position=accepted,
        acceptance_length=1.0 + sum(accepted) / vs if vs else 1.0,
        acceptance_rate=sum(accepted) / sum(drafted) if sum(drafted) else None,
        per_position_acceptance_rate=[a / d if d else None for a, d in zip(accepted, drafted)],
        spread={key: _spread([r[key] for r in reps]) for key in (
            "itl_mean_ms", "output_tokens_per_s", "acceptance_length", "drafter_share")})


# ---- the sweep --------------------------------------------------------------------------------
def environment(sweep: dict) -> dict:
    import matplotlib
    import rich  # noqa: F401
    from importlib.metadata import PackageNotFoundError, version

    def ver(pkg):
        try:
            return version(pkg)
        except PackageNotFoundError:
            return None

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    device = sweep["device"]
    return dict(
        python=sys.version.split()[0], platform=platform.platform(), machine=platform.machine(),
        processor=platform.processor() or None, cpu_count=os.cpu_count(),
        torch=torch.__version__, numpy=np.__version__, matplotlib=matplotlib.__version__,
        specdec=ver("specdec"), git_commit=commit, device=device,
        device_name=(torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu"),
        torch_threads=torch.get_num_threads(), torch_interop_threads=torch.get_num_interop_threads(),
        omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
        load_average_1_5_15min=list(os.getloadavg()),
        time=time.strftime("%Y-%m-%dT%H:%M:%S%z"))


@dataclass
class Engine:
    """One (method, mode, K): its LLM(...) arguments and, built once, the single-rank LLM (used
    to run when dp == 1; under DP it validates the config and each rank builds its own)."""

    kwargs: dict
    llm: object


def synthetic_model(sweep: dict, spec: dict | None) -> dict:
    """LLM(target=, draft_head=) of the sweep's synthetic shape (zero weights: every draft is
    accepted, the real cost per step), or {} for a model folder."""
    if sweep["synthetic"] is None:
        return {}
    method = spec["method"] if spec else None
    target, heads = build_synthetic(sweep["synthetic"], dtype=DTYPES[sweep["dtype"]],
                                    device=sweep["device"], init="zeros",
                                    methods=(method,) if method else ())
    return dict(target=target, draft_head=heads.get(method))


def build_engines(sweep: dict, configs: list[BenchConfig]) -> tuple[dict, dict]:
    """One engine per (method, mode, K), sized for its largest config; -> (engines, skip reasons)."""
    engines, skipped = {}, {}
    for key in dict.fromkeys(c.engine_key for c in configs):
        method, padded, k = key
        mine = [c for c in configs if c.engine_key == key]
        conc = max(c.concurrency for c in mine)
        spec = speculative_config(method, k, padded)
        # padded steps run through the graph backend; ragged ones cannot (host-read shapes)
        backend = sweep["graph_backend"] if padded and "graph_mode" not in (spec or {}) else None
        kwargs = dict(seed=sweep["seed"], device=sweep["device"], max_num_seqs=conc,
                      check_host_syncs=False, dtype=sweep["dtype"], graph_backend=backend,
                      max_model_len=max(c.prompt_len + c.output_len for c in mine) + k + 1,
                      max_num_batched_tokens=max(256, conc * (k + 1)))
        try:
            llm = build_llm(sweep["model"], spec, dp=1, **kwargs, **synthetic_model(sweep, spec))
        except UsageError as e:
            skipped[key] = str(e)
            continue
        kwargs.update(model=str(sweep["model"] or DEFAULT_MODEL), speculative_config=spec)
        engines[key] = Engine(kwargs, llm)
    return engines, skipped


def run_round(sweep: dict, engines: dict, configs: list[BenchConfig], source: PromptSource,
              prompt_seed: int, on_done) -> list[dict]:
    """Run each config once, in the given order (one DP spawn for all under DP); -> raw figures
    in that order. ``on_done(config)`` is called as each finishes."""
    def job(c):
        prompts = source.prompts(c.concurrency, c.prompt_len, prompt_seed)
        params = SamplingParams(max_tokens=c.output_len, temperature=sweep["temperature"],
                                ignore_eos=True)
        return prompts, params

    if sweep["dp"] == 1:
        raws = []
        for c in configs:
            prompts, params = job(c)
            try:
                raws.append(measure(engines[c.engine_key].llm, prompts, c.output_len,
                                    sweep["temperature"]))
            except Exception as e:  # one failing config must not lose the sweep
                raws.append(dict(error=f"{type(e).__name__}: {e}"))
            on_done(c)
        return raws
    from specdec.engine.dp_engine import DPJob
    jobs = [DPJob(engines[c.engine_key].kwargs, *job(c)) for c in configs]
    raws = measure_dp(jobs, sweep["dp"])
    for c in configs:
        on_done(c)
    return raws


def check_syncs(sweep: dict, engines: dict, configs: list[BenchConfig],
                source: PromptSource) -> dict:
    """One separate, untimed pass per config with the host-sync check on (never the timed
    runs): {config: host syncs per step, or an error string}."""
    checked = {c.engine_key: replace(e, kwargs={**e.kwargs, "check_host_syncs": True})
               for c in configs for e in [engines[c.engine_key]]}
    for e in checked.values():
        if e.llm is not None:
            e.llm.check_host_syncs = True
    try:
        raws = run_round(sweep, checked, configs, source, 20_000 + sweep["seed"], lambda c: None)
    finally:
        for e in checked.values():
            if e.llm is not None:
                e.llm.check_host_syncs = False
    return {c: None if "error" in raw else raw["host_syncs"] / max(raw["num_steps"], 1)
            for c, raw in zip(configs, raws)}


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a 256 MiB device-to-device copy (read + write counted); CUDA only."""
    x = torch.empty(1 << 28, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize(device)
    return 2 * x.numel() * 10 / (time.perf_counter() - t)


def weight_read(sweep: dict, engines: dict) -> dict:
    """The target's weight bytes and, on CUDA, the time to read them once at the device's
    copy bandwidth (measured once per run): the floor of a decode step."""
    if not engines or next(iter(engines.values())).llm.data_parallel_size > 1:
        return dict(bytes=None, bandwidth_bytes_per_s=None, weight_read_ms=None)
    nbytes = weight_bytes(next(iter(engines.values())).llm.target)
    device = torch.device(sweep["device"])
    bw = copy_bandwidth(device) if device.type == "cuda" else None
    return dict(bytes=nbytes, bandwidth_bytes_per_s=bw,
                weight_read_ms=1e3 * nbytes / bw if bw else None)


def run_sweep(sweep: dict, console: Console | None = None) -> dict:
    """Build, warm up, run the interleaved repeats; -> the results dict (see DEFINITIONS)."""
    console = console or Console(stderr=True)
    start = time.perf_counter()
    load_start = list(os.getloadavg())
    phases = {}
    torch.manual_seed(sweep["seed"])
    configs = expand(sweep)
    engines, skipped = build_engines(sweep, configs)
    ok = [c for c in configs if c.engine_key in engines]
    source = None
    if engines:
        llm = next(iter(engines.values())).llm
        source = PromptSource(llm.tokenizer, llm.target.config.vocab_size)
    phases["build_s"] = time.perf_counter() - start
    reps: dict[BenchConfig, list[dict]] = {c: [] for c in ok}
    failed: dict[BenchConfig, str] = {}  # config -> its first error
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("bench", total=len(ok) * (sweep["warmup"] + sweep["repeats"]))
        t = time.perf_counter()
        for w in range(sweep["warmup"]):  # excluded from the figures
            bar.update(task, description=f"warm-up {w + 1}/{sweep['warmup']}")
            run_round(sweep, engines, ok, source, 10_000 + sweep["seed"] + w, lambda c: bar.advance(task))
        phases["warmup_s"] = time.perf_counter() - t
        t = time.perf_counter()
        for r in range(sweep["repeats"]):
            order = ok if r % 2 == 0 else ok[::-1]  # interleaved: drift hits every config alike
            bar.update(task, description=f"repeat {r + 1}/{sweep['repeats']}")
            raws = run_round(sweep, engines, order, source, sweep["seed"] + r, lambda c: bar.advance(task))
            for c, raw in zip(order, raws):
                if "error" in raw:
                    failed.setdefault(c, raw["error"])
                else:
                    reps[c].append(repeat_figures(raw))
        phases["measure_s"] = time.perf_counter() - t
    t = time.perf_counter()
    syncs = check_syncs(sweep, engines, [c for c in ok if c not in failed], source) if ok else {}
    phases["sync_check_s"] = time.perf_counter() - t
    results = []
    for c in configs:
        entry = dict(name=c.name, method=c.method, mode=c.mode, k=c.k, concurrency=c.concurrency,
                     prompt_len=c.prompt_len, output_len=c.output_len)
        if c in failed:
            entry.update(status="failed", error=failed[c])
        elif c in reps:
            summary = summarize(reps[c])
            summary["host_syncs_per_step"] = syncs[c]
            entry.update(status="ok", summary=summary, repeats=reps[c])
        else:
            entry.update(status="skipped", reason=skipped[c.engine_key])
        results.append(entry)
    phases["sweep_s"] = time.perf_counter() - start
    env = dict(environment(sweep), load_average_at_start_1_5_15min=load_start)
    weights = weight_read(sweep, engines)
    for c in results:
        if c["status"] == "ok" and weights["weight_read_ms"]:
            c["summary"]["step_over_weight_read"] = (c["summary"]["ms_per_step"]
                                                     / weights["weight_read_ms"])
    return dict(schema_version=SCHEMA_VERSION, definitions=DEFINITIONS, environment=env,
                weights=weights, sweep={**sweep, "model": str(sweep["model"] or DEFAULT_MODEL)},
                prompt_source=source.kind if source else None, phase_seconds=phases,
                configs=results, warnings=load_warnings(env) + comparison_warnings(results))


def load_warnings(env: dict) -> list[str]:
    """A busy machine inflates every latency: say so when the 1-minute load average, at the
    start or the end, exceeds half the CPUs."""
    cpus = env["cpu_count"] or 1
    load = max(env["load_average_at_start_1_5_15min"][0], env["load_average_1_5_15min"][0])
    if load <= cpus / 2:
        return []
    return [f"load average {load:.1f} on {cpus} CPUs ({env['torch_threads']} torch threads): "
            "other processes competed for the CPUs; latencies are not comparable to an idle "
            "machine's"]


def comparison_warnings(configs: list[dict]) -> list[str]:
    """A padded/ragged pair whose mean-ITL difference is within either one's spread (the std
    of its per-repeat means) is not a measured difference."""
    by_key = {(c["method"], c["k"], c["concurrency"], c["prompt_len"], c["output_len"],
               c["mode"]): c for c in configs if c["status"] == "ok"}
    out = []
    for key, padded in by_key.items():
        ragged = by_key.get(key[:-1] + ("ragged",))
        if key[-1] != "padded" or ragged is None:
            continue
        a, b = (c["summary"]["spread"]["itl_mean_ms"] for c in (padded, ragged))
        diff = abs(a["mean"] - b["mean"])
        spread = max(a["std"], b["std"])
        if spread > diff:
            out.append(f"{padded['method']} K={key[1]} conc={key[2]}: padded vs ragged mean ITL "
                       f"differ by {diff:.3f} ms, less than the spread over repeats "
                       f"({spread:.3f} ms std): no measured difference")
    return out


# ---- report -----------------------------------------------------------------------------------
def _f(x, fmt=".2f") -> str:
    return "-" if x is None else format(x, fmt)


TABLE_COLUMNS = ("method", "mode", "K", "conc", "ITL mean", "p99", "TTFT", "tok/s", "acc len",
                 "acc rate per position", "syncs")  # every other figure is in results.json
WRAPPING = ("method", "acc rate per position")  # may wrap; the numbers never do


def results_table(results: dict) -> Table:
    sw = results["sweep"]
    t = Table(title=f"ITL sweep: {sw['repeats']} repeats, dp={sw['dp']}, latencies in ms",
              caption="tok/s: mean over repeats; acc len = 1 + accepted / verifying steps; "
                      "syncs: host-device syncs per step; all figures in results.json",
              header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in TABLE_COLUMNS:
        t.add_column(col, justify="left" if col in ("method", "mode") else "right",
                     no_wrap=col not in WRAPPING)
    for c in results["configs"]:
        if c["status"] != "ok":
            continue
        s = c["summary"]
        itl = s["itl_ms"]
        t.add_row(
            c["method"], c["mode"], str(c["k"] or "-"), str(c["concurrency"]), _f(itl["mean"]),
            _f(itl["p99"]), _f(s["ttft_ms"]["mean"], ".1f"), f"{s['output_tokens_per_s']:.0f}",
            _f(s["acceptance_length"]),
            " ".join(_f(x) for x in s["per_position_acceptance_rate"]) or "-",
            _f(s["host_syncs_per_step"], ".1f"))
    return t


def skipped_lines(results: dict) -> list[str]:
    """One line per skipped (method, mode, K) with the reason, and per failed config with its
    error (the other configs were still measured)."""
    seen = {}
    for c in results["configs"]:
        if c["status"] == "skipped":
            seen.setdefault((c["method"], c["mode"], c["k"]), c["reason"])
    lines = [f"skipped {m} {mode} K={k}: {reason}" for (m, mode, k), reason in seen.items()]
    return lines + [f"failed {c['name']}: {c['error']}" for c in results["configs"]
                    if c["status"] == "failed"]


def series_style(method: str, mode: str, hue: int, palette) -> dict:
    """Padded and ragged differ in colour (dark / light shade of the method's hue), line and
    marker; the no-speculation baseline is black."""
    ragged = mode == "ragged"
    return dict(color="black" if method == "none" else palette[2 * hue + ragged],
                linestyle="--" if ragged else "-", marker="s" if ragged else "o")


def percentile_band(spreads: list[dict]) -> tuple[list[float], list[list[float]]]:
    """-> (means, [below, above]): the asymmetric p10-p90 band of the per-repeat values as
    errorbar offsets, e.g. mean 5, p10 4, p90 9 -> below 1, above 4 (never a negative
    offset, so never a bar below the smallest repeat)."""
    mid = [sp["mean"] if sp["mean"] is not None else np.nan for sp in spreads]
    below = [max(m - sp["p10"], 0.0) if sp["p10"] is not None else 0.0
             for m, sp in zip(mid, spreads)]
    above = [max(sp["p90"] - m, 0.0) if sp["p90"] is not None else 0.0
             for m, sp in zip(mid, spreads)]
    return mid, [below, above]


def write_plots(results: dict, out: Path) -> list[str]:
    """ITL distribution per config; ITL and output tok/s vs concurrency (padded solid, ragged
    dashed). -> file names written under ``out``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [c for c in results["configs"] if c["status"] == "ok"]
    if not ok:
        return []
    names = []
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(ok) + 1.5))
    data = [[x for r in c["repeats"] for x in r["itl_ms"]] or [float("nan")] for c in ok]
    ax.boxplot(data, orientation="horizontal", showfliers=True, flierprops=dict(markersize=2))
    ax.set_yticks(range(1, len(ok) + 1), [c["name"] for c in ok], fontsize=7)
    ax.invert_yaxis()  # first config on top, as in the table
    ax.set_xlabel("ITL per output token (ms)")
    ax.set_title("ITL distribution per configuration (all repeats)")
    if all(len(d) and np.nanmin(d) > 0 for d in data) and np.nanmax(
            [np.nanmax(d) for d in data]) / np.nanmin([np.nanmin(d) for d in data]) > 30:
        ax.set_xscale("log")
    fig.tight_layout()
    fig.savefig(out / "itl_distribution.png", dpi=110)
    plt.close(fig)
    names.append("itl_distribution.png")

    groups: dict[tuple, list[dict]] = {}
    for c in ok:
        groups.setdefault((c["method"], c["k"], c["prompt_len"], c["output_len"], c["mode"]),
                          []).append(c)
    palette = plt.get_cmap("tab20").colors  # pairs: dark (padded), light (ragged) of a hue
    for fname, ylabel, key in (("itl_vs_concurrency.png", "mean ITL (ms)", "itl_mean_ms"),
                               ("throughput_vs_concurrency.png", "output tokens/s",
                                "output_tokens_per_s")):
        fig, ax = plt.subplots(figsize=(8, 5))
        hues = {}
        for (method, k, p, o, mode), cs in groups.items():
            cs = sorted(cs, key=lambda c: c["concurrency"])
            hue = hues.setdefault((method, k), len(hues) % 10)
            label = "none" if method == "none" else f"{method} k{k} {mode}"
            label += f" p{p}/o{o}" if len({(g[2], g[3]) for g in groups}) > 1 else ""
            mid, band = percentile_band([c["summary"]["spread"][key] for c in cs])
            ax.errorbar([c["concurrency"] for c in cs], mid, yerr=band, capsize=3, label=label,
                        **series_style(method, mode, hue, palette))
        ax.set_xscale("log", base=2)
        concs = sorted({c["concurrency"] for c in ok})
        ax.set_xticks(concs, [str(c) for c in concs])
        ax.minorticks_off()
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{ylabel} vs concurrency (bars: p10-p90 over repeats)\n"
                     "padded: solid, circles; ragged: dashed, squares", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        names.append(fname)
    return names


# ---- command line -----------------------------------------------------------------------------
def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {s!r}") from None


def _words(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="the quick sweep: every method and mode, K=3, concurrency 1,4, "
                        "32-token prompts, 32 output tokens, 4 repeats (< 2 min on 2 CPUs)")
    p.add_argument("--sweep", metavar="FILE", help="YAML or JSON sweep file (keys: "
                   + ", ".join(DEFAULT_SWEEP) + "); flags given on the command line override it")
    p.add_argument("--out", default="bench-results", metavar="DIR",
                   help="where results.json and the PNGs go (default: bench-results)")
    p.add_argument("--methods", type=_words, help=f"comma list of {','.join(METHODS)}")
    p.add_argument("--modes", type=_words, help="comma list of padded,ragged")
    p.add_argument("-k", "--num-speculative-tokens", type=_ints, dest="k",
                   help="comma list of K values")
    p.add_argument("--concurrency", type=_ints, help="comma list, e.g. 1,4,16,64")
    p.add_argument("--prompt-len", type=_ints, dest="prompt_len", help="comma list of prompt tokens")
    p.add_argument("--output-len", type=_ints, dest="output_len", help="comma list of output tokens")
    p.add_argument("--repeats", type=int)
    p.add_argument("--warmup", type=int, help="warm-up runs per configuration (excluded)")
    p.add_argument("--seed", type=int)
    p.add_argument("--temperature", type=float, help="0 = greedy (default)")
    p.add_argument("--model", metavar="PATH", help="target folder (default: the embedded model)")
    p.add_argument("--dp", type=int, help="data-parallel ranks (default 1)")
    p.add_argument("--device", help="cpu (default) or cuda")
    p.add_argument("--dtype", help=f"one of {', '.join(DTYPES)} (default float32)")
    p.add_argument("--synthetic", help=f"a synthetic target instead of --model: "
                   f"{', '.join(SHAPES)} (zero weights, heads to match: every draft accepted)")
    p.add_argument("--graph-backend", dest="graph_backend",
                   help=f"step wrapper of padded steps: {', '.join(BACKENDS)} (default eager; "
                        "ragged steps always run eager)")


def sweep_from_args(args) -> dict:
    sweep = dict(QUICK_SWEEP) if args.quick else {}
    if args.sweep:
        sweep.update(load_sweep(args.sweep))
    for key in DEFAULT_SWEEP:
        v = getattr(args, key, None)
        if v is not None:
            sweep[key] = v
    return check_sweep(sweep)


def run_from_args(args) -> int:
    sweep = sweep_from_args(args)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out={args.out!r} cannot be created: {e}") from None
    start = time.perf_counter()
    results = run_sweep(sweep, Console(stderr=True))
    t = time.perf_counter()
    results["plots"] = write_plots(results, out)
    results["phase_seconds"]["plots_s"] = time.perf_counter() - t
    results["wall_seconds"] = time.perf_counter() - start
    (out / "results.json").write_text(json.dumps(results, indent=1))
    console = Console()
    console.print(results_table(results))
    for line in results["warnings"]:
        console.print(f"warning: {line}", markup=False, highlight=False, soft_wrap=True)
    for line in skipped_lines(results):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    console.print(f"wrote {out / 'results.json'} and {', '.join(results['plots']) or 'no plots'} "
                  f"in {results['wall_seconds']:.1f} s", markup=False, highlight=False,
                  soft_wrap=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    from specdec.cli import OneLineParser
    p = OneLineParser(prog="specdec bench", description=__doc__.split("\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run_from_args(args)
    except UsageError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
