"""Log-probabilities of the target distribution, for the requests that ask (vLLM's
``SamplingParams.logprobs`` / ``prompt_logprobs``).

They are log-softmax of the target's raw logits (before temperature and top-p, as vLLM returns
by default). An emitted token's comes from the verify pass's logits row that sampled it (every
accepted draft and the bonus token have one); a prompt token's from the prefill's hidden state
at the position before it. A step computes them only when one of its requests asks, after the
step's one host read.
"""

from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # the most top log-probabilities a request may ask for (vLLM's default)


@dataclass(slots=True)
class TokenLogprob:
    """One position: the token there, its log-probability and rank, and the top ones."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]  # the request's N most likely (token id, logprob), best first


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                   num_top: list[int]) -> list[TokenLogprob]:
    """logits [R, V] (any float dtype), token_ids [R] int, num_top: R ints (each row's N)
    -> R TokenLogprob, row r's with its num_top[r] best tokens. One host read per call."""
    if not num_top:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, token_ids.long()[:, None]).squeeze(1)
    rank = (lp > chosen[:, None]).sum(dim=1) + 1
    k = max(num_top)
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    rows = torch.cat([chosen[:, None].double(), rank[:, None].double(), top_lp.double(),
                      top_ids.double()], dim=1).tolist()  # float64 holds every token id
    out = []
    for row, tok, n in zip(rows, token_ids.tolist(), num_top):
        top = [(int(i), v) for v, i in zip(row[2:2 + n], row[2 + k:2 + k + n])]
        out.append(TokenLogprob(int(tok), row[0], int(row[1]), top))
    return out
