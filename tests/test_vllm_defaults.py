"""Device and dtype chosen as vLLM chooses them (issue 51, item 1): the accelerator when one is
present, else cpu, for ``LLM`` as for the commands (one rule: ``platform.default_device``);
``dtype="auto"`` (the default): the checkpoint's torch_dtype, float32 on CPU. The device check
is monkeypatched, as tests/test_cli.py does for the graph backend's default."""

import argparse
import importlib
import json
import types

import pytest
import torch

from specdec import platform
from specdec.bench import itl
from specdec.commands.cli import build_parser, main
from specdec.engine.config import EngineConfig, auto_dtype
from specdec.engine.inputs import checkpoint_dtype
from specdec.engine.llm import LLM
from specdec.flags import engine_kwargs

PROMPT = "def fibonacci(n):"


@pytest.fixture
def no_npu(monkeypatch):
    monkeypatch.setattr(platform, "_has_module", lambda name: False)


def test_default_device_is_the_accelerator_when_present(monkeypatch, no_npu):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert platform.default_device() == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert platform.default_device() == "cpu"
    # an NPU: torch_npu installed (its import registers torch.npu) and a device seen
    monkeypatch.setattr(platform, "_has_module", lambda name: name == "torch_npu")
    monkeypatch.setattr(importlib, "import_module", lambda name: None)
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: True),
                        raising=False)
    assert platform.default_device() == "npu"
    torch.npu.is_available = lambda: False
    assert platform.default_device() == "cpu"


def test_llm_and_the_commands_share_the_rule(monkeypatch, no_npu):
    """With CUDA reported present, LLM() without device= goes for cuda (on this CPU-only torch
    the device check then refuses it, which proves the choice), as the commands' flags do."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="device='cuda' is not available"):
        LLM()
    for argv in (["generate", "--prompt", "x"], ["serve"]):
        assert engine_kwargs(build_parser().parse_args(argv))["device"] == "cuda"
    args = build_parser().parse_args(["bench", "--quick"])
    assert itl.resolve_dtype({"device": "cuda"}) == "float16"  # the embedded model's
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert itl.sweep_from_args(args)["device"] == "cpu"
    assert LLM(max_model_len=32, max_num_seqs=1).device == torch.device("cpu")


def test_auto_dtype_rule():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert auto_dtype("bfloat16", cuda) == torch.bfloat16
    assert auto_dtype("float16", cuda) == torch.float16
    assert auto_dtype(None, cuda) == torch.float32  # the checkpoint names none
    assert auto_dtype("bfloat16", cpu) == torch.float32  # bf16 / fp16 matmuls are slow there
    with pytest.raises(ValueError, match=r"torch_dtype='float8_e4m3fn'.*allowed.*'auto'"):
        auto_dtype("float8_e4m3fn", cuda)
    assert auto_dtype("float8_e4m3fn", cpu) == torch.float32


def test_checkpoint_dtype_reads_torch_dtype_or_dtype(tmp_path):
    for key in ("torch_dtype", "dtype"):
        (tmp_path / key).mkdir()
        (tmp_path / key / "config.json").write_text(json.dumps(
            {"architectures": ["LlamaForCausalLM"], key: "bfloat16"}))
        assert checkpoint_dtype(tmp_path / key) == "bfloat16"
    assert checkpoint_dtype(None) == "float16"  # the embedded model's config.json
    assert checkpoint_dtype(tmp_path / "missing") is None


def test_engine_config_resolves_auto_and_keeps_explicit_values():
    cfg = EngineConfig(device="cpu", checkpoint_dtype="bfloat16")
    assert cfg.dtype == torch.float32 and cfg.dtype_auto
    assert "auto: float32 on CPU; the checkpoint's is bfloat16" in cfg.describe()
    for given, want in (("bfloat16", torch.bfloat16), ("half", torch.float16),
                        ("float", torch.float32), (torch.float64, torch.float64)):
        cfg = EngineConfig(dtype=given, device="cpu")
        assert cfg.dtype == want and not cfg.dtype_auto
    with pytest.raises(ValueError, match=r"dtype='int8': allowed \['auto', 'float32'"):
        EngineConfig(dtype="int8")


def test_llm_auto_dtype_on_cpu_and_a_given_target(folder):
    """A bfloat16 checkpoint runs float32 on CPU by default, bfloat16 when asked; a target
    object keeps its own dtype (nothing is converted)."""
    llm = LLM(folder / "target", max_model_len=32, max_num_seqs=1)
    assert llm.config.dtype == torch.float32 and llm.init_kwargs["dtype"] == torch.float32
    assert llm.init_kwargs["device"] == "cpu"  # what data-parallel ranks are built with
    bf16 = llm.target.to(torch.bfloat16)
    other = LLM(target=bf16, tokenizer=llm.tokenizer, max_model_len=32, max_num_seqs=1)
    assert other.config.dtype == torch.bfloat16
    assert len(other.generate(PROMPT, max_tokens=3)[0].token_ids) == 3


def test_the_commands_take_auto_and_print_what_was_chosen(folder, capsys):
    code = main(["generate", "--model", str(folder / "target"), "--prompt", PROMPT,
                 "--max-tokens", "4", "--method", "none"])
    out = " ".join(capsys.readouterr().out.split())  # the console folds at its width
    assert code == 0
    assert out.count("engine: device cpu (default: no accelerator), dtype float32 (auto: "
                     "float32 on CPU; the checkpoint's is float32)") == 1
    assert "first run, cold" in out  # the table says its tok/s is cold
    code = main(["generate", "--model", str(folder / "target"), "--prompt", PROMPT,
                 "--max-tokens", "4", "--method", "none", "--device", "cpu", "--dtype",
                 "half"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0 and "engine: device cpu, dtype float16 speculative decoding" in out
    for argv in (["generate", "--prompt", "x"], ["serve"], ["bench", "serve", "--launch"]):
        args = build_parser().parse_args([*argv, "--dtype", "auto"])
        assert engine_kwargs(args)["dtype"] == "auto"
        assert engine_kwargs(build_parser().parse_args(argv))["dtype"] == "auto"
    args = build_parser().parse_args(["bench", "--quick", "--dtype", "auto"])
    assert isinstance(args, argparse.Namespace) and itl.sweep_from_args(args)["dtype"] == "float32"
