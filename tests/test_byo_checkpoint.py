"""Bring your own checkpoint: ``specdec generate --model DIR`` and ``specdec serve --model DIR``
on a folder as transformers writes it (Qwen3, sharded), with the folder's own tokenizer.json
and chat template; and the load's peak memory stays about one shard above the model."""

import json
import shutil
import subprocess
import sys

import httpx
import pytest
import torch

from specdec.commands.cli import main
from specdec.engine.llm import DEFAULT_MODEL, LLM
from specdec.entrypoints.serve import build_server_app

from helpers import ServerThread
from hf_models import hf_greedy

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A tiny Qwen3 (transformers-built, sharded) with the embedded model's tokenizer.json and
    a tokenizer_config.json carrying a ChatML template."""
    import transformers

    path = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(0)
    vocab = json.loads((DEFAULT_MODEL / "config.json").read_text())["vocab_size"]
    cfg = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, initializer_range=0.2,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path, max_shard_size="200KB")
    shutil.copy(DEFAULT_MODEL / "tokenizer.json", path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    assert len(list(path.glob("model-*.safetensors"))) > 1
    return path


def test_generate_on_a_transformers_folder_prints_its_greedy_text(qwen3_dir, capsys):
    prompt = "def fibonacci(n):"
    code = main(["generate", "--model", str(qwen3_dir), "--prompt", prompt, "--max-tokens",
                 "12", "--method", "none"])
    out = capsys.readouterr().out
    assert code == 0
    llm = LLM(model=str(qwen3_dir))
    ids = llm.tokenizer.encode(prompt).ids
    expected = hf_greedy(qwen3_dir, [ids], max_new_tokens=12)[0]
    got = llm.generate(prompt, max_tokens=12, ignore_eos=True)[0]
    assert got.token_ids == expected
    assert llm.tokenizer.decode(expected[:4]) in out  # the CLI printed the same text


def test_bench_runs_on_a_folder_whose_tokenizer_has_no_endoftext(qwen3_dir, tmp_path, capsys):
    """Issue 37, item 1: the benchmark's prompts come from any tokenizer (this one's
    ``<|endoftext|>`` renamed), and the run ends with its table, exit 0."""
    folder = tmp_path / "model"
    shutil.copytree(qwen3_dir, folder)
    text = (folder / "tokenizer.json").read_text()
    assert "<|endoftext|>" in text
    (folder / "tokenizer.json").write_text(text.replace("<|endoftext|>", "<|end|>"))
    code = main(["bench", "--quick", "--model", str(folder), "--methods", "none,ngram",
                 "--modes", "padded", "--concurrency", "1", "--output-len", "4", "--repeats",
                 "1", "--warmup", "0", "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == 0 and "ngram" in out
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {c["method"] for c in results["configs"]} == {"none", "ngram"}


def test_bench_serve_launch_runs_the_folder_given_as_model(qwen3_dir, tmp_path, capsys):
    """Issue 37, item 2: --model is the checkpoint folder in bench serve --launch too: the
    server runs it (no heads beside it: no speculation, serve's default) and its tokenizer
    (here without <|endoftext|>) makes the prompts; the served name is the server's own; the
    engine flags reach the server (its /metrics count the replayed steps)."""
    folder = tmp_path / "model"
    shutil.copytree(qwen3_dir, folder)
    text = (folder / "tokenizer.json").read_text()
    (folder / "tokenizer.json").write_text(text.replace("<|endoftext|>", "<|end|>"))
    code = main(["bench", "serve", "--launch", "--quick", "--model", str(folder),
                 "--concurrency", "1", "--repeats", "1", "--warmup", "0", "--output-len", "4",
                 "--graph-backend", "replay", "--out", str(tmp_path / "out")])
    assert code == 0, capsys.readouterr().err
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["launched_speculative_config"] is None
    assert results["launched_engine_flags"] == ["--graph-backend", "replay"]
    [config] = results["configs"]
    assert (config["method"], config["status"], config["output_len"]) == ("none", "ok", 4)
    assert config["summary"]["captured_share"] > 0


def test_extract_hidden_states_on_a_two_layer_folder(qwen3_dir, tmp_path, capsys):
    """Issue 37, item 4: vLLM's default aux layers (2, L/2, L-3) held inside a 2-layer
    target ((1, 1, 0)); --aux-layer-ids picks others; --speculative-config naming only the
    method runs with its K of 1."""
    from safetensors.torch import load_file
    base = ["generate", "--model", str(qwen3_dir), "--prompt", "def f(", "--max-tokens", "3"]
    for i, extra in enumerate([["--method", "extract_hidden_states"],
                               ["--method", "extract_hidden_states", "--aux-layer-ids", "0,1"],
                               ["--speculative-config", '{"method": "extract_hidden_states"}']]):
        out = tmp_path / f"hs{i}"
        assert main(base + extra + ["--output-dir", str(out)]) == 0, capsys.readouterr().err
        [file] = out.glob("*.safetensors")
        assert load_file(str(file))["hidden_states"].shape[1] == (2 if i == 1 else 3)
    capsys.readouterr()
    assert main(base + ["--method", "extract_hidden_states", "--aux-layer-ids", "0,2",
                        "--output-dir", str(tmp_path / "bad")]) == 2
    assert "--aux-layer-ids=0,2: [2] outside the target's layers [0, 2)" in \
        capsys.readouterr().err


def test_serve_chat_uses_the_folders_template(qwen3_dir):
    llm = LLM(model=str(qwen3_dir), max_model_len=128)
    server = ServerThread(build_server_app(llm, "qwen3-tiny"))
    try:
        messages = [{"role": "user", "content": "hi"}]
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": "qwen3-tiny", "messages": messages, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant"  # jinja drops the
        # template's last newline
        ids = llm.tokenizer.encode(prompt).ids
        expected = hf_greedy(qwen3_dir, [ids], max_new_tokens=6)[0]
        assert r.json()["choices"][0]["token_ids"] == expected
    finally:
        server.close()


PEAK_SCRIPT = r"""
import json, sys, torch, transformers
from pathlib import Path
from transformers.initialization import no_init_weights
path = Path(sys.argv[1])
cfg = transformers.LlamaConfig(vocab_size=16000, hidden_size=1024, intermediate_size=2816,
                               num_hidden_layers=4, num_attention_heads=8,
                               num_key_value_heads=8, tie_word_embeddings=False)
with no_init_weights():  # sizes matter here, not values (a random init took ~3.5 s)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, max_shard_size="40MB")
del cfg
import gc; gc.collect()
from specdec.models import load_model

def rss_hwm():  # kB; reset first so only the load counts
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])
open("/proc/self/clear_refs", "w").write("5")
before = rss_hwm()
model = load_model(path)
print(json.dumps({"rise_kb": rss_hwm() - before,
                  "model_kb": sum(p.numel() * p.element_size() for p in model.parameters()) / 1024,
                  "shard_kb": max(f.stat().st_size for f in path.glob("model-*")) / 1024}))
"""


def test_loading_peaks_at_about_the_model_plus_one_shard(tmp_path):
    """A ~330 MB float32 Llama in 40 MB shards: the load's peak rise stays below the model
    plus two shards (a whole-checkpoint dict would add the model again)."""
    run = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(tmp_path / "m")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["model_kb"] > 250_000
    assert r["rise_kb"] < r["model_kb"] + 2 * r["shard_kb"], r
