"""What the model runner hands a proposer each step (all device tensors unless noted)."""

from dataclasses import dataclass

import torch

from specdec.attention import AttentionMetadata


@dataclass
class DraftInputs:
    num_reqs: int  # host int: B, requests in the step
    uniform_decode: bool  # host: every request verifies exactly K drafts (layout [B, 1+K])
    input_ids: torch.Tensor  # [N] int64, the target's input tokens (N = padded token count)
    positions: torch.Tensor  # [N] int64
    hidden_states: torch.Tensor  # [N, H] target final-norm hidden states
    aux_hidden_states: torch.Tensor | None  # [N, A, H] target aux-layer states (Eagle3), else None
    attn: AttentionMetadata  # the target's layout: slots, query_start_loc, seq_lens, block table
    sampled_token_ids: torch.Tensor  # [B, K+1] int32, -1 = placeholder
    discard_mask: torch.Tensor  # [B] bool, partial-prefill requests (sampled token is junk)
    cu_num_draft_tokens: torch.Tensor  # [B] int32, inclusive cumsum of drafts verified this step
    token_table: torch.Tensor  # [max_num_seqs, max_model_len + 1] int32 known tokens, -1 = unknown
    rows: torch.Tensor  # [B] int64, each request's row in token_table
