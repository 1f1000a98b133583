"""Fit a draft head's ``tree_score_temperature``: the temperature at which its probabilities
are the chance that a draft equals the target's greedy token.

A dynamic tree (EAGLE-2) keeps the candidates of highest cumulative draft log-probability, as
if a draft's probability were its chance of acceptance. Under greedy verification a draft is
accepted when it is the target's argmax, and a head trained on the target's distribution
spreads its probability as that distribution does: the embedded heads give their first
choice 0.33 on average where it is the argmax 77-87% of the time. So the tree spends nodes
on second and third choices that a deeper first choice would beat. Dividing the head's
logits by a temperature T < 1 before the log-softmax corrects that; the drafts themselves
(each node's top-k) do not change, only which candidates are kept.

The fit is teacher-forced (``acceptance.chain_logits``) on the target's greedy continuations
of held-out prompts: at depth s, the slots whose drafts 1..s-1 all matched (the head then
reads what a node on the accepted path reads), and T minimizes the mean negative
log-likelihood of the target's token under softmax(logits / T) over a log-spaced grid.
Target tokens outside a head's draft vocabulary cannot be drafted and are left out. A separate
draft model (method ``draft_model``) is fitted the same way (``depth_logits``).

Usage: ``python -m specdec.train.tree_temperature --assets specdec/assets/default [--write]``
(``--write``: into each head's ``config.json``, where the engine reads its default);
``--draft-model DIR``: the draft model of that folder instead of the heads, for the assets'
target.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from tokenizers import Tokenizer

from specdec.models.draft_lm import DraftLM, load_draft_lm
from specdec.models.heads import DraftHead, load_head
from specdec.models.registry import load_model, load_pretrained
from specdec.train.acceptance import chain_logits, greedy_generate
from specdec.train.data import heldout_prompts
from specdec.train.kv import CacheKV

# candidate temperatures: 0.05 .. 2, log-spaced (steps of ~6%)
GRID = torch.logspace(math.log10(0.05), math.log10(2.0), 64).tolist()
PROMPTS, SEED = 32, 5  # the fit's held-out prompts and their seed


def best_temperature(logits: torch.Tensor, truth: torch.Tensor) -> tuple[float, float]:
    """logits [N, V] float32, truth [N] int64 in 0..V-1 -> (the grid's T of least mean
    -log softmax(logits / T)[truth], that mean)."""
    nll = [-torch.log_softmax(logits / t, dim=-1).gather(1, truth[:, None]).mean().item()
           for t in GRID]
    i = min(range(len(GRID)), key=nll.__getitem__)
    return GRID[i], nll[i]


@torch.no_grad()
def depth_logits(target, head: DraftHead | DraftLM, x: torch.Tensor, k: int):
    """Yield depth s = 1..k's draft logits [B, T, V] float32: ``[b, i]`` scores the draft for
    ``x[b, i+1+s]``, equal to the drafter's chain wherever drafts 1..s-1 matched ``x`` (the
    only slots ``greedy_draft_pairs`` keeps). A head runs its chain (``chain_logits``). A draft
    model reads tokens only, and on those slots its chain's inputs are ``x``'s own tokens, so
    one pass over ``x`` gives every depth: its logits at position i + s."""
    if not isinstance(head, DraftLM):
        yield from chain_logits(target, head, x, k)
        return
    b, t = x.shape
    hidden, _ = head(x.reshape(-1), torch.arange(t).repeat(b), None, CacheKV(b))
    logits = head.compute_logits(hidden).float().view(b, t, -1)  # [b, j] scores x[b, j+1]
    for s in range(1, k + 1):
        yield logits.roll(-s, dims=1)  # slots past T - 1 - s wrap around: never kept


@torch.no_grad()
def greedy_draft_pairs(target, head: DraftHead | DraftLM, x: torch.Tensor, prompt_len: int, k: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, T] prompts and their greedy continuations -> (logits [N, draft vocab], the
    target's token [N] as a draft id) of every depth 1..k whose earlier drafts all matched,
    from slots whose drafts lie in the generated part."""
    b, t = x.shape
    slots = torch.arange(max(prompt_len - 2, 0), t - 1 - k)
    on_path = torch.ones(b, len(slots), dtype=torch.bool)
    logits_kept, truth_kept = [], []
    for s, logits in enumerate(depth_logits(target, head, x, k), start=1):
        if s == 1:  # target id -> draft id, -1 where the draft vocabulary lacks it
            target_ids = head.draft_to_target_ids(torch.arange(logits.shape[-1]))
            to_draft = torch.full((max(int(target_ids.max()), int(x.max())) + 1,), -1)
            to_draft[target_ids] = torch.arange(logits.shape[-1])
        truth = x[:, slots + 1 + s]
        draft_truth = to_draft[truth]
        keep = on_path & (draft_truth >= 0)
        logits_kept.append(logits[:, slots][keep])
        truth_kept.append(draft_truth[keep])
        on_path &= head.draft_to_target_ids(logits[:, slots].argmax(-1)) == truth
    return torch.cat(logits_kept), torch.cat(truth_kept)


def fit(target, heads: dict[str, DraftHead | DraftLM], tok: Tokenizer, prompts: int = PROMPTS,
        prompt_len: int = 64, new_tokens: int = 128, k: int = 5, seed: int = SEED) -> dict:
    """Per head: the fitted T, the mean NLL at it and at T = 1, the pairs it saw."""
    x = greedy_generate(target, heldout_prompts(tok, prompts, prompt_len, seed), new_tokens)
    out = {}
    for name, head in heads.items():
        logits, truth = greedy_draft_pairs(target, head, x, prompt_len, k)
        t, nll = best_temperature(logits, truth)
        raw = -torch.log_softmax(logits, -1).gather(1, truth[:, None]).mean().item()
        out[name] = {"tree_score_temperature": round(t, 3), "nll": round(nll, 4),
                     "nll_at_1": round(raw, 4), "pairs": len(truth)}
    return out


def write(folders: dict[str, Path], result: dict) -> None:
    """Each drafter's fitted T (``result[name]``) into ``folders[name] / "config.json"``."""
    for name, figures in result.items():
        path = folders[name] / "config.json"
        config = json.loads(path.read_text())
        config["tree_score_temperature"] = figures["tree_score_temperature"]
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def fit_draft_model(target_dir: Path, folder: Path, prompts: int = PROMPTS, seed: int = SEED,
                    write_it: bool = True) -> dict:
    """Fit the draft model of ``folder`` (method ``draft_model``) for the target of
    ``target_dir``, and (``write_it``) write its T into the folder's ``config.json`` -> ``fit``'s
    figures under ``"draft_model"``."""
    target = load_pretrained(target_dir)
    tok = Tokenizer.from_file(str(Path(target_dir) / "tokenizer.json"))
    draft = load_draft_lm(folder, target, tok, load_model, dtype=torch.float32,
                          device=torch.device("cpu"))
    result = fit(target, {"draft_model": draft}, tok, prompts, seed=seed)
    if write_it:
        write({"draft_model": Path(folder)}, result)
    return result


def report_lines(result: dict, prompts: int = PROMPTS, seed: int = SEED) -> list[str]:
    """TRAINING.md's section on the fit (``fit``'s result, its prompts and seed)."""
    lines = [
        "## Dynamic-tree score temperature", "",
        "Each head's `config.json` carries `tree_score_temperature`, fitted by "
        "`specdec.train.tree_temperature` (run by the training script; alone: `python -m "
        f"specdec.train.tree_temperature --write`) on {prompts} held-out prompts of 64 tokens "
        f"(seed {seed}), each continued greedily for 128 tokens, K = 5: the temperature at "
        "which the head's probabilities best predict the target's greedy token at the depths "
        "whose earlier drafts matched (least mean negative log-likelihood on a log-spaced "
        "grid, 0.05-2). It changes only which candidates a dynamic draft tree keeps, never a "
        "draft.", "",
        "| head | T | NLL at T | NLL at 1 | pairs |", "|---|---|---|---|---|",
    ]
    for name, r in result.items():
        lines.append(f"| {name} | {r['tree_score_temperature']:.3f} | {r['nll']:.3f} | "
                     f"{r['nll_at_1']:.3f} | {r['pairs']} |")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--assets", default="specdec/assets/default")
    ap.add_argument("--heads", nargs="+", default=["mtp", "eagle", "eagle3"])
    ap.add_argument("--draft-model", type=Path, default=None,
                    help="fit this draft model's folder (method draft_model) instead of heads")
    ap.add_argument("--prompts", type=int, default=PROMPTS, help="held-out prompts")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--write", action="store_true", help="into each drafter's config.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    root = Path(args.assets)
    if args.draft_model is not None:
        result = fit_draft_model(root / "target", args.draft_model, args.prompts, args.seed,
                                 write_it=args.write)
        print(json.dumps(result, indent=2))
        return
    target = load_pretrained(root / "target")
    tok = Tokenizer.from_file(str(root / "target" / "tokenizer.json"))
    heads = {name: load_head(root / name, target) for name in args.heads}
    result = fit(target, heads, tok, args.prompts, seed=args.seed)
    print(json.dumps(result, indent=2))
    if args.write:
        write({name: root / name for name in args.heads}, result)


if __name__ == "__main__":
    main()
