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
"""

import torch

from specdec.attention import AttentionMetadata
from specdec.kernels import gather_backup_tokens
from specdec.padding import StepPlan
from specdec.proposers.base import DraftModelProposer, _pad_rows
from specdec.proposers.inputs import DraftInputs, PaddedStepInputs


class DraftLMProposer(DraftModelProposer):
    def loop_seq_len(self, max_seq_len: int) -> int:
        """The loop's K steps reach one position past a head's K - 1."""
        return min(max_seq_len + self.num_speculative_tokens, self.max_model_len)

    def draft_features(self, x: DraftInputs) -> torch.Tensor:
        """The draft model reads no target state: the token ids stand in (never read)."""
        return x.input_ids

    def padded_step(self, x: PaddedStepInputs, *, max_seq_len: int, max_query_len: int | None,
                    loop_seq_len: int) -> torch.Tensor:
        """The padded draft step (as the base's: static shapes, no host read) -> [Bp, K]."""
        n, bp = x.target_ids.shape[0], x.sampled.shape[0]
        next_ids, _, sample_idx, num_rejected = self.prepare_padded(
            x.sampled, x.discard, x.cu_num_draft_tokens, x.query_start_loc, x.token_table,
            x.rows, x.seq_lens)
        real = torch.arange(bp, device=x.sampled.device) < x.num_reqs
        sample_idx = torch.where(real, sample_idx, n - 1).to(torch.int64)
        attn = AttentionMetadata(x.slot_mapping, x.query_start_loc, x.seq_lens, x.block_table,
                                 max_seq_len, max_query_len=max_query_len)
        self.head(x.target_ids, x.positions, None, kv=self.kv.bind(attn))
        drafts = self.draft_loop_steps(
            next_ids, None, x.positions[sample_idx], x.seq_lens, num_rejected, x.num_reqs,
            x.block_table, loop_seq_len, num_steps=self.num_speculative_tokens)
        return torch.stack(drafts, dim=1)

    def _propose_ragged(self, x: DraftInputs) -> torch.Tensor:
        """disable_padded_drafter_batch=True: the kept tokens only (a host read of the
        acceptance), padded back to the plan's Np tokens and Bp rows (same DP shapes)."""
        plan, dev = x.plan, self.device
        b, bp, n = plan.num_reqs, plan.num_reqs_padded, plan.num_tokens_padded
        a = x.attn
        backup = gather_backup_tokens(x.token_table, x.rows[:b], a.seq_lens[:b])
        cu = x.cu_num_draft_tokens[:b].tolist()
        next_ids, r = self.prepare_ragged(
            x.sampled_token_ids[:b].tolist(), x.discard_mask[:b].tolist(), backup.tolist(),
            a.query_start_loc[:b + 1].cpu(), a.seq_lens[:b].cpu(),
            [c - p for c, p in zip(cu, [0] + cu)])
        keep = r.token_indices.to(dev)
        kept = keep.shape[0]
        slots = torch.cat([a.slot_mapping[keep], a.slot_mapping.new_full((n - kept,), -1)])
        attn = AttentionMetadata(slots, r.new_query_start_loc.to(dev), r.new_seq_lens.to(dev),
                                 a.block_table[:b], a.max_seq_len,
                                 max_query_len=a.max_query_len)
        kept_positions = x.positions[keep]
        self.head(_pad_rows(x.input_ids[keep], n), _pad_rows(kept_positions, n), None,
                  kv=self.kv.bind(attn))
        sample_idx = r.sample_indices.to(dev, torch.int64)
        tokens = torch.tensor(next_ids, dtype=torch.int32, device=dev)
        drafts = self.draft_loop_steps(
            _pad_rows(tokens, bp), None, kept_positions[sample_idx], attn.seq_lens, None, b,
            a.block_table, self.loop_seq_len(a.max_seq_len),
            num_steps=self.num_speculative_tokens)
        return torch.stack([d[:b] for d in drafts], dim=1)

    @torch.inference_mode()
    def dummy_run(self, plan: StepPlan) -> None:
        """An idle DP rank: the prefix pass over Np tokens, then K loop forwards over Bp."""
        self._dummy_forward(plan.num_tokens_padded)
        for _ in range(self.num_speculative_tokens):
            self._dummy_forward(plan.num_reqs_padded)
