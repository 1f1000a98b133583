"""ITL harness, the sweep: its configurations and checks, the prompts, one measured run, and
the interleaved repeats over engines built once per (method, mode, K). See
``specdec/bench/itl.py`` for how a run is measured."""

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
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specdec.bench import datasets
from specdec.bench.metrics import DEFINITIONS, repeat_figures, summarize
from specdec.config import TREE_METHODS, SpeculativeConfig
from specdec.engine.config import DTYPES
from specdec.engine.llm import DEFAULT_MODEL, LLM
from specdec.engine.sequence import SamplingParams, Status
from specdec.flags import BENCH_METHODS, UsageError, build_llm, speculative_config
from specdec.graphs import BACKENDS
from specdec.models.synthetic import SHAPES, DraftProfile, synthetic_engine, weight_bytes
from specdec.platform import torch_device
from specdec.train import data

SCHEMA_VERSION = 2
METHODS = BENCH_METHODS  # swept by default
# swept only when named: draft_model needs its folder (the ``draft_model`` sweep key)
OPT_IN_METHODS = ("draft_model",)
MODES = ("padded", "ragged")
# sweep keys -> defaults (the full CPU sweep); lists are crossed, scalars apply to every config
DEFAULT_SWEEP = dict(methods=list(METHODS), modes=list(MODES), k=[1, 3, 5],
                     concurrency=[1, 4, 16, 64], prompt_len=[64], output_len=[64], repeats=3,
                     warmup=1, seed=0, temperature=0.0, model=None, dp=1, device="cpu",
                     dtype="float32", synthetic=None, graph_backend=None,
                     max_num_batched_tokens=None, workload="stdlib", draft_model=None,
                     k_schedule=None, draft_acceptance=None, num_prompts=None, tree=None,
                     dataset_name="random", dataset_path=None,
                     enable_prefix_caching=None, pack_prefill=None)
# --quick: every method and mode at one K, two concurrencies, short requests (its measured
# duration is in docs/benchmarks.md; most of it compiles the torchair-mtp graphs)
QUICK_SWEEP = dict(DEFAULT_SWEEP, k=[3], concurrency=[1, 4], prompt_len=[32], output_len=[32],
                   repeats=4)
LIST_KEYS = ("methods", "modes", "k", "concurrency", "prompt_len", "output_len")
# prompts: "stdlib": held-out stdlib windows; "repeat": a window, then the same window again
# cut off (the shape of a request to rewrite or edit a given code block: the output repeats
# the input, which draft-free lookup predicts)
WORKLOADS = ("stdlib", "repeat")

@dataclass(frozen=True)
class BenchConfig:
    method: str  # one of METHODS
    padded: bool
    k: int  # 0 for "none"
    concurrency: int
    prompt_len: int  # 0: a dataset's prompts (their own lengths)
    output_len: int  # a dataset row's own output length overrides it
    category: str | None = None  # a dataset's category: its rows only

    @property
    def mode(self) -> str:
        return "-" if self.method == "none" else ("padded" if self.padded else "ragged")

    @property
    def engine_key(self) -> tuple[str, bool, int]:
        return self.method, self.padded, self.k

    @property
    def name(self) -> str:
        head = "none" if self.method == "none" else f"{self.method}-{self.mode}-k{self.k}"
        prompts = f"p{self.prompt_len}" if self.prompt_len else "dataset"
        if self.category is not None:
            prompts += f"-{self.category}"
        return f"{head}-c{self.concurrency}-{prompts}-o{self.output_len}"


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
    if bad := [m for m in s["methods"] if m not in METHODS + OPT_IN_METHODS]:
        raise UsageError(f"sweep methods={bad} not supported; allowed: "
                         f"{list(METHODS + OPT_IN_METHODS)}")
    if ("draft_model" in s["methods"]) != (s["draft_model"] is not None):
        raise UsageError(f"sweep draft_model={s['draft_model']!r} (--draft-model DIR: the draft "
                         "model's folder) goes with method draft_model in methods, and only "
                         "with it")
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
    if s["workload"] not in WORKLOADS:
        raise UsageError(f"sweep workload={s['workload']!r}: allowed {list(WORKLOADS)}")
    if s["dtype"] not in DTYPES:
        raise UsageError(f"sweep dtype={s['dtype']!r}: allowed {sorted(DTYPES)}")
    if s["synthetic"] is not None and s["synthetic"] not in SHAPES:
        raise UsageError(f"sweep synthetic={s['synthetic']!r}: allowed {sorted(SHAPES)}")
    if s["synthetic"] is not None and (s["model"] is not None or s["dp"] > 1):
        raise UsageError("sweep synthetic= builds its own target: give no model, and dp=1")
    n = s["num_prompts"]
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise UsageError(f"sweep num_prompts={n!r}: allowed an int >= 1 or none (none: one "
                         "batch of concurrency prompts)")
    if n is not None and s["dp"] > 1:
        raise UsageError("sweep num_prompts= runs a closed loop on one rank: give dp=1")
    if s["draft_acceptance"] is not None:
        check_draft_acceptance(s["draft_acceptance"], max(s["k"]), s["synthetic"],
                               "sweep draft_acceptance")
    budget = s["max_num_batched_tokens"]
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool)
                               or budget < 1):
        raise UsageError(f"sweep max_num_batched_tokens={budget!r}: allowed an int >= 1 or "
                         "none (none: max(256, concurrency x (K + 1)))")
    if s["k_schedule"] is not None:
        check_k_schedule(s["k_schedule"], min(s["k"]))
    if s["tree"] is not None:
        check_tree(s)
    try:
        datasets.check_pair(s["dataset_name"], s["dataset_path"])
    except UsageError as e:
        raise UsageError(f"sweep {e}") from None
    if s["dataset_name"] != "random" and (s["dp"] > 1 or s["synthetic"] is not None):
        raise UsageError(f"sweep dataset_name={s['dataset_name']!r}: its prompts are text for "
                         "the model's tokenizer on one rank: give dp=1 and no synthetic")
    for key, default in (("enable_prefix_caching", "on"),
                         ("pack_prefill", "off on cpu without a head or draft model")):
        if not (s[key] is None or isinstance(s[key], bool)):
            raise UsageError(f"sweep {key}={s[key]!r}: allowed true, false or none (none: "
                             f"LLM's default, {default})")
    if s["graph_backend"] is not None and s["graph_backend"] not in BACKENDS:
        raise UsageError(f"sweep graph_backend={s['graph_backend']!r}: allowed {BACKENDS}")
    try:  # before anything is written: a CPU-only torch asked for cuda is one line
        torch_device(s["device"])
    except (ValueError, TypeError) as e:
        raise UsageError(f"sweep device={s['device']!r}: {e}") from None
    return s


def check_tree(sweep: dict) -> None:
    """The sweep's ``tree`` (speculative_config's draft-tree keys, for every speculative
    engine): the methods that draft trees, padded, each K a depth it holds."""
    tree = sweep["tree"]
    keys = ("speculative_token_tree", "tree_topk", "num_draft_tokens", "tree_score_temperature")
    if not isinstance(tree, dict) or not tree or set(tree) - set(keys):
        raise UsageError(f"sweep tree={tree!r}: allowed a mapping of {list(keys)}")
    drafters = [m for m in sweep["methods"] if m != "none"]
    if bad := [m for m in drafters if m not in (*TREE_METHODS, "suffix")]:
        raise UsageError(f"sweep tree= with methods {bad}: they draft chains; allowed methods "
                         f"{['none', *TREE_METHODS, 'suffix']}")
    if "ragged" in sweep["modes"]:
        raise UsageError("sweep tree= with mode ragged (its drafter drafts chains); allowed "
                         "modes: ['padded']")
    for k, method in product(sweep["k"], drafters):
        try:
            SpeculativeConfig(method, k, **tree)
        except ValueError as e:
            raise UsageError(f"sweep tree= at K={k} with method {method}: {e}") from None


def tree_label(sweep: dict, method: str, k: int) -> str | None:
    """The sweep's draft tree of ``method`` at K ``k`` for a report (e.g. "static 6 drafts
    d3", "suffix 8 drafts d5"); None: chains."""
    if sweep.get("tree") is None or method == "none":
        return None
    return SpeculativeConfig(method, k, **sweep["tree"]).tree.label


def check_k_schedule(schedule, k: int) -> None:
    """The sweep's ``k_schedule`` (speculative_config's num_speculative_tokens_per_batch_size,
    given to every speculative engine) must hold for its smallest K."""
    try:
        SpeculativeConfig("mtp", k, num_speculative_tokens_per_batch_size=schedule)
    except ValueError as e:
        raise UsageError(f"sweep k_schedule: {e} (the sweep's smallest K)") from None


def expand(sweep: dict, categories=(None,)) -> list[BenchConfig]:
    """The configurations of a checked sweep; "none" has no mode or K, so it appears once per
    (concurrency, prompt_len, output_len). With a dataset (prompt_len 0: its own prompts),
    once per its ``categories`` too."""
    configs = []
    lengths = [0] if sweep.get("dataset_name", "random") != "random" else sweep["prompt_len"]
    for method, mode, k in product(sweep["methods"], sweep["modes"], sweep["k"]):
        for c, p, o, cat in product(sweep["concurrency"], lengths, sweep["output_len"],
                                    categories):
            cfg = (BenchConfig("none", True, 0, c, p, o, cat) if method == "none"
                   else BenchConfig(method, mode == "padded", k, c, p, o, cat))
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

    def prompts(self, n: int, length: int, seed: int,
                workload: str = "stdlib") -> list[list[int]]:
        """``n`` prompts of ``length`` tokens; ``workload`` "repeat": a window of 2/3 of the
        length, then its first 1/3 again (``WORKLOADS``)."""
        gen = torch.Generator().manual_seed(seed)
        block = length - length // 3 if workload == "repeat" else length
        if self.stream is None or len(self.stream) <= block:
            windows = torch.randint(1, self.vocab_size, (n, block), generator=gen).tolist()
        else:
            windows = data.sample_windows(self.stream, n, block, gen).tolist()
        return [w + w[:length - block] for w in windows]


class DatasetPrompts:
    """A dataset's single-turn rows as token ids, with their output lengths. Rows whose prompt
    and output (the row's, else the largest ``output_len``) with ``spare`` more tokens (K + 1)
    exceed ``max_model_len`` are left out, each listed in ``left_out`` as ``file:line: why``."""

    def __init__(self, dataset: "datasets.Dataset", tokenizer, max_model_len: int,
                 output_len: int, spare: int):
        self.dataset, self.kind = dataset, dataset.kind
        self.rows: list[tuple[list[int], int | None, str | None]] = []
        self.left_out: list[str] = []
        for conv in dataset.conversations:
            ids = tokenizer.encode(conv.turns[0]).ids
            need = len(ids) + (conv.max_tokens[0] or output_len) + spare
            if need > max_model_len:
                self.left_out.append(f"{conv.where}: {len(ids)} prompt tokens + "
                                     f"{conv.max_tokens[0] or output_len} output + {spare} "
                                     f"> max_model_len {max_model_len}")
            else:
                self.rows.append((ids, conv.max_tokens[0], conv.category))
        if not self.rows:
            raise UsageError(f"--dataset-path={dataset.path!r}: no prompt fits max_model_len "
                             f"{max_model_len} (e.g. {self.left_out[0]})")

    def longest(self, output_len: int) -> int:
        """Tokens of the longest prompt and its output."""
        return max(len(ids) + (mt or output_len) for ids, mt, _ in self.rows)

    @property
    def categories(self) -> list[str | None]:
        """The categories of the rows that fit, in order of first appearance: one run each
        (None: the rows without one; [None] when no row has one)."""
        return list(dict.fromkeys(category for _, _, category in self.rows))

    def prompts(self, n: int, category: str | None, seed: int) -> tuple[list, list[int | None]]:
        """``n`` rows of ``category`` (one of ``categories``), a seeded shuffle (``pick``); ->
        (token ids per prompt, output length per prompt: None = the config's)."""
        chosen = datasets.pick([r for r in self.rows if r[2] == category], n, seed)
        return [ids for ids, _, _ in chosen], [mt for _, mt, _ in chosen]

    def warnings(self) -> list[str]:
        """What was left out of the dataset, and why (the first 3 named)."""
        return self.dataset.warnings() + datasets.left_out_warning(self.kind, "rows too long",
                                                                   self.left_out)


def model_limit(model) -> int:
    """The most tokens the model folder's config allows (max_position_embeddings; 512, the
    engine's default, when it names none)."""
    from specdec.engine.config import DEFAULT_MAX_MODEL_LEN
    from specdec.engine.llm import DEFAULT_MODEL
    cfg = json.loads((Path(model or DEFAULT_MODEL) / "config.json").read_text())
    return cfg.get("max_position_embeddings") or DEFAULT_MAX_MODEL_LEN


def dataset_prompts(sweep: dict) -> DatasetPrompts | None:
    """The sweep's dataset read and tokenized with the model's tokenizer (before any engine is
    built: a malformed file fails first); None for the generated prompts."""
    if sweep["dataset_name"] == "random":
        return None
    from specdec.engine.llm import DEFAULT_MODEL
    from specdec.models.checkpoint import load_tokenizer
    tok = load_tokenizer(sweep["model"] or DEFAULT_MODEL)
    if tok is None:
        raise UsageError(f"sweep dataset_name={sweep['dataset_name']!r}: the model "
                         f"{sweep['model']!r} has no tokenizer.json to encode the prompts")
    data = datasets.load(sweep["dataset_name"], sweep["dataset_path"],
                         lambda text: len(tok.encode(text).ids))
    return DatasetPrompts(data, tok, model_limit(sweep["model"]), max(sweep["output_len"]),
                          max(sweep["k"]) + 1)


# ---- one run ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReqStats:
    """What a finished request contributes (from an engine Request or a RequestOutput)."""

    request_id: str
    num_output: int
    drafted: list[int]  # per draft position
    accepted: list[int]  # per draft position
    verify_steps: int  # steps in which this request verified drafts
    sent: float = 0.0  # when it was added, seconds after the run's t0


def measure(llm, prompts: list[list[int]], output_len: int, temperature: float,
            concurrency: int | None = None, max_tokens: list[int | None] | None = None) -> dict:
    """Run the prompts to completion on a single-rank engine; -> raw figures (see
    run_figures). ``concurrency`` None: one batch, every prompt added at t0; else a closed
    loop, as ``bench serve`` sends them: ``concurrency`` prompts at t0, then one more each time
    one finishes (added before the next step). ``max_tokens``: each prompt's output length
    (None in it: ``output_len``)."""
    def params(n):
        return SamplingParams(max_tokens=n or output_len, temperature=temperature,
                              ignore_eos=True)

    first_step = len(llm.steps)
    waiting = list(zip(prompts, max_tokens or [None] * len(prompts)))
    running, sent = [], []  # sent: (request, seconds after t0)
    limit = concurrency or len(prompts)
    t0 = time.perf_counter()
    times = []  # end of each step, seconds after t0
    while True:
        running = [r for r in running if r.status is not Status.FINISHED]
        while waiting and len(running) < limit:
            prompt, n = waiting.pop(0)
            running.append(llm.add_request(prompt, params(n)))
            sent.append((running[-1], time.perf_counter() - t0))
        if llm.step() is None:
            break
        times.append(time.perf_counter() - t0)
    stats = [ReqStats(r.request_id, len(r.output_token_ids), r.num_drafted, r.num_accepted,
                      r.num_steps_decoding, t) for r, t in sent]
    return run_figures(stats, llm.steps[first_step:], times)


def run_figures(reqs: list[ReqStats], steps: list, times: list[float]) -> dict:
    """Raw figures of one run (seconds). ``steps[i]`` (a StepRecord) ended ``times[i]`` s after
    t0, the run's start; a request's chunks are its steps with new tokens, its TTFT and E2E
    count from when it was sent."""
    chunks = {r.request_id: [] for r in reqs}  # request id -> [(arrival, tokens)]
    for rec, t in zip(steps, times, strict=True):
        for rid, n in rec.new_tokens.items():
            if n and rid in chunks:
                chunks[rid].append((t, n))
    itl, ttft, e2e, tpot = [], [], [], []
    for r in reqs:
        arrivals = chunks[r.request_id]
        ttft.append(arrivals[0][0] - r.sent)
        e2e.append(arrivals[-1][0] - r.sent)
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
        captured_steps=sum(s.captured for s in steps),
        spec_tokens=sum(s.num_spec_tokens for s in steps),
        host_syncs=sum(s.host_syncs for s in steps) if steps and all(
            s.host_syncs is not None for s in steps) else None,
        collectives=sum(s.collectives for s in steps),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in steps),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in steps),
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
                "captured_steps", "spec_tokens", "collectives", "verify_steps",
                "prefix_cache_queries", "prefix_cache_hits"):
        out[key] = sum(r[key] for r in raws)
    syncs = [r["host_syncs"] for r in raws]
    out["host_syncs"] = None if None in syncs else sum(syncs)
    return out


def measure_dp(jobs: list, dp_size: int) -> list[dict]:
    """Run DPJobs on ``dp_size`` rank processes (one spawn); -> raw figures per job. A rank's
    chunk arrival times are its cumulative step seconds (each rank starts at its t0)."""
    from specdec.engine.dp_engine import run_data_parallel
    raws = []
    for run in run_data_parallel(jobs, dp_size, engine=LLM):
        per_rank = []
        for rank in run.ranks:
            stats = [ReqStats(o.request_id, len(o.token_ids), o.num_drafted, o.num_accepted,
                              o.num_decode_steps) for o in rank.outputs.values()]
            times = np.cumsum([s.seconds for s in rank.steps]).tolist()
            per_rank.append(run_figures(stats, rank.steps, times))
        raws.append(merge_ranks(per_rank))
    return raws


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


def check_draft_acceptance(rates, k: int, synthetic: str | None, name: str) -> None:
    """UsageError naming ``name`` unless ``rates`` are a synthetic head's acceptance rates
    (``models.synthetic.DraftProfile``) for at least ``k`` draft positions."""
    if synthetic is None:
        raise UsageError(f"{name} sets a synthetic draft head's rates: give a synthetic shape")
    if not isinstance(rates, (list, tuple)) or len(rates) < k:
        raise UsageError(f"{name}={rates!r}: give a rate per draft position, at least {k}")
    try:
        DraftProfile(rates, 0, "cpu")
    except ValueError as e:
        raise UsageError(f"{name}: {e}") from None


def synthetic_model(sweep: dict, spec: dict | None) -> dict:
    """LLM(target=, draft_head=) of the sweep's synthetic shape (zero weights: every draft is
    accepted, the real cost per step; with ``draft_acceptance``, drafts accepted at those rates
    per position), or {} for a model folder."""
    if sweep["synthetic"] is None:
        return {}
    return synthetic_engine(sweep["synthetic"], spec["method"] if spec else None,
                            dtype=DTYPES[sweep["dtype"]], device=sweep["device"],
                            acceptance=sweep["draft_acceptance"])


def build_engines(sweep: dict, configs: list[BenchConfig],
                  dataset: DatasetPrompts | None = None) -> tuple[dict, dict]:
    """One engine per (method, mode, K), sized for its largest config (with a dataset: its
    longest prompt and output); -> (engines, skip reasons)."""
    engines, skipped = {}, {}
    for key in dict.fromkeys(c.engine_key for c in configs):
        method, padded, k = key
        mine = [c for c in configs if c.engine_key == key]
        conc = max(c.concurrency for c in mine)
        spec = speculative_config(method, k, padded, draft_model=sweep["draft_model"]
                                  if method == "draft_model" else None)
        if spec is not None and sweep["k_schedule"] is not None:
            spec["num_speculative_tokens_per_batch_size"] = sweep["k_schedule"]
        fed = k  # the drafts a decode feeds: a tree's nodes past its root
        if spec is not None and sweep["tree"] is not None:
            spec.update(sweep["tree"])
            fed = SpeculativeConfig.from_dict(spec).num_fed_drafts
        # padded steps run through the graph backend (None: the device's default, cuda_graph
        # on CUDA); ragged ones eager, the reference (their shapes come from a host read)
        backend = (sweep["graph_backend"] if padded else "eager") \
            if "graph_mode" not in (spec or {}) else None
        kwargs = dict(seed=sweep["seed"], device=sweep["device"], max_num_seqs=conc,
                      enable_prefix_caching=sweep["enable_prefix_caching"],
                      pack_prefill=sweep["pack_prefill"],
                      check_host_syncs=False, dtype=sweep["dtype"], graph_backend=backend,
                      max_model_len=max(c.prompt_len + (dataset.longest(c.output_len)
                                                         if dataset else c.output_len)
                                        for c in mine) + fed + 1,
                      max_num_batched_tokens=sweep["max_num_batched_tokens"]
                      or max(256, conc * (fed + 1)))
        try:
            llm = build_llm(sweep["model"], spec, **kwargs, **synthetic_model(sweep, spec))
        except UsageError as e:
            skipped[key] = str(e)
            continue
        if llm.startup is not None:
            print(f"{method} {'padded' if padded else 'ragged'} K={k}: {llm.startup}",
                  file=sys.stderr, flush=True)
        kwargs.update(model=str(sweep["model"] or DEFAULT_MODEL), speculative_config=spec)
        engines[key] = Engine(kwargs, llm)
    return engines, skipped


def run_round(sweep: dict, engines: dict, configs: list[BenchConfig],
              source: PromptSource | DatasetPrompts, prompt_seed: int, on_done) -> list[dict]:
    """Run each config once, in the given order (one DP spawn for all under DP); -> raw figures
    in that order. ``on_done(config)`` is called as each finishes."""
    def job(c):
        n = sweep["num_prompts"] or c.concurrency
        if isinstance(source, DatasetPrompts):
            return source.prompts(n, c.category, prompt_seed)
        return source.prompts(n, c.prompt_len, prompt_seed, sweep["workload"]), None

    if sweep["dp"] == 1:
        raws = []
        for c in configs:
            prompts, max_tokens = job(c)
            try:
                raws.append(measure(engines[c.engine_key].llm, prompts, c.output_len,
                                    sweep["temperature"], c.concurrency, max_tokens))
            except Exception as e:  # one failing config must not lose the sweep
                raws.append(dict(error=f"{type(e).__name__}: {e}"))
            on_done(c)
        return raws
    from specdec.engine.dp_engine import DPJob
    params = {c: SamplingParams(max_tokens=c.output_len, temperature=sweep["temperature"],
                                ignore_eos=True) for c in configs}  # dp > 1: no dataset
    jobs = [DPJob(engines[c.engine_key].kwargs, job(c)[0], params[c]) for c in configs]
    raws = measure_dp(jobs, sweep["dp"])
    for c in configs:
        on_done(c)
    return raws


def check_syncs(sweep: dict, engines: dict, configs: list[BenchConfig],
                source: PromptSource | DatasetPrompts) -> dict:
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
    dataset = dataset_prompts(sweep)
    configs = expand(sweep, dataset.categories if dataset else (None,))
    engines, skipped = build_engines(sweep, configs, dataset)
    ok = [c for c in configs if c.engine_key in engines]
    source = dataset
    if engines and dataset is None:
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
                     prompt_len=c.prompt_len, output_len=c.output_len, category=c.category,
                     tree=tree_label(sweep, c.method, c.k))
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
                configs=results, warnings=load_warnings(env) + comparison_warnings(results)
                + (dataset.warnings() if dataset else []))


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
               c.get("category"), c["mode"]): c for c in configs if c["status"] == "ok"}
    out = []
    for key, padded in by_key.items():
        ragged = by_key.get(key[:-1] + ("ragged",))
        if key[-1] != "padded" or ragged is None:
            continue
        a, b = (c["summary"]["spread"]["itl_mean_ms"] for c in (padded, ragged))
        diff = abs(a["mean"] - b["mean"])
        spread = max(a["std"], b["std"])
        if spread > diff:
            where = f" category {key[5]}" if key[5] is not None else ""
            out.append(f"{padded['method']} K={key[1]} conc={key[2]}{where}: padded vs ragged "
                       "mean ITL "
                       f"differ by {diff:.3f} ms, less than the spread over repeats "
                       f"({spread:.3f} ms std): no measured difference")
    return out
