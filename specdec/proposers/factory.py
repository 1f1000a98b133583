"""Build the proposer a SpeculativeConfig asks for: find and load its head, pick its class."""

from pathlib import Path

import torch

from specdec.config import SpeculativeConfig
from specdec.models.heads import load_head
from specdec.models.llama import LlamaForCausalLM
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


def build_proposer(spec: SpeculativeConfig, target: LlamaForCausalLM, *, model_dir, draft_head,
                   max_num_seqs: int, max_num_tokens: int, block_size: int, num_kv_blocks: int,
                   max_model_len: int, dtype: torch.dtype, device: torch.device,
                   graph_backend: str = "eager", compile_backend: str = "inductor"):
    """-> (proposer, aux_layer_ids the target must return).

    max_num_seqs / max_num_tokens: the largest *padded* request / token counts of a step.
    """
    num_layers = target.config.num_hidden_layers
    head = draft_head
    if spec.method != "extract_hidden_states" and head is None:
        head = load_head(find_head_dir(spec, model_dir), target, dtype=dtype, device=device)
    if spec.uses_aux_hidden_states:
        configured = getattr(head, "aux_layer_ids", None) if head is not None else None
        if spec.aux_layer_ids_configured is None and configured is not None:
            spec.draft_model_config["eagle_aux_hidden_state_layer_ids"] = list(configured)
        aux_ids = spec.aux_layer_ids(num_layers)
    else:
        aux_ids = ()
    cls = get_proposer_class(spec)
    sizes = dict(max_num_seqs=max_num_seqs, max_num_tokens=max_num_tokens, block_size=block_size,
                 max_model_len=max_model_len, vocab_size=target.config.vocab_size, device=device)
    if spec.method == "extract_hidden_states":
        proposer = cls(spec, num_aux_layers=len(aux_ids),
                       hidden_size=target.config.hidden_size, dtype=dtype, **sizes)
    else:
        proposer = cls(spec, head=head, num_kv_blocks=num_kv_blocks, dtype=dtype,
                       graph_backend=graph_backend, compile_backend=compile_backend, **sizes)
    return proposer, aux_ids
