"""Padded-drafting formulas (imported as ``specdec.kernels``).

The names below are the stable API. Today they are the pure-torch reference
(``reference.py``); a per-device dispatch to Triton kernels will sit here later.
``ragged.py`` holds the host-side reference for ``disable_padded_drafter_batch=True``.
"""

from specdec.kernels.reference import (
    DraftStep,
    advance_draft_step,
    gather_backup_tokens,
    prepare_inputs_padded,
    prepare_next_token_ids_padded,
    shift_first_pass_input_ids,
    slot_mapping_for_positions,
)

__all__ = [
    "DraftStep",
    "advance_draft_step",
    "gather_backup_tokens",
    "prepare_inputs_padded",
    "prepare_next_token_ids_padded",
    "shift_first_pass_input_ids",
    "slot_mapping_for_positions",
]
