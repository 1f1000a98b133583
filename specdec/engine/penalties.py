"""vLLM's logits processing before temperature, on the device, at every verified position of a
step: ``min_tokens`` (the stop ids at -inf), then the repetition, frequency and presence
penalties. Greedy rows then take the argmax of what this returns; sampled rows go on through
``rejection_sampler.target_probs`` (temperature, min_p, top_k, top_p).

Position j of a request's step (its logits row j: the token after its j-th verified token)
counts the tokens before it: the request's known tokens (its token-table row up to its first
sampled position, ``first``) and this step's drafts 0..j-1 -- exactly the tokens the request
holds if row j is reached at all (row j is used only when drafts 0..j-1 are accepted), so a
penalty at a later draft position is the one plain decoding applies there, and the rejection
sampler's output keeps the processed target distribution exactly (the drafts are proposals:
q is one-hot at each draft, and no draft probability is read).

    prompt tokens:  token_table[row, :num_prompt]          (repetition only)
    output tokens:  token_table[row, num_prompt:first] + drafts[:j]
    repetition:     a token in the prompt or the output: logit / r if logit > 0, else logit * r
    frequency:      logit -= f * (times the output holds the token)
    presence:       logit -= p * (the output holds the token)
    min_tokens:     row j's position first + j < min_len (num_prompt + min_tokens): every stop
                    id (eos, stop_token_ids) at -inf

Example (V = 4, prompt [1], output so far [2, 2], drafts [3, 0], repetition 2, frequency 0.5,
presence 0.25, raw logits 1.0 everywhere): row 0 -> [1.0, 0.5, -0.75, 1.0]; row 1 (draft 3
counted) -> [1.0, 0.5, -0.75, -0.25]; row 2 (3 and 0) -> [-0.25, 0.5, -0.75, -0.25].

Every shape is fixed by (B, R, V) and the token table: no host sync, capturable.
"""

import torch


def output_counts(token_table: torch.Tensor, rows: torch.Tensor, first: torch.Tensor,
                  num_prompt: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (in_prompt [B, V] bool: the token is in the prompt; counts [B, V] float32: times the
    output before ``first`` holds it). token_table [R, L] int32 (-1 = unknown), rows [B] int64,
    first [B] int64 (the position of each request's first sampled token = its known tokens),
    num_prompt [B] int64."""
    tokens = token_table[rows].long()  # [B, L]
    col = torch.arange(tokens.shape[1], device=tokens.device)[None]
    known = (col < first[:, None]) & (tokens >= 0)
    prompt = known & (col < num_prompt[:, None])
    out = known & ~prompt
    # masked entries go to a spare column V, dropped after (every write to a real column is
    # then the same value: deterministic)
    spare = torch.full_like(tokens, vocab)
    batch = tokens.shape[0]
    in_prompt = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=tokens.device)
    in_prompt.scatter_(1, torch.where(prompt, tokens, spare), True)
    counts = torch.zeros(batch, vocab + 1, dtype=torch.float32, device=tokens.device)
    counts.scatter_add_(1, torch.where(out, tokens, spare), torch.ones_like(counts[:, :1])
                        .expand_as(tokens))
    return in_prompt[:, :vocab], counts[:, :vocab]


def with_drafts(counts: torch.Tensor, drafts: torch.Tensor, num_rows: int) -> torch.Tensor:
    """counts [B, V] -> [B, num_rows, V]: row j adds drafts[:, :j] (drafts [B, >= num_rows - 1]
    int; an id outside [0, V) is clamped: a row after such a draft is never used)."""
    batch, vocab = counts.shape
    out = counts[:, None, :].repeat(1, num_rows, 1)
    k = num_rows - 1
    if k > 0:
        j = torch.arange(num_rows, device=counts.device)[:, None]
        i = torch.arange(k, device=counts.device)[None, :]
        before = (i < j).to(counts.dtype)[None].expand(batch, num_rows, k)  # [B, R, K]
        ids = drafts[:, :k].long().clamp(0, vocab - 1)[:, None, :].expand(batch, num_rows, k)
        out.scatter_add_(2, ids, before)
    return out


def penalize(logits: torch.Tensor, in_prompt: torch.Tensor, counts: torch.Tensor,
             repetition: torch.Tensor, frequency: torch.Tensor,
             presence: torch.Tensor) -> torch.Tensor:
    """logits [B, R, V] float32, in_prompt [B, V] bool, counts [B, R, V] float32 (the output
    tokens before each row), repetition / frequency / presence [B] float32 -> [B, R, V]. A row
    with the neutral values (1, 0, 0) comes back bit for bit."""
    seen = counts > 0
    rep = torch.where(in_prompt[:, None, :] | seen, repetition[:, None, None], 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    return (logits - frequency[:, None, None] * counts
            - presence[:, None, None] * seen.to(logits.dtype))


def hold_back_stops(logits: torch.Tensor, first: torch.Tensor, min_len: torch.Tensor,
                    stop_ids: torch.Tensor) -> torch.Tensor:
    """min_tokens: logits [B, R, V]; row j of request b (position first[b] + j) below
    min_len[b] gets -inf at each of stop_ids[b] ([B, S] int, -1 = none)."""
    batch, num_rows, vocab = logits.shape
    pos = first[:, None] + torch.arange(num_rows, device=logits.device)[None]
    hold = pos < min_len[:, None]  # [B, R]
    ids = stop_ids.long()
    is_stop = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=logits.device)
    is_stop.scatter_(1, torch.where((ids >= 0) & (ids < vocab), ids, vocab), True)
    return logits.masked_fill(hold[:, :, None] & is_stop[:, None, :vocab], float("-inf"))


def process_logits(logits: torch.Tensor, drafts: torch.Tensor, token_table: torch.Tensor,
                   rows: torch.Tensor, first: torch.Tensor, num_prompt: torch.Tensor,
                   min_len: torch.Tensor, stop_ids: torch.Tensor, repetition: torch.Tensor,
                   frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """The whole processing of a step's target logits [B, R, V] (float32) before temperature:
    min_tokens, then the penalties, each row counting the drafts before it (module doc).
    drafts [B, >= R - 1] int; the rest as in ``output_counts`` / ``hold_back_stops`` /
    ``penalize``."""
    num_rows, vocab = logits.shape[1], logits.shape[2]
    in_prompt, counts = output_counts(token_table, rows, first, num_prompt, vocab)
    logits = hold_back_stops(logits, first, min_len, stop_ids)
    return penalize(logits, in_prompt, with_drafts(counts, drafts, num_rows), repetition,
                    frequency, presence)
