"""Async scheduling (``LLM(async_scheduling=True)``): a uniform decode's next step is launched
from the device outputs before the host reads them, so the host's work on a step runs while
the next one executes. Against the same engine without it: the same tokens, drafts accepted
and log-probabilities, greedy and sampled, with arrivals, finishes at different steps, EOS and
aborts; the overlapped steps run with no host sync; what cannot overlap is refused by name."""

import pytest

from specdec import LLM, SamplingParams
from specdec.engine.llm import DEFAULT_MODEL

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(", "import os\nimport sys\n",
           "for i in range(10):", "class Stack:\n", "x = 1\ny = 2\nx = 1\n"]
# a mix: lengths that end at different steps, one that may stop at EOS
PARAMS = [SamplingParams(max_tokens=n, ignore_eos=i != 1)
          for i, n in enumerate((30, 24, 9, 17, 40))]


def build(method, backend, async_scheduling, **kw):
    spec = None if method is None else {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = str(DEFAULT_MODEL)
    return LLM(speculative_config=spec, max_model_len=96, max_num_seqs=4,
               graph_backend=backend, async_scheduling=async_scheduling, **kw)


def run(llm, params=PARAMS, abort_at=None):
    """Two requests, then the rest after two steps (a waiting request breaks the overlap
    until rows free up); ``abort_at``: (step, request index) aborted between steps. -> per
    request (tokens, accepted per position, finish reason)."""
    reqs = [llm.add_request(p, s) for p, s in zip(PROMPTS[:2], params[:2])]
    steps = 0
    while True:
        if steps == 2:
            reqs += [llm.add_request(p, s) for p, s in zip(PROMPTS[2:], params[2:])]
        if abort_at is not None and steps == abort_at[0]:
            llm.abort_request(reqs[abort_at[1]].request_id)
        if llm.step() is None:
            break
        steps += 1
    return [(r.output_token_ids, r.num_accepted, r.finish_reason) for r in reqs]


@pytest.mark.parametrize("method,backend", [(None, "eager"), (None, "replay"),
                                            ("eagle3", "eager"), ("eagle3", "replay"),
                                            ("mtp", "replay"), ("draft_model", "replay")])
def test_async_equals_sync_token_for_token(method, backend):
    sync = build(method, backend, False)
    overlapped = build(method, backend, True, check_host_syncs=True)
    assert run(overlapped) == run(sync)
    steps = [s for s in overlapped.steps if s.num_reqs]
    assert sum(s.overlapped for s in steps) >= len(steps) // 3
    assert {s.host_syncs for s in steps} == {0}  # the overlapped steps included
    assert not overlapped.has_unfinished()


def test_a_prefill_chunk_cut_to_one_token_is_not_continued():
    """At K = 0 a budget of 2 tokens cuts a prompt that arrives beside a decode into chunks
    of 1: such a step looks like a uniform decode, but the chunk samples nothing to decode
    next (it once gathered index -1 and failed every request in the step)."""
    outs = []
    for flag in (False, True):
        llm = LLM(max_num_seqs=2, max_num_batched_tokens=2, max_model_len=64,
                  async_scheduling=flag)
        first = llm.add_request([11, 12, 13], SamplingParams(max_tokens=30, ignore_eos=True))
        llm.step(), llm.step()  # the first prompt's chunks: it decodes from here on
        second = llm.add_request(list(range(100, 120)),
                                 SamplingParams(max_tokens=8, ignore_eos=True))
        while llm.step() is not None:
            pass
        outs.append([(r.output_token_ids, r.finish_reason) for r in (first, second)])
    assert outs[1] == outs[0] and outs[0][1][1] == "length"
    assert any(s.overlapped for s in llm.steps)  # the decodes after the prompt still overlap


@pytest.mark.parametrize("backend", ["replay", "eager"])
def test_a_step_padded_with_filler_is_not_continued(backend):
    """K rises when the batch shrinks (K 0 at two requests, 2 at one): the next step's
    drafts are made at the old K and padded with filler, which reads its logits at other
    rows than K real drafts do; a step continued from it kept those rows and, captured,
    verified every draft against the root's logits (tokens doubled, wrong drafts kept)."""
    spec = {"method": "eagle", "num_speculative_tokens": 2,
            "num_speculative_tokens_per_batch_size": [[1, 1, 2], [2, 2, 0]]}
    prompts = [[1277, 14, 263, 362, 263, 305, 368], [100, 200, 300, 400, 500, 600]]
    params = [SamplingParams(max_tokens=3, ignore_eos=True),
              SamplingParams(max_tokens=24, ignore_eos=True)]
    plain = LLM(max_model_len=96).generate(prompts, params)
    llm = LLM(max_model_len=96, speculative_config=spec, graph_backend=backend,
              async_scheduling=True)
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert sum(s.overlapped for s in llm.steps) >= 3  # the steps after it overlap again


def test_sampled_async_equals_sync():
    """Counter-based random numbers: each draw is keyed by request and position, so a step
    launched before the host read draws what the synchronous one would."""
    params = [SamplingParams(max_tokens=p.max_tokens, ignore_eos=True, temperature=0.8,
                             top_p=0.9 if i % 2 else 1.0, seed=i)
              for i, p in enumerate(PARAMS)]
    got = [run(build("eagle3", "replay", flag), params) for flag in (False, True)]
    assert got[0] == got[1]


def test_an_abort_while_a_step_is_in_flight():
    """Aborted between steps while its next step already runs: the others are untouched, the
    aborted one keeps what it had (the in-flight step's tokens for it are dropped)."""
    sync = run(build("eagle3", "replay", False), abort_at=(8, 0))
    got = run(build("eagle3", "replay", True), abort_at=(8, 0))
    assert got[1:] == sync[1:]
    assert got[0][2] == sync[0][2] == "abort"
    assert got[0][0] == sync[0][0]


def test_log_probabilities_run_synchronously_and_equal():
    params = [SamplingParams(max_tokens=p.max_tokens, ignore_eos=True, logprobs=2)
              for p in PARAMS]
    llms = [build("eagle3", "replay", flag) for flag in (False, True)]
    outs = []
    for llm in llms:
        reqs = [llm.add_request(p, s) for p, s in zip(PROMPTS, params[:4])]
        while llm.step() is not None:
            pass
        outs.append([(r.output_token_ids, [(lp.token_id, round(lp.logprob, 6))
                                           for lp in r.logprobs]) for r in reqs])
    assert outs[0] == outs[1]
    assert not any(s.overlapped for s in llms[1].steps)


@pytest.mark.parametrize("kw,match", [
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
     "async_scheduling=True with method='ngram'"),
    (dict(speculative_config={"method": "eagle3", "num_speculative_tokens": 3,
                              "disable_padded_drafter_batch": True}),
     "async_scheduling=True with disable_padded_drafter_batch=True"),
    (dict(speculative_config={"method": "eagle3", "num_speculative_tokens": 3,
                              "num_speculative_tokens_policy": "goodput"}),
     "async_scheduling=True with num_speculative_tokens_policy='goodput'"),
    (dict(data_parallel_size=2), "async_scheduling=True with data_parallel_size=2"),
    (dict(tensor_parallel_size=2), "async_scheduling=True with tensor_parallel_size=2")])
def test_what_cannot_overlap_is_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        LLM(async_scheduling=True, **kw)


def test_async_scheduling_must_be_a_bool():
    with pytest.raises(TypeError, match="async_scheduling"):
        LLM(async_scheduling="yes")


def test_served_with_async_scheduling_equals_generate():
    """The serving loop (EngineLoop in the in-process server) over an async engine: four
    concurrent completions get the token ids a synchronous ``generate`` gives."""
    import asyncio

    import httpx

    from specdec.entrypoints.serve import build_server_app

    from helpers import ServerThread

    llm = build("eagle3", "replay", True)
    want = [o.token_ids for o in build("eagle3", "replay", False).generate(
        PROMPTS[:4], [SamplingParams(max_tokens=p.max_tokens, ignore_eos=True)
                      for p in PARAMS[:4]])]
    continued, launch_next = [], llm.core._continue  # counts the overlapped launches
    llm.core._continue = lambda launched: continued.append(1) or launch_next(launched)
    server = ServerThread(build_server_app(llm, "tiny"))

    async def complete(client, prompt, n):
        r = await client.post(f"{server.url}/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}, timeout=60)
        return r.json()["choices"][0]["token_ids"]

    async def all_four():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(complete(client, p, s.max_tokens)
                                          for p, s in zip(PROMPTS[:4], PARAMS[:4])))
    try:
        got = asyncio.run(all_four())
    finally:
        server.close()
    assert got == want and continued
