"""extract_hidden_states: one file per request, equal to the target's plain dense forward.

A 7-token budget splits the prompts into several prefill chunks; each file must hold
``token_ids [T]`` and ``hidden_states [T, len(layer_ids), H]``, appear once (write then
rename: no ``.tmp`` ever left, never rewritten) right after the request's last chunk.
"""

import pytest
import torch
from safetensors.torch import load_file

from specdec.engine.llm import LLM
from specdec.engine.sequence import SamplingParams

from helpers import PROMPTS, tiny_target, dense_greedy

LAYER_IDS = [0, 2, 3]
BUDGET = 7  # tokens per step: the 40-token prompt takes 6 chunks


def run_extract(target, out_dir, **kw):
    """Step the engine by hand; after each step note which files exist and their identity."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"eagle_aux_hidden_state_layer_ids": LAYER_IDS,
                                   "output_dir": str(out_dir)}}
    llm = LLM(target=target, speculative_config=spec, dtype=torch.float64, max_model_len=64,
              max_num_seqs=4, max_num_batched_tokens=BUDGET, **kw)
    reqs = [llm.add_request(p, SamplingParams(max_tokens=6)) for p in PROMPTS]
    seen = []  # per step: ({file name: (inode, mtime_ns)}, {request id: prefill done}, all names)
    while llm.step() is not None:
        names = sorted(p.name for p in out_dir.iterdir())
        files = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out_dir.iterdir()}
        seen.append((files, {r.request_id: not r.is_prefilling for r in reqs}, names))
    return llm, reqs, seen


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    target = tiny_target()
    out = tmp_path_factory.mktemp("hidden")
    return target, out, *run_extract(target, out)


def test_files_hold_the_dense_forward_hidden_states(extracted):
    target, out, _, reqs, _ = extracted
    for r, prompt in zip(reqs, PROMPTS):
        f = load_file(str(out / f"{r.request_id}.safetensors"))
        assert f["token_ids"].tolist() == prompt
        assert f["hidden_states"].shape == (len(prompt), len(LAYER_IDS), 32)
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            _, aux = target(ids, torch.arange(len(prompt))[None], aux_layer_ids=tuple(LAYER_IDS))
        torch.testing.assert_close(f["hidden_states"], aux[0], rtol=1e-9, atol=1e-10)


def test_prompts_were_chunked(extracted):
    *_, seen = extracted
    # the 40-token request ("1") is still prefilling after 5 steps of a 7-token budget
    assert sum(not done["1"] for _, done, _ in seen) >= 5


def test_each_file_appears_after_the_last_chunk_once_and_no_tmp_is_left(extracted):
    *_, seen = extracted
    first = {}
    for files, done, names in seen:
        assert not [n for n in names if not n.endswith(".safetensors")], names
        assert {n.removesuffix(".safetensors") for n in files} == {r for r, d in done.items() if d}
        for name, ident in files.items():
            assert first.setdefault(name, ident) == ident, f"{name} was rewritten"
    assert len(first) == len(PROMPTS)


def test_generation_is_still_lossless(extracted):
    target, _, llm, reqs, _ = extracted
    assert [r.output_token_ids for r in reqs] == [dense_greedy(target, p, 6, 64) for p in PROMPTS]
