"""The README's promise, entry point by entry point: bad input is a ValueError (TypeError for a
wrong type) whose message names the field; the CLI prints it as one line and exits 2; a bad
checkpoint file is named."""

import json
import shutil

import pytest
import torch

from specdec.config import SpeculativeConfig
from specdec.engine.llm import LLM
from specdec.engine.sequence import SamplingParams

from helpers import CORRUPTIONS, assert_one_line_exit_2, cli

SPEC = {"method": "mtp", "num_speculative_tokens": 2}

LLM_CASES = [  # LLM(**kwargs) -> the field named
    ({"max_model_len": 0}, "max_model_len"), ({"max_model_len": "64"}, "max_model_len"),
    ({"max_num_seqs": -1}, "max_num_seqs"), ({"max_num_batched_tokens": 0},
                                            "max_num_batched_tokens"),
    ({"block_size": 1.5}, "block_size"), ({"dtype": "fp8"}, "dtype"),
    ({"dtype": torch.int64}, "dtype"), ({"device": "tpu"}, "device"), ({"device": 3}, "device"),
    ({"seed": None}, "seed"), ({"seed": 2**64}, "seed"), ({"capture_sizes": 8}, "capture_sizes"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"sequence_parallel": 1}, "sequence_parallel"),
    ({"data_parallel_size": 0}, "data_parallel_size"),
    ({"data_parallel_timeout": 0}, "data_parallel_timeout"),
    ({"data_parallel_timeout": "1"}, "data_parallel_timeout"),
    ({"speculative_config": 5}, "speculative_config"),
    ({"speculative_config": "{bad"}, "speculative_config"),
    ({"speculative_config": {"method": "medusa", "num_speculative_tokens": 2}}, "method"),
    ({"speculative_config": {"method": "mtp"}}, "num_speculative_tokens"),
    ({"speculative_config": {**SPEC, "model": "/nonexistent"}}, "speculative_config.model"),
    ({"speculative_config": {**SPEC, "draft_model_config": 1}}, "draft_model_config"),
    ({"target": "llama"}, "target"), ({"tokenizer": 1}, "tokenizer"), ({"model": 1}, "model"),
    ({"dp": "rank0"}, "dp"),
    ({"speculative_config": SPEC, "draft_head": "mtp"}, "draft_head"),
]


@pytest.mark.parametrize("kwargs,field", LLM_CASES, ids=[repr(k) for k, _ in LLM_CASES])
def test_llm(folder, kwargs, field):  # noqa: F811
    with pytest.raises((ValueError, TypeError), match=field):
        LLM(**{"model": folder / "target", **kwargs})


GENERATE_CASES = [  # llm.generate(prompts, **kwargs) -> the field named
    (([[1, 2]],), {"max_tokens": 0}, "max_tokens"), (([[1, 2]],), {"max_tokens": "2"}, "max_tokens"),
    (([[1, 2]],), {"temperature": -0.5}, "temperature"),
    (([[1, 2]],), {"temperature": float("nan")}, "temperature"),
    (([[1, 2]],), {"top_p": 1.5}, "top_p"), (([[1, 2]],), {"ignore_eos": 1}, "ignore_eos"),
    (([[1, 2]],), {"stop_token_ids": [-1]}, "stop_token_ids"),
    (([[1, 2]],), {"stop_token_ids": "5"}, "stop_token_ids"),
    (([[1, 2.0]],), {}, "prompts"), (([[1, 10**9]],), {}, "prompts"), ((["a", []],), {}, "prompts"),
    (("",), {}, "prompts"), ((None,), {}, "prompts"), (({1: 2},), {}, "prompts"),
    (([list(range(1, 70))],), {}, "prompts"),
]


@pytest.mark.parametrize("args,kwargs,field", GENERATE_CASES,
                         ids=[f"{a!r:.30}-{k!r}" for a, k, _ in GENERATE_CASES])
def test_generate(llm, args, kwargs, field):  # noqa: F811
    with pytest.raises((ValueError, TypeError), match=field):
        llm.generate(*args, **{"max_tokens": 2, **kwargs})
    assert not llm.scheduler.waiting and not llm.scheduler.running


@pytest.mark.parametrize("call,field", [
    (lambda llm: llm.add_request([1, 2], {"max_tokens": 2}), "params"),
    (lambda llm: llm.add_request([1, 2], SamplingParams(), request_id=5), "request_id"),
    (lambda llm: llm.add_request([1, llm.vocab_size], SamplingParams()), "prompt"),
    (lambda llm: SamplingParams(top_p=float("inf")), "top_p"),
    (lambda llm: SamplingParams(stop_token_ids=[True]), "stop_token_ids"),
])
def test_add_request_and_sampling_params(llm, call, field):  # noqa: F811
    with pytest.raises((ValueError, TypeError), match=field):
        call(llm)


SPEC_CASES = [  # SpeculativeConfig.from_dict(d) -> the field named
    ({"method": 3, "num_speculative_tokens": 1}, "method"),
    ({"method": "mtp", "num_speculative_tokens": "3"}, "num_speculative_tokens"),
    ({"method": "mtp", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "mtp", "num_speculative_tokens": 1, "graph_mode": "x"}, "graph_mode"),
    ({"method": "extract_hidden_states", "num_speculative_tokens": 1, "graph_mode": "torchair",
      "draft_model_config": {"eagle_aux_hidden_state_layer_ids": [1]}}, "graph_mode"),
    ({"method": "mtp", "num_speculative_tokens": 1, "disable_padded_drafter_batch": "no"},
     "disable_padded_drafter_batch"),
    ({"method": "mtp", "num_speculative_tokens": 1, "model": 5}, "model"),
    ({"method": "eagle3", "num_speculative_tokens": 1,
      "draft_model_config": {"eagle_aux_hidden_state_layer_ids": [-1]}},
     "eagle_aux_hidden_state_layer_ids"),
    ({"method": "extract_hidden_states", "num_speculative_tokens": 2}, "num_speculative_tokens"),
    ({"method": "mtp", "num_speculative_tokens": 1, "typo": 1}, "typo"),
]


@pytest.mark.parametrize("d,field", SPEC_CASES, ids=[f for _, f in SPEC_CASES])
def test_speculative_config(d, field):
    with pytest.raises((ValueError, TypeError), match=field):
        SpeculativeConfig.from_dict(d)


CLI_CASES = [  # specdec generate ... -> the flag or field named on one line, exit 2
    (["--max-tokens", "0"], "--max-tokens"), (["--temperature", "inf"], "--temperature"),
    (["--temperature", "nan"], "--temperature"), (["--dp", "0"], "--dp"),
    (["-k", "0", "--method", "mtp"], "num_speculative_tokens"),
    (["--seed", "-1"], "seed"), (["--seed", str(2**70)], "seed"),
    (["--speculative-config", "[1]"], "--speculative-config"),
    (["--speculative-config", json.dumps({"model": "/nonexistent"}), "--method", "eagle"],
     "speculative_config.model"),
    (["--method", "extract_hidden_states"], "--output-dir"),
    (["--prompt", ""], "prompts"),
]


@pytest.mark.parametrize("argv,field", CLI_CASES, ids=[" ".join(a) for a, _ in CLI_CASES])
def test_cli_flags(folder, capsys, argv, field):  # noqa: F811
    argv = ["generate", "--model", str(folder / "target"), "--prompt", "x", *argv]
    code, out, err = cli(capsys, *argv)
    assert out == ""
    assert_one_line_exit_2(code, err, field)


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_checkpoint_on_disk(folder, tmp_path, case):  # noqa: F811
    root = tmp_path / "m"
    shutil.copytree(folder, root)
    rel, corrupt, _ = CORRUPTIONS[case]
    corrupt(root / rel)
    with pytest.raises(ValueError, match=str(root / rel.split("/")[0])):
        LLM(root / "target", {"method": "eagle3", "num_speculative_tokens": 2})
