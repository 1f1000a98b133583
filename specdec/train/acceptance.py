"""Offline (teacher-forced) estimate of draft acceptance under greedy decoding.

For a prompt plus the target's own greedy continuation ``x [B, T]`` (what a greedy engine
outputs), every slot ``i`` simulates one speculation round: the draft chain starts from the
target hidden at position ``i`` with input token ``x[i+1]``; step s proposes ``d_s`` for
``x[i+1+s]`` and feeds ``d_s`` plus its ``next_hidden`` to step s+1 (attention per
``UnrolledKV``). Slot acceptance length = 1 + number of leading correct drafts (1 = nothing
accepted); only slots whose drafted tokens all lie in the generated part count.

Usage: ``python -m specdec.train.acceptance --assets specdec/assets/default``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

from specdec.models.decoder import DecoderForCausalLM
from specdec.models.heads import DraftHead, load_head
from specdec.models.registry import load_pretrained
from specdec.train.data import heldout_prompts
from specdec.train.kv import CacheKV, UnrolledKV


@torch.no_grad()
def greedy_generate(target: DecoderForCausalLM, prompts: torch.Tensor, n_new: int,
                    chunk: int = 128) -> torch.Tensor:
    """prompts [B, P] int64 -> [B, P + n_new]: the target's greedy continuation (cached decode)."""
    out = []
    for rows in prompts.split(chunk):
        b, p = rows.shape
        kv = CacheKV(b)
        ids, pos = rows.reshape(-1), torch.arange(p).repeat(b)
        seq = [rows]
        for t in range(n_new):
            hidden, _ = target(ids, pos, kv)
            ids = target.compute_logits(hidden.view(b, -1, hidden.shape[-1])[:, -1]).argmax(-1)
            pos = torch.full((b,), p + t)
            seq.append(ids[:, None])
        out.append(torch.cat(seq, dim=1))
    return torch.cat(out)


@torch.no_grad()
def chain_logits(target: DecoderForCausalLM, head: DraftHead, x: torch.Tensor, k: int):
    """Yield step s = 1..k's head logits [B, T, draft vocab] float32: ``[b, i]`` scores the
    draft for ``x[b, i+1+s]``, the head fed its own argmax drafts of the steps before."""
    b, t = x.shape
    pos = torch.arange(t).expand(b, t)
    hidden, aux = target(x, pos, aux_layer_ids=head.aux_layer_ids)
    hidden = head.combine_hidden_states(aux if head.aux_layer_ids else hidden).flatten(0, 1)
    ids = torch.cat((x[:, 1:], x[:, -1:]), dim=1).reshape(-1)  # last slot's input is never scored
    kv = UnrolledKV(b, t)
    for s in range(k):
        logits_hidden, hidden = head(ids, (pos + s).reshape(-1), hidden, kv)
        logits = head.compute_logits(logits_hidden).float()
        ids = head.draft_to_target_ids(logits.argmax(-1))
        yield logits.view(b, t, -1)


def draft_chain(target: DecoderForCausalLM, head: DraftHead, x: torch.Tensor,
                k: int) -> torch.Tensor:
    """Drafts [B, T, k] (target ids): ``[b, i, s-1]`` is step s's proposal for ``x[b, i+1+s]``."""
    return torch.stack([head.draft_to_target_ids(logits.argmax(-1))
                        for logits in chain_logits(target, head, x, k)], dim=-1)


def acceptance_stats(x: torch.Tensor, drafts: torch.Tensor, prompt_len: int) -> dict:
    """Per-position conditional acceptance and mean acceptance length.

    x [B, T]; drafts [B, T, k]. Slot i counts when ``prompt_len <= i + 2`` and ``i + 1 + k < T``.
    Example: one slot with correct, correct, wrong -> per_position [1, 1, 0], mean length 3.
    """
    b, t, k = drafts.shape
    slots = torch.arange(max(prompt_len - 2, 0), t - 1 - k)
    truth = torch.stack([x[:, slots + 1 + s] for s in range(1, k + 1)], dim=-1)  # [B, S, k]
    run = (drafts[:, slots] == truth).long().cumprod(dim=-1)  # 1 while every earlier draft was right
    reached = torch.cat((torch.ones_like(run[..., :1]), run[..., :-1]), dim=-1)
    per_pos = (run.sum((0, 1)).double() / reached.sum((0, 1)).clamp(min=1)).tolist()
    return {"per_position": per_pos, "mean_acceptance_length": 1 + run.sum(-1).double().mean().item(),
            "slots": int(run.shape[0] * run.shape[1])}


@torch.no_grad()
def real_text_agreement(target: DecoderForCausalLM, head: DraftHead, x: torch.Tensor) -> float:
    """Share of slots of real text ``x [B, T]`` whose first draft equals the target's greedy token
    there (step 1 of a round started inside a prompt; exact, no greedy-continuation assumption)."""
    hidden, _ = target(x, torch.arange(x.shape[1]))
    greedy = target.compute_logits(hidden).argmax(-1)  # [B, T]: greedy[:, j] follows x[:, j]
    first = draft_chain(target, head, x, 1)[..., 0]  # [:, i] proposes the token after x[:, i+1]
    return (first[:, :-2] == greedy[:, 1:-1]).double().mean().item()


def repeated_ngram_share(x: torch.Tensor, start: int, n: int = 4) -> float:
    """Share of n-grams starting at or after ``start`` that already occurred earlier in their row.

    Example: row [1, 2, 1, 2, 1], n = 2, start = 2: [1, 2] seen, [2, 1] seen -> 1.0.
    """
    hits = total = 0
    for row in x.tolist():
        seen = set()
        for i in range(len(row) - n + 1):
            gram = tuple(row[i:i + n])
            if i >= start:
                hits, total = hits + (gram in seen), total + 1
            seen.add(gram)
    return hits / max(total, 1)


def evaluate(target: DecoderForCausalLM, heads: dict[str, DraftHead], tok: Tokenizer,
             prompts: int = 64, prompt_len: int = 64, new_tokens: int = 192, k: int = 3,
             seed: int = 0) -> dict:
    """The held-out estimate: greedy-chain acceptance per head, real-text step-1 agreement per
    head (32 held-out windows of ``prompt_len + new_tokens``, seed + 1), and how repetitive the
    target's greedy continuations are (share of repeated 4-grams)."""
    x = greedy_generate(target, heldout_prompts(tok, prompts, prompt_len, seed), new_tokens)
    real = heldout_prompts(tok, 32, prompt_len + new_tokens, seed + 1)
    result = {"repeated_4gram_share": repeated_ngram_share(x, prompt_len)}
    for name, head in heads.items():
        result[name] = acceptance_stats(x, draft_chain(target, head, x, k), prompt_len)
        result[name]["real_text_step1_agreement"] = real_text_agreement(target, head, real)
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--assets", default="specdec/assets/default")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=64, help="held-out prompts")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    root = Path(args.assets)
    target = load_pretrained(root / "target")
    tok = Tokenizer.from_file(str(root / "target" / "tokenizer.json"))
    heads = {name: load_head(root / name, target) for name in ("mtp", "eagle", "eagle3")}
    result = evaluate(target, heads, tok, args.prompts, args.prompt_len, args.new_tokens, args.k, args.seed)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
