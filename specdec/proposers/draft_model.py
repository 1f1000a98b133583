"""DraftLMProposer (method ``draft_model``): a separate small causal LM drafts K tokens.

Unlike a head, the draft model reads tokens at their own positions (no target hidden states,
no shift). Per step, for Np tokens and Bp requests:

    prep   = next tokens, sample indices, num_rejected        (the shared padded prep, no sync)
    prefix = the draft model over the target's own tokens and positions: its KV cache gets
             every token the target saw this step (prefill chunks included, so the draft
             model's prefill runs with the target's); rejected drafts' slots are rewritten below
    loop   = seq_lens -= num_rejected, then K steps of one token per row: step 1 feeds each
             request's next token (the target's sampled one) at the position after its last
             kept token -> draft 1; step j feeds draft j - 1 -> draft j

So a step costs one wide pass and K narrow ones (a head: one and K - 1). The ragged path runs
the same over the kept tokens only.

A draft tree (``padded_tree``) is a head's tree one position on: the prefix pass leaves the
next token out of the draft model's KV, so the root runs first, as head row 0 at position
p + 1 (``tree_root``), and its logits rank the root's children; each depth then runs as a
head's, its nodes at p + 1 + depth. One forward more than a head's tree, and one K/V row.
"""

from pathlib import Path

import torch

from specdec.kernels.paged_attention_torch import QuerySplit
from specdec.models.draft_lm import DraftLM, load_draft_lm
from specdec.models.registry import load_model
from specdec.padding import StepPlan
from specdec.proposers.base import HeadProposer, _pad_rows
from specdec.proposers.inputs import DraftInputs, PaddedStepInputs


class DraftLMProposer(HeadProposer):
    tensor_parallel = False  # the draft LM is not sharded yet (data parallelism runs it)
    cache_lookahead = 0  # its KV at position p is computed from tokens 0..p, as the target's

    @classmethod
    def head_folder(cls, spec, model_dir: Path | None) -> Path:
        return spec.model

    @classmethod
    def load_head(cls, spec, target, path: Path, *, dtype: torch.dtype,
                  device: torch.device, tokenizer=None) -> DraftLM:
        """The causal LM at ``speculative_config.model`` (``tokenizer``: the target's)."""
        return load_draft_lm(path, target, tokenizer, load_model, dtype=dtype, device=device)

    def loop_seq_len(self, max_seq_len: int) -> int:
        """The loop's K steps reach one position past a head's K - 1 (a tree: the root's
        row past a head's rows)."""
        rows = self.num_speculative_tokens if self.tree is None else 1 + self.tree.head_rows
        return min(max_seq_len + rows, self.max_model_len)

    def draft_features(self, x: DraftInputs) -> torch.Tensor:
        """The draft model reads no target state: the token ids stand in (never read)."""
        return x.input_ids

    def padded_first(self, x: PaddedStepInputs, *, max_seq_len: int, max_query_len: int | None,
                     num_drafts: int, query_split: QuerySplit | None = None
                     ) -> tuple[torch.Tensor, ...]:
        """The padded step's layout and the prefix pass over the target's tokens (every K,
        0 too) -> (the next token ids [Bp] int32, None, positions at the sample index [Bp]
        int64, num_rejected [Bp])."""
        next_ids, sample_idx, num_rejected, attn = self.padded_layout(x, max_seq_len,
                                                                      max_query_len, query_split)
        self.head(x.target_ids, x.positions, None, kv=self.kv.bind(attn))
        return next_ids, None, x.positions[sample_idx], num_rejected

    def padded_loop(self, x: PaddedStepInputs, next_ids: torch.Tensor, hidden: None,
                    positions: torch.Tensor, num_rejected: torch.Tensor, *, loop_seq_len: int,
                    num_drafts: int) -> torch.Tensor:
        """The K loop steps from the next tokens -> drafts [Bp, num_drafts] (0: none); a
        tree's nodes (``padded_tree``) from the root, one position past the kept tokens."""
        if self.tree is not None and num_drafts:
            return self.padded_tree(next_ids, None, positions + 1, x.num_reqs, x.block_table,
                                    loop_seq_len, x.temperature)
        drafts = self.draft_loop_steps(next_ids, None, positions, x.seq_lens, num_rejected,
                                       x.num_reqs, x.block_table, loop_seq_len, num_drafts)
        return torch.stack(drafts, dim=1) if drafts else next_ids.new_zeros((len(next_ids), 0))

    def _propose_ragged(self, x: DraftInputs) -> torch.Tensor:
        """disable_padded_drafter_batch=True: the kept tokens only (a host read of the
        acceptance), padded back to the plan's Np tokens and Bp rows (same DP shapes)."""
        b, bp, n = x.plan.num_reqs, x.plan.num_reqs_padded, x.plan.num_tokens_padded
        next_ids, keep, sample_idx, attn = self.ragged_layout(x)
        kept_positions = x.positions[keep]
        self.head(_pad_rows(x.input_ids[keep], n), _pad_rows(kept_positions, n), None,
                  kv=self.kv.bind(attn))
        drafts = self.draft_loop_steps(
            _pad_rows(next_ids, bp), None, kept_positions[sample_idx], attn.seq_lens, None, b,
            x.attn.block_table, self.loop_seq_len(x.attn.max_seq_len), x.plan.num_spec_tokens)
        return (torch.stack([d[:b] for d in drafts], dim=1) if drafts
                else next_ids.new_zeros((b, 0)))

    def tree_root(self, next_ids: torch.Tensor, hidden: None, level
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The root's forward: each request's next token [Bp] int32 as head row 0 (depth 0,
        seeing its prefix and itself) -> its outputs [Bp, H] each."""
        rows = torch.zeros(1, dtype=torch.int64, device=next_ids.device)
        logits_h, out = level(next_ids[:, None], None, 0, rows,
                              rows.new_ones((next_ids.shape[0], 1)))
        return logits_h[:, 0], out[:, 0]

    @torch.inference_mode()
    def dummy_run(self, plan: StepPlan) -> None:
        """An idle DP rank: the prefix pass over Np tokens, then the step's K loop forwards
        over Bp (a tree: the root's, then its depths')."""
        self._dummy_forward(plan.num_tokens_padded)
        if self.tree is not None:
            self._dummy_forward(plan.num_reqs_padded)
            self._dummy_tree(plan.num_reqs_padded)
            return
        for _ in range(plan.num_spec_tokens):
            self._dummy_forward(plan.num_reqs_padded)
