"""Where a turn's time goes on the agentic trace, in process: plain and a speculative config
(default suffix) on two engines built as ``specdec bench serve --launch`` builds the server's
(4 rows, the model's max_model_len, 256 batched tokens, prefix caching on), the trace's
conversations replayed as ``bench serve --multi-turn 5`` replays them (``--pacing rounds``:
lock-step rounds, each round's 4 chats to the end; ``free``: 4 slots, a conversation's next
turn queued when its reply ends; 32 greedy tokens a reply, appended as the assistant turn;
each repeat ``--conversations`` the earlier repeats did not send), repeat r of one engine,
then of the other (interleaved).

Per engine, over every round: the round wall time and its share in steps that hold a prefill
chunk (speculation cannot shorten them) against decode-only steps; per decode-only step its
ms, the requests in it, the tokens fed (1 + drafts per request), the logits rows verified
per request (1 + the step's most drafts), the tokens accepted, and the host time of the
drafter's search (``next_drafts``, timed by a wrapper here, not in the engine).

    python -m benchmarks.profile_agentic [--speculative-config '{"method":"suffix"}'] [--repeats 3]
        [--pacing rounds|free] [--conversations 4]
"""

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from specdec import LLM, SamplingParams
from specdec.bench import datasets, multiturn
from specdec.bench.serve import MULTI_TURN_PACINGS
from specdec.bench.sweep import model_limit
from specdec.engine.chat_template import load_chat_template
from specdec.engine.llm import DEFAULT_MODEL

TRACE = Path(__file__).resolve().parent.parent / "specdec/bench/traces/agentic.jsonl"
PARAMS = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


class Probe:
    """The shapes of each schedule and the drafter's search time, from wrappers around the
    engine's scheduler and proposer (this script's, the engine is unchanged)."""

    def __init__(self, llm: LLM):
        self.schedules, self.search_s = [], 0.0
        sched, proposer = llm.core.scheduler, llm.core.proposer
        schedule = sched.schedule

        def traced_schedule():
            out = schedule()
            self.schedules.append([(s.request.is_prefilling, s.num_tokens,
                                    len(s.spec_token_ids)) for s in out])
            return out
        sched.schedule = traced_schedule
        if proposer is not None:
            next_drafts = proposer.next_drafts

            def timed(*a, **kw):
                t = time.perf_counter()
                try:
                    return next_drafts(*a, **kw)
                finally:
                    self.search_s += time.perf_counter() - t
            proposer.next_drafts = timed


def account(llm: LLM, probe: Probe, first_step: int, first_sched: int, stats: dict) -> None:
    """Adds the steps since ``first_step`` (and their schedules) to ``stats``."""
    for rec, shape in zip(llm.core.steps[first_step:], probe.schedules[first_sched:]):
        if any(prefilling for prefilling, _, _ in shape):
            stats["prefill_steps"] += 1
            stats["prefill_s"] += rec.seconds
            stats["prefill_tokens"] += sum(n for p, n, _ in shape if p)
            continue
        stats["decode_steps"] += 1
        stats["decode_s"] += rec.seconds
        stats["decode_reqs"] += len(shape)
        stats["fed"] += sum(n for _, n, _ in shape)
        stats["rows"] += len(shape) * (1 + max(d for _, _, d in shape))
        stats["emitted"] += sum(rec.new_tokens.values())


def replay_rounds(llm: LLM, probe: Probe, convs, stats: dict) -> None:
    """The conversations' lock-step rounds on ``llm``; adds to ``stats``."""
    history = [[] for _ in convs]
    for t in range(max(len(c.turns) for c in convs)):
        todo = [i for i, c in enumerate(convs) if t < len(c.turns)]
        msgs = [history[i] + [{"role": "user", "content": convs[i].turns[t]}] for i in todo]
        first_step, first_sched, search = len(llm.core.steps), len(probe.schedules), probe.search_s
        start = time.perf_counter()
        outs = llm.chat(msgs, PARAMS)
        stats["wall_s"] += time.perf_counter() - start
        stats["search_s"] += probe.search_s - search
        for i, m, out in zip(todo, msgs, outs):
            history[i] = m + [{"role": "assistant", "content": out.outputs[0].text}]
            stats["output_tokens"] += len(out.outputs[0].token_ids)
        account(llm, probe, first_step, first_sched, stats)


def replay_free(llm: LLM, probe: Probe, convs, stats: dict, slots: int = 4) -> None:
    """The conversations with free pacing (``bench serve --multi-turn-pacing free``): each of
    ``slots`` conversations queues its next turn in the step after its reply ends, and a slot
    takes the next conversation when its own ends; adds to ``stats``."""
    render = load_chat_template(DEFAULT_MODEL)
    queue = iter(range(len(convs)))

    def send(i: int, t: int, history: list[dict]) -> tuple:
        msgs = history + [{"role": "user", "content": convs[i].turns[t]}]
        ids = llm.tokenizer.encode(render(msgs), add_special_tokens=False).ids
        return i, t, msgs, llm.add_request(ids, PARAMS)

    active = [send(i, 0, []) for i in itertools.islice(queue, slots)]
    first_step, first_sched, search = len(llm.core.steps), len(probe.schedules), probe.search_s
    start = time.perf_counter()
    while active:
        llm.step()
        for j, (i, t, msgs, req) in enumerate(active):
            if req.finish_reason is None:
                continue
            out = req.output_token_ids
            stats["output_tokens"] += len(out)
            history = msgs + [{"role": "assistant", "content": llm.tokenizer.decode(out)}]
            nxt = i if t + 1 < len(convs[i].turns) else next(queue, None)
            active[j] = (None if nxt is None
                         else send(nxt, t + 1, history) if nxt == i else send(nxt, 0, []))
        active = [a for a in active if a is not None]
    stats["wall_s"] += time.perf_counter() - start
    stats["search_s"] += probe.search_s - search
    account(llm, probe, first_step, first_sched, stats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--speculative-config", default='{"method":"suffix"}')
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pacing", choices=MULTI_TURN_PACINGS, default="rounds",
                   help="bench serve's --multi-turn-pacing (default rounds)")
    p.add_argument("--conversations", type=int, default=4,
                   help="conversations per repeat (default 4; the trace has 16)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: the served engine's on this 2-core CPU)")
    args = p.parse_args()
    for name in ("repeats", "threads", "conversations"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name}={getattr(args, name)}: allowed an int >= 1")
    torch.set_num_threads(args.threads)
    kw = dict(max_num_seqs=4, max_model_len=model_limit(None), max_num_batched_tokens=256)
    engines = {"plain": LLM(**kw), "spec": LLM(speculative_config=json.loads(
        args.speculative_config), **kw)}
    probes = {name: Probe(llm) for name, llm in engines.items()}
    keys = ("wall_s", "search_s", "output_tokens", "prefill_steps", "prefill_s",
            "prefill_tokens", "decode_steps", "decode_s", "decode_reqs", "fed", "rows", "emitted")
    stats = {name: dict.fromkeys(keys, 0) for name in engines}
    tok = _tokenizer()
    opts = dict(multi_turn=5, prompt_len=64)
    trace = datasets.load("spec_bench", str(TRACE))
    for name, llm in engines.items():  # warm-up: generated text, nothing of the trace
        llm.generate(["def main():"] * 4, max_tokens=32, ignore_eos=True)
    replay = replay_free if args.pacing == "free" else replay_rounds
    for r in range(args.repeats):
        convs = multiturn.conversations(trace, opts, tok, args.conversations, 0,
                                        r * args.conversations)
        for name, llm in engines.items():
            replay(llm, probes[name], convs, stats[name])
    for name, s in stats.items():
        ds = max(s["decode_steps"], 1)
        print(f"{name}: {s['output_tokens'] / s['wall_s']:.0f} tok/s over {s['wall_s']:.2f} s; "
              f"prefill steps {s['prefill_steps']} ({s['prefill_tokens']} tokens) "
              f"{s['prefill_s']:.2f} s = {s['prefill_s'] / s['wall_s']:.0%} of the wall; "
              f"decode-only steps {s['decode_steps']} {s['decode_s']:.2f} s = "
              f"{s['decode_s'] / s['wall_s']:.0%}, {1e3 * s['decode_s'] / ds:.2f} ms each, "
              f"{s['decode_reqs'] / ds:.2f} requests, {s['fed'] / ds:.1f} tokens fed, "
              f"{s['rows'] / ds:.1f} logits rows, {s['emitted'] / ds:.2f} tokens emitted; "
              f"drafter search {s['search_s']:.2f} s = {s['search_s'] / s['wall_s']:.0%}")
    a, b = stats["plain"], stats["spec"]
    ratio = (b["output_tokens"] / b["wall_s"]) / (a["output_tokens"] / a["wall_s"])
    print(f"spec / plain tok/s: {ratio:.2f}")


def _tokenizer():
    """The embedded model's tokenizer (the bench's, which makes the conversations)."""
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(Path(DEFAULT_MODEL) / "tokenizer.json"))


if __name__ == "__main__":
    main()
