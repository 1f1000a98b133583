"""method ``draft_model``: a separate small causal LM drafts for the embedded target. A copy of
the target as its own draft model is accepted at every position (acceptance K + 1); a tiny
transformers Llama of the target's tokenizer drafts without changing a greedy token (padded
and ragged, eager and replay, one request and eight, data parallel with an idle rank); its
draft trees (static and dynamic) the same; a draft model of another vocabulary or tokenizer,
or none, is refused by name."""

import itertools
import json
import shutil

import pytest
import torch

from specdec.engine.llm import DEFAULT_MODEL, LLM
from specdec.engine.sequence import SamplingParams

import hf_models
from helpers import assert_one_line_exit_2, cli

K = 3
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, x):",
           "for i in range(10):", "with open(path) as f:", "x = [", "return self.", "try:\n"]


def spec(model, padded=True, k=K) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k,
            "disable_padded_drafter_batch": not padded}


def engine(speculative_config=None, **kw) -> LLM:
    return LLM(speculative_config=speculative_config, dtype=torch.float64, max_model_len=128,
               **kw)


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory):
    """A tiny random Llama built and saved by transformers, with the target's vocabulary and
    tokenizer.json: a draft model that disagrees with the target often."""
    path = hf_models._llama(tmp_path_factory.mktemp("draft") / "llama", vocab_size=2048)
    shutil.copy(DEFAULT_MODEL / "tokenizer.json", path / "tokenizer.json")
    return path


@pytest.fixture(scope="module")
def plain():
    """Plain greedy tokens of every prompt (ignore_eos, 13 tokens)."""
    return [o.token_ids for o in engine().generate(
        PROMPTS, SamplingParams(max_tokens=13, ignore_eos=True))]


@pytest.mark.parametrize("padded,backend", [(True, "eager"), (True, "replay"), (False, "replay")],
                         ids=["padded-eager", "padded-replay", "ragged-replay"])
def test_a_copy_of_the_target_is_accepted_at_every_position(plain, padded, backend):
    """The target's own folder as the draft model: every draft equals the target's greedy
    token, so each verifying step accepts K (1 + K tokens per step) and the tokens are plain
    greedy's."""
    outs = engine(spec(DEFAULT_MODEL, padded), graph_backend=backend, max_num_seqs=2).generate(
        PROMPTS[:2], SamplingParams(max_tokens=13, ignore_eos=True))  # 1 + 3 steps of 1 + K
    assert [o.token_ids for o in outs] == plain[:2]
    for o in outs:
        assert o.num_drafted == o.num_accepted == [3, 3, 3]
        assert o.acceptance_length == K + 1


@pytest.mark.parametrize("padded,backend,conc", [(True, "replay", 8), (True, "eager", 1),
                                                 (False, "eager", 8)],
                         ids=["padded-replay-conc8", "padded-eager-conc1", "ragged-conc8"])
def test_a_small_llama_drafts_plain_greedys_tokens(small_llama, plain, padded, backend, conc):
    llm = engine(spec(small_llama, padded), graph_backend=backend, max_num_seqs=conc)
    n = 2 if conc == 1 else len(PROMPTS)  # one at a time: two prompts say it
    outs = llm.generate(PROMPTS[:n], SamplingParams(max_tokens=13, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain[:n]
    assert sum(sum(o.num_drafted) for o in outs) > 0


def test_sampled_padded_equals_sampled_ragged(small_llama):
    """temperature 0.8 (seeded, counter-based numbers): the same drafts verified the same way,
    so the padded and the ragged drafter give the same sampled tokens."""
    params = SamplingParams(max_tokens=13, temperature=0.8, seed=5, ignore_eos=True)
    padded, ragged = (engine(spec(small_llama, p)).generate(PROMPTS[:3], params)
                      for p in (True, False))
    assert [o.token_ids for o in padded] == [o.token_ids for o in ragged]
    assert [o.num_accepted for o in padded] == [o.num_accepted for o in ragged]


def test_data_parallel_with_an_idle_rank(small_llama, plain):
    """Two DP ranks, one prompt: the idle rank runs the draft model's dummy forwards."""
    outs = engine(spec(small_llama), data_parallel_size=2).generate(
        PROMPTS[:1], SamplingParams(max_tokens=13, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain[:1]


TREE = [(0,), (1,), (0, 0), (1, 0), (0, 1), (0, 0, 0)]  # depth 3, 6 drafts
SHAPES = {"static": {"speculative_token_tree": TREE},
          "dynamic": {"tree_topk": 2, "num_draft_tokens": 6}}
FULL = [p for d in (1, 2, 3) for p in itertools.product((0, 1), repeat=d)]  # 14 drafts


def test_a_copys_tree_is_accepted_along_its_first_choices(plain):
    """The target's own folder as the draft model of a static tree holding the chain of first
    choices: that path is the target's greedy tokens, so every verifying step accepts the
    whole depth (the root's row, positions and tree mask off by one would lose it)."""
    config = {**spec(DEFAULT_MODEL), **SHAPES["static"]}
    outs = engine(config, max_num_seqs=2).generate(
        PROMPTS[:2], SamplingParams(max_tokens=13, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain[:2]
    for o in outs:
        assert o.num_accepted == [3, 3, 3] and o.acceptance_length == K + 1


@pytest.mark.parametrize("backend", ["eager", "replay"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_small_llamas_tree_keeps_plain_greedys_tokens(small_llama, plain, shape, backend):
    """Four at a time, arrivals mid-decode (``generate`` admits as rows free), no host read
    in a step."""
    llm = engine({**spec(small_llama), **SHAPES[shape]}, graph_backend=backend, max_num_seqs=4,
                 check_host_syncs=True)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=13, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain
    assert sum(sum(o.num_drafted) for o in outs) > 0
    assert {s.host_syncs for s in llm.steps if s.num_reqs} == {0}
    if backend == "replay":
        assert any(s.captured for s in llm.steps)


def test_a_fitted_tree_temperature_is_the_draft_models_dynamic_tree_default(small_llama,
                                                                              tmp_path):
    """``tree_temperature.fit_draft_model`` writes the draft model's fitted T into its
    folder's config.json; a dynamic tree scores its candidates at it unless the config
    names another."""
    from specdec.train.tree_temperature import GRID, fit_draft_model
    folder = tmp_path / "draft"
    shutil.copytree(small_llama, folder)
    fitted = fit_draft_model(DEFAULT_MODEL, folder, prompts=2)["draft_model"]
    t = json.loads((folder / "config.json").read_text())["tree_score_temperature"]
    assert t == fitted["tree_score_temperature"] and min(GRID) <= t <= max(GRID)
    assert fitted["pairs"] > 0 and fitted["nll"] <= fitted["nll_at_1"]
    dynamic = {**spec(folder), **SHAPES["dynamic"]}
    assert engine(dynamic).runner.proposer.score_temperature == t
    named = engine({**dynamic, "tree_score_temperature": 0.5})
    assert named.runner.proposer.score_temperature == 0.5


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_tree_decodes_up_to_max_model_len(shape):
    """A prompt ending 8 tokens before max_model_len (128: the block table's last block),
    7 tokens out, the target's copy drafting (accepted deep, so trees reach the end): the
    root's and the nodes' rows past the end write nothing, and the tokens are plain
    greedy's."""
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    prompt = [1 + i % 97 for i in range(120)]
    want = engine().generate([prompt], params)[0].token_ids
    out = engine({**spec(DEFAULT_MODEL), **SHAPES[shape]}, max_num_seqs=2).generate(
        [prompt], params)[0]
    assert out.token_ids == want and sum(out.num_accepted) >= 3


def test_each_tree_nodes_logits_are_the_models_over_its_path(small_llama):
    """After the prefill, the full binary tree of depth 3: the root's and every node with
    children's draft-model logits (recorded at its forward) equal transformers' logits at
    the last position of the prompt + the next token + the node's path (its positions, tree
    mask, K/V rows and attention bound all show here)."""
    llm = engine({**spec(small_llama), "speculative_token_tree": FULL}, max_num_seqs=1)
    head, rows = llm.runner.proposer.head, []
    head.register_forward_hook(lambda m, args, out: rows.append(m.compute_logits(out[0])))
    req = llm.add_request(PROMPTS[2], SamplingParams(max_tokens=4, ignore_eos=True))
    llm.step()
    assert not req.is_prefilling and len(rows) == 4  # the prefix pass, root, depths 1 and 2
    got = torch.cat(rows[1:])  # the root, (0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)
    paths = [()] + FULL[:6]
    drafts = {p: t for p, t in zip(FULL, req.spec_token_ids)}
    hf = hf_models.hf_model(small_llama).double()
    for path, logits in zip(paths, got):
        ids = req.token_ids + [drafts[path[:d]] for d in range(1, len(path) + 1)]
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(logits.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_sampled_tree_under_async_scheduling_equals_sync(small_llama, shape):
    """The next tree step built on the device from the accepted path and the draft model's
    nodes: the same sampled tokens and acceptance as the synchronous engine."""
    params = SamplingParams(max_tokens=13, temperature=0.8, seed=5, ignore_eos=True)
    runs = []
    for overlap in (False, True):
        llm = engine({**spec(small_llama), **SHAPES[shape]}, max_num_seqs=4,
                     async_scheduling=overlap)
        outs = llm.generate(PROMPTS[:4], params)
        runs.append([(o.token_ids, o.num_accepted) for o in outs])
    assert runs[0] == runs[1]
    assert sum(s.overlapped for s in llm.steps) > 0


@pytest.mark.parametrize("shape", ["chain", *SHAPES])
def test_an_idle_ranks_forwards_are_a_busy_steps(small_llama, shape):
    """What data parallelism needs of ``dummy_run``: an idle rank runs the draft model over
    the same token counts, in the same order, as a busy rank's step of the same plan (the
    prefix pass over Np, then each loop step's or the tree's root and depths' over Bp rows
    and their nodes), recorded at the draft model's forward."""
    llm = engine({**spec(small_llama), **SHAPES.get(shape, {})}, max_num_seqs=2)
    proposer, plans, calls = llm.runner.proposer, [], []
    propose = proposer.propose
    proposer.propose = lambda x: plans.append(x.plan) or propose(x)
    proposer.head.register_forward_pre_hook(lambda _, args: calls.append(args[0].shape[0]))
    reqs = [llm.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True))
            for p in PROMPTS[:2]]
    while any(r.is_prefilling for r in reqs):
        llm.step()
    calls.clear()
    llm.step()  # two decodes
    busy = list(calls)
    calls.clear()
    proposer.dummy_run(plans[-1])
    assert calls == busy and len(busy) > 2


def test_a_tree_with_an_idle_data_parallel_rank(small_llama, plain):
    """Two ranks, one prompt, a dynamic tree: the idle rank's dummy forwards run beside the
    tree steps (their shapes: ``test_an_idle_ranks_forwards_are_a_busy_steps``)."""
    outs = engine({**spec(small_llama), **SHAPES["dynamic"]}, data_parallel_size=2).generate(
        PROMPTS[:1], SamplingParams(max_tokens=13, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain[:1]


def test_refused_by_name(small_llama, tmp_path):
    with pytest.raises(ValueError, match="method='draft_model' needs speculative_config.model"):
        engine({"method": "draft_model", "num_speculative_tokens": 2})
    other_vocab = hf_models._llama(tmp_path / "v512", vocab_size=512)
    with pytest.raises(ValueError, match=r"v512'\: vocab_size=512, the target's is 2048"):
        engine(spec(other_vocab))
    other_tok = tmp_path / "tok"
    shutil.copytree(small_llama, other_tok)
    tok = json.loads((other_tok / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap ids
    (other_tok / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="tok'.*maps tokens to other ids than the target's"):
        engine(spec(other_tok))
    with pytest.raises(ValueError, match="method='draft_model' with tensor_parallel_size=2"):
        LLM(speculative_config=spec(small_llama), tensor_parallel_size=2)


def test_the_commands_take_draft_model(small_llama, capsys):
    """specdec generate --method draft_model --draft-model DIR: the engine's tokens and a
    table row; without the folder, or the folder with another method: one line, exit 2."""
    code, out, err = cli(capsys, "generate", "--prompt", PROMPTS[0], "--max-tokens", "8",
                         "--method", "draft_model", "--draft-model", str(small_llama), "-k", "2")
    assert code == 0, err
    want = LLM(speculative_config=spec(small_llama, k=2)).generate(PROMPTS[0], max_tokens=8)[0]
    assert out.startswith(PROMPTS[0] + want.text)
    assert "│ draft_model │ 2 │ padded │" in out
    code, _, err = cli(capsys, "generate", "--prompt", "x", "--method", "draft_model")
    assert_one_line_exit_2(code, err, "--method draft_model needs --draft-model DIR")
    code, _, err = cli(capsys, "generate", "--prompt", "x", "--method", "eagle3",
                       "--draft-model", str(small_llama))
    assert_one_line_exit_2(code, err, "is method draft_model's folder", "'eagle3'")


def test_the_bench_sweeps_it(small_llama, tmp_path):
    """specdec bench --methods none,draft_model --draft-model DIR: a measured row per mode
    whose acceptance the engine counted; draft_model without its folder (or the folder
    without the method) is a sweep error."""
    from specdec.bench import itl
    from specdec.flags import UsageError
    out = tmp_path / "out"
    assert itl.main(["--methods", "none,draft_model", "--draft-model", str(small_llama),
                     "--modes", "padded,ragged", "-k", "2", "--concurrency", "2",
                     "--prompt-len", "8", "--output-len", "8", "--repeats", "1",
                     "--out", str(out)]) == 0
    configs = json.loads((out / "results.json").read_text())["configs"]
    drafted = [c for c in configs if c["method"] == "draft_model"]
    assert [(c["mode"], c["status"]) for c in drafted] == [("padded", "ok"), ("ragged", "ok")]
    for c in drafted:
        assert sum(c["repeats"][0]["num_drafted"]) > 0
    for bad in (dict(methods=["draft_model"]), dict(methods=["none"], draft_model="x")):
        with pytest.raises(UsageError, match="sweep draft_model="):
            itl.check_sweep(bad)
