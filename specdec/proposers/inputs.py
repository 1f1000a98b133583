"""What the model runner hands a proposer each step (all device tensors unless noted)."""

from dataclasses import dataclass

import torch

from specdec.attention import AttentionMetadata
from specdec.padding import StepPlan


@dataclass
class DraftInputs:
    """Np = plan.num_tokens_padded tokens, Bp = plan.num_reqs_padded requests (B real)."""

    plan: StepPlan  # host: the step's sizes, the same on every DP rank
    input_ids: torch.Tensor  # [Np] int64, the target's input tokens
    positions: torch.Tensor  # [Np] int64
    hidden_states: torch.Tensor  # [Np, H] target final-norm hidden states
    aux_hidden_states: torch.Tensor | None  # [Np, A, H] target aux-layer states, else None
    attn: AttentionMetadata  # the target's layout over [Np] tokens and [Bp] requests
    sampled_token_ids: torch.Tensor  # [Bp, K+1] int32, -1 = placeholder
    discard_mask: torch.Tensor  # [Bp] bool, partial prefills and padding rows
    cu_num_draft_tokens: torch.Tensor  # [Bp] int32, inclusive cumsum of drafts verified
    token_table: torch.Tensor  # [rows + 1, max_model_len + 1] int32 known tokens, -1 unknown
    rows: torch.Tensor  # [Bp] int64, each request's row in token_table
    graph_seq_len: int  # host: the attention bound of a captured step (>= every seq_len)
    graph_query_len: int  # host: a captured step's bound on tokens per request
