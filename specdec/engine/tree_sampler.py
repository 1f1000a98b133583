"""Tree rejection sampler: verify a draft tree against the target (issue 53's acceptance).

A request's step verifies a tree of n nodes: node 0 the root (its last emitted token), nodes
1..n-1 drafts, node k's parent ``parents[k] < k`` (parents before children; -1 for the root
and for padding nodes). The target's probabilities at node k, ``probs[k]``, predict the token
after k's path. One pass over the nodes in order keeps the current node u (the root first)
and a residual r (``probs[0]`` first):

    node k whose parent is u, token x (drawn from q_k: one-hot at x for a top-k candidate):
        accept with probability min(1, r(x) / q_k(x))
        accepted: u = k, r = probs[k]
        rejected: r = (r - q_k)+, renormalised        (one-hot q: r with x removed)
    after the pass: emit the tokens of u's path, then one token ~ r (the exponential race)

Every emitted token is distributed exactly as the target's: SpecInfer's recursive rejection
over siblings (Miao et al. 2024, multi-step speculative sampling), exact for deterministic
candidates (one-hot q, the ``draft_probs`` None case: a dynamic tree's top-k children) and for
siblings drawn independently from q. A child is tried only while its parent is the current
node, and children come after their parents, so the one pass visits each sibling set in
order. Greedy rows take r one-hot at the argmax: a child is accepted iff it is its parent's
argmax, and the last token is the argmax at the deepest accepted node.

Random numbers are the chain sampler's (``rejection_sampler``): node k's uniform is lane k-1
of the request's (key, counter), the last token's race its V exponentials, so a chain
(``parents = [-1, 0, 1, ...]``) emits exactly what ``rejection_sample`` does, and a request's
tokens depend on neither its batch nor the step. Device tensor ops only, shapes fixed by
(B, n, V, depth): no host sync.

Example (greedy, V = 4; argmax of probs per node [2, 1, 3, 0]): tokens [_, 1, 2, 3],
parents [-1, 0, 0, 1] -> node 1 (token 1) is not the root's argmax 2, rejected; node 2
(token 2) accepted; node 3's parent 1 is not the current node 2, skipped; the last token is
node 2's argmax 3 -> tokens [2, 3, -1], path [2, -1], 1 accepted.

``tree_greedy_verify`` is the same pass for an all-greedy batch (the chain's ``greedy_verify``):
the argmax at each node once, then [B]-sized work per node, no random numbers.
"""

from typing import NamedTuple

import torch

from specdec.engine import counter_rng
from specdec.engine.rejection_sampler import GREEDY_TEMPERATURE


class TreeVerdict(NamedTuple):
    tokens: torch.Tensor  # [B, depth + 1] int32: the accepted path's tokens, the next one, -1s
    path: torch.Tensor  # [B, depth] int64: the accepted nodes by depth, -1 past the path
    num_accepted: torch.Tensor  # [B] int64


def tree_rejection_sample(probs: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                          temperature: torch.Tensor, keys: torch.Tensor,
                          counters: torch.Tensor, depth: int,
                          draft_probs: torch.Tensor | None = None) -> TreeVerdict:
    """probs [B, n, V] float: the target's (processed) distribution at each node (a greedy
    row's: any scores whose argmax is the target's token, e.g. its logits); tokens
    [B, n] int: each node's token (node 0's unused; one outside [0, V) is never accepted);
    parents [B, n] int (module docstring); temperature [B] (< 1e-5: greedy); keys, counters
    [B] int64 as ``rejection_sample``'s (counter: the position the root's row samples);
    depth: a static bound on the tree's depth; draft_probs [B, n, V] or None: q_k, the
    distribution node k's token was drawn from (None: one-hot, a deterministic candidate)."""
    batch, n, vocab = probs.shape
    device = probs.device
    greedy = temperature < GREEDY_TEMPERATURE
    probs = probs.float()
    one_hot = torch.nn.functional.one_hot(probs.argmax(dim=-1), vocab).to(probs.dtype)
    probs = torch.where(greedy[:, None, None], one_hot, probs)  # greedy: r one-hot at argmax
    uniform = counter_rng.uniforms(keys, counters, counter_rng.STREAM_UNIFORM, max(n - 1, 1))
    race = counter_rng.exponentials(keys, counters, counter_rng.STREAM_RACE, vocab)
    node = torch.zeros(batch, dtype=torch.int64, device=device)  # the current node u
    residual = probs[:, 0]
    path = torch.full((batch, depth), -1, dtype=torch.int64, device=device)
    level = torch.zeros(batch, dtype=torch.int64, device=device)  # u's depth
    levels = torch.arange(depth, device=device)
    for k in range(1, n):
        x = tokens[:, k].long()
        tried = (parents[:, k].long() == node) & (x >= 0) & (x < vocab)
        x = x.clamp(0, vocab - 1)
        r_x = residual.gather(1, x[:, None]).squeeze(1)
        if draft_probs is None:
            accept = tried & (uniform[:, k - 1] < r_x)
            left = residual.scatter(1, x[:, None], 0.0)
        else:
            q = draft_probs[:, k].float()
            q_x = q.gather(1, x[:, None]).squeeze(1)
            accept = tried & (uniform[:, k - 1] * q_x < r_x)
            left = (residual - q).clamp_min(0.0)
        mass = left.sum(dim=1, keepdim=True)
        # rounding can reject a candidate holding all of r's mass: keep r then
        left = torch.where(mass > 0, left / mass.clamp_min(torch.finfo(left.dtype).tiny),
                           residual)
        residual = torch.where(accept[:, None], probs[:, k],
                               torch.where(tried[:, None], left, residual))
        path = torch.where(accept[:, None] & (levels[None] == level[:, None]), k, path)
        level = level + accept.long()
        node = torch.where(accept, k, node)
    last = torch.where(greedy, residual.argmax(dim=1), (residual / race).argmax(dim=1))
    return _verdict(tokens, path, level, last)


def tree_greedy_verify(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                       depth: int) -> TreeVerdict:
    """``tree_rejection_sample`` of an all-greedy batch: scores [B, n, V] (any whose argmax is
    the target's token, e.g. its logits), the rest as there. Node k is accepted iff its
    parent is the current node and its token is the current node's argmax; the last token is
    the argmax at the deepest accepted node. The module docstring's example holds here too."""
    batch, n, _ = scores.shape
    device = scores.device
    argmax = scores.argmax(dim=-1)  # [B, n]
    node = torch.zeros(batch, dtype=torch.int64, device=device)  # the current node u
    path = torch.full((batch, depth), -1, dtype=torch.int64, device=device)
    level = torch.zeros(batch, dtype=torch.int64, device=device)  # u's depth
    levels = torch.arange(depth, device=device)
    for k in range(1, n):
        target = argmax.gather(1, node[:, None]).squeeze(1)
        accept = (parents[:, k].long() == node) & (tokens[:, k].long() == target)
        path = torch.where(accept[:, None] & (levels[None] == level[:, None]), k, path)
        level = level + accept.long()
        node = torch.where(accept, k, node)
    return _verdict(tokens, path, level, argmax.gather(1, node[:, None]).squeeze(1))


def _verdict(tokens: torch.Tensor, path: torch.Tensor, level: torch.Tensor,
             last: torch.Tensor) -> TreeVerdict:
    """The verdict from the accepted path [B, depth], its length [B] and the token after it
    [B]: the path's tokens, then ``last``, then -1."""
    batch, depth = path.shape
    levels = torch.arange(depth, device=path.device)
    path_tokens = tokens.long().gather(1, path.clamp(min=0))
    out = torch.where(levels[None] < level[:, None], path_tokens, -1)
    out = torch.cat([out, out.new_full((batch, 1), -1)], dim=1)
    out[torch.arange(batch, device=path.device), level] = last
    return TreeVerdict(out.to(torch.int32), path, level)
