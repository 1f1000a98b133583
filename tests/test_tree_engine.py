"""Draft trees in the engine (``speculative_token_tree``): a tree step's greedy tokens equal
plain greedy decoding (the embedded model's trained heads, eager / replay / compile_dynamic,
arrivals mid-decode, no host sync); a chain given as a tree is today's chain, tokens and
counters, greedy and sampled; a windowed target; a request's sampled tokens do not depend
on its batch; what a tree cannot run with is refused by name. DeepSeek MLA + MTP:
test_deepseek.py; DP: test_dp.py ("mtp-tree")."""

import itertools

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.engine import core

from specdec.models.config import ModelConfig
from specdec.models.llama import LlamaForCausalLM

from helpers import PROMPTS, VOCAB, drafts_after_prefill, make_llm, tiny_head, tiny_target

TREE = [(0,), (1,), (0, 0), (1, 0), (0, 1), (0, 0, 0)]  # depth 3, 6 drafts
# the shapes a test runs: the static tree above, and a dynamic one (EAGLE-2: top 2 per
# frontier node, the best 5 of 2 + 2 x 4 candidates, depth 3)
SHAPES = {"static": {"speculative_token_tree": TREE},
          "dynamic": {"tree_topk": 2, "num_draft_tokens": 6}}
TEXT = ["def add(a, b):\n    return a + b\n\ndef add(", "import os\nimport sys\n",
        "for i in range(10):", "class Stack:\n", "x = 1\ny = 2\nx = 1\n"]
LENGTHS = (30, 24, 9, 17, 40)


def build(method, tree=TREE, backend=None, shape=None, **kw):
    """``shape``: a dynamic tree's keys (depth 3) instead of the static ``tree``."""
    spec = None if method is None else {"method": method, "num_speculative_tokens": 3}
    if shape is not None:
        spec.update(shape)
    elif method is not None and tree is not None:
        spec.update(speculative_token_tree=tree, num_speculative_tokens=max(map(len, tree)))
    return LLM(speculative_config=spec, max_model_len=96, max_num_seqs=4,
               graph_backend=backend, **kw)


def run(llm, params):
    """Two requests, the rest after two steps -> per request (tokens, accepted per depth)."""
    reqs = [llm.add_request(p, s) for p, s in zip(TEXT[:2], params[:2])]
    steps = 0
    while llm.step() is not None:
        steps += 1
        if steps == 2:
            reqs += [llm.add_request(p, s) for p, s in zip(TEXT[2:], params[2:])]
    return [r.output_token_ids for r in reqs], [r.num_accepted for r in reqs]


GREEDY = [SamplingParams(max_tokens=n, ignore_eos=True) for n in LENGTHS]
SAMPLED = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.8, seed=i)
           for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def plain():
    return run(build(None), GREEDY)[0]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("method,backend", [("eagle3", None), ("eagle", None), ("mtp", None),
                                            ("eagle3", "replay"), ("mtp", "replay")])
def test_tree_greedy_equals_plain_greedy(method, backend, shape, plain):
    llm = build(method, backend=backend, shape=SHAPES[shape], check_host_syncs=True)
    tokens, accepted = run(llm, GREEDY)
    assert tokens == plain
    assert all(len(a) <= 3 for a in accepted) and sum(map(sum, accepted)) > 0
    steps = [s for s in llm.steps if s.num_reqs]
    assert {s.host_syncs for s in steps} == {0}
    if backend == "replay":
        assert sum(s.captured for s in steps) >= len(steps) // 2


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_tree_decodes_up_to_max_model_len(shape):
    """A request whose tree reaches past max_model_len (96: its block table's last block)
    decodes to the end as plain greedy does (the accepted path's K/V move reads no block
    past the table)."""
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    prompt = list(range(1, 90))
    plain = build(None).generate([prompt], params)[0].token_ids
    assert build("mtp", shape=SHAPES[shape]).generate([prompt], params)[0].token_ids == plain


@pytest.mark.parametrize("method", ["eagle", "draft_model"])
def test_tree_under_compile_dynamic_equals_eager(monkeypatch, method):
    """compile_dynamic (traced, no code generation: dynamo's eager backend) on tiny models:
    the tree's target step and draft step through their compiled graphs equal eager, the
    drafts of every step too (the tokens alone would hide a wrong draft: greedy output is the
    target's whatever the drafts); a head's tree, and a draft model's (its root's forward
    first). (One prompt, the shape start-up warms up, not every serving path: dynamo traces
    each graph in seconds; the full warm-up is test_graphs.py's.)"""
    monkeypatch.setattr(core, "WARMUP_SAMPLING", ({},))
    monkeypatch.setattr(core, "warmup_phases", lambda *sizes: (((3,),),))
    torch.manual_seed(0)
    target = LlamaForCausalLM(ModelConfig(  # one layer: dynamo traces it in seconds
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2)).to(torch.float64).eval()
    head = tiny_head(method, target)

    def run(**kw):
        llm = make_llm(target, method, 3, True, head=head,
                       tree=[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)], max_num_seqs=2, **kw)
        req = llm.add_request(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True))
        drafts = []
        while llm.step() is not None:
            drafts.append(list(req.spec_token_ids))
        return req.output_token_ids, drafts, llm
    tokens, drafts, llm = run(graph_backend="compile_dynamic", compile_backend="eager")
    assert (tokens, drafts) == run()[:2]
    # (through the compiled functions; an earlier test's graphs of the same shapes may serve)
    assert llm.runner.target_graph.calls > 0 and llm.runner.proposer.step_graph.calls > 0


def test_a_suffix_tree_under_compile_dynamic_equals_eager_and_plain(monkeypatch):
    """A suffix tree (host drafts and parents, fewer than num_draft_tokens - 1 in most steps)
    through compile_dynamic's graphs (traced by dynamo's eager backend) gives eager's tokens,
    accepted counts and plain greedy's tokens."""
    monkeypatch.setattr(core, "WARMUP_SAMPLING", ({},))
    monkeypatch.setattr(core, "warmup_phases", lambda *sizes: (((3,),),))
    torch.manual_seed(0)
    target = LlamaForCausalLM(ModelConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2)).to(torch.float64).eval()
    prompt = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7, 8, 5, 6, 7]
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    def run(method, **kw):
        llm = make_llm(target, method, 4, True, max_num_seqs=2, tree={
            "num_draft_tokens": 7, "suffix_decoding_max_spec_factor": 4.0}, **kw)
        out = llm.generate([prompt], params)[0]
        return (out.token_ids, out.num_accepted), llm
    compiled, llm = run("suffix", graph_backend="compile_dynamic", compile_backend="eager")
    assert compiled == run("suffix")[0] and sum(compiled[1]) > 0
    assert compiled[0] == make_llm(target, None, 1, True).generate([prompt], params)[0].token_ids
    assert llm.runner.target_graph.calls > 0


def test_a_branching_tree_accepts_more_than_its_chain():
    """The embedded EAGLE-3 head's second candidates at depths 1 and 2 are right where its
    first is not: the static tree's accepted drafts exceed the chain's (same depth), so it
    needs fewer steps for the same tokens. (The dynamic tree's gain needs more prompts than
    a test runs: benchmarks/bench_tree.py.)"""
    chain = run(build("eagle3", tree=None), GREEDY)[1]
    tree = run(build("eagle3"), GREEDY)[1]
    assert sum(map(sum, tree)) > sum(map(sum, chain))


@pytest.mark.parametrize("as_tree", [{"speculative_token_tree": [(0,), (0, 0), (0, 0, 0)]},
                                     {"tree_topk": 1, "num_draft_tokens": 4}],
                         ids=["static", "dynamic"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_chain_given_as_a_tree_is_the_chain(params, as_tree):
    assert run(build("eagle3", shape=as_tree), params) == run(build("eagle3", tree=None), params)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_sampled_tree_tokens_do_not_depend_on_the_batch(shape):
    llm = build("mtp", shape=SHAPES[shape])
    batch = run(llm, SAMPLED)[0]
    alone = [llm.generate([p], s)[0].outputs[0].token_ids for p, s in zip(TEXT, SAMPLED)]
    assert alone == batch


def test_a_windowed_target_verifies_a_tree():
    """Every layer sees 8 keys: a node's window ends at its own position (its depth's), not
    at its key row; prompts and outputs run past the window."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      eos_token_id=VOCAB - 1, sliding_window=8,
                      layer_types=["sliding_attention"] * 4)
    target = LlamaForCausalLM(cfg).to(torch.float64).eval()
    assert target.kv_cache_spec()[0].sliding_window == 8
    plain = make_llm(target, None, 0, True).generate(PROMPTS, max_tokens=16)
    tree = make_llm(target, "eagle", 2, True, head=tiny_head("eagle", target),
                    tree=[(0,), (1,), (0, 0), (2,)])
    got = tree.generate(PROMPTS, max_tokens=16)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert sum(sum(o.num_accepted) for o in got) > 0


@pytest.mark.parametrize("spec,kw,match", [
    ({"method": "ngram"}, {}, r"speculative_token_tree with method='ngram'"),
    ({"method": "suffix", "speculative_token_tree": None, "tree_topk": 2,
      "num_draft_tokens": 4}, {}, r"tree_topk=2 with method='suffix' \(a suffix tree: its "
                                   r"branching follows its counts\)"),
    ({"method": "mtp", "speculative_token_tree": None, "tree_topk": 2}, {},
     r"num_draft_tokens=None: a dynamic tree needs tree_topk and num_draft_tokens"),
    ({"method": "eagle3", "disable_padded_drafter_batch": True}, {},
     r"disable_padded_drafter_batch=True with speculative_token_tree"),
    ({"method": "eagle3", "num_speculative_tokens_policy": "goodput"}, {},
     r"num_speculative_tokens_policy='goodput' with speculative_token_tree"),
    ({"method": "eagle3", "num_speculative_tokens": 3}, {},
     r"is 2 deep and num_speculative_tokens=3"),
    ({"method": "eagle3", "tree_score_temperature": 0.5}, {},
     r"tree_score_temperature=0.5 scores a dynamic tree's candidates"),
    ({"method": "mtp", "speculative_token_tree": None, "tree_topk": 2, "num_draft_tokens": 2},
     {}, r"num_draft_tokens=2: the root and its drafts; allowed 3 \.\. 7 \(a tree "
         r"num_speculative_tokens=2 deep holds at least 2 drafts"),
    ({"method": "mtp", "speculative_token_tree": None, "tree_topk": 2, "num_draft_tokens": 4,
      "tree_score_temperature": 0}, {},
     r"tree_score_temperature=0: allowed a finite number > 0"),
])
def test_what_a_tree_cannot_run_with_is_refused_by_name(spec, kw, match):
    spec = {"num_speculative_tokens": 2, "speculative_token_tree": [(0,), (1,), (0, 0)], **spec}
    with pytest.raises(ValueError, match=match):
        LLM(speculative_config=spec, max_model_len=96, **kw)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_async_scheduling_with_a_tree_equals_sync(shape, params):
    """The next tree step's inputs built on the device from the accepted path and the
    drafter's nodes (a dynamic tree's parents too), before the host reads the step."""
    sync = run(build("eagle3", shape=SHAPES[shape]), params)
    llm = build("eagle3", shape=SHAPES[shape], async_scheduling=True, check_host_syncs=True)
    assert run(llm, params) == sync
    steps = [s for s in llm.steps if s.num_reqs]
    assert sum(s.overlapped for s in steps) >= len(steps) // 3
    assert {s.host_syncs for s in steps} == {0}


@pytest.mark.parametrize("field,value", [("repetition_penalty", 1.2), ("min_tokens", 2),
                                         ("presence_penalty", 0.5)])
@pytest.mark.parametrize("shape,key", [(None, "speculative_token_tree"),
                                       ("dynamic", "tree_topk")])
def test_penalties_with_a_tree_are_refused_by_name(field, value, shape, key):
    """The message names the key that asked for the tree (a dynamic tree has no paths)."""
    llm = build("eagle3", shape=SHAPES.get(shape))
    with pytest.raises(ValueError, match=rf"{field}={value} with {key}:"):
        llm.generate(TEXT[:1], SamplingParams(max_tokens=4, **{field: value}))


def test_tree_flags_reach_every_command(capsys, tmp_path):
    """--speculative-token-tree (K its depth when -k is not given), --tree-topk,
    --num-draft-tokens and --tree-score-temperature: generate runs the tree, serve and bench
    serve --launch build the config with it (bench serve hands it to the server), bench
    labels its rows with it (a suffix tree's too, each row at its K's depth); without a
    drafter they are refused."""
    from specdec.bench import serve as bench_serve
    from specdec.commands import cli as specdec_cli
    from specdec.flags import speculation_from_args
    code = specdec_cli.main(["generate", "--prompt", "def f(x):", "--method", "mtp",
                             "--speculative-token-tree", "[(0,), (1,), (0, 0)]",
                             "--max-tokens", "8"])
    assert code == 0 and "mtp accept rate per draft position 1-2" in capsys.readouterr().out
    parser = specdec_cli.build_parser()
    for argv in (["serve"], ["bench", "serve", "--launch"]):
        args = parser.parse_args([*argv, "--method", "eagle3", "-k", "4", "--tree-topk", "3",
                                  "--num-draft-tokens", "9", "--tree-score-temperature", "0.3"])
        spec = speculation_from_args(args)
        assert (spec["tree_topk"], spec["num_draft_tokens"], spec["num_speculative_tokens"],
                spec["tree_score_temperature"]) == (3, 9, 4, 0.3)
    assert bench_serve.fed_drafts(spec) == 8
    code = specdec_cli.main(["bench", "--methods", "eagle3", "--speculative-token-tree",
                             "[(0,), (1,), (0, 0)]", "--concurrency", "1", "--prompt-len", "8",
                             "--output-len", "8", "--repeats", "1", "--warmup", "0",
                             "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "padded, static 3 drafts d2" in out
    # a suffix tree's rows: its size and each row's K as its depth
    code = specdec_cli.main(["bench", "--methods", "suffix", "--num-draft-tokens", "5", "-k",
                             "1,3", "--concurrency", "1", "--prompt-len", "8", "--output-len",
                             "8", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "suffix 4 drafts d1" in out and "suffix 4 drafts d3" in out
    code = specdec_cli.main(["generate", "--prompt", "x", "--method", "none", "--tree-topk", "2"])
    assert code == 2 and "--tree-topk sets the drafter's tree" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["eagle3", "eagle", "mtp", "draft_model"])
def test_a_trees_first_choice_path_is_the_chain(method):
    """Along its first choices, a static tree holds chain K=3's drafts, however many heads
    run beside them: the full binary tree of depth 3 (heads at 6 nodes, the path's last one
    at K/V row 3, past a chain's rows) and a chain given as a tree. A draft model's tree
    (its root's row one position past the kept tokens) the same."""
    target = tiny_target()
    head = tiny_head(method, target)

    def drafts(tree):
        llm = make_llm(target, method, 3, True, head=head, tree=tree)
        return drafts_after_prefill(llm, PROMPTS[3])[0]

    full = [p for d in (1, 2, 3) for p in itertools.product((0, 1), repeat=d)]
    chain = drafts(None)
    got = drafts(full)
    assert [got[full.index(p)] for p in [(0,), (0, 0), (0, 0, 0)]] == chain
    assert drafts([(0,), (0, 0), (0, 0, 0)]) == chain


@pytest.mark.parametrize("method", ["eagle3", "mtp", "draft_model"])
def test_a_dynamic_trees_drafts_are_the_heads_along_each_path(method):
    """Every candidate of a dynamic tree is its parent's top-k under the head run along the
    parent's own path: with every candidate verified (top 2, depth 3: 2 + 2 x 4 = 10 drafts),
    its depth-2 nodes equal the full binary static tree's, and the children of its two
    frontier nodes equal that tree's children of the same nodes (the static tree runs the
    head on every node: a frontier node's hidden state, position or mask gone wrong differs)."""
    target = tiny_target()
    head = tiny_head(method, target)
    full = [p for d in (1, 2, 3) for p in itertools.product((0, 1), repeat=d)]

    def drafts(tree):
        return drafts_after_prefill(make_llm(target, method, 3, True, head=head, tree=tree),
                                    PROMPTS[3])
    static, _ = drafts(full)
    dynamic, parents = drafts({"tree_topk": 2, "num_draft_tokens": 11})
    assert dynamic[:6] == static[:6] and parents[:6] == [0, 0, 1, 1, 2, 2]
    for i, up in enumerate(parents[6:]):
        assert 3 <= up <= 6  # a depth-2 node (nodes 3..6) of the frontier
        rank = i % 2
        assert dynamic[6 + i] == static[6 + 2 * (up - 3) + rank]
    assert len(set(parents[6:])) == 2


@pytest.mark.parametrize("where", ["speculative_config", "head config"])
def test_the_score_temperature_chooses_between_depth_and_width(where):
    """A dynamic tree keeps the candidates of highest log-softmax(logits / T) summed along
    their path. T -> 0: every first choice scores ~0 and every other far below, so 3 drafts
    of top 2, depth 3, are the chain (parents 0, 1, 2) and equal chain K=3's drafts. T -> oo:
    every candidate scores -depth x log V, so the shallowest come first (both children of
    the root). The temperature comes from the speculative config or the head's config.json
    key; a bad head value is refused naming it."""
    target = tiny_target()
    head = tiny_head("eagle3", target)

    def drafts(temperature, tree):
        if where == "head config":
            head.config.extra["tree_score_temperature"] = temperature
        elif temperature is not None and isinstance(tree, dict):
            tree = {**tree, "tree_score_temperature": temperature}
        return drafts_after_prefill(make_llm(target, "eagle3", 3, True, head=head, tree=tree),
                                    PROMPTS[3])

    dynamic = {"tree_topk": 2, "num_draft_tokens": 4}
    chain, _ = drafts(None, None)
    assert drafts(1e-3, dynamic) == (chain, [0, 1, 2])
    _, parents = drafts(1e3, dynamic)
    assert parents[:2] == [0, 0]
    if where == "head config":
        with pytest.raises(ValueError, match=r"the head's config.json tree_score_temperature="
                                             r"-1: allowed a finite number > 0"):
            drafts(-1, dynamic)


def test_a_sampled_request_scores_its_candidates_at_its_own_temperature():
    """A dynamic tree scores a request at max(its sampling temperature, the score
    temperature): in one batch at score temperature 1e-3, the greedy request's 3 drafts are
    the chain (parents 0, 1, 2) and a request sampled at 1e3 keeps the root's two children
    (its log-probabilities flat: the shallowest first); alone, each request drafts the same
    tree as in the batch."""
    target = tiny_target()
    head = tiny_head("eagle3", target)
    tree = {"tree_topk": 2, "num_draft_tokens": 4, "tree_score_temperature": 1e-3}
    params = [SamplingParams(max_tokens=4, ignore_eos=True),
              SamplingParams(max_tokens=4, ignore_eos=True, temperature=1e3, seed=0)]

    def parents(which):
        llm = make_llm(target, "eagle3", 3, True, head=head, tree=tree)
        reqs = [llm.add_request(PROMPTS[3], params[i]) for i in which]
        while any(r.is_prefilling for r in reqs):
            llm.step()
        return [r.spec_parents for r in reqs]
    both = parents([0, 1])
    assert both[0] == [0, 1, 2] and both[1][:2] == [0, 0]
    assert parents([0]) + parents([1]) == both
