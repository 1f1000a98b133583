"""``pack_prefill``: prefill chunks packed into each step's token budget (vLLM's chunked
prefill), or not: a step that ends a prompt then holds no chunk of a prompt it cannot end.
Both give the same tokens; unpacked, a prompt's first token waits for no later prompt's work.
"""

import pytest
import torch

from specdec.engine.config import EngineConfig
from specdec.engine.sequence import SamplingParams

from helpers import VOCAB, make_llm, tiny_head, tiny_target

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=3)
PROMPTS = [[(7 * i + j) % (VOCAB - 1) for j in range(n)]
           for i, n in enumerate([12, 12, 30, 5, 20])]


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def replay(llm, prompts) -> tuple[list, list]:
    """The prompts, greedy and seeded alternating -> (each one's tokens, each step's prefill
    chunks as scheduled: (prompt index, tokens, whether the chunk stops short of the
    prompt's end))."""
    reqs = [llm.add_request(p, GREEDY if i % 2 else SEEDED) for i, p in enumerate(prompts)]
    index = {id(r): i for i, r in enumerate(reqs)}
    sched, schedules = llm.core.scheduler, []
    schedule = sched.schedule

    def traced():  # the scheduler's own schedule, recorded as it is made
        out = schedule()
        schedules.append([(index[id(s.request)], s.num_tokens, s.is_discarded)
                          for s in out if s.request.is_prefilling])
        return out
    sched.schedule = traced
    while llm.core.has_unfinished():
        llm.step()
    sched.schedule = schedule
    return [r.output_token_ids for r in reqs], [s for s in schedules if s]


@pytest.mark.parametrize("method", [None, "eagle", "mtp"])
def test_unpacked_steps_give_the_packed_tokens_and_end_prompts_alone(target, method):
    """Budget 16, prompts of 12, 12, 30, 5 and 20 tokens: packed, the first step ends prompt
    0 and starts prompt 1 (12 + 4); unpacked, it is prompt 0's 12 alone and prompt 1's 12
    follow in the next step. No unpacked step that ends a prompt holds a chunk stopping
    short of its own; a packed one does. Tokens (greedy and seeded) and the drafts' effect
    are the same either way."""
    head = tiny_head(method, target) if method else None
    runs = {pack: replay(make_llm(target, method, 3, True, head=head, pack_prefill=pack,
                                  max_num_seqs=3), PROMPTS) for pack in (True, False)}
    (packed, packed_steps), (unpacked, unpacked_steps) = runs[True], runs[False]
    assert unpacked == packed
    assert packed_steps[0] == [(0, 12, False), (1, 4, True)]
    assert unpacked_steps[:2] == [[(0, 12, False)], [(1, 12, False)]]

    def mixed(steps):  # steps with a chunk that ends its prompt and one that stops short
        return sum(any(d for _, _, d in s) and not all(d for _, _, d in s) for s in steps)
    assert mixed(unpacked_steps) == 0 < mixed(packed_steps)


def test_a_cached_prefix_counts_as_computed_when_it_decides(target):
    """Unpacked, a waiting prompt whose prefix the cache holds is admitted beside a prompt's
    last chunk when what it still computes fits the budget: prompt 1 repeats prompt 0's 32
    tokens plus 3, so after prompt 0 it computes 3 (the cache holds 32), and a step holds
    prompt 2's last 9 tokens and prompt 1's 3."""
    base = [(3 * j + 1) % (VOCAB - 1) for j in range(32)]
    llm = make_llm(target, None, 0, True, pack_prefill=False, max_num_seqs=3,
                   max_model_len=64)
    llm.generate([base + [1]], GREEDY)
    _, steps = replay(llm, [[5] * 25, base + [2, 3, 4]])
    assert steps[:2] == [[(0, 16, True)], [(0, 9, False), (1, 3, False)]]


@pytest.mark.parametrize("method,want", [(None, False), ("ngram", False), ("eagle", True)])
def test_the_cpu_default_packs_only_where_steps_run_a_draft_forward(target, method, want):
    """On a CPU: unpacked without a head or draft model (plain, ngram: host drafts), packed
    with one (each step's head forwards make an extra step dear); given values are kept."""
    head = tiny_head(method, target) if method == "eagle" else None
    assert make_llm(target, method, 2, True, head=head).config.pack_prefill is want
    for given in (True, False):
        llm = make_llm(target, method, 2, True, head=head, pack_prefill=given)
        assert llm.config.pack_prefill is llm.core.scheduler.pack_prefill is given


def test_a_bad_value_names_the_field():
    with pytest.raises(TypeError, match="pack_prefill"):
        EngineConfig(device="cpu", pack_prefill="yes")


@pytest.mark.parametrize("given,value", [([], None), (["--pack-prefill"], True),
                                         (["--no-pack-prefill"], False)])
def test_the_flag_reaches_every_command(given, value):
    """generate and serve pass it to LLM, bench serve --launch to the server it starts, bench
    to its engines (None: the flag not given, the device's default)."""
    from specdec.bench import itl
    from specdec.bench import serve as bench_serve
    from specdec.bench.sweep import build_engines, expand
    from specdec.commands.cli import build_parser
    from specdec.flags import engine_kwargs
    parse = build_parser().parse_args
    for command in (["generate", "--prompt", "x"], ["serve"]):
        assert engine_kwargs(parse([*command, *given])).get("pack_prefill") == value
    assert bench_serve.engine_flags(parse(["bench", "serve", "--launch", *given])) == given
    sweep = itl.sweep_from_args(parse(["bench", "--methods", "none", "--concurrency", "1",
                                       "--prompt-len", "4", "--output-len", "2", *given]))
    engines, _ = build_engines(sweep, expand(sweep))
    (engine,) = engines.values()
    assert engine.kwargs["pack_prefill"] is value
    assert engine.llm.config.pack_prefill is (value is True)
    assert engine.llm.core.scheduler.pack_prefill is (value is True)
