"""``specdec generate``: text and table on a tiny saved model; bad input is one line, exit 2."""

import importlib.metadata
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from specdec.commands.cli import main
from specdec.engine.llm import LLM
from specdec.flags import speculative_config

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def model(folder) -> Path:
    """A tiny random target with a byte-level BPE tokenizer, and mtp/eagle/eagle3 heads beside
    it (conftest's saved model): its target folder."""
    return folder / "target"


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_speculative_config_worked_example():
    assert speculative_config("torchair-mtp", 2, True) == {
        "method": "mtp", "num_speculative_tokens": 2, "disable_padded_drafter_batch": False,
        "graph_mode": "torchair"}
    assert speculative_config("none", 3, True) is None
    assert speculative_config("eagle", 3, False, '{"num_speculative_tokens": 5}') == {
        "method": "eagle", "num_speculative_tokens": 5, "disable_padded_drafter_batch": True}


@pytest.mark.parametrize("method,k,padded", [("mtp", 2, True), ("eagle3", 3, False)])
def test_generate_prints_the_engines_text_and_the_table(model, capsys, method, k, padded):
    argv = ["generate", "--model", str(model), "--prompt", PROMPT, "--max-tokens", "12",
            "--method", method, "-k", str(k)] + ([] if padded else ["--no-padded"])
    code, out, err = run(capsys, *argv)
    assert code == 0 and err == ""
    spec = {"method": method, "num_speculative_tokens": k, "disable_padded_drafter_batch": not padded}
    ref = LLM(model, speculative_config=spec).generate([PROMPT], max_tokens=12)[0]
    assert out.startswith(PROMPT + ref.text)
    row = next(line for line in out.splitlines() if f"│ {method} " in line)
    cells = [c.strip() for c in row.strip("│").split("│")]
    assert cells[:4] == [method, str(k), "padded" if padded else "ragged", str(len(ref.token_ids))]
    assert cells[5:8] == [f"{ref.acceptance_length:.2f}", str(sum(ref.num_drafted)),
                          str(sum(ref.num_accepted))]
    rates = next(line for line in out.splitlines() if "accept rate per draft position" in line)
    assert len(rates.split(": ")[1].split()) == k  # one acceptance rate per draft position


def test_speculative_config_json_overrides_flags(model, capsys):
    code, out, _ = run(capsys, "generate", "--model", str(model), "--prompt", PROMPT,
                       "--max-tokens", "4", "--method", "eagle3", "--speculative-config",
                       json.dumps({"method": "mtp", "num_speculative_tokens": 1}))
    assert code == 0 and "│ mtp " in out and "eagle3" not in out


def test_speculative_config_without_k_takes_k_from_the_flag(model, tmp_path, capsys):
    """A folder without heads (default method none), -k 2 and a JSON naming only the method:
    K is the flag's (issue 37, item 3)."""
    shutil.copytree(model, tmp_path / "target")
    code, out, err = run(capsys, "generate", "--model", str(tmp_path / "target"), "--prompt",
                         PROMPT, "--max-tokens", "4", "-k", "2", "--speculative-config",
                         '{"method": "ngram"}')
    assert code == 0 and "│ ngram  │ 2 │ padded" in out, out + err
    assert speculative_config("none", 3, True, '{"method": "ngram"}') == {
        "method": "ngram", "num_speculative_tokens": 3}


def test_a_k_larger_than_the_default_step_budget_runs(model, capsys):
    """-k 260 needs 261 tokens per step: generate's default budget (256) grows to fit, and
    the counters count what the request kept (issue 37, item 6); an explicit
    --max-num-batched-tokens below 1 + K is one line naming it, exit 2."""
    code, out, err = run(capsys, "generate", "--model", str(model), "--prompt", PROMPT,
                         "--max-tokens", "2", "--method", "mtp", "-k", "260")
    assert code == 0, err
    row = next(line for line in out.splitlines() if "│ mtp " in line)
    cells = [c.strip() for c in row.strip("│").split("│")]
    assert cells[:2] == ["mtp", "260"] and int(cells[7]) <= int(cells[3]) == 2
    code, out, err = run(capsys, "generate", "--model", str(model), "--prompt", PROMPT,
                         "-k", "10", "--method", "mtp", "--max-num-batched-tokens", "5")
    assert code == 2 and "max_num_batched_tokens=5: must be >= 1 + num_speculative_tokens" \
        in err and len(err.strip().splitlines()) == 1


def test_default_method_is_eagle3_k3_when_the_head_exists(model, tmp_path, capsys):
    code, out, _ = run(capsys, "generate", "--model", str(model), "--prompt", PROMPT,
                       "--max-tokens", "4")
    assert code == 0 and "│ eagle3 │ 3 │ padded" in out
    shutil.copytree(model, tmp_path / "target")  # no sibling heads: no speculation
    code, out, _ = run(capsys, "generate", "--model", str(tmp_path / "target"), "--prompt",
                       PROMPT, "--max-tokens", "4")
    assert code == 0 and "│ none " in out
    code, _, err = run(capsys, "generate", "--model", str(tmp_path / "target"), "--prompt",
                       PROMPT, "-k", "2")  # the default (none) has no drafter for -k to set
    assert code == 2 and "no --method, and the model folder has no eagle3 head" in err


@pytest.mark.parametrize("argv,match", [
    (["--speculative-config", "{bad"], "not valid JSON"),
    (["--speculative-config", "[1, 2]"], "must be a JSON object"),
    (["--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}'], "medusa"),
    (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2, "x": 1}'],
     "unknown speculative config keys"),
    (["--method", "torchair-mtp", "--no-padded"], "graph_mode='torchair'"),
    (["-k", "0", "--method", "mtp"], "num_speculative_tokens=0"),
    (["--max-tokens", "0"], "--max-tokens=0"),
    (["--temperature", "-1"], "--temperature=-1"),
    (["--dp", "0"], "--dp=0"),
    (["--method", "ngram", "--async-scheduling"], "async_scheduling=True with method='ngram'"),
    # flags that would do nothing here are refused, not ignored
    (["--method", "none", "-k", "7"], "-k 7 sets the drafter, and none runs here"),
    (["--method", "none", "--no-padded"], "--no-padded sets the drafter"),
    (["--method", "eagle3", "--output-dir", "hs"], "--output-dir applies to --method "
     "extract_hidden_states only; the method here is 'eagle3'"),
    (["--method", "ngram", "--aux-layer-ids", "0"], "--aux-layer-ids applies to"),
    (["--overwrite-output-dir"], "--overwrite-output-dir applies to"),
    # a flag and the JSON that set one field: refused, neither silently wins
    (["--method", "draft_model", "--draft-model", "/models/A", "--speculative-config",
      '{"model": "/models/B"}'], "--draft-model='/models/A' and --speculative-config's "
     "model='/models/B' name two folders"),
    (["--method", "extract_hidden_states", "--output-dir", "a", "--speculative-config",
      '{"draft_model_config": {"output_dir": "b"}}'], "--output-dir and --speculative-config's "
     "draft_model_config.output_dir='b' both set it"),
    (["--method", "extract_hidden_states", "--aux-layer-ids", "0,1", "--speculative-config",
      '{"draft_model_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}'],
     "--aux-layer-ids and --speculative-config's draft_model_config."
     "eagle_aux_hidden_state_layer_ids=[1, 2, 3] both set it"),
])
def test_bad_config_is_one_line_exit_2(model, capsys, argv, match):
    code, out, err = run(capsys, "generate", "--model", str(model), "--prompt", PROMPT, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("specdec generate: error: ") and match in err
    assert "Traceback" not in err


def test_missing_model_folder_is_one_line_exit_2(tmp_path, capsys):
    """A path that does not exist says so; a folder without config.json says that."""
    code, _, err = run(capsys, "generate", "--model", str(tmp_path / "nope"), "--prompt", PROMPT)
    assert code == 2 and err.count("\n") == 1 and "does not exist" in err
    code, _, err = run(capsys, "generate", "--model", str(tmp_path), "--prompt", PROMPT)
    assert code == 2 and err.count("\n") == 1 and "has no config.json" in err


@pytest.mark.parametrize("argv", [["generate", "--prompt", "x", "--method", "medusa"],
                                  ["generate", "--prompt", "x", "--bogus"], ["generate"]])
def test_argparse_errors_are_one_line_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "error:" in err


def test_plain_specdec_prints_help_and_version_prints_the_version(capsys):
    code, out, err = run(capsys)
    assert code == 0 and err == "" and "generate" in out and "bench" in out
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"specdec {importlib.metadata.version('specdec')}"


def test_installed_entry_point(model):
    """The ``specdec`` console script (setup.cfg entry point) runs, and passes exit status 2 on."""
    exe = shutil.which("specdec")
    assert exe is not None, "specdec is not installed (pip install -e .)"
    ok = subprocess.run([exe, "generate", "--model", str(model), "--prompt", PROMPT,
                         "--max-tokens", "6", "--method", "eagle", "-k", "2"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith(PROMPT) and "│ eagle " in ok.stdout and "accept" in ok.stdout
    bad = subprocess.run([exe, "generate", "--model", str(model), "--prompt", PROMPT,
                          "--speculative-config", '{"method": 3}'],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has CUDA")


@no_cuda
def test_cuda_on_a_cpu_only_torch_is_one_line_exit_2(model, tmp_path, capsys):
    code, out, err = run(capsys, "generate", "--model", str(model), "--prompt", PROMPT,
                         "--device", "cuda")
    assert code == 2 and out == "" and err.count("\n") == 1 and "device='cuda'" in err
    code, out, err = run(capsys, "bench", "--device", "cuda", "--quick",
                         "--out", str(tmp_path / "bench"))
    assert code == 2 and err.count("\n") == 1 and "device='cuda'" in err
    assert not (tmp_path / "bench").exists()  # nothing written


def test_device_dtype_and_graph_backend_flags_reach_the_engine(model, capsys):
    """--graph-backend replay (the CUDA-graph code path on CPU) gives eager's text; --dtype
    float64 is the engine's dtype."""
    argv = ["generate", "--model", str(model), "--prompt", PROMPT, "--max-tokens", "10",
            "--method", "eagle3", "-k", "2", "--device", "cpu", "--dtype", "float64"]
    code, eager, _ = run(capsys, *argv)
    code2, replay, _ = run(capsys, *argv, "--graph-backend", "replay")
    assert code == code2 == 0
    assert "(cpu, float64, eager)" in eager and "(cpu, float64, replay)" in replay
    assert eager.split("\n\n")[0] == replay.split("\n\n")[0]
    text = LLM(str(model), speculative_config={"method": "eagle3", "num_speculative_tokens": 2},
               dtype="float64").generate(PROMPT, max_tokens=10)[0].text
    assert eager.startswith(PROMPT + text)


def test_async_scheduling_flag_reaches_the_engine_and_keeps_the_text(model, capsys):
    """--async-scheduling: the same text as without."""
    argv = ["generate", "--model", str(model), "--prompt", PROMPT, "--max-tokens", "12",
            "--method", "eagle3", "-k", "2", "--graph-backend", "replay"]
    code, sync, _ = run(capsys, *argv)
    code2, overlapped, _ = run(capsys, *argv, "--async-scheduling")
    assert code == code2 == 0 and sync.split("\n\n")[0] == overlapped.split("\n\n")[0]
    from specdec.commands.cli import build_parser
    from specdec.flags import engine_kwargs
    for command in (["generate", "--prompt", PROMPT], ["serve"]):
        args = build_parser().parse_args([*command, "--async-scheduling"])
        assert engine_kwargs(args)["async_scheduling"] is True


def test_the_commands_leave_the_backend_to_the_devices_default(monkeypatch):
    """With CUDA present (the device check monkeypatched on this CPU) generate and serve pick
    device cuda and pass no backend, so LLM resolves cuda_graph; the bench sweep's default is
    the device's default too."""
    from specdec.bench import itl
    from specdec.commands.cli import build_parser
    from specdec.flags import engine_kwargs
    from specdec.graphs import resolve_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for argv in (["generate", "--prompt", "x"], ["serve"]):
        kw = engine_kwargs(build_parser().parse_args(argv))
        assert kw["device"] == "cuda" and kw["graph_backend"] is None
        assert resolve_backend(None, kw["graph_backend"],
                               torch.device(kw["device"])).name == "cuda_graph"
    sweep = itl.check_sweep(dict(methods=["none", "eagle3"], modes=["padded", "ragged"], k=[2],
                                 concurrency=[1]))
    assert sweep["graph_backend"] is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    kw = engine_kwargs(build_parser().parse_args(["generate", "--prompt", "x"]))
    assert kw["device"] == "cpu"
    assert resolve_backend(None, kw["graph_backend"], torch.device("cpu")).name == "eager"
