"""Build the proposer a SpeculativeConfig asks for: its class (``registry``) loads its draft
model and builds itself; the checks every method shares are here, once."""

from pathlib import Path

import torch

from specdec.config import SpeculativeConfig
from specdec.graphs import EAGER, Backend
from specdec.models.draft_lm import DraftLM
from specdec.models.heads import DraftHead
from specdec.padding import StepSizes
from specdec.proposers.base import Proposer
from specdec.proposers.registry import get_proposer_class


def load_checked_head(spec: SpeculativeConfig, target, *, model_dir: Path | None,
                      draft_head, dtype: torch.dtype, device: torch.device, tokenizer=None):
    """The draft model ``spec`` needs (``draft_head``, else the one in its class's
    ``head_folder``: None for a method without one), checked against the method and the aux
    layers: the one check of the speculative parts, before anything is built.

    EAGLE-3 aux layer ids, as vLLM picks them: the head config's, else the speculative
    config's ``draft_model_config``, else vLLM's default (2, L // 2, L - 3); the head's become
    the config's (a configured list that differs is an error naming the field: vLLM would
    take the head's silently)."""
    if draft_head is not None:
        if not isinstance(draft_head, (DraftHead, DraftLM)):
            raise TypeError(f"draft_head={draft_head!r}: must be a DraftHead (see "
                            "specdec.models.heads), a DraftLM (specdec.models.draft_lm) or None")
        head, where = draft_head, "draft_head"
    else:
        cls = get_proposer_class(spec)
        path = cls.head_folder(spec, model_dir)
        head = cls.load_head(spec, target, path, dtype=dtype, device=device,
                             tokenizer=tokenizer)
        where = f"speculative_config.model={str(path)!r}"
    if head is not None and head.method != spec.method:
        raise ValueError(f"speculative_config.method={spec.method!r}, but {where} is a "
                         f"{head.method!r} head ({type(head).__name__}); allowed: a "
                         f"{spec.method!r} head")
    if spec.uses_aux_hidden_states and head is not None:
        trained = head.aux_layer_ids
        configured = spec.aux_layer_ids_configured
        if configured is not None and list(configured) != list(trained):
            raise ValueError(
                f"eagle_aux_hidden_state_layer_ids={configured!r}: {where} combines target "
                f"layers {list(trained)} (as trained); allowed: that list, or none given")
        spec.draft_model_config["eagle_aux_hidden_state_layer_ids"] = list(trained)
    if spec.uses_aux_hidden_states:
        spec.aux_layer_ids(target.config.num_hidden_layers)  # the ids exist in the target
    return head


def build_proposer(spec: SpeculativeConfig, target, head, sizes: StepSizes, *,
                   block_size: int, num_kv_blocks: int, dtype: torch.dtype,
                   device: torch.device, backend: Backend = EAGER
                   ) -> tuple[Proposer, tuple[int, ...]]:
    """The proposer for ``spec`` over ``head`` (``load_checked_head``'s) -> (proposer, aux
    layer ids the target must return)."""
    aux_ids = spec.aux_layer_ids(target.config.num_hidden_layers) \
        if spec.uses_aux_hidden_states else ()
    proposer = get_proposer_class(spec).build(
        spec, target, head, sizes, block_size=block_size, num_kv_blocks=num_kv_blocks,
        dtype=dtype, device=device, backend=backend)
    return proposer, aux_ids
