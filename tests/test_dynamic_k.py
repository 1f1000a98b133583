"""K per step (``num_speculative_tokens_per_batch_size``, vLLM's key): the schedule's lookup and
its refusals; in the engine, each step's K follows its batch size (0 switches speculation
off), the padded step stays uniform and captured at every K (one graph per K; a head's
decodes get filler when K grows past the drafts it proposed), no host sync, and the tokens
never change: greedy equals plain decoding, sampled padded equals sampled ragged. The
benchmark derives a schedule from its measurements and takes one (``--k-schedule``)."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specdec import LLM, SamplingParams
from specdec.bench import itl
from specdec.bench.report import best_k_schedule
from specdec.config import SpeculativeConfig
from specdec.engine.llm import DEFAULT_MODEL
from specdec.flags import UsageError
from specdec.proposers.ngram import NgramProposer
from specdec.proposers.suffix import SuffixProposer

PROPOSERS = {"ngram": NgramProposer, "suffix": SuffixProposer}

K = 3
KEY = "num_speculative_tokens_per_batch_size"
# one request: K = 3; two to four: 1; five or more: speculation off
SCHEDULE = [[1, 1, 3], [2, 4, 1], [5, 8, 0]]
PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(", "import os\nimport sys\n",
           "for i in range(10):", "class Stack:\n", "x = 1\ny = 2\nx = 1\n", "def f(n):",
           "a = [1, 2, 3]\n", "print('hello')\nprint("]


def spec(method: str, schedule=SCHEDULE, **kw) -> dict:
    extra = {"model": str(DEFAULT_MODEL)} if method == "draft_model" else {}
    return {"method": method, "num_speculative_tokens": K, KEY: schedule, **extra, **kw}


@pytest.mark.parametrize("schedule,batch_ks", [
    (SCHEDULE, {1: 3, 2: 1, 4: 1, 5: 0, 8: 0, 9: 3}),  # a size in no range drafts K
    ([[3, 4, 2]], {1: 3, 2: 3, 3: 2, 4: 2, 5: 3}),
    ([[2, 2, 0], [1, 1, 1]], {1: 1, 2: 0, 3: 3}),  # ranges in any order
])
def test_the_schedule_maps_batch_sizes_to_k(schedule, batch_ks):
    cfg = SpeculativeConfig.from_dict(spec("mtp", schedule))
    assert {b: cfg.k_for_batch_size(b) for b in batch_ks} == batch_ks
    assert cfg.step_ks == tuple(sorted({K, *(k for _, _, k in schedule)}))


def test_without_a_schedule_every_step_drafts_k():
    cfg = SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": K})
    assert [cfg.k_for_batch_size(b) for b in (1, 64)] == [K, K] and cfg.step_ks == (K,)


@pytest.mark.parametrize("schedule,match", [
    ([], r"num_speculative_tokens_per_batch_size=\[\]: allowed a non-empty list"),
    ("1-4:2", "allowed a non-empty list of \\[lo, hi, k\\]"),
    ([[1, 4]], r"num_speculative_tokens_per_batch_size\[0\]=\[1, 4\]: allowed \[lo, hi, k\]"),
    ([[0, 4, 1]], r"\[0\]=\[0, 4, 1\]: allowed .* 1 <= lo <= hi"),
    ([[5, 4, 1]], r"\[0\]=\[5, 4, 1\]"),
    ([[1, 4, 4]], r"0 <= k <= num_speculative_tokens=3"),
    ([[1, 4, -1]], r"\[0\]=\[1, 4, -1\]"),
    ([[1, 4, 1.5]], r"\[0\]=\[1, 4, 1.5\]"),
    ([[1, 4, True]], r"\[0\]=\[1, 4, True\]"),
    ([[1, 4, 1], [4, 8, 0]], r"ranges \[1, 4, 1\] and \[4, 8, 0\] overlap"),
])
def test_a_bad_schedule_is_refused_naming_the_key(schedule, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(spec("mtp", schedule))


def test_a_schedule_for_a_method_that_drafts_nothing_is_refused():
    with pytest.raises(ValueError, match="with method='extract_hidden_states'.*allowed: None"):
        SpeculativeConfig.from_dict({
            "method": "extract_hidden_states", "num_speculative_tokens": 1, KEY: [[1, 2, 0]],
            "draft_model_config": {"eagle_aux_hidden_state_layer_ids": [1]}})


# ---- the engine ------------------------------------------------------------------------------
# the last request outlives the others by far: it runs alone at K = 3
PARAMS = [SamplingParams(max_tokens=30 if i == 7 else 5 + 2 * i, ignore_eos=True)
          for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def plain():
    return [o.token_ids for o in LLM(max_num_seqs=8).generate(PROMPTS, PARAMS)]


def run_with_arrivals(llm: LLM) -> list[tuple[int, bool, bool]]:
    """One request first, seven more after its second step (the batch grows: K falls with
    drafts in flight), then all to the end (it shrinks: K grows back). -> each step's (K,
    uniform decode, captured); the outputs are in ``llm``'s requests."""
    record, execute = [], llm.runner.execute

    def recording(batch):
        out = execute(batch)
        record.append((batch.plan.num_spec_tokens, batch.plan.uniform_decode,
                       llm.runner.last_step_captured))
        return out
    llm.runner.execute = recording
    llm.requests = [llm.add_request(PROMPTS[0], PARAMS[0])]
    for _ in range(2):
        llm.step()
    llm.requests += [llm.add_request(p, s) for p, s in zip(PROMPTS[1:], PARAMS[1:])]
    while llm.step() is not None:
        pass
    return record


@pytest.mark.parametrize("method,padded,backend", [
    ("eagle3", True, "replay"), ("mtp", True, "eager"), ("eagle3", False, "eager"),
    ("ngram", True, "replay"), ("draft_model", True, "replay")])
def test_k_follows_the_batch_size_and_never_changes_a_token(plain, method, padded, backend):
    """Greedy tokens equal plain decoding while K moves 3 -> 0 (drafts in flight dropped) ->
    1 -> 3 (a head's decodes filled up to the new K); every padded decode step on a
    capturing backend is a captured uniform decode at its K; no host sync in the padded
    step."""
    llm = LLM(speculative_config=spec(method, disable_padded_drafter_batch=not padded),
              max_num_seqs=8, capture_sizes=[1, 4, 8], graph_backend=backend,
              check_host_syncs=True)
    record = run_with_arrivals(llm)
    assert [r.output_token_ids for r in llm.requests] == plain
    ks = [k for k, _, _ in record]
    assert ks[:2] == [3, 3] and ks[2] == 0 and {0, 1, 3} <= set(ks) and ks[-1] == 3
    # K rises back only as the batch shrinks: 0s, then 1s, then 3s after the arrivals
    assert ks[2:] == sorted(ks[2:])
    if padded and backend == "replay":
        prefill_steps = {0, 2}  # the first request's and the arrivals' prefill
        assert all(uniform and captured for i, (_, uniform, captured) in enumerate(record)
                   if i not in prefill_steps)
    assert sum(sum(r.num_accepted) for r in llm.requests) > 0


@pytest.mark.parametrize("backend", ["eager", "replay"])
def test_k_zero_still_feeds_the_draft_models_kv(backend):
    """The target's own folder as the draft model: the steps at K = 0 still write the draft
    model's KV, so once the batch is one request again (K = 3; replay: its first decode
    filled up to 3 after 0 drafts) every draft is accepted (but those of the last step,
    past max_tokens)."""
    llm = LLM(speculative_config=spec("draft_model", [[1, 1, 3], [2, 8, 0]]), max_num_seqs=4,
              capture_sizes=[1, 4], graph_backend=backend)
    long_one = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = llm.generate(PROMPTS[:4], [long_one] + PARAMS[:3])
    drafted, accepted = outs[0].num_drafted, outs[0].num_accepted
    assert len(drafted) == K and all(d - 1 <= a <= d for d, a in zip(drafted, accepted))
    assert drafted[0] >= 3
    assert all(not o.num_drafted for o in outs[1:])  # they never ran alone


def test_sampled_padded_equals_sampled_ragged_under_a_schedule():
    """T 0.8, seeded: the padded and the ragged drafter make the same drafts at each step's
    K, so verification draws the same tokens."""
    params = [SamplingParams(max_tokens=5 + 2 * i, temperature=0.8, seed=i, ignore_eos=True)
              for i in range(4)]
    out = {}
    for padded in (True, False):
        llm = LLM(speculative_config=spec("eagle3", [[1, 2, 3], [3, 8, 1]],
                                          disable_padded_drafter_batch=not padded),
                  max_num_seqs=4)
        out[padded] = [(o.token_ids, o.num_drafted, o.num_accepted)
                       for o in llm.generate(PROMPTS[:4], params)]
    assert out[True] == out[False]
    assert any(acc for _, _, acc in out[True])


def test_a_filled_decode_samples_the_draft_step_at_its_last_kept_token(monkeypatch):
    """The drafter's preparation of each step (K moving, so decodes with filler after fewer
    drafts, 0 included, and decodes with fewer tokens than 1 + K) puts each request's sample
    index at its last kept token and rejects every token fed after it (drafts and filler):
    recorded from the real preparation, checked against the host's schedule and results."""
    llm = LLM(speculative_config=spec("eagle3"), max_num_seqs=8, capture_sizes=[1, 4, 8],
              graph_backend="replay", check_host_syncs=False)  # (the recording reads)
    prepare, seen = llm.runner.proposer.prepare_padded, []

    def recording(*args):
        out = prepare(*args)
        seen.append((args[3].tolist(), out[2].tolist(), out[3].tolist()))  # qsl, idx, rej
        return out
    monkeypatch.setattr(llm.runner.proposer, "prepare_padded", recording)
    execute, checked = llm.runner.execute, []

    def checking(batch):
        sampled, drafts = execute(batch)
        qsl, idx, rejected = seen.pop()
        for i, s in enumerate(llm.scheduler.scheduled):
            if s.is_discarded:
                continue
            fed = len(s.spec_token_ids) + s.num_filler
            kept = sum(t >= 0 for t in sampled[i].tolist()) - 1  # accepted drafts
            assert idx[i] == qsl[i] + (kept if fed else s.num_tokens - 1)
            assert rejected[i] == (fed - kept if fed else 0)
            checked.append(s.num_filler)
        return sampled, drafts
    monkeypatch.setattr(llm.runner, "execute", checking)
    run_with_arrivals(llm)
    assert checked and any(f > 0 for f in checked)  # filled decodes were among them


# ---- the benchmark ---------------------------------------------------------------------------
@given(st.dictionaries(st.integers(1, 64), st.dictionaries(
    st.integers(0, 5), st.floats(1, 1e4, allow_nan=False), min_size=1), min_size=1))
def test_the_derived_schedule_picks_the_fastest_k_at_each_measured_concurrency(tok_s):
    """``best_k_schedule``: read back through the config's own lookup, each measured
    concurrency gets the K of the most tokens/s (the smaller K on a tie)."""
    schedule = best_k_schedule(tok_s)
    cfg = SpeculativeConfig("mtp", 5, num_speculative_tokens_per_batch_size=schedule)
    for c, by_k in tok_s.items():
        best = max(by_k.values())
        assert cfg.k_for_batch_size(c) == min(k for k, v in by_k.items() if v == best)


def test_the_sweep_gives_its_schedule_to_every_speculative_engine():
    sweep = itl.check_sweep(dict(methods=["none", "ngram"], modes=["padded"], k=[3],
                                 concurrency=[2], k_schedule=[[2, 8, 1]]))
    engines, skipped = itl.build_engines(sweep, itl.expand(sweep))
    assert not skipped
    ngram = engines["ngram", True, 3].llm
    assert ngram.scheduler.pick_k(2, True) == 1 and ngram.runner.step_ks == (1, 3)
    assert engines["none", True, 0].llm.spec is None


@pytest.mark.parametrize("schedule,match", [
    ([[1, 4, 5]], r"sweep k_schedule: .*\[1, 4, 5\].*num_speculative_tokens=3"),
    ([[1, 4]], r"sweep k_schedule: num_speculative_tokens_per_batch_size\[0\]")])
def test_a_bad_sweep_schedule_is_refused(schedule, match):
    with pytest.raises(UsageError, match=match):
        itl.check_sweep(dict(k=[3, 5], k_schedule=schedule))


def test_a_bench_run_prints_a_schedule_and_takes_one(tmp_path, capsys):
    """``specdec bench`` prints the schedule its measurements imply, from 1 to the largest
    concurrency; ``--k-schedule`` with that value runs (and is recorded), and then no
    schedule is derived."""
    args = ["--methods", "none,ngram", "--modes", "padded", "-k", "2", "--concurrency", "1,2",
            "--prompt-len", "8", "--output-len", "6", "--repeats", "1", "--warmup", "0",
            "--workload", "repeat"]
    assert itl.main(args + ["--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("hint: K schedule from this run"))
    schedule = json.loads(line.split("--k-schedule '")[1].split("'")[0])
    assert [r[0] for r in schedule][0] == 1 and schedule[-1][1] == 2
    assert itl.main(args + ["--out", str(tmp_path / "b"), "--k-schedule",
                            json.dumps(schedule)]) == 0
    results = json.loads((tmp_path / "b" / "results.json").read_text())
    assert results["sweep"]["k_schedule"] == schedule
    # each config's mean step K: the schedule's K at its concurrency (2 without a schedule;
    # plain decoding 0), counted from the engine's StepRecords
    fixed = json.loads((tmp_path / "a" / "results.json").read_text())
    cfg = SpeculativeConfig("ngram", 2, num_speculative_tokens_per_batch_size=schedule)
    for run, k_of in ((fixed, lambda c: 2), (results, cfg.k_for_batch_size)):
        for c in run["configs"]:
            want = 0 if c["method"] == "none" else k_of(c["concurrency"])
            assert c["summary"]["mean_step_k"] == want
    assert "K schedule from this run" not in capsys.readouterr().out


def test_under_dp_the_printed_schedule_is_per_rank_batch_size():
    """Each rank picks K for its own batch: at dp 2, concurrencies 2 and 4 are batches of 1
    and 2 on a rank (concurrency 1 is a batch of 1 too, on one rank only: 2 speaks for it)."""
    from specdec.bench.report import k_schedule_lines

    def config(method, conc, k, tok_s):
        return dict(status="ok", method=method, mode="padded", k=k, concurrency=conc,
                    prompt_len=8, output_len=6, summary={"output_tokens_per_s": tok_s})
    measured = {1: (100, 50), 2: (100, 300), 4: (400, 300)}  # conc: (plain, K 2) tok/s
    configs = [config(m, c, k, t[i]) for c, t in measured.items()
               for i, (m, k) in enumerate((("none", 0), ("eagle3", 2)))]
    for dp, want in ((1, [[1, 1, 0], [2, 3, 2], [4, 4, 0]]), (2, [[1, 1, 2], [2, 2, 0]])):
        line, = k_schedule_lines({"sweep": {"dp": dp}, "configs": configs})
        assert f"--k-schedule '{want}' -k 2" in line
        assert ("per rank batch size" in line) == (dp > 1)


@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 39))
def test_a_host_drafter_at_k_zero_drafts_nothing_and_keeps_up(tokens, cut):
    """ngram and suffix asked for K 0 propose nothing (suffix does not even extend its tree);
    suffix's next proposal at K 3 takes every token since, so it equals one from a drafter
    that proposed at K 3 all along."""
    cfg = {"ngram": SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=2),
           "suffix": SpeculativeConfig("suffix", 3, suffix_decoding_min_token_prob=0.0)}
    cut = min(cut, len(tokens))
    for method, c in cfg.items():
        lazy, eager = (PROPOSERS[method](c, max_model_len=64) for _ in range(2))
        assert lazy.drafts("r", tokens[:cut], 0) == []
        eager.drafts("r", tokens[:cut], 3)
        assert lazy.drafts("r", tokens, 3) == eager.drafts("r", tokens, 3)
