"""The ITL harness on tiny saved models: JSON schema, per-config identities, syncs, plots."""

import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from specdec.bench import itl
from specdec.bench import sweep as bench_sweep
from specdec.flags import UsageError
from specdec.models.heads import build_head
from specdec.models.config import ModelConfig
from specdec.models.llama import LlamaForCausalLM

VOCAB = 64
K = 2
SWEEP = dict(methods=["none", "mtp", "eagle", "eagle3"], modes=["padded", "ragged"], k=[K],
             concurrency=[1, 3], prompt_len=[5], output_len=[7], repeats=2, warmup=1, seed=0)


def save_model(root: Path, heads=("mtp", "eagle3"), zero: bool = False) -> Path:
    """A tiny target in ``root/target`` and heads in its sibling folders; -> the target folder.
    ``zero``: every weight 0, so target and drafts always pick token 0 (every draft accepted)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=VOCAB - 1)
    target = LlamaForCausalLM(cfg).eval()
    modules = [target]
    for method in heads:
        extra = {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]} if method == "eagle3" else {}
        modules.append(build_head(method, target, **extra))
    for m in modules if zero else []:
        with torch.no_grad():
            for p in m.parameters():
                p.zero_()
    target.save_pretrained(root / "target", dtype=torch.float32)
    for method, head in zip(heads, modules[1:]):
        head.save_pretrained(root / method, dtype=torch.float32)
    return root / "target"


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """One sweep (no eagle head saved: eagle is skipped), run through the command line."""
    root = tmp_path_factory.mktemp("bench")
    model = save_model(root / "model", zero=True)
    (root / "sweep.json").write_text(json.dumps({**SWEEP, "model": str(model)}))
    assert itl.main(["--sweep", str(root / "sweep.json"), "--out", str(root / "out")]) == 0
    return root / "out", json.loads((root / "out" / "results.json").read_text())


def ok_configs(results):
    return [c for c in results["configs"] if c["status"] == "ok"]


def test_schema(bench):
    _, r = bench
    assert r["schema_version"] == itl.SCHEMA_VERSION
    assert {"acceptance_length", "itl", "ttft", "tpot"} <= set(r["definitions"])
    assert {"python", "torch", "numpy", "device", "torch_threads", "cpu_count"} <= set(
        r["environment"])
    assert r["sweep"]["repeats"] == 2 and r["prompt_source"] == "random token ids"
    assert set(r["phase_seconds"]) == {"build_s", "warmup_s", "measure_s", "sync_check_s", "sweep_s",
                                     "plots_s"}
    names = [c["name"] for c in r["configs"]]
    # none once per concurrency; every other method x mode x concurrency
    assert len(names) == len(set(names)) == 2 + 3 * 2 * 2
    for c in r["configs"]:
        assert c["status"] in ("ok", "skipped")
        if c["status"] == "ok":
            assert len(c["repeats"]) == 2
            assert {"itl_ms", "tpot_ms", "ttft_ms", "e2e_ms"} <= set(c["summary"])
            assert set(c["summary"]["itl_ms"]) == {"n", "mean", "p50", "p90", "p99", "min", "max"}


def test_missing_head_is_skipped_with_reason(bench):
    _, r = bench
    skipped = [c for c in r["configs"] if c["status"] == "skipped"]
    assert {c["method"] for c in skipped} == {"eagle"} and len(skipped) == 4
    assert all("eagle" in c["reason"] and "config.json" in c["reason"] for c in skipped)
    assert len(ok_configs(r)) == 2 + 2 * 2 * 2


def test_repeat_identities(bench):
    """ITL x tokens adds up to decode time; token counts; TPOT; throughput; per request order."""
    _, r = bench
    for c in ok_configs(r):
        for rep in c["repeats"]:
            n = c["concurrency"]
            assert rep["output_tokens"] == n * c["output_len"]  # ignore_eos: exact length
            # the first chunk of a request is its one prefill token; every later token has an ITL
            assert len(rep["itl_ms"]) == rep["output_tokens"] - n
            assert sum(rep["itl_ms"]) == pytest.approx(1e3 * rep["decode_time_s"], rel=1e-9)
            assert sum(e - t for t, e in zip(rep["ttft_ms"], rep["e2e_ms"])) == pytest.approx(
                1e3 * rep["decode_time_s"], rel=1e-9)
            for tpot, ttft, e2e in zip(rep["tpot_ms"], rep["ttft_ms"], rep["e2e_ms"]):
                assert 0 < ttft <= e2e <= 1e3 * rep["wall_s"] + 1e-9
                assert tpot * (c["output_len"] - 1) == pytest.approx(e2e - ttft)
            assert rep["output_tokens_per_s"] * rep["wall_s"] == pytest.approx(rep["output_tokens"])
            assert 0 <= rep["draft_seconds"] <= rep["step_seconds"] <= rep["wall_s"]
            assert rep["collectives"] == 0  # dp = 1


def test_acceptance_identities(bench):
    """acceptance length = 1 + accepted / verifying steps; the all-zero model accepts every
    draft, so it is exactly 1 + K and the decode chunks carry up to K + 1 tokens."""
    _, r = bench
    for c in ok_configs(r):
        s = c["summary"]
        reps = c["repeats"]
        assert s["num_accepted"] == sum(sum(x["num_accepted"]) for x in reps)
        assert s["verify_steps"] == sum(x["verify_steps"] for x in reps)
        if c["method"] == "none":
            assert s["num_drafted"] == s["verify_steps"] == 0 and s["acceptance_length"] == 1.0
            assert s["drafter_share"] == 0.0 and s["acceptance_rate"] is None
            continue
        assert s["acceptance_length"] == pytest.approx(1 + s["num_accepted"] / s["verify_steps"])
        for x in reps:
            assert x["acceptance_length"] == pytest.approx(
                1 + sum(x["num_accepted"]) / x["verify_steps"])
        # every verifying step drafts all K positions
        assert s["num_drafted_per_position"] == [s["verify_steps"]] * K
        assert s["acceptance_rate"] == 1.0 and s["per_position_acceptance_rate"] == [1.0] * K
        assert s["acceptance_length"] == 1 + K
        assert 0 < s["drafter_share"] < 1


def test_summary_pools_repeats(bench):
    _, r = bench
    for c in ok_configs(r):
        s, reps = c["summary"], c["repeats"]
        pooled = [x for rep in reps for x in rep["itl_ms"]]
        assert s["itl_ms"]["n"] == len(pooled)
        assert s["itl_ms"]["mean"] == pytest.approx(sum(pooled) / len(pooled))
        d = s["itl_ms"]
        assert d["min"] <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"]
        assert d["min"] <= d["mean"] <= d["max"]
        assert s["decode_time_s"] == pytest.approx(sum(x["decode_time_s"] for x in reps))
        sp = s["spread"]["output_tokens_per_s"]
        vals = [x["output_tokens_per_s"] for x in reps]
        assert (sp["min"], sp["max"]) == (min(vals), max(vals)) and sp["std"] >= 0


def test_padded_never_syncs_ragged_does(bench):
    """Counted in one separate checked pass per config; the timed repeats run unchecked."""
    _, r = bench
    for c in ok_configs(r):
        syncs = c["summary"]["host_syncs_per_step"]
        assert all("host_syncs" not in x for x in c["repeats"])
        if c["mode"] == "ragged":
            assert syncs > 0, c["name"]
        else:
            assert syncs == 0, c["name"]


def test_one_failing_config_does_not_lose_the_sweep(tmp_path, monkeypatch):
    """An engine that raises mid-run: its config is reported failed with the error, the rest
    are measured and written."""
    model = save_model(tmp_path / "model", heads=("mtp",))
    build = itl.build_engines

    def build_with_a_broken_engine(sweep, configs, *dataset):
        engines, skipped = build(sweep, configs, *dataset)
        broken = engines[("mtp", True, K)].llm

        def step():
            raise RuntimeError("device lost")
        broken.step = step
        return engines, skipped

    monkeypatch.setattr(bench_sweep, "build_engines", build_with_a_broken_engine)
    out = tmp_path / "out"
    sweep = {**SWEEP, "methods": ["none", "mtp"], "concurrency": [1], "model": str(model)}
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    assert itl.main(["--sweep", str(tmp_path / "sweep.json"), "--out", str(out)]) == 0
    r = json.loads((out / "results.json").read_text())
    status = {c["name"]: (c["status"], c.get("error")) for c in r["configs"]}
    assert status["mtp-padded-k2-c1-p5-o7"] == ("failed", "RuntimeError: device lost")
    assert status["none-c1-p5-o7"][0] == status["mtp-ragged-k2-c1-p5-o7"][0] == "ok"


def test_plots_written(bench):
    out, r = bench
    assert len(r["plots"]) >= 2
    for name in r["plots"]:
        png = (out / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_table_lists_every_ok_config_and_the_skips(bench):
    from rich.console import Console
    _, r = bench
    console = Console(record=True, width=250)
    console.print(itl.results_table(r))
    text = console.export_text()
    assert text.count("padded") == 4 and text.count("ragged") == 4
    assert itl.skipped_lines(r) == [
        f"skipped eagle {mode} K={K}: {c['reason']}" for mode, c in
        [(m, next(c for c in r["configs"] if c["method"] == "eagle" and c["mode"] == m))
         for m in ("padded", "ragged")]]


def test_expand_and_check_sweep():
    configs = itl.expand(itl.check_sweep(dict(methods=["none", "mtp"], modes=["padded", "ragged"],
                                              k=[1, 3], concurrency=[1, 4])))
    assert len(configs) == 2 + 2 * 2 * 2
    assert [c.name for c in configs[:3]] == ["none-c1-p64-o64", "none-c4-p64-o64",
                                             "mtp-padded-k1-c1-p64-o64"]
    assert len({c.engine_key for c in configs}) == 1 + 4
    for bad, match in (({"method": ["mtp"]}, "unknown sweep keys"),
                       ({"methods": ["medusa"]}, "medusa"), ({"modes": ["fast"]}, "fast"),
                       ({"k": [0]}, "k="), ({"concurrency": []}, "empty"),
                       ({"repeats": 0}, "repeats"), ({"output_len": [1]}, "output_len"),
                       ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
                       ({"max_num_batched_tokens": "2048"}, "max_num_batched_tokens")):
        with pytest.raises(UsageError, match=match):
            itl.check_sweep(bad)


@pytest.mark.parametrize("budget", [None, 300])
def test_the_step_budget_reaches_the_engine(budget):
    """``max_num_batched_tokens`` (``--max-num-batched-tokens``): the engines' token budget;
    none: max(256, concurrency x (K + 1))."""
    sweep = itl.check_sweep(dict(methods=["none", "mtp"], modes=["padded"], k=[3],
                                 concurrency=[1, 80], max_num_batched_tokens=budget))
    engines, skipped = itl.build_engines(sweep, itl.expand(sweep))
    assert not skipped
    got = {key: e.llm.scheduler.max_num_batched_tokens for key, e in engines.items()}
    assert got == ({("none", True, 0): 256, ("mtp", True, 3): 320} if budget is None
                   else {("none", True, 0): 300, ("mtp", True, 3): 300})


def test_num_prompts_runs_a_closed_loop_as_bench_serve_sends_requests():
    """num_prompts=5 at concurrency 2 (``--num-prompts``): two requests at t0, the next two
    as those finish, then the last -- steps of 2, 2, 2, 2, 2, 2, 1, 1, 1 requests for 3 tokens
    each (one batch would step 5 at a time) -- and each request's TTFT counts from when it was
    added (about a step), not from t0."""
    from specdec import LLM
    llm = LLM(max_model_len=32, max_num_seqs=2)
    prompts = [[5 + i, 6, 7, 8] for i in range(5)]
    raw = bench_sweep.measure(llm, prompts, 3, 0.0, concurrency=2)
    assert [s.num_reqs for s in llm.steps] == [2, 2, 2, 2, 2, 2, 1, 1, 1]
    assert raw["output_tokens"] == 15 and len(raw["ttft_s"]) == 5
    assert max(raw["ttft_s"]) < raw["wall_s"] / 3
    with pytest.raises(UsageError, match="num_prompts=0: allowed an int >= 1"):
        itl.check_sweep(dict(num_prompts=0))
    with pytest.raises(UsageError, match="closed loop on one rank: give dp=1"):
        itl.check_sweep(dict(num_prompts=8, dp=2))


@pytest.mark.parametrize("path", sorted((Path(itl.__file__).parent / "sweeps").glob("*.*")),
                         ids=lambda p: p.name)
def test_example_sweep_files_are_valid(path):
    sweep = itl.check_sweep(itl.load_sweep(path))
    assert itl.expand(sweep)


def test_quick_sweep_is_small():
    """--quick: every method and both modes at one K and two concurrencies."""
    configs = itl.expand(itl.check_sweep(dict(itl.QUICK_SWEEP)))
    assert {c.method for c in configs} == set(itl.METHODS)
    assert len(configs) <= 2 * (1 + 2 * (len(itl.METHODS) - 1))


def test_bad_sweep_file_is_one_line_exit_2(tmp_path, capsys):
    bad = tmp_path / "s.yaml"
    bad.write_text("methods: [none\n")
    assert itl.main(["--sweep", str(bad), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not parse" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="cuda_graph is refused off CUDA only")
def test_a_run_that_measured_nothing_exits_2_after_writing_its_results(tmp_path, capsys):
    """Every config skipped (cuda_graph without CUDA): the skip lines, results.json, then one
    error line and exit 2 -- a script or CI job must not read it as a measurement."""
    code = itl.main(["--methods", "none", "--graph-backend", "cuda_graph", "--concurrency", "1",
                     "--prompt-len", "8", "--output-len", "2", "--repeats", "1", "--warmup",
                     "0", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 2 and "skipped none - K=0: " in out and "needs a CUDA device" in out
    assert err.endswith("error: nothing was measured: every config was skipped or failed (the "
                        "reasons are above)\n")
    configs = json.loads((tmp_path / "results.json").read_text())["configs"]
    assert {c["status"] for c in configs} == {"skipped"}


def test_prompts_are_deterministic_held_out_windows():
    from specdec.train import data
    texts = data.read_texts(data.list_files()[0][:3])
    tok = data.train_tokenizer(texts, 300)
    src = itl.PromptSource(tok, tok.get_vocab_size())
    assert src.kind == "held-out stdlib files"
    a, b, c = src.prompts(3, 20, 1), src.prompts(3, 20, 1), src.prompts(3, 20, 2)
    assert a == b != c and all(len(p) == 20 for p in a)
    stream = src.stream.tolist()
    for p in a:  # a contiguous window of the held-out token stream
        assert any(stream[i:i + 20] == p for i in range(len(stream) - 19))


def test_data_parallel_sweep_counts_collectives(tmp_path):
    """dp=2: rank processes run the requests; one packed DP all_reduce per step, no host sync
    in padded mode; the per-rank figures pool into the same identities."""
    model = save_model(tmp_path / "model", heads=("mtp",))
    sweep = itl.check_sweep(dict(methods=["none", "mtp"], modes=["padded"], k=[K],
                                 concurrency=[3], prompt_len=[5], output_len=[4], repeats=1,
                                 warmup=0, dp=2, model=str(model)))
    from rich.console import Console
    r = itl.run_sweep(sweep, Console(quiet=True))
    assert [c["status"] for c in r["configs"]] == ["ok", "ok"]
    for c in r["configs"]:
        s, rep = c["summary"], c["repeats"][0]
        assert rep["output_tokens"] == 3 * 4 and len(rep["itl_ms"]) == 3 * 3
        assert sum(rep["itl_ms"]) == pytest.approx(1e3 * rep["decode_time_s"], rel=1e-9)
        assert s["collectives_per_step"] == 1.0 and s["host_syncs_per_step"] == 0


# ---- issue 13, item 4: the bench says when its figures are not to be trusted -------------
def test_results_record_load_cpus_and_threads(bench):
    out, r = bench
    env = r["environment"]
    for key in ("load_average_1_5_15min", "load_average_at_start_1_5_15min"):
        assert len(env[key]) == 3 and all(x >= 0 for x in env[key])
    assert env["cpu_count"] >= 1 and env["torch_threads"] >= 1
    assert isinstance(r["warnings"], list)
    assert json.loads((out / "results.json").read_text())["warnings"] == r["warnings"]


def test_load_warning():
    env = dict(cpu_count=2, torch_threads=2, load_average_1_5_15min=[0.2, 0.1, 0.1],
               load_average_at_start_1_5_15min=[5.0, 4.0, 3.0])
    (line,) = itl.load_warnings(env)
    assert "load average 5.0 on 2 CPUs" in line
    assert itl.load_warnings({**env, "load_average_at_start_1_5_15min": [0.5, 0, 0]}) == []


def pair(mean_padded, std_padded, mean_ragged, std_ragged):
    def config(mode, mean, std):
        return dict(status="ok", method="mtp", k=3, concurrency=4, prompt_len=32, output_len=32,
                    mode=mode, summary=dict(spread=dict(itl_mean_ms=dict(mean=mean, std=std))))
    return [config("padded", mean_padded, std_padded), config("ragged", mean_ragged, std_ragged)]


def test_spread_larger_than_the_difference_is_flagged():
    (line,) = itl.comparison_warnings(pair(4.0, 0.5, 4.2, 0.1))
    assert "mtp K=3 conc=4" in line and "0.200 ms" in line and "0.500 ms std" in line
    assert itl.comparison_warnings(pair(4.0, 0.5, 6.0, 0.1)) == []


def test_bands_are_percentiles_and_never_below_zero():
    mid, (below, above) = itl.percentile_band([dict(mean=5.0, p10=4.0, p90=9.0),
                                               dict(mean=0.3, p10=0.05, p90=3.0)])
    assert mid == [5.0, 0.3] and below == [1.0, 0.25] and above == [4.0, 2.7]
    assert all(m - b >= 0 for m, b in zip(mid, below))


def test_padded_and_ragged_differ_in_colour_and_marker():
    palette = [f"c{i}" for i in range(20)]
    padded = itl.series_style("mtp", "padded", 1, palette)
    ragged = itl.series_style("mtp", "ragged", 1, palette)
    assert padded["color"] != ragged["color"] and padded["marker"] != ragged["marker"]


def test_table_fits_a_100_column_terminal(bench):
    _, r = bench
    console = Console(record=True, width=100)
    console.print(itl.results_table(r))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "…" not in text


def test_synthetic_target_with_captured_padded_steps(tmp_path):
    """--synthetic: a built-in target (zero weights: every draft accepted) and matching heads;
    padded steps through the graph wrapper (replay: the CUDA-graph code path on CPU), ragged
    ones eager; the JSON records the weight bytes every step reads."""
    from specdec.models.synthetic import build_synthetic, weight_bytes
    sweep = itl.check_sweep(dict(methods=["none", "eagle3"], modes=["padded", "ragged"], k=[2],
                                 concurrency=[2], prompt_len=[5], output_len=[6], repeats=1,
                                 warmup=0, synthetic="llama-tiny", graph_backend="replay"))
    r = itl.run_sweep(sweep, Console(quiet=True))
    assert [c["status"] for c in r["configs"]] == ["ok", "ok", "ok"]
    target, _ = build_synthetic("llama-tiny", dtype=torch.float32, methods=())
    assert r["weights"]["bytes"] == weight_bytes(target)
    assert r["weights"]["weight_read_ms"] is None  # measured on CUDA only
    for c in r["configs"]:
        s = c["summary"]
        assert s["ms_per_step"] > 0
        if c["method"] == "eagle3":
            assert s["acceptance_length"] == 3.0  # K=2, every draft accepted
    # --draft-acceptance 0,0: the same head's drafts are never accepted
    never = itl.run_sweep(itl.check_sweep(dict(sweep, methods=["eagle3"], modes=["padded"],
                                               draft_acceptance=[0.0, 0.0])), Console(quiet=True))
    assert never["configs"][0]["summary"]["acceptance_length"] == 1.0
    with pytest.raises(UsageError, match="draft_acceptance sets a synthetic draft head's"):
        itl.check_sweep(dict(draft_acceptance=[0.5]))
    with pytest.raises(UsageError, match=r"draft_acceptance=\[0.5\]: give a rate per draft "
                                         "position, at least 2"):
        itl.check_sweep(dict(synthetic="llama-tiny", k=[1, 2], draft_acceptance=[0.5]))
    with pytest.raises(UsageError, match="synthetic='llama-2t'"):
        itl.check_sweep(dict(synthetic="llama-2t"))
    with pytest.raises(UsageError, match="graph_backend='xla'"):
        itl.check_sweep(dict(graph_backend="xla"))
