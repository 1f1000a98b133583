"""What a new user reads: tables at 80 columns and redirected, the slower-than-plain hint,
endpoint labels, plot labels and footers, extract_hidden_states' report, --help defaults
(issue 22, items 7, 8, 11-14)."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from specdec.commands import cli, generate as generate_command
from specdec.bench import itl
from specdec.bench import serve as bench_serve
from specdec.engine.llm import RequestOutput
from specdec.engine.outputs import CompletionOutput
from specdec.flags import add_engine_arguments, speculative_config

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def fibonacci(n):"


def env80() -> dict:
    """A redirected stdout (a pipe) on an 80-column terminal."""
    return {**os.environ, "COLUMNS": "80", "TERM": "dumb"}


def specdec(*argv, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec.commands.cli", *argv],
                          capture_output=True, text=True, timeout=timeout, env=env80(), cwd=ROOT)


def fake_results(k: int = 3, methods=itl.METHODS, concs=(1, 4, 64), itl_of=None) -> dict:
    """A results.json-shaped dict with the widest cells the table can get."""
    configs = []
    for m in methods:
        for mode in ["-"] if m == "none" else ["padded", "ragged"]:
            for c in concs:
                kk = 0 if m == "none" else k
                mean = itl_of(m, c) if itl_of else 11.75
                summary = dict(itl_ms=dict(mean=mean, p99=123.45), ttft_ms=dict(mean=1234.5),
                               output_tokens_per_s=12345.0, acceptance_length=2.8,
                               per_position_acceptance_rate=[0.82] * kk, host_syncs_per_step=14.0,
                               captured_share=0.875, prefix_cache_hit_rate=0.25,
                               spread={key: dict(mean=1.0, std=0.1, p10=0.9, p90=1.1) for key in
                                       ("itl_mean_ms", "output_tokens_per_s")})
                configs.append(dict(name=f"{m}-{mode}-k{kk}-c{c}-p32-o32", method=m, mode=mode,
                                    k=kk, concurrency=c, prompt_len=32, output_len=32,
                                    status="ok", summary=summary,
                                    repeats=[dict(itl_ms=[0.4, 2.0, 3.0, 90.0])]))
    env = dict(device_name="cpu", processor="x86_64", cpu_count=2, torch_threads=2,
               torch="9.9.9", load_average_at_start_1_5_15min=[3.5, 1, 1],
               load_average_1_5_15min=[4.25, 1, 1])
    return dict(sweep=dict(repeats=4, dp=1), configs=configs, environment=env)


def rendered(renderable, width: int) -> str:
    console = Console(record=True, width=width, file=open(os.devnull, "w"))
    console.print(renderable)
    return console.export_text()


def rows_of(text: str, methods) -> list[str]:
    return [line for line in text.splitlines() if line.split()[:1] and line.split()[0] in methods]


# ---- item 7: 80 columns -------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3, 20])
def test_bench_table_keeps_method_and_mode_at_80_columns(k):
    r = fake_results(k)
    text = rendered(itl.results_table(r, 80), 80)
    assert max(map(len, text.splitlines())) <= 80 and "…" not in text
    for c in r["configs"]:  # every config's method and mode, whole, on its rows
        assert any(line.split()[:2] == [c["method"], c["mode"]] for line in text.splitlines())
    assert text.count("0.82") == k * (len(r["configs"]) - 3)  # every rate, folded if need be
    wide = rendered(itl.results_table(r, 250), 250)  # room enough: one table, as before
    assert len(rows_of(wide, itl.METHODS)) == len(r["configs"])


def test_specdec_bench_redirected_at_80_columns(tmp_path):
    """The real command, stdout a pipe, COLUMNS=80: every method and mode in the table."""
    from test_bench import save_model
    model = save_model(tmp_path / "m", heads=("mtp", "eagle3"))
    run = specdec("bench", "--model", str(model), "--methods", "none,mtp,eagle3",
                  "--modes", "padded,ragged", "-k", "2", "--concurrency", "1,2",
                  "--prompt-len", "4", "--output-len", "5", "--repeats", "1", "--warmup", "0",
                  "--out", str(tmp_path / "out"))
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    # the table and its caption fit; the messages after it are one line each (the terminal folds)
    table = [line for line in lines if not line.startswith(("warning:", "hint:", "wrote "))]
    assert max(map(len, table)) <= 80 and "…" not in run.stdout
    for method, mode in [("none", "-"), ("mtp", "padded"), ("mtp", "ragged"),
                         ("eagle3", "padded"), ("eagle3", "ragged")]:
        for conc in ("1", "2"):
            assert any(line.split()[:4] == [method, mode, "-" if method == "none" else "2", conc]
                       for line in lines), (method, mode, conc, run.stdout)


def test_generate_table_at_80_columns_and_k20(folder):
    run = specdec("generate", "--model", str(folder / "target"), "--prompt", PROMPT,
                  "--max-tokens", "24", "--method", "mtp", "-k", "20")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert max(map(len, lines)) <= 80 and "…" not in run.stdout
    row = next(line for line in lines if "│ mtp " in line)
    assert [c.strip() for c in row.strip("│").split("│")][:3] == ["mtp", "20", "padded"]
    rates = run.stdout[run.stdout.index("accept rate per draft position 1-20:"):]
    assert len(rates.split(":", 1)[1].split()) == 20  # all 20, folded at 80 columns
    assert run.stdout.startswith(PROMPT)


# ---- item 8: slower than plain ------------------------------------------------------------
def test_bench_hint_only_when_speculation_was_slower():
    slow = fake_results(itl_of=lambda m, c: 3.0 if m == "none" else 4.6, methods=(
        "none", "mtp", "eagle3"), concs=(1,))
    hint = itl.slower_hint(slow)
    assert hint.startswith("hint: 4 of 4 speculative configs were slower") and "\n" not in hint
    assert "4.60 vs 3.00 ms" in hint
    fast = fake_results(itl_of=lambda m, c: 3.0 if m == "none" else 2.0, concs=(1,))
    assert itl.slower_hint(fast) is None
    assert itl.slower_hint(fake_results(methods=("mtp",))) is None  # no plain run: no guess


def out(n_tokens: int) -> RequestOutput:
    return RequestOutput("0", None, [1], None,
                         [CompletionOutput(0, None, [5] * n_tokens, None, None, "length")],
                         num_drafted=[3], num_accepted=[2], num_decode_steps=3)


def test_generate_hint_needs_both_measured():
    spec = speculative_config("eagle3", 3, True)
    assert "eagle3 was slower than plain" in generate_command.compare_hint([(out(10), 1.0, spec),
                                                               (out(10), 0.5, None)])
    assert generate_command.compare_hint([(out(10), 0.5, spec), (out(10), 1.0, None)]) is None
    assert generate_command.compare_hint([(out(10), 9.0, spec)]) is None  # plain not measured: no guess


def test_generate_compare_plain_shows_both_rows(folder, capsys):
    code = cli.main(["generate", "--model", str(folder / "target"), "--prompt", PROMPT,
                     "--max-tokens", "6", "--method", "eagle", "-k", "2", "--compare-plain"])
    text = capsys.readouterr().out
    assert code == 0 and "│ eagle " in text and "│ none " in text


# ---- item 11: endpoint labels -------------------------------------------------------------
def test_endpoint_mode_and_server_are_named(monkeypatch):
    assert bench_serve.endpoint_mode(None, launched=False) == "server"
    assert bench_serve.endpoint_mode(None, launched=True) == "plain"
    assert bench_serve.endpoint_mode(speculative_config("eagle3", 3, False), True) == "ragged"
    monkeypatch.setattr(bench_serve, "served_models", lambda url: [
        {"id": "m", "owned_by": "vllm"}])
    info = bench_serve.server_info("http://h:1", "m", launched=False)
    assert info["name"] == "vllm serve" and info["base_url"] == "http://h:1"
    r = fake_results(methods=("eagle3",), concs=(1, 4))
    for c in r["configs"]:
        c["mode"] = "server"
    r.update(kind="endpoint", server=info, sweep=dict(repeats=3, dp=1, model="m",
                                                       base_url="http://h:1"))
    text = rendered(itl.results_table(r, 80), 80)
    assert "vllm serve serving 'm' at http://h:1" in text.replace("\n", " ").replace("  ", " ")
    assert " - " not in " ".join(line for line in rows_of(text, ("eagle3",)))
    assert all(line.split()[:2] == ["eagle3", "server"] for line in rows_of(text, ("eagle3",)))


# ---- item 12: plots -----------------------------------------------------------------------
def test_plots_have_footer_words_readable_ticks_and_legend_outside(tmp_path, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    seen = {}
    save = Figure.savefig

    def spy(fig, path, **kw):
        fig.canvas.draw()
        ax = fig.axes[0]
        legend = ax.get_legend()
        seen[Path(path).name] = dict(
            texts=[t.get_text() for t in fig.texts],
            yticks=[t.get_text() for t in ax.get_yticklabels()],
            xticks=[t.get_text() for t in ax.get_xticklabels() if t.get_text()],
            xscale=ax.get_xscale(), title=ax.get_title(),
            legend_x0=legend.get_window_extent().x0, axes_x1=ax.get_window_extent().x1,
            legend_text=[t.get_text() for t in legend.get_texts()])
        return save(fig, path, **kw)

    monkeypatch.setattr(Figure, "savefig", spy)
    r = fake_results(methods=("none", "mtp"), concs=(1, 4))
    names = itl.write_plots(r, tmp_path)
    assert set(names) == set(seen) and len(names) == 3
    for name, s in seen.items():
        footer = " ".join(s["texts"])
        assert "torch 9.9.9" in footer and "load average (1 min) 3.5 at start, 4.2" in footer
        assert "2 CPUs" in footer
        assert s["legend_x0"] >= s["axes_x1"]  # the legend sits right of the axes, off the bars
    dist = seen["itl_distribution.png"]
    assert dist["yticks"][0] == "none, concurrency 1"
    assert "mtp padded K=3, concurrency 4" in dist["yticks"]
    assert "prompt 32 tokens, output 32 tokens" in dist["title"]
    assert dist["xscale"] == "log" and {"1", "10"} <= set(dist["xticks"])
    assert all("^" not in t and "$" not in t for t in dist["xticks"])  # plain numbers
    assert any(t.startswith("median") for t in dist["legend_text"])


# ---- item 13: extract_hidden_states -------------------------------------------------------
def test_extract_hidden_states_prints_what_it_wrote(folder, tmp_path, capsys):
    argv = ["generate", "--model", str(folder / "target"), "--prompt", PROMPT, "--max-tokens",
            "5", "--method", "extract_hidden_states", "--output-dir", str(tmp_path / "hs")]
    code = cli.main(argv)
    text = capsys.readouterr().out
    assert code == 0 and "accept" not in text and "│" not in text
    files = list((tmp_path / "hs").glob("*.safetensors"))
    assert len(files) == 1 and f"wrote {files[0]}:" in text
    from safetensors.torch import load_file
    saved = load_file(str(files[0]))
    t, layers, h = saved["hidden_states"].shape
    assert f"hidden_states [{t}, {layers}, {h}]" in text and f"token_ids [{t}]" in text
    assert f"T = {t}: the prompt's {t} tokens" in text
    code, err = cli.main(argv), capsys.readouterr().err
    assert code == 2 and "already holds" in err and "add --overwrite-output-dir" in err
    assert cli.main(argv + ["--overwrite-output-dir"]) == 0


# ---- item 14: help ------------------------------------------------------------------------
def flags(parser: argparse.ArgumentParser):
    return [a for a in parser._actions if a.option_strings
            and not isinstance(a, (argparse._HelpAction, argparse._VersionAction))]


def subparser(parser, *path):
    for name in path:
        parser = next(a for a in parser._actions
                      if isinstance(a, argparse._SubParsersAction)).choices[name]
    return parser


@pytest.mark.parametrize("path", [("generate",), ("bench",), ("bench", "serve")])
def test_every_flag_has_help_with_its_default(path):
    p = subparser(cli.build_parser(), *path)
    for action in flags(p):
        assert action.help and "default" in action.help.lower() or action.required or (
            action.help and "required" in action.help), (path, action.option_strings)
    text = p.format_help()
    assert "None" not in text.replace("(default: None", "")


def test_bench_serve_launch_passes_serves_engine_flags_and_base_url_refuses_them(capsys):
    """``bench serve --launch`` takes ``serve``'s engine flags (the same parser code) and
    hands the given ones to the server it starts; with --base-url there is no server to give
    them to: one line naming each, exit 2."""
    parse = subparser(cli.build_parser(), "bench", "serve").parse_args
    serve_flags = {a.dest for a in flags(subparser(cli.build_parser(), "serve"))}
    args = parse(["--launch", "--dtype", "bfloat16", "--device", "cpu", "--async-scheduling",
                  "--graph-backend", "replay", "--compile-backend", "eager"])
    assert set(bench_serve.ENGINE_FLAGS) <= serve_flags
    engine_parser = argparse.ArgumentParser()
    add_engine_arguments(engine_parser)  # every engine flag reaches the launched server
    assert {a.dest for a in flags(engine_parser)} <= set(bench_serve.ENGINE_FLAGS)
    assert bench_serve.engine_flags(parse(["--launch", "-tp", "2", "--dp", "2",
                                           "--enable-expert-parallel"])) == [
        "--tensor-parallel-size", "2", "--data-parallel-size", "2", "--enable-expert-parallel"]
    assert bench_serve.engine_flags(args) == [
        "--device", "cpu", "--dtype", "bfloat16", "--graph-backend", "replay",
        "--compile-backend", "eager", "--async-scheduling"]
    assert bench_serve.engine_flags(parse(["--launch"])) == []
    code = cli.main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--dtype",
                     "bfloat16", "-k", "2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "-k, --dtype" in err and "--launch" in err
    assert cli.main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "-k", "0"]) == 2
    assert capsys.readouterr().err.startswith("specdec bench: error: -k: ")


def test_serve_host_and_seed_show_defaults():
    text = subparser(cli.build_parser(), "serve").format_help()
    assert "(default: 127.0.0.1)" in text and "(default: 8000)" in text


def test_bench_gpu_help_is_whole_and_says_run_from_the_root():
    run = subprocess.run([sys.executable, "-m", "benchmarks.bench_gpu", "--help"],
                         capture_output=True, text=True, env=env80(), cwd=ROOT, timeout=120)
    assert run.returncode == 0
    text = " ".join(run.stdout.split())
    assert "on synthetic Llama targets (bf16);" in text and "repository root" in text
    assert "(default: 3)" in text


def test_bench_gpu_smoke_run_on_cpu_prints_the_goal_figures(tmp_path):
    """The GPU table's code on a CPU (replay backend, tiny synthetic target): every config
    measured, the sampled rows beside the greedy ones, every Poisson-arrival step captured,
    and each goal line printed."""
    run = subprocess.run([sys.executable, "-m", "benchmarks.bench_gpu", "--device", "cpu",
                          "--models", "llama-tiny", "--backends", "replay", "--methods", "none",
                          "eagle3", "--concurrency", "2", "--output-len", "6", "--out",
                          str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    r = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert [(x["method"], x["temperature"]) for x in r["rows"]] == [
        ("none", 0.0), ("none", 0.7), ("eagle3", 0.0), ("eagle3", 0.7)]
    assert all("error" not in x and x["graph_calls_per_step"] > 0 for x in r["rows"])
    assert r["poisson"][0]["steps"] > 0 and r["poisson"][0]["share"] == 1.0
    assert r["goals"]["captured_share_poisson"] == 1.0
    assert r["goals"]["sampled_over_greedy_step"] > 0
    assert r["goals"]["eagle3_over_plain_tokens_per_s"] > 0
    for key in r["goals"]:
        assert f"{key}: " in run.stdout
