"""What the model runner hands a proposer each step (``DraftInputs``) and the padded draft
step's tensors (``PaddedStepInputs``); all device tensors unless noted."""

from dataclasses import dataclass
from typing import NamedTuple

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
    temperature: torch.Tensor  # [Bp] float32, each request's sampling temperature (0: greedy)
    graph_seq_len: int  # host: the attention bound of a captured step (>= every seq_len)
    graph_query_len: int  # host: a captured step's bound on tokens per request


class PaddedStepInputs(NamedTuple):
    """The padded draft step's tensors (``HeadProposer.padded_step``), passed
    positionally through its StepGraph: Np tokens, Bp requests (B real)."""

    target_ids: torch.Tensor  # [Np] int64, the target's input tokens
    positions: torch.Tensor  # [Np] int64
    features: torch.Tensor  # [Np, ...] the target states the first pass reads (draft_features)
    slot_mapping: torch.Tensor  # [Np] int64
    query_start_loc: torch.Tensor  # [Bp+1] int32
    seq_lens: torch.Tensor  # [Bp] int32, the target step's
    block_table: torch.Tensor  # [Bp, M] int32
    sampled: torch.Tensor  # [Bp, K+1] int32
    discard: torch.Tensor  # [Bp] bool
    cu_num_draft_tokens: torch.Tensor  # [Bp] int32
    token_table: torch.Tensor  # [R, L] int32
    rows: torch.Tensor  # [Bp] int64
    num_reqs: torch.Tensor  # 0-dim int32: B
    temperature: torch.Tensor  # [Bp] float32
