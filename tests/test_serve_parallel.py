"""``specdec serve`` over data x tensor parallel ranks (``entrypoints/parallel_engine.py``):
the seed's layout at test size served (tiny DeepSeek-V3 + MTP, DP=2 x TP=2 with expert
parallelism) equals one rank token for token with the same acceptance counts in /metrics;
requests arriving at random times, with the ranks going to sleep and waking between them,
equal one rank; an idle server outlives its process groups' timeout; a dead rank fails its
requests; a rank's refusal is the command's one-line error."""

import asyncio
import random
import threading

import hf_deepseek as D
import httpx
import pytest

from specdec import LLM
from specdec.commands.cli import main
from specdec.engine.sequence import SamplingParams
from specdec.entrypoints import serve
from specdec.entrypoints.async_engine import EngineDeadError
from specdec.entrypoints.parallel_engine import ParallelEngine

from helpers import ServerThread, folder_builder, metrics

PROMPTS = [[5, 17, 40, 3, 9], [11, 12, 13], list(range(20, 60)), [7] * 9]
NEW = 12


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory):
    return folder_builder(D.BUILDERS, tmp_path_factory)


def served_app(monkeypatch, capsys, argv):
    """``specdec serve argv`` up to the point it would serve: (app, start-up line)."""
    got = {}
    monkeypatch.setattr(serve, "serve_until_signal",
                        lambda app, sock, *a: got.update(app=app, sock=sock))
    code = main(["serve", *argv, "--port", "0"])
    out, err = capsys.readouterr()
    assert code == 0, err
    got["sock"].close()
    return got["app"], out


def complete(url: str, prompt: list[int], out: dict, i: int) -> None:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json=dict(
        prompt=prompt, max_tokens=NEW, ignore_eos=True, temperature=0, return_token_ids=True))
    out[i] = r.json()["choices"][0]["token_ids"]


def test_serve_tp_dp_ep_mtp_equals_one_rank_and_metrics_count_the_whole_job(
        ds_dir, monkeypatch, capsys):
    """The seed's shape served: 4 rank processes (DP=2 x TP=2, routed experts split over the
    four), padded MTP K=3. Four concurrent requests, then one more after the ranks went idle:
    the tokens of one unsharded rank, and /metrics' drafted and accepted counts and token
    totals are the whole job's (both replicas'), equal to that rank's."""
    model = str(ds_dir("deepseek_v3_mtp"))
    app, line = served_app(monkeypatch, capsys, [
        model, "--method", "mtp", "-k", "3", "-tp", "2", "--dp", "2", "--enable-expert-parallel",
        "--max-model-len", "256", "--max-num-seqs", "4"])
    engine = app.state.engine
    assert isinstance(engine, ParallelEngine) and "4 rank processes" in line
    assert "DP=2 x TP=2" in line
    server = ServerThread(app)
    try:
        got = {}
        threads = [threading.Thread(target=complete, args=(server.url, p, got, i))
                   for i, p in enumerate(PROMPTS[:3])]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        while engine._asleep_at is None:  # every rank idle before the last request
            threading.Event().wait(0.01)
        complete(server.url, PROMPTS[3], got, 3)
        m = metrics(server.url)
    finally:
        server.close()
    assert all(p.exitcode == 0 for p in engine.processes)
    one = LLM(model=model, max_num_seqs=4, max_model_len=256, speculative_config={
        "method": "mtp", "num_speculative_tokens": 3}).generate(
        PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    assert [got[i] for i in range(4)] == [o.token_ids for o in one]
    drafted, accepted = (sum(sum(getattr(o, f)) for o in one)
                         for f in ("num_drafted", "num_accepted"))
    assert drafted > 0
    assert m["specdec:spec_decode_num_draft_tokens_total"] == drafted
    assert m["specdec:spec_decode_num_accepted_tokens_total"] == accepted
    assert m["specdec:generation_tokens_total"] == 4 * NEW
    assert m["specdec:prompt_tokens_total"] == sum(map(len, PROMPTS))


async def _generate(engine, prompt, params, delay: float):
    await asyncio.sleep(delay)
    handle, tokens = engine.submit(prompt, params), []
    while True:
        chunk = await handle.next_chunk()
        tokens += chunk.token_ids
        if chunk.finish_reason is not None or chunk.error is not None:
            assert chunk.error is None, chunk.error
            return tokens


def test_random_arrivals_sleeps_and_an_idle_spell_past_the_group_timeout_equal_one_rank():
    """DP=2 x TP=2 on the embedded model, groups timing out after 5 s (their start-up skew stays under it): requests arrive at
    random times in three bursts (each burst wakes the sleeping ranks; the gaps put them to
    sleep again), then the server idles 6 s -- longer than the timeout a TP peer waits in
    the step broadcast, which the keep-alive steps renew -- and serves again: every request
    equals one rank's tokens, greedy and seeded sampled alike. Then a TP peer is killed: the
    server says its engine died and refuses new requests."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 900) for _ in range(rng.randrange(2, 30))] for _ in range(10)]
    params = [SamplingParams(max_tokens=rng.randrange(2, 10), ignore_eos=True,
                             temperature=0.0 if i % 2 else 0.8, seed=i) for i in range(10)]
    delays = [burst * 0.3 + rng.uniform(0, 0.05) for burst in (0, 0, 0, 1, 1, 1, 2, 2, 2)]
    died = []

    async def run():
        engine = ParallelEngine(dict(model=None, spec=None, seed=0, max_model_len=64,
                                     device="cpu", data_parallel_size=2,
                                     tensor_parallel_size=2, data_parallel_timeout=5.0),
                                num_threads=1)
        engine.start_process()
        engine.on_engine_death = lambda: died.append(True)
        engine.start()
        try:
            first = await asyncio.gather(*(_generate(engine, p, s, d) for p, s, d in
                                           zip(prompts, params, delays)))
            await asyncio.sleep(6.0)
            last = await _generate(engine, prompts[9], params[9], 0)
            engine.processes[1].kill()  # a TP peer: no pipe of its own
            for _ in range(500):
                if died:
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(EngineDeadError, match="a rank process exited"):
                engine.submit([1, 2], SamplingParams())
            return [*first, last]
        finally:
            await engine.stop()

    got = asyncio.run(run())
    one = LLM(max_model_len=64).generate(prompts, params)
    assert got == [o.token_ids for o in one]
    assert died == [True]


def test_a_ranks_refusal_is_the_commands_one_line_error(capsys):
    """Expert parallelism over a dense model: every rank refuses it as one rank does, and
    serve says so on one line, exit 2."""
    code = main(["serve", "--dp", "2", "--enable-expert-parallel", "--port", "0"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "enable_expert_parallel=True: LlamaForCausalLM has no MoE layers" in err


def test_a_stub_engine_has_no_ranks(capsys):
    assert main(["serve", "--stub-engine", "1", "-tp", "2", "--port", "0"]) == 2
    assert "--stub-engine has no ranks" in capsys.readouterr().err


@pytest.mark.parametrize("flags,named", [
    (["--method", "mtp"], "--method"), (["-k", "2"], "-k"), (["--dtype", "float32"], "--dtype"),
    (["--synthetic", "llama-tiny"], "--synthetic"), (["--async-scheduling"], None),
    (["--no-enable-prefix-caching"], "--enable-prefix-caching"), (["--tree-topk", "2"], None)])
def test_a_stub_engine_refuses_what_it_would_ignore(flags, named, capsys):
    """It runs no model: these were accepted and the start-up line named a model and a
    drafter that did not run."""
    assert main(["serve", "--stub-engine", "1", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert f"error: {named or flags[0]} sets the model's engine, and --stub-engine runs none" \
        in err, err
