"""benchmarks/bench_gpu_peer.py on a CPU: transformers' generate (static cache) and specdec
(plain, EAGLE-3) on the tiny synthetic, both tok/s figures and their ratios reported."""

import json

from benchmarks.bench_gpu_peer import main


def test_smoke_run_on_cpu_reports_both_engines(tmp_path, capsys):
    assert main(["--model", "llama-tiny", "--device", "cpu", "--dtype", "float32",
                 "--concurrency", "2", "--output-len", "4", "--repeats", "1", "--warmup", "1",
                 "--methods", "none", "eagle3", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "bench_gpu_peer.json").read_text())
    assert [(x["engine"], x["method"]) for x in r["rows"]] == [
        ("transformers", "none"), ("specdec", "none"), ("specdec", "eagle3")]
    assert all(x["tokens_per_s"] > 0 and x["concurrency"] == 2 for x in r["rows"])
    peer = r["rows"][0]
    assert peer["over_transformers"] == 1.0 and peer["compiled"] is False  # CPU: no compile
    for x in r["rows"][1:]:
        assert x["over_transformers"] == x["tokens_per_s"] / peer["tokens_per_s"]
    out = " ".join(capsys.readouterr().out.split())
    assert "specdec none / transformers plain, c2: " in out
    assert "specdec eagle3 / transformers plain, c2: " in out
