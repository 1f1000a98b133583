"""Issue 13: what a new user and a fault probe hit. One test (or parametrized group) per item.

Everything runs on a tiny random model saved to disk (target + tokenizer + mtp/eagle/eagle3
heads, the EAGLE-3 head with a 48-token draft vocab and its d2t map); corrupted copies of it
are made per test.
"""

import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdec.engine.llm import LLM
from specdec.engine.sequence import SamplingParams

from helpers import AUX, CORRUPTIONS, MAX_POS, assert_one_line_exit_2, cli



@pytest.fixture
def copy(folder, tmp_path) -> Path:
    """A private copy of the model folders, to corrupt."""
    shutil.copytree(folder, tmp_path / "m")
    return tmp_path / "m"


def assert_idle(llm: LLM) -> None:
    """Nothing queued or running; every KV block and row free."""
    s = llm.scheduler
    assert not s.waiting and not s.running
    assert len(llm.allocator.free) == llm.config.num_kv_blocks
    assert sorted(s.free_rows) == list(range(s.max_num_seqs))


# ---- 1. extract_hidden_states from the CLI --------------------------------------------------
def test_1_cli_extract_hidden_states_runs_with_defaults(folder, tmp_path, capsys):
    out = tmp_path / "hs"
    code, stdout, err = cli(capsys, "generate", "--model", str(folder / "target"), "--prompt",
                            "def f(x):", "--max-tokens", "3", "--method",
                            "extract_hidden_states", "--output-dir", str(out))
    assert code == 0, err
    f = load_file(str(out / "0.safetensors"))
    assert f["hidden_states"].shape[1:] == (3, 32)  # vLLM's default layers (2, L//2, L-3)
    code, _, err = cli(capsys, "generate", "--model", str(folder / "target"), "--prompt", "x",
                       "--method", "extract_hidden_states")
    assert_one_line_exit_2(code, err, "--output-dir")


# ---- 2. one string is one prompt ------------------------------------------------------------
def test_2_a_single_str_or_id_list_is_one_prompt(llm):
    text = llm.generate("def f(x):", max_tokens=3)
    assert len(text) == 1 and text[0].prompt_token_ids == llm.tokenizer.encode("def f(x):").ids
    ids = llm.generate([5, 9, 13], max_tokens=3)
    assert len(ids) == 1 and ids[0].prompt_token_ids == [5, 9, 13]
    assert llm.generate([], max_tokens=3) == []


# ---- 3. error types: an unavailable device lists the available ones ------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a build or host without CUDA")
def test_3_unavailable_device_is_a_value_error_listing_the_available(folder):
    with pytest.raises(ValueError, match=r"device='cuda' is not available.*\['cpu'"):
        LLM(folder / "target", device="cuda")
    with pytest.raises(ValueError, match=r"device='cuda:3'"):
        LLM(folder / "target", device="cuda:3")


# ---- 5. torchair-mtp: compile time apart from tok/s ---------------------------------------
def test_5_torchair_compile_is_timed_apart(folder, capsys):
    code, out, err = cli(capsys, "generate", "--model", str(folder / "target"), "--prompt", "x",
                         "--max-tokens", "4", "--method", "torchair-mtp", "-k", "2",
                         "--compile-backend", "eager")  # dynamo's graphs, no inductor codegen
    assert code == 0, err
    assert "graph compile + warm-up:" in out and "│ torchair-mtp " in out


def test_5_compile_backend_without_a_compiling_graph_backend_names_the_flags(folder, capsys):
    code, _, err = cli(capsys, "generate", "--model", str(folder / "target"), "--prompt", "x",
                       "--max-tokens", "2", "--method", "none", "--compile-backend", "eager")
    assert code == 2 and err.count("\n") == 1
    assert "compile_backend='eager' is for a compiling graph backend" in err
    assert "this engine's is 'eager'" in err
    code, _, err = cli(capsys, "generate", "--model", str(folder / "target"), "--prompt", "x",
                       "--max-tokens", "2", "--method", "none", "--graph-backend", "compile",
                       "--compile-backend", "tensorrt")
    assert code == 2 and "compile_backend='tensorrt'" in err and "inductor" in err


# ---- 6. small CLI / README gaps ------------------------------------------------------------
ROOT = Path(__file__).resolve().parent.parent


def test_6_readme_gaps():
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "../shared" not in readme and "docs/DESIGN.md" in readme
    assert (ROOT / "docs" / "DESIGN.md").is_file()
    for flag in ("--max-tokens", "--seed", "--output-dir", "--version"):
        assert flag in readme, flag
    assert "`num_drafted` and `num_accepted` are per draft position" in readme
    assert "toy quality" in readme
    assert "/bench-results/" in (ROOT / ".gitignore").read_text().splitlines()
    assert "benchmarks.itl" not in (ROOT / "specdec" / "bench" / "itl.py").read_text()


# ---- 8. a bad token id never reaches the model; a failed request does not poison the engine -
def test_8_out_of_vocab_id_is_rejected_at_add_request(llm):
    v = llm.vocab_size
    with pytest.raises(ValueError, match=rf"prompt\[1\]={v}: .*vocab_size={v}"):
        llm.add_request([5, v], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"prompts\[0\]\[0\]=-1"):
        llm.generate([[-1, 3]], max_tokens=2)
    assert_idle(llm)
    assert llm.generate([[5, 9]], max_tokens=2)[0].finish_reason in ("length", "eos")


def extract_llm(target_dir: Path, out: Path) -> LLM:
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"eagle_aux_hidden_state_layer_ids": AUX,
                                   "output_dir": str(out)}}
    return LLM(target_dir, spec, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32)


def test_8_13_io_error_fails_that_request_only_and_the_engine_goes_on(folder, tmp_path):
    """A request whose hidden-state file cannot be written is finished with an error; the
    request decoding beside it and every later call go on as on a fresh engine."""
    out = tmp_path / "hs"
    llm = extract_llm(folder / "target", out)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    a = llm.add_request([5, 9, 13], params)
    llm.step()  # a's prefill is done: its file is written
    assert (out / f"{a.request_id}.safetensors").is_file()
    out.rename(tmp_path / "moved")
    out.write_text("not a folder")  # b's file cannot be written
    b = llm.add_request([7, 7, 7, 7], params)
    while llm.step() is not None:
        pass
    assert b.finish_reason == "error" and "hs" in b.error
    fresh = extract_llm(folder / "target", tmp_path / "fresh")
    assert a.finish_reason == "length"
    assert a.output_token_ids == fresh.generate([[5, 9, 13]], 8, ignore_eos=True)[0].token_ids
    assert_idle(llm)
    out.unlink()
    out.mkdir()
    again = llm.generate([[7, 7, 7, 7]], max_tokens=8, ignore_eos=True)[0]
    assert again.token_ids == fresh.generate([[7, 7, 7, 7]], 8, ignore_eos=True)[0].token_ids


# ---- 9. corrupted checkpoints: one error naming the file ------------------------------------
@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_9_11_corrupted_checkpoint_is_one_error_naming_the_file(copy, capsys, case):
    rel, corrupt, what = CORRUPTIONS[case]
    corrupt(copy / rel)
    spec = {"method": "eagle3", "num_speculative_tokens": 2}
    with pytest.raises(ValueError) as e:
        LLM(copy / "target", spec)
    assert str(copy / rel.split("/")[0]) in str(e.value) and what in str(e.value)
    code, _, err = cli(capsys, "generate", "--model", str(copy / "target"), "--prompt", "x",
                       "--method", "eagle3")
    assert_one_line_exit_2(code, err, what)


# ---- 10. silently accepted inputs ----------------------------------------------------------
def test_10_stop_token_ids_must_be_a_list_of_vocab_ids(llm):
    with pytest.raises(TypeError, match="stop_token_ids=5"):
        llm.generate([[5, 9]], max_tokens=2, stop_token_ids=5)
    with pytest.raises(ValueError, match=r"stop_token_ids\[0\]"):
        llm.generate([[5, 9]], max_tokens=2, stop_token_ids=[llm.vocab_size])
    out = llm.generate([[5, 9]], max_tokens=8, ignore_eos=True)[0]
    stop = out.token_ids[2]
    got = llm.generate([[5, 9]], max_tokens=8, ignore_eos=True, stop_token_ids=[stop])[0]
    assert got.finish_reason == "stop" and got.token_ids == out.token_ids[:out.token_ids.index(stop) + 1]


def test_10_extract_hidden_states_refuses_a_used_output_dir(folder, tmp_path):
    out = tmp_path / "hs"
    extract_llm(folder / "target", out).generate([[5, 9, 13]], max_tokens=2)
    with pytest.raises(ValueError, match="output_dir=.*already holds"):
        extract_llm(folder / "target", out)
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"eagle_aux_hidden_state_layer_ids": AUX,
                                   "output_dir": str(out), "overwrite_output_dir": True}}
    LLM(folder / "target", spec, max_model_len=64, max_num_seqs=4)  # asked for: allowed


# ---- 11. silent wrong output -----------------------------------------------------------------
@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(temperature=float("nan")), ValueError, "temperature=nan"),
    (dict(temperature=float("inf")), ValueError, "temperature=inf"),
    (dict(temperature=1e300), ValueError, r"temperature=1e\+300: must be finite, in \[0.0, "
                                          r"3.40\d*e\+38\]"),  # inf in the float32 step
    (dict(top_p=float("nan")), ValueError, "top_p=nan"),
    (dict(ignore_eos="no"), TypeError, "ignore_eos='no'"),
    (dict(max_tokens=True), TypeError, "max_tokens=True"),
    (dict(max_tokens=2.0), TypeError, "max_tokens=2.0"),
])
def test_11_non_finite_and_mistyped_sampling_params(llm, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        llm.generate([[5, 9]], **{"max_tokens": 2, **kwargs})
    assert_idle(llm)


@pytest.mark.parametrize("prompt,match", [([1.0, 2.5], r"\[0\]=1.0"), ([[1, True]], r"=True"),
                                          ([["a"]], r"\[0\]\[0\]='a'")])
def test_11_non_int_ids_are_a_type_error(llm, prompt, match):
    with pytest.raises(TypeError, match=match):
        llm.generate(prompt, max_tokens=2)


def test_11_cli_nan_temperature(folder, capsys):
    code, _, err = cli(capsys, "generate", "--model", str(folder / "target"), "--prompt", "x",
                       "--temperature", "nan")
    assert_one_line_exit_2(code, err, "--temperature=nan")


# ---- 12. no lost or re-run work -----------------------------------------------------------
def test_12_generate_checks_every_prompt_before_queueing_any(llm):
    with pytest.raises(ValueError, match=r"prompts\[1\] has 80 tokens"):
        llm.generate([[5, 9], list(range(1, 81))], max_tokens=2)
    assert_idle(llm)
    outs = llm.generate([[7, 8]], max_tokens=2)
    assert len(outs) == 1 and outs[0].prompt_token_ids == [7, 8]


def test_12_ctrl_c_leaves_no_queued_requests(llm):
    prompts = [[5, 9, 13], [7, 7], [1, 2, 3, 4]]
    fresh = llm.generate(prompts, max_tokens=40, ignore_eos=True)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.02)
        with pytest.raises(KeyboardInterrupt):
            for _ in range(100):  # the timer fires inside one of these
                llm.generate(prompts * 2, max_tokens=40, ignore_eos=True)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert_idle(llm)
    again = llm.generate(prompts, max_tokens=40, ignore_eos=True)
    assert [o.token_ids for o in again] == [o.token_ids for o in fresh]
    assert [o.request_id for o in again] != [o.request_id for o in fresh]  # no re-run


# ---- 14. late or misleading errors: caught at construction, also before DP ranks start ------
@pytest.mark.parametrize("spec,match", [
    ({"method": "eagle3", "draft_model_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}},
     r"ids=\[1, 2\]: .*eagle3.* combines target layers \[.*\] \(as trained\)"),
    ({"method": "eagle3", "model": "{root}/eagle"}, r"method='eagle3', but .* is a 'eagle' head"),
    ({"method": "eagle", "model": "{root}/mtp"}, r"method='eagle', but .* is a 'mtp' head"),
    ({"method": "mtp", "model": "{root}/eagle3"}, r"method='mtp', but .* is a 'eagle3' head"),
])
@pytest.mark.parametrize("dp", [1, 2])
def test_14_head_method_and_aux_layers_agree_at_construction(folder, spec, match, dp):
    spec = {"num_speculative_tokens": 2, **spec}
    if "model" in spec:
        spec["model"] = spec["model"].format(root=folder)
    with pytest.raises(ValueError, match=match):
        LLM(folder / "target", spec, data_parallel_size=dp)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_model_len=MAX_POS + 1), "max_position_embeddings"),
    (dict(speculative_config={"method": "mtp", "num_speculative_tokens": 2},
          max_num_batched_tokens=2), "max_num_batched_tokens=2"),
    (dict(dtype="int8"), "dtype='int8'"),
])
def test_14_dp_parent_validates_the_whole_config(folder, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(folder / "target", data_parallel_size=2, **kwargs)


def test_14_a_draft_head_without_a_speculative_config_or_beside_its_model_is_refused():
    """It was accepted and never drafted; beside speculative_config.model, the folder was
    accepted and never read."""
    from helpers import tiny_head, tiny_target
    target = tiny_target()
    with pytest.raises(ValueError, match="draft_head: a head drafts only under a "
                                         "speculative_config"):
        LLM(target=target, draft_head=tiny_head("mtp", target))
    with pytest.raises(ValueError, match="draft_head and speculative_config.model='elsewhere' "
                                         "both give the head"):  # the folder was never read
        LLM(target=target, draft_head=tiny_head("mtp", target), speculative_config={
            "method": "mtp", "num_speculative_tokens": 2, "model": "elsewhere"})


# ---- 15. sizes bounded by the model and by memory -------------------------------------------
def test_15_sizes_are_bounded_by_the_model_and_memory(folder):
    with pytest.raises(ValueError, match=rf"max_model_len={MAX_POS + 1}: allowed .*<= {MAX_POS}"):
        LLM(folder / "target", max_model_len=MAX_POS + 1)
    with pytest.raises(ValueError, match=r"max_num_seqs=1000000000.*GiB"):
        LLM(folder / "target", max_num_seqs=10**9, max_model_len=MAX_POS)


def test_15_max_model_len_holds_a_prompt_and_a_token(folder):
    """max_model_len=1 admits no prompt (a prompt must be shorter than it): refused at
    construction; 2, the smallest allowed, serves a 1-token prompt its one token."""
    with pytest.raises(ValueError, match=r"max_model_len=1: allowed 2 <= max_model_len"):
        LLM(folder / "target", max_model_len=1)
    out = LLM(folder / "target", max_model_len=2).generate([[3]], max_tokens=5)[0]
    assert (len(out.token_ids), out.finish_reason) == (1, "length")


# ---- 17. wrong exception types ---------------------------------------------------------------
@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(speculative_config=5), TypeError, "speculative_config=5"),
    (dict(speculative_config=["mtp"]), TypeError, "speculative_config="),
    (dict(speculative_config="{bad"), ValueError, "speculative_config=.*not valid JSON"),
    (dict(target=object()), TypeError, "target="),
    (dict(tokenizer="x"), ValueError, "tokenizer='x': no tokenizer.json there"),
    (dict(tokenizer=5), TypeError, "tokenizer=5: must be a folder"),
    (dict(dtype=torch.int32), ValueError, "dtype=torch.int32"),
    (dict(dtype=5), TypeError, "dtype=5"),
    (dict(seed="abc"), TypeError, "seed='abc'"),
    (dict(seed=2**70), ValueError, "seed="),
    (dict(seed=-1), ValueError, "seed=-1"),
    (dict(max_num_seqs=True), TypeError, "max_num_seqs=True"),
    (dict(sequence_parallel="yes"), TypeError, "sequence_parallel='yes'"),
    (dict(capture_sizes=[4, 0]), ValueError, r"capture_sizes\[1\]=0"),
    (dict(model=5), TypeError, "model=5"),
])
def test_17_bad_llm_arguments_raise_value_or_type_error(folder, kwargs, exc, match):
    kwargs = {"model": folder / "target", **kwargs}
    with pytest.raises(exc, match=match):
        LLM(**kwargs)


def test_17_a_target_in_another_dtype_is_named_with_both_fixes():
    """A target module whose parameters are not ``dtype`` (the KV cache's) is refused at
    construction, naming both dtypes and both ways to match them (it used to fail deep in the
    first step's cache write)."""
    from specdec.models.config import ModelConfig
    from specdec.models.llama import LlamaForCausalLM
    cfg = ModelConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=7)
    target = LlamaForCausalLM(cfg).eval()
    with pytest.raises(ValueError, match=r"target: its parameters are torch.float32, "
                       r"dtype=torch.bfloat16.*target.to\(torch.bfloat16\) or dtype=torch.float32"):
        LLM(target=target, dtype=torch.bfloat16)
    assert LLM(target=target.to(torch.bfloat16), dtype=torch.bfloat16).generate(
        [[1, 2, 3]], max_tokens=2)[0].token_ids


@pytest.mark.parametrize("prompts,kwargs,exc,match", [
    (5, {}, TypeError, "prompts=5"),
    (None, {}, TypeError, "prompts=None"),
    ([None], {}, TypeError, r"prompts\[0\]=None"),
    ([[5, 9]], dict(temperature="0.5"), TypeError, "temperature='0.5'"),
    ([[5, 9]], dict(top_p=0), ValueError, "top_p=0.0"),
])
def test_17_bad_generate_arguments_raise_value_or_type_error(llm, prompts, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        llm.generate(prompts, max_tokens=2, **kwargs)
    assert_idle(llm)


# ---- 18. sampling and batch neighbours: documented ------------------------------------------
def test_18_readme_says_a_sampled_output_ignores_its_batch(folder):
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "never of its batch" in readme

    def first(prompts):  # a fresh engine, same seed: only the batch differs
        return LLM(folder / "target", seed=0, max_model_len=64).generate(
            prompts, max_tokens=8, temperature=1.0, ignore_eos=True)[0].token_ids
    alone = first([[5, 9]])
    assert first([[5, 9]]) == alone
    assert first([[5, 9], [7, 7, 7]]) == alone  # what the README promises
