"""vLLM's sampling settings computed directly, in plain Python floats (float64), one position at a
time: what ``specdec.engine.penalties`` and ``rejection_sampler.target_probs`` must equal, and a
speculative step replayed from the engine's own counter-based random numbers.

vLLM's order (v1 Sampler): min_tokens -> repetition, frequency, presence penalties -> [greedy:
argmax] -> temperature -> min_p -> top_k -> top_p.
"""

import math

import torch

from specdec.engine import counter_rng

NEG_INF = float("-inf")


def process(logits: list[float], prompt: list[int], output: list[int], params,
            eos_token_ids=()) -> list[float]:
    """One position's logits after min_tokens and the penalties; ``output``: the output tokens
    before this position (accepted, and drafts before it)."""
    out = list(logits)
    if len(output) < params.min_tokens:
        for t in (*eos_token_ids, *params.stop_token_ids):
            out[t] = NEG_INF
    seen = set(prompt) | set(output)
    for t in range(len(out)):
        x = out[t]
        if t in seen:
            x = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
        n = output.count(t)
        x -= params.frequency_penalty * n + params.presence_penalty * (n > 0)
        out[t] = x
    return out


def probs(processed: list[float], params) -> list[float]:
    """The distribution a sampled position draws from: softmax(x / T), min_p, top_k (ties
    kept), then top_p over what is left, renormalised (a token is kept when the mass above it,
    in descending order, is < top_p)."""
    top = max(processed)
    e = [math.exp((x - top) / params.temperature) if x > NEG_INF else 0.0 for x in processed]
    p = [x / sum(e) for x in e]
    keep = [True] * len(p)
    if params.min_p > 0:
        keep = [k and x >= params.min_p * max(p) for k, x in zip(keep, p)]
    if params.top_k > 0:
        kth = sorted(p, reverse=True)[min(params.top_k, len(p)) - 1]
        keep = [k and x >= kth for k, x in zip(keep, p)]
    if params.top_p < 1.0:
        left = sum(x for x, k in zip(p, keep) if k)
        above = 0.0
        for t in sorted(range(len(p)), key=lambda t: -p[t]):
            if not keep[t]:
                continue
            keep[t] = above < params.top_p
            above += p[t] / left
    kept = sum(x for x, k in zip(p, keep) if k)
    return [x / kept if k else 0.0 for x, k in zip(p, keep)]


def argmax(xs: list[float]) -> int:
    return max(range(len(xs)), key=xs.__getitem__)


def replay_step(logits_at, prompt: list[int], output: list[int], drafts: list[int], params,
                key: int, eos_token_ids=()) -> list[int]:
    """The tokens a speculative step emits, computed directly: position j's distribution from
    ``logits_at(j)`` (the target's logits after the known tokens and drafts[:j]) processed
    with output + drafts[:j] counted; the step's random numbers drawn as the engine draws them
    (``counter_rng``: key, counter = the first sampled position). Greedy: accept while the draft
    is the argmax, then the argmax. Sampled: accept draft j when u_j < p_j(d_j); on rejection
    the race over p_j without d_j, after every draft the race over p_K."""
    counter = len(prompt) + len(output)
    greedy = params.temperature < 1e-5
    vocab = None
    emitted = []
    for j in range(len(drafts) + 1):
        x = process(logits_at(j), prompt, output + drafts[:j], params, eos_token_ids)
        vocab = len(x)
        if greedy:
            best = argmax(x)
            if j < len(drafts) and drafts[j] == best:
                emitted.append(best)
                continue
            return emitted + [best]
        p = probs(x, params)
        keys, counters = torch.tensor([key]), torch.tensor([counter])
        if j < len(drafts):
            u = float(counter_rng.uniforms(keys, counters, counter_rng.STREAM_UNIFORM,
                                           len(drafts))[0, j])
            d = drafts[j]
            if 0 <= d < vocab and u < p[d]:
                emitted.append(d)
                continue
            residual = [0.0 if t == d else q for t, q in enumerate(p)]
            p = residual if sum(residual) > 0 else p
        race = counter_rng.exponentials(keys, counters, counter_rng.STREAM_RACE, vocab)[0]
        return emitted + [argmax([q / float(e) for q, e in zip(p, race.tolist())])]
    raise AssertionError("unreachable")
