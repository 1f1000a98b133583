"""Rejection sampler: verify a greedy drafter's tokens against the target model.

Output convention (vLLM): `sampled_token_ids` [B, K+1] int32 holds the accepted drafts,
then one recovered-or-bonus token, then -1 placeholders; valid entries form a prefix.

The drafter is greedy, so its distribution q is one-hot at the draft d. Standard
speculative sampling then reads (p = target probabilities at that position):
    accept d with probability min(1, p(d) / q(d)) = p(d)
    on rejection emit x ~ (p - q)+ / sum   = p with d removed, renormalised
    after K accepts emit the bonus x ~ p at row K
so every emitted token is distributed exactly as p. Greedy rows (temperature 0) accept
while d == argmax(target) and emit the argmax at the first mismatch or at the bonus row.

Sampling uses the exponential race: argmax_x p(x) / E_x with E_x ~ Exp(1) i.i.d. is a
sample from p / sum(p) (no normalisation, no sort, no host sync). The random numbers are
counter-based (``counter_rng``): row r's K uniforms and V exponentials are a function of its
key (the request's seed, or the engine seed and its id) and its counter (the position of the
token its first logits row samples), so a request's tokens depend on neither its batch nor
the step's bucket, and a captured step draws fresh numbers each replay with no host input.

Everything is device tensor ops with shapes fixed by (B, K, V): no host-device sync, no
generator state (the step can be captured in a CUDA graph).
"""

import torch

from specdec.engine import counter_rng

GREEDY_TEMPERATURE = 1e-5  # temperature below this is greedy (vLLM's _SAMPLING_EPS)


def rejection_sample(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    temperature: torch.Tensor,
    keys: torch.Tensor,
    counters: torch.Tensor,
    top_p: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    width: int | None = None,
) -> torch.Tensor:
    """Verify drafts; return sampled_token_ids [B, K+1] int32 (-1 = placeholder).

    target_logits:    [B, K+1, V] float; row j of request r predicts the token after its
                      j-th verified token (row num_draft[r] gives the bonus); later rows
                      are padding.
    draft_token_ids:  [B, K] int32/int64; entries past num_draft[r] are padding (any value).
                      A draft outside [0, V) is never accepted.
    num_draft_tokens: [B] int32/int64 in 0..K (0: a prefill request, one token sampled).
    temperature:      [B] float; < 1e-5 means greedy for that row.
    keys:             [B] int64 random key of each row (``counter_rng.request_key``).
    counters:         [B] int64 position of the token logits row 0 samples (seq_len - num_draft).
    top_p:            [B] float in (0, 1], or None (no nucleus filter). Greedy rows ignore it.
    top_k:            [B] int32/int64, 0 = every token; or None. Greedy rows ignore it.
    min_p:            [B] float in [0, 1], 0 = off; or None. Greedy rows ignore it.
    width:            a static int: ``target_probs`` sorts only the ``width`` most likely.
    The logits are used as given: penalties and min_tokens come before (``penalties``), and
    greedy rows take their argmax; sampled rows draw from ``target_probs`` (temperature,
    min_p, top_k, top_p, in vLLM's order).

    Example (greedy, K=2, V=4; argmax of the logits rows per request):
        argmax rows = [[1,2,3], [1,0,3], [2,0,0]], drafts = [[1,2], [1,2], [0,0]],
        num_draft = [2, 2, 0], temperature = [0, 0, 0]
        -> [[1, 2, 3],     all accepted, bonus 3
            [1, 0, -1],    draft 2 rejected at row 1, recovered 0
            [2, -1, -1]]   prefill: only row 0 sampled
    """
    batch, num_rows, vocab = _check_args(target_logits, draft_token_ids, num_draft_tokens,
                                         temperature, top_p, keys, counters, top_k, min_p)
    k = num_rows - 1
    device = target_logits.device
    logits = target_logits.float()
    greedy = temperature < GREEDY_TEMPERATURE  # [B]
    draft = draft_token_ids.long()
    in_vocab = (draft >= 0) & (draft < vocab)  # [B, K]
    safe_draft = draft.clamp(0, vocab - 1)

    # Target probabilities p [B, K+1, V]; greedy rows divide by 1 (their p is unused).
    probs = target_probs(logits, torch.where(greedy, 1.0, temperature.float()), top_p, top_k,
                         min_p, width)

    # Each row's own numbers: a function of (its key, its counter) only.
    uniform = counter_rng.uniforms(keys, counters, counter_rng.STREAM_UNIFORM, k)
    race = counter_rng.exponentials(keys, counters, counter_rng.STREAM_RACE, vocab)

    # Accept d at row j: greedy d == argmax; stochastic u < p(d) (u in [0, 1): p(d)=0 never).
    argmax = logits.argmax(dim=-1)  # [B, K+1]
    draft_prob = probs[:, :k].gather(2, safe_draft[..., None]).squeeze(2)  # [B, K]
    accept = torch.where(greedy[:, None], draft == argmax[:, :k], uniform < draft_prob)
    rows = torch.arange(num_rows, device=device)
    accept = accept & in_vocab & (rows[None, :k] < num_draft_tokens[:, None])
    num_accepted = accept.to(torch.int32).cumprod(dim=1).sum(dim=1).long()  # [B], 0..K

    # The one token after the accepted drafts, at row a = num_accepted.
    ar = torch.arange(batch, device=device)
    draft_ext = torch.cat([draft, draft.new_full((batch, 1), -1)], dim=1)  # [B, K+1]
    draft_a = draft_ext.gather(1, num_accepted[:, None])  # [B, 1]
    rejected = num_accepted < num_draft_tokens  # else: all accepted -> bonus from p
    p_a = probs[ar, num_accepted]  # [B, V]
    removed = rejected[:, None] & (torch.arange(vocab, device=device)[None] == draft_a)
    residual = p_a.masked_fill(removed, 0.0)  # (p - q)+ up to normalisation
    # Rounding can reject a draft holding all of p's mass: fall back to p then.
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p_a)
    sampled = (residual / race).argmax(dim=1)
    token_a = torch.where(greedy, argmax[ar, num_accepted], sampled)

    out = torch.where(rows[None] == num_accepted[:, None], token_a[:, None], -1)
    out = torch.where(rows[None] < num_accepted[:, None], draft_ext, out)
    return out.to(torch.int32)


def greedy_verify(target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                  num_draft_tokens: torch.Tensor) -> torch.Tensor:
    """rejection_sample for an all-greedy batch, without random draws (a capturable step):
    accept while the draft equals the target's argmax, then emit the argmax.
    Shapes as in rejection_sample; the docstring example there holds here too."""
    argmax = target_logits.argmax(dim=-1)  # [B, K+1]
    k = argmax.shape[1] - 1
    rows = torch.arange(k + 1, device=argmax.device)
    accept = (draft_token_ids.long() == argmax[:, :k]) & (rows[None, :k] < num_draft_tokens[:, None])
    num_accepted = accept.to(torch.int32).cumprod(dim=1).sum(dim=1)  # [B], 0..K
    return torch.where(rows[None] <= num_accepted[:, None], argmax, -1).to(torch.int32)


def target_probs(logits: torch.Tensor, temperature: torch.Tensor,
                 top_p: torch.Tensor | None = None, top_k: torch.Tensor | None = None,
                 min_p: torch.Tensor | None = None, width: int | None = None) -> torch.Tensor:
    """The distribution a sampled row draws from: softmax(logits / temperature), then the
    filters in vLLM's order -- min_p, top_k, top_p -- and renormalised.

    logits: [B, R, V] float32; temperature: [B] float32 > 0; top_p [B] in (0, 1], top_k [B]
    int (0: all), min_p [B] in [0, 1], each None when no row filters that way.
    min_p keeps p >= min_p * max(p); top_k keeps p >= the k-th largest p (ties kept); top_p
    then keeps, of the tokens left (renormalised), each one whose mass strictly above it in
    sorted order is < top_p (so the most likely is always kept). Every filter keeps an upper
    set of the same order, so one descending sort serves all three; min_p alone needs none.
    ``width`` (a static int, top_p None): top_k's k-th largest p from the ``width`` most
    likely (``topk``, not a sort of the vocabulary; vLLM's top-k-only path) -- exact for
    every row with top_k <= width (0: every token).
    Example: p = [0.5, 0.3, 0.15, 0.05]; top_k = 3 -> [0.526, 0.316, 0.158, 0];
    min_p = 0.5 -> [0.625, 0.375, 0, 0]; top_p = 0.6 -> [0.625, 0.375, 0, 0];
    top_k = 3 and top_p = 0.8 -> [0.625, 0.375, 0, 0] (0.842 above the third of the three).
    """
    probs = torch.softmax(logits / temperature[:, None, None], dim=-1)
    if top_p is None and top_k is None and min_p is None:
        return probs
    vocab = probs.shape[-1]
    if top_p is None and (top_k is None or (width is not None and width < vocab)):
        keep = torch.ones_like(probs, dtype=torch.bool)
        if min_p is not None:
            keep = probs >= min_p.float()[:, None, None] * probs.amax(dim=-1, keepdim=True)
        if top_k is not None:  # the k-th largest from the width most likely
            largest = probs.topk(width, dim=-1).values
            last = (top_k.long() - 1).clamp(0, width - 1)[:, None, None]
            kth = largest.gather(-1, last.expand(*probs.shape[:2], 1))
            keep = keep & ((probs >= kth) | (top_k <= 0)[:, None, None])
        kept = probs * keep
        return kept / kept.sum(dim=-1, keepdim=True)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if top_k is not None:
        last = (top_k.long() - 1).clamp(0, vocab - 1)[:, None, None]
        kth = sorted_probs.gather(-1, last.expand(*probs.shape[:2], 1))
        keep = (sorted_probs >= kth) | (top_k <= 0)[:, None, None]
    if min_p is not None:
        keep = keep & (sorted_probs >= min_p.float()[:, None, None] * sorted_probs[..., :1])
    if top_p is not None:
        top_p = top_p.float()[:, None, None]
        kept = sorted_probs * keep
        # the mass left after top_k / min_p, renormalised (a row they left whole: as it is)
        kept = torch.where(keep.all(dim=-1, keepdim=True), sorted_probs,
                           kept / kept.sum(dim=-1, keepdim=True))
        mass_above = kept.cumsum(dim=-1) - kept
        # the most likely token always stays (mass above it 0): a top_p that rounds to 0 in
        # float32 (e.g. 1e-50) kept none, and the row drew token 0
        keep = keep & ((mass_above < top_p) | (top_p >= 1.0) | (mass_above == 0))
    keep = torch.empty_like(keep).scatter_(-1, order, keep)
    kept = probs * keep
    return kept / kept.sum(dim=-1, keepdim=True)


def _check_args(target_logits, draft_token_ids, num_draft_tokens, temperature, top_p, keys,
                counters, top_k=None, min_p=None):
    """Shape/dtype/device checks only (never tensor values: no host sync). -> (B, K+1, V)."""
    named = {"target_logits": target_logits, "draft_token_ids": draft_token_ids,
             "num_draft_tokens": num_draft_tokens, "temperature": temperature, "keys": keys,
             "counters": counters}
    for name, t in (("top_p", top_p), ("top_k", top_k), ("min_p", min_p)):
        if t is not None:
            named[name] = t
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if target_logits.dim() != 3 or target_logits.shape[1] < 1 or target_logits.shape[2] < 1:
        raise ValueError(f"target_logits must be [B, K+1, V] with K+1 >= 1 and V >= 1, "
                         f"got shape {tuple(target_logits.shape)}")
    batch, num_rows, _ = target_logits.shape
    expected = {"draft_token_ids": (batch, num_rows - 1), "num_draft_tokens": (batch,),
                "temperature": (batch,), "top_p": (batch,), "keys": (batch,),
                "counters": (batch,), "top_k": (batch,), "min_p": (batch,)}
    for name, t in named.items():
        if name != "target_logits" and tuple(t.shape) != expected[name]:
            raise ValueError(f"{name} must have shape {expected[name]} (B, K from target_logits "
                             f"{tuple(target_logits.shape)}), got {tuple(t.shape)}")
        if t.device != target_logits.device:
            raise ValueError(f"{name} is on {t.device}, target_logits on {target_logits.device}; "
                             f"all inputs must be on one device")
    for name in ("target_logits", "temperature", "top_p", "min_p"):
        if name in named and not named[name].is_floating_point():
            raise ValueError(f"{name} must be a floating dtype, got {named[name].dtype}")
    for name in ("draft_token_ids", "num_draft_tokens", "keys", "counters", "top_k"):
        if name in named and named[name].dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {named[name].dtype}")
    return batch, num_rows, target_logits.shape[2]


def valid_tokens(sampled: list[int]) -> list[int]:
    """A request's row of sampled token ids up to its first placeholder (-1)."""
    return sampled[:next((i for i, t in enumerate(sampled) if t < 0), len(sampled))]
