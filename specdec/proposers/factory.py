"""Build the proposer a SpeculativeConfig asks for: find and load its head, pick its class."""

from pathlib import Path

import torch

from specdec.config import SpeculativeConfig
from specdec.models.heads import DraftHead, load_head
from specdec.proposers.registry import get_proposer_class


def find_head_dir(spec: SpeculativeConfig, model_dir: Path | None) -> Path:
    """``speculative_config.model``, else ``<target folder>/../<method>``."""
    if spec.model is not None:
        path = Path(spec.model)
    elif model_dir is not None:
        path = Path(model_dir).parent / spec.method  # e.g. assets/default/{target,eagle3}
    else:
        raise ValueError(f"speculative_config.model is required for method={spec.method!r}")
    if not (path / "config.json").exists():
        raise ValueError(f"speculative_config.model={str(path)!r} has no config.json "
                         f"(a {spec.method} head folder is needed)")
    return path


def load_checked_head(spec: SpeculativeConfig, target, *, model_dir,
                      draft_head, dtype: torch.dtype, device: torch.device):
    """The head ``spec`` needs (``draft_head``, else loaded from its folder; None for
    extract_hidden_states), checked against the method and the aux layers; an EAGLE-3
    head's aux layer ids become the config's when the config sets none."""
    if spec.method == "extract_hidden_states":
        head, where = None, None
    elif draft_head is not None:
        if not isinstance(draft_head, DraftHead):
            raise TypeError(f"draft_head={draft_head!r}: must be a DraftHead (see "
                            "specdec.models.heads) or None")
        head, where = draft_head, "draft_head"
    else:
        path = find_head_dir(spec, model_dir)
        head = load_head(path, target, dtype=dtype, device=device)
        where = f"speculative_config.model={str(path)!r}"
    if head is not None and head.method != spec.method:
        raise ValueError(f"speculative_config.method={spec.method!r}, but {where} is a "
                         f"{head.method!r} head ({type(head).__name__}); allowed: a "
                         f"{spec.method!r} head")
    if spec.uses_aux_hidden_states and head is not None:
        trained = head.aux_layer_ids
        if spec.aux_layer_ids_configured is None:
            spec.draft_model_config["eagle_aux_hidden_state_layer_ids"] = list(trained)
        configured = spec.aux_layer_ids_configured
        if len(configured) != len(trained):
            raise ValueError(
                f"eagle_aux_hidden_state_layer_ids={configured!r} has {len(configured)} ids, "
                f"but {where} combines {len(trained)} target layers ({list(trained)})")
    if spec.uses_aux_hidden_states:
        spec.aux_layer_ids(target.config.num_hidden_layers)  # the ids exist in the target
    return head


def build_proposer(spec: SpeculativeConfig, target, *, model_dir, draft_head,
                   max_num_seqs: int, block_size: int, num_kv_blocks: int,
                   max_model_len: int, dtype: torch.dtype, device: torch.device,
                   graph_backend: str = "eager", compile_backend: str = "inductor"):
    """-> (proposer, aux_layer_ids the target must return).

    max_num_seqs: the largest *padded* request count of a step.
    """
    head = load_checked_head(spec, target, model_dir=model_dir, draft_head=draft_head,
                             dtype=dtype, device=device)
    aux_ids = spec.aux_layer_ids(target.config.num_hidden_layers) \
        if spec.uses_aux_hidden_states else ()
    cls = get_proposer_class(spec)
    sizes = dict(max_num_seqs=max_num_seqs, block_size=block_size,
                 max_model_len=max_model_len, vocab_size=target.config.vocab_size, device=device)
    if spec.method == "extract_hidden_states":
        proposer = cls(spec, num_aux_layers=len(aux_ids),
                       hidden_size=target.config.hidden_size, dtype=dtype, **sizes)
    else:
        proposer = cls(spec, head=head, num_kv_blocks=num_kv_blocks, dtype=dtype,
                       graph_backend=graph_backend, compile_backend=compile_backend, **sizes)
    return proposer, aux_ids
