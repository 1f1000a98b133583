"""Paged attention in pure torch: gather each request's keys up to a static bound, then SDPA.

The CPU path and the oracle of the Triton kernel (``triton_paged_attention.py``). Both take a
per-forward plan (shared by every layer) and one layer's cache:

    q        [N, Hq, D]   queries (RoPE applied), any float dtype; rows may be strided
    k_cache  [S, Hkv, D]  one layer's flat cache (S = num_blocks * block_size + 1 trash slot)
    v_cache  [S, Hkv, D]
    -> out   [N, Hq, D]   q's dtype

Token ``i`` of request ``r`` (``r = req[i]``, tokens past the last request map to it) sees the
first ``visible[i]`` keys of ``r``, where, with ``q_end = query_start_loc[r + 1]``,

    visible[i] = clamp(seq_len[r] - (q_end - 1 - i), 1, seq_len[r])   (at least 1 key)

i.e. everything before the chunk plus the chunk's tokens up to and including ``i`` (causal).
The token's own position is ``visible[i] - 1``. With a sliding window ``W`` (Mistral v0.1:
key ``j`` is seen by the query at position ``p`` iff ``p - W < j <= p``, transformers'
``kv_idx > q_idx - sliding_window``) it sees key positions

    max(0, visible[i] - W) <= j < visible[i]                          (at most W keys)

and without one (``W = None``) positions ``0 <= j < visible[i]``. Key position ``j`` of ``r``
lives in slot ``block_table[r, j // bs] * bs + j % bs``. Scores are scaled by ``scale``
(default ``D ** -0.5``), then, with a soft cap ``c`` (Gemma-2's ``attn_logit_softcapping``),
squashed to ``c * tanh(s / c)`` (in (-c, c)) before the mask and the softmax. An attention
sink (gpt-oss: a learned logit per query head) is one more entry of the softmax with no value:
``out = sum_j e^(s_j) v_j / (e^(sink) + sum_j e^(s_j))``.

Worked example: query_start_loc = [0, 3, 4], seq_lens = [5, 9] (request 0: a 3-token chunk
after 2 cached tokens; request 1: one decode token), N = 5 (token 4 is padding)
-> req = [0, 0, 0, 1, 1], visible = [3, 4, 5, 9, 9] (the padding token is clamped to 9);
with W = 4 the windows start at max(0, visible - 4) = [0, 0, 1, 5, 5]: token 2 (position 4)
sees keys 1..4, token 3 (position 8) sees keys 5..8.

``bound`` (the gather length L) is any host int >= max(seq_lens): keys outside the
token's range are masked out, so the result does not depend on it. Shapes depend only on N, B,
the block table's width, ``bound`` and ``max_query_len``; nothing is read back to the host.
The window, scale, soft cap and sinks are per call (layers may differ), not part of the plan.

Query rows: the queries sit in R rows of T tokens, each row T consecutive tokens of one
request (padded), and each row gathers its request's L keys once, so a layout gathers R * L
keys, not N * L. The plan picks (T, R) from host ints only (``row_shape``):

    token-major     T = 1, R = N              (one token per request: decodes)
    request-major   T = max_query_len, R = B  (a host bound T > 1 with B * T <= 2N:
                                              verification, equal prefill chunks)
    segments        T = ceil(N / B), R = (N + B * (T - 1)) // T  (a bound on the rows
                    the requests fill; mixed steps: one prefill chunk among decodes)

A step whose requests differ in kind -- decodes of 1 + K tokens first, then prefill chunks --
can be split (``QuerySplit``, host ints) into two groups with their own rows (``SplitPlan``):
one (T, R) for both pads every decode to a chunk's row. On this CPU one layer's attention for
3 decodes (over 800-820 keys) and a 190-token chunk (over 790) took 11.3 ms in one plan's 7
rows of 49 and 3.8 ms as the two groups' 3 rows of 1 and 1 row of 190.

Request b fills ceil(C_b / T) rows (C_b its tokens), from row ``row_start[b]`` (exclusive
cumsum); rows past the last hold nothing (their outputs are dropped). Row r, slot t holds
token ``query_start_loc[b] + (r - row_start[b]) * T + t`` (clamped to N - 1, a padding slot
repeats a token) and token i's output is slot ``local % T`` of row ``row_start[b] + local //
T`` (``local = i - query_start_loc[b]``; clamped to the last slot). In the example, request-
major with T = 3: rows [[0, 1, 2], [3, 4, 4]], visible [[3, 4, 5], [9, 9, 9]], outputs from
slots [0, 1, 2, 3, 4]; a 1 + K verification gathers 1 + K times fewer keys than token-major.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F


class TreeMask(NamedTuple):
    """Where a step's tokens are draft-tree nodes: per token [N] int64. A request's tree
    tokens are its last n query tokens, node k at key position ``prefix + k`` (in node order,
    parents before children); node k of depth d has RoPE position ``prefix + d`` and sees the
    prefix and its ancestors: bit a of ``ancestors`` set for each ancestor node a and for k
    itself. Any other token (a prefill chunk, padding) is node 0 of depth 0 with ancestors 1:
    plain causal. A chain of K drafts is the tree whose node k has ancestors ``2**(k+1) - 1``.

    Example: root r, children a, b of r, child c of a (nodes 0..3: r, a, b, c) -> depth
    [0, 1, 1, 2], ancestors [0b1, 0b11, 0b101, 0b1011]: b sees r and b, not a."""

    node: torch.Tensor  # [N] int64, index in its request's tree (0..62)
    depth: torch.Tensor  # [N] int64
    ancestors: torch.Tensor  # [N] int64 bitmask over its request's tree nodes


class PagedPlan(NamedTuple):
    """Per-forward indices, built once and reused by every layer (R rows of T query slots,
    L = the gather bound; module docstring)."""

    visible: torch.Tensor  # [R, T] int64, keys each query slot sees (>= 1)
    key_slots: torch.Tensor  # [R * L] int64, slot of key position j of row r at r * L + j
    #                          (one flat index: each layer gathers K and V once)
    key_mask: torch.Tensor  # [R, T, L] bool, key position < visible
    query_rows: torch.Tensor | None  # [R * T] int64, the token in each slot; None:
    #                                  token-major (the identity)
    out_rows: torch.Tensor | None  # [N] int64, the slot of each token; None: token-major
    # [R, T] int64, a sliding window's end: position + 1 of each slot (a tree node's position
    # is its depth's, not its key index's); None: ``visible``
    window_end: torch.Tensor | None = None


class QuerySplit(NamedTuple):
    """Host ints: a step's first ``num_reqs`` requests (0 < num_reqs < B) hold its first
    ``num_tokens`` tokens, at most ``max_query_len`` each (decodes); the other requests hold
    the rest."""

    num_reqs: int
    num_tokens: int
    max_query_len: int


class SplitPlan(NamedTuple):
    """Two groups of a step's requests, each in its own rows (``QuerySplit``): ``head`` plans
    the first ``num_tokens`` tokens, ``tail`` the rest."""

    num_tokens: int
    head: PagedPlan
    tail: PagedPlan


def row_shape(num_tokens: int, num_reqs: int, max_query_len: int | None) -> tuple[int, int]:
    """(T, R) of the query rows (module table) from host ints. Segments are taken only when
    they need at most 3/4 of token-major's rows; ``max_query_len`` 1 is token-major.

    Examples: N = 64, B = 16, max_query_len 4 -> (4, 16); N = 47, B = 16 (one 32-token chunk
    among 15 decodes), None -> (3, 26); N = 16, B = 16 -> (1, 16)."""
    if num_tokens == 0 or num_reqs == 0 or max_query_len == 1:
        return 1, num_tokens
    if max_query_len is not None and 1 < max_query_len <= 2 * num_tokens // num_reqs:
        return max_query_len, num_reqs  # request-major: B * T <= 2N
    t = -(-num_tokens // num_reqs)
    rows = (num_tokens + num_reqs * (t - 1)) // t
    return (t, rows) if t > 1 and 4 * rows <= 3 * num_tokens else (1, num_tokens)


def token_requests(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[N] int64 request of each token; tokens past the last request map to it.

    Example: query_start_loc = [0, 3, 3, 4], N = 6 -> [0, 0, 0, 2, 2, 2] (request 1 is empty).
    """
    tok = torch.arange(num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
    # = searchsorted(query_start_loc[1:], tok, right=True), as a count: inductor's CUDA
    # lowering of searchsorted rejects a sliced boundary tensor (graph_mode="torchair")
    idx = (query_start_loc[None, 1:] <= tok[:, None]).sum(dim=1)
    return idx.clamp_(max=query_start_loc.shape[0] - 2)


def visible_keys(req: torch.Tensor, query_start_loc: torch.Tensor,
                 seq_lens: torch.Tensor) -> torch.Tensor:
    """[N] int64 keys seen by each token (module formula; example in the module docstring)."""
    tok = torch.arange(req.shape[0], device=req.device)
    seq_len = seq_lens.to(torch.int64)[req]
    q_end = query_start_loc.to(torch.int64)[req + 1]
    return torch.minimum(seq_len - (q_end - 1 - tok), seq_len).clamp_(min=1)


def check_sliding_window(sliding_window) -> None:
    """Raise ValueError unless ``sliding_window`` is None or an int >= 1."""
    if sliding_window is not None and (not isinstance(sliding_window, int)
                                       or isinstance(sliding_window, bool) or sliding_window < 1):
        raise ValueError(f"sliding_window={sliding_window!r} must be None or an int >= 1")


def plan_paged_attention(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                         block_table: torch.Tensor, num_tokens: int, bound: int,
                         block_size: int, max_query_len: int | None = None,
                         tree: TreeMask | None = None, split: QuerySplit | None = None
                         ) -> PagedPlan | SplitPlan:
    """query_start_loc [B+1] int32, seq_lens [B] int32, block_table [B, M] int32 -> PagedPlan.
    ``max_query_len``: a host bound on every request's tokens (None: unknown). ``tree``: the
    tokens' draft-tree nodes (``TreeMask``; None: every token causal). ``split``: plan its two
    groups apart (-> ``SplitPlan``)."""
    if split is not None:
        b, n = split.num_reqs, split.num_tokens
        if not 0 < b < seq_lens.shape[0]:
            raise ValueError(f"split.num_reqs={b}: must be in [1, {seq_lens.shape[0] - 1}] "
                             "(both groups hold a request)")
        head_tree, tail_tree = (None, None) if tree is None else (
            TreeMask(*(t[:n] for t in tree)), TreeMask(*(t[n:] for t in tree)))
        head = plan_paged_attention(query_start_loc[:b + 1], seq_lens[:b], block_table[:b], n,
                                    bound, block_size, split.max_query_len, head_tree)
        tail = plan_paged_attention(query_start_loc[b:] - n, seq_lens[b:], block_table[b:],
                                    num_tokens - n, bound, block_size, max_query_len, tail_tree)
        return SplitPlan(n, head, tail)
    plan = _plan(query_start_loc, seq_lens, block_table, num_tokens, bound, block_size,
                 max_query_len)
    return plan if tree is None else with_tree(plan, tree)


def with_tree(p: PagedPlan, tree: TreeMask) -> PagedPlan:
    """``p`` with each tree node's keys cut to its request's prefix and its ancestors, and its
    window ending at its position (``TreeMask``)."""
    def slots(t: torch.Tensor) -> torch.Tensor:  # [N] -> [R, T], the plan's query slots
        return t[:, None] if p.query_rows is None else t[p.query_rows].view(p.visible.shape)
    node, depth, ancestors = (slots(t.to(torch.int64)) for t in tree)
    start = p.visible - 1 - node  # the key position of the request's node 0
    rel = torch.arange(p.key_mask.shape[-1], device=node.device) - start[..., None]
    seen = (rel < 0) | ((ancestors[..., None] >> rel.clamp(0, 62)) & 1).bool()
    return p._replace(key_mask=p.key_mask & seen, window_end=p.visible - node + depth)


def _plan(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
          num_tokens: int, bound: int, block_size: int, max_query_len: int | None) -> PagedPlan:
    device = seq_lens.device
    b = seq_lens.shape[0]
    key_pos = torch.arange(bound, device=device)
    block_idx = (key_pos // block_size).clamp_(max=block_table.shape[1] - 1)
    key_slots = block_table.to(torch.int64)[:, block_idx] * block_size + key_pos % block_size
    # (a block table's unused entries may be -1: their keys are masked, read slot 0 instead)
    key_slots.clamp_(min=0)
    req = token_requests(query_start_loc, num_tokens)
    t, rows = row_shape(num_tokens, b, max_query_len)
    if t == 1:
        visible = visible_keys(req, query_start_loc, seq_lens)[:, None]
        return PagedPlan(visible, key_slots[req].flatten(), key_pos < visible[..., None],
                         None, None)
    qsl = query_start_loc.to(torch.int64)
    lens = qsl[1:] - qsl[:-1]
    ends = torch.cumsum((lens + t - 1) // t, 0)  # rows filled by requests 0..b
    row_req = token_requests(torch.cat([ends.new_zeros(1), ends]), rows)
    row_start = ends - (lens + t - 1) // t
    first = (torch.arange(rows, device=device) - row_start[row_req]) * t  # in the request
    local = first[:, None] + torch.arange(t, device=device)  # [R, T]
    seq = seq_lens.to(torch.int64)[row_req, None]
    # slot (r, t) is token `local` of its request: it sees seq - (len - 1 - local) keys
    visible = torch.minimum((seq - lens[row_req, None] + 1 + local).clamp_(min=1), seq)
    query_rows = (qsl[row_req, None] + local).clamp_(max=num_tokens - 1).flatten()
    tok_local = torch.arange(num_tokens, device=device) - qsl[req]
    out_rows = ((row_start[req] + tok_local // t) * t + tok_local % t).clamp_(max=rows * t - 1)
    return PagedPlan(visible, key_slots[row_req].flatten(), key_pos < visible[..., None],
                     query_rows, out_rows)


def check_softcap(softcap) -> None:
    """Raise ValueError unless ``softcap`` is None or a number > 0."""
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not softcap > 0):
        raise ValueError(f"softcap={softcap!r} must be None or a number > 0")


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *,
                     scale: float | None = None, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [..., Hq, Tq, D], k/v [..., Hkv, Tk, D] (Hkv divides Hq: grouped), mask [..., 1 or
    Hq, Tq, Tk] bool (True: attend) or additive (``attention_bias``) -> [..., Hq, Tq, D].
    SDPA; with ``softcap`` c or ``sinks``, the same math spelled out as transformers' eager
    attention: scores ``q.k * scale`` in float32, ``c * tanh(s / c)``, masked, softmax, cast
    to v's dtype, times v.
    ``sinks`` (gpt-oss): one extra logit per query row, broadcastable to [..., Hq, Tq, 1],
    that joins the softmax and is then dropped (its row's weights sum to less than 1)."""
    gqa = q.shape[-3] != k.shape[-3]
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=gqa)
    if gqa:
        k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)).float() * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if sinks is None:
        return scores.softmax(-1).to(v.dtype) @ v
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], -1).softmax(-1)[..., :-1].to(v.dtype) @ v


def gather_keys(cache: torch.Tensor, p: PagedPlan) -> torch.Tensor:
    """cache [S, H, D] -> [R, L, H, D]: each query row's request's key positions 0..L-1 (one
    index_select: a 2-D advanced index, or a gather per request then per token, costs several
    times more on CPU)."""
    rows, _, length = p.key_mask.shape
    return cache.index_select(0, p.key_slots).view(rows, length, *cache.shape[1:])


def rows_of(q: torch.Tensor, p: PagedPlan) -> torch.Tensor:
    """q [N, H, D] -> [R, T, H, D] as the plan lays out its query rows."""
    rows, t, _ = p.key_mask.shape
    if p.query_rows is None:
        return q[:, None]
    return q.index_select(0, p.query_rows).view(rows, t, *q.shape[1:])


def tokens_of(out: torch.Tensor, p: PagedPlan) -> torch.Tensor:
    """out [R, T, H, D] -> [N, H, D], each token's row."""
    flat = out.reshape(-1, *out.shape[2:])
    return flat if p.out_rows is None else flat.index_select(0, p.out_rows)


def attention_bias(p: PagedPlan | SplitPlan, group: int, sliding_window: int | None,
                   dtype: torch.dtype) -> torch.Tensor | tuple:
    """The plan's key mask as SDPA's additive mask for ``group`` query heads per kv head (0
    where a query row attends, -inf elsewhere; a window W drops keys before ``window_end - W``,
    ``window_end`` defaulting to ``visible``) -> [R, 1, T * group, L] ``dtype``. The same for
    every layer with that group and window: ``PagedKV`` builds it once per forward and keeps
    it for the forward (SDPA would convert a bool mask in every call). A ``SplitPlan``: its
    groups' masks, (head, tail)."""
    if isinstance(p, SplitPlan):
        return tuple(attention_bias(g, group, sliding_window, dtype) for g in (p.head, p.tail))
    check_sliding_window(sliding_window)
    rows, t, length = p.key_mask.shape
    mask = p.key_mask
    if sliding_window is not None:
        key_pos = torch.arange(length, device=mask.device)
        end = p.visible if p.window_end is None else p.window_end
        mask = mask & (key_pos >= (end - sliding_window)[..., None])
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf"))
    return bias[:, None, :, None, :].expand(rows, 1, t, group, length).reshape(
        rows, 1, t * group, length)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    p: PagedPlan | SplitPlan, *, sliding_window: int | None = None,
                    scale: float | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None,
                    bias: torch.Tensor | tuple | None = None) -> torch.Tensor:
    """q [N, Hq, D], k_cache/v_cache [S, Hkv, D] -> [N, Hq, D] (module docstring).

    ``sliding_window`` W (None: full causal) drops the keys before ``window_end - W``
    (``visible - W`` where the plan has no window ends); ``scale`` None is ``D ** -0.5``;
    ``softcap`` (None: none) caps the scores; ``sinks`` [Hq] (None: none) adds a per-head
    logit to each softmax (``masked_attention``); ``bias``: this call's ``attention_bias``
    (same group and window) where the caller keeps it across layers, None: built here."""
    if isinstance(p, SplitPlan):  # each group in its own rows
        n, kw = p.num_tokens, dict(sliding_window=sliding_window, scale=scale, softcap=softcap,
                                   sinks=sinks)
        head, tail = (None, None) if bias is None else bias
        return torch.cat([paged_attention(q[:n], k_cache, v_cache, p.head, bias=head, **kw),
                          paged_attention(q[n:], k_cache, v_cache, p.tail, bias=tail, **kw)])
    check_sliding_window(sliding_window)
    check_softcap(softcap)
    hq, d = q.shape[1:]
    hkv = k_cache.shape[1]
    g = hq // hkv
    rows, t, length = p.key_mask.shape
    if bias is None:
        bias = attention_bias(p, g, sliding_window, q.dtype)
    keys = gather_keys(k_cache, p).transpose(1, 2)  # [R, Hkv, L, D]
    values = gather_keys(v_cache, p).transpose(1, 2)
    # [R, Hkv, T * G, D] x [R, Hkv, D, L]: query row (t, g) of each kv head
    queries = rows_of(q, p).reshape(rows, t, hkv, g, d).permute(0, 2, 1, 3, 4)
    if sinks is not None:  # query row (t, g) of kv head h takes head h * G + g's sink
        sinks = sinks.view(hkv, 1, g).expand(hkv, t, g).reshape(hkv, t * g, 1)
    out = masked_attention(queries.reshape(rows, hkv, t * g, d), keys, values, bias,
                           scale=scale, softcap=softcap, sinks=sinks)
    return tokens_of(out.view(rows, hkv, t, g, d).permute(0, 2, 1, 3, 4), p).reshape(-1, hq, d)
