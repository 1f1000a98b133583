"""``SamplingParams.n``: n samples of one prompt run as n requests, their outputs gathered back
into one ``RequestOutput`` (``outputs[i]`` is sample i), as vLLM's parallel sampling. With a
seed, sample i draws with ``seed + i`` (vLLM's child seed), so each has its own counter-based
stream; without one, each sample's numbers are keyed by its own request id.

Example: prompts [a, b] with n = [2, 1] -> requests [a (seed s), a (seed s + 1), b], then
outputs [a: outputs[0], outputs[1]; b: outputs[0]].
"""

from dataclasses import replace

from specdec.engine.outputs import RequestOutput
from specdec.engine.sequence import SamplingParams


def fan_out(ids: list[list[int]], per_prompt: list[SamplingParams], texts: list
            ) -> tuple[list[list[int]], list[SamplingParams], list, list[int]]:
    """-> (ids, params, texts) with each prompt repeated n times (params n = 1, seed + i), and
    the number of samples of each prompt."""
    out_ids, out_params, out_texts, counts = [], [], [], []
    for x, params, text in zip(ids, per_prompt, texts):
        counts.append(params.n)
        for i in range(params.n):
            seed = params.seed + i if params.seed is not None else None
            out_ids.append(list(x))  # each request appends to its own list
            out_params.append(params if params.n == 1 else replace(params, n=1, seed=seed))
            out_texts.append(text)
    return out_ids, out_params, out_texts, counts


def fan_in(outputs: list[RequestOutput], counts: list[int]) -> list[RequestOutput]:
    """One RequestOutput per prompt from its ``counts[i]`` samples' (in order): the first
    sample's request id and prompt, ``outputs`` from every sample (``index`` i), the
    speculation figures summed over the samples, the first error."""
    merged, at = [], 0
    for n in counts:
        group, at = outputs[at:at + n], at + n
        first = group[0]
        if n == 1:
            merged.append(first)
            continue
        for i, out in enumerate(group):
            out.outputs[0].index = i
        width = max(len(o.num_drafted) for o in group)
        merged.append(replace(
            first, outputs=[o.outputs[0] for o in group],
            num_drafted=[sum(o.num_drafted[j] for o in group if j < len(o.num_drafted))
                         for j in range(width)],
            num_accepted=[sum(o.num_accepted[j] for o in group if j < len(o.num_accepted))
                          for j in range(width)],
            num_decode_steps=sum(o.num_decode_steps for o in group),
            error=next((o.error for o in group if o.error is not None), None)))
    return merged
