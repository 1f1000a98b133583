"""Padded-drafting formulas (imported as ``specdec.kernels``), dispatched by device.

The names below are the stable API. The dispatched ones (listed next) pick their
implementation from the device of their first tensor argument (``specdec.platform.triton_available``):

    CUDA with triton, NPU with torch_npu + triton-ascend -> triton_padded.py (Triton)
    everything else (CPU)                                -> reference.py (pure torch)

``prepare_padded_step`` (one kernel for all five per-request prep outputs -- next token,
valid count, backup token, sample index, num rejected -- into ``out=`` buffers: the
proposer's), ``prepare_inputs_padded``, ``shift_first_pass_input_ids``, ``advance_draft_step``;
``plan_paged_attention`` + ``paged_attention`` pick between triton_paged_attention.py (no
cache gather) and paged_attention_torch.py (gather up to a static bound + SDPA) the same way,
``mla_attention`` (latent MLA over the same plan) between triton_mla_attention.py and
mla_attention_torch.py;
``add_rms_norm`` (residual add + RMSNorm) and ``rms_norm`` between triton_norm.py and
norm_torch.py,
``apply_rope`` (rotary embedding) between triton_rope.py and rope_torch.py.
``gather_backup_tokens``, ``prepare_next_token_ids_padded`` and
``slot_mapping_for_positions`` are the torch reference on every device (the first two
are fused in ``prepare_padded_step``). Under ``torch.compile`` (Torchair-MTP's
graph) the torch formulas are traced instead, so the graph holds no opaque launch.
``reference.py`` is the oracle the Triton kernels are tested against; ``ragged.py`` holds
the host-side reference for ``disable_padded_drafter_batch=True``.
"""

import functools
import importlib

import torch

from specdec import platform
from specdec.kernels import (
    mla_attention_torch,
    norm_torch,
    paged_attention_torch,
    reference,
    rope_torch,
)
from specdec.kernels.paged_attention_torch import token_requests
from specdec.kernels.reference import (
    DraftStep,
    PaddedPrep,
    gather_backup_tokens,
    prepare_next_token_ids_padded,
    request_slots,
    slot_mapping_for_positions,
)

# The torch implementation of each dispatched name (the CPU path and the oracle).
TORCH_IMPLS = {
    "prepare_inputs_padded": reference.prepare_inputs_padded,
    "shift_first_pass_input_ids": reference.shift_first_pass_input_ids,
    "advance_draft_step": reference.advance_draft_step,
    "prepare_padded_step": reference.prepare_padded_step,
    "plan_paged_attention": paged_attention_torch.plan_paged_attention,
    "paged_attention": paged_attention_torch.paged_attention,
    "mla_attention": mla_attention_torch.mla_attention,
    "add_rms_norm": norm_torch.add_rms_norm,
    "rms_norm": norm_torch.rms_norm,
    "apply_rope": rope_torch.apply_rope,
}
# The Triton module (under specdec.kernels) of each dispatched name.
TRITON_MODULES = dict.fromkeys(TORCH_IMPLS, "triton_padded") | {
    "plan_paged_attention": "triton_paged_attention",
    "paged_attention": "triton_paged_attention",
    "mla_attention": "triton_mla_attention",
    "add_rms_norm": "triton_norm",
    "rms_norm": "triton_norm",
    "apply_rope": "triton_rope"}


def _by_device(name: str):
    """``name`` from its Triton module when the first argument's device runs Triton, else its
    torch implementation. The Triton module is imported on first use only."""
    torch_impl = TORCH_IMPLS[name]
    module = f"specdec.kernels.{TRITON_MODULES[name]}"

    @functools.wraps(torch_impl)
    def call(first: torch.Tensor, *args, **kwargs):
        # inside torch.compile (graph mode) the compiler fuses the torch formulas itself
        if not torch.compiler.is_compiling() and platform.triton_available(first.device):
            triton_impl = getattr(importlib.import_module(module), name)
            return triton_impl(first, *args, **kwargs)
        return torch_impl(first, *args, **kwargs)
    return call


prepare_inputs_padded = _by_device("prepare_inputs_padded")
shift_first_pass_input_ids = _by_device("shift_first_pass_input_ids")
advance_draft_step = _by_device("advance_draft_step")
prepare_padded_step = _by_device("prepare_padded_step")
plan_paged_attention = _by_device("plan_paged_attention")
paged_attention = _by_device("paged_attention")
mla_attention = _by_device("mla_attention")
add_rms_norm = _by_device("add_rms_norm")
rms_norm = _by_device("rms_norm")
apply_rope = _by_device("apply_rope")

__all__ = [
    "DraftStep",
    "PaddedPrep",
    "TORCH_IMPLS",
    "add_rms_norm",
    "apply_rope",
    "advance_draft_step",
    "gather_backup_tokens",
    "mla_attention",
    "paged_attention",
    "plan_paged_attention",
    "prepare_inputs_padded",
    "prepare_next_token_ids_padded",
    "prepare_padded_step",
    "request_slots",
    "rms_norm",
    "shift_first_pass_input_ids",
    "slot_mapping_for_positions",
    "token_requests",
]
