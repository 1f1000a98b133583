"""Build the proposer a SpeculativeConfig asks for: find and load its head, pick its class."""

from pathlib import Path

import torch

from specdec.config import SpeculativeConfig
from specdec.models.draft_lm import DraftLM, load_draft_lm
from specdec.models.heads import DraftHead, load_head
from specdec.models.heads.registry import MTP_TARGETS, holds_mtp_layers, target_architecture
from specdec.padding import StepSizes
from specdec.proposers.extract_hidden_states import check_output_dir
from specdec.proposers.registry import get_proposer_class


def find_head_dir(spec: SpeculativeConfig, model_dir: Path | None) -> Path:
    """``speculative_config.model``; else for ``mtp`` the target folder itself when it holds
    its MTP layer (``holds_mtp_layers``), as vLLM takes the target as the MTP model;
    else ``<target folder>/../<method>`` (the embedded default model's sibling heads)."""
    if spec.model is not None:
        path = Path(spec.model)
    elif model_dir is not None:
        if spec.method == "mtp" and holds_mtp_layers(model_dir):
            return Path(model_dir)
        path = Path(model_dir).parent / spec.method  # e.g. assets/default/{target,eagle3}
    else:
        raise ValueError(f"speculative_config.model is required for method={spec.method!r}")
    if not (path / "config.json").exists():
        where = ""
        if spec.method == "mtp" and spec.model is None:
            arch = target_architecture(model_dir)
            archs = f"{', '.join(MTP_TARGETS[:-1])} or {MTP_TARGETS[-1]}"
            where = (f"; the target folder {str(model_dir)!r} is a {arch} checkpoint, but its "
                     "files hold no MTP layer's tensors (only the target's shards were "
                     "saved or downloaded?)" if arch in MTP_TARGETS else
                     f"; the target folder {str(model_dir)!r} is not a {archs} checkpoint "
                     "holding its MTP layer")
        raise ValueError(f"speculative_config.model={str(path)!r} has no config.json "
                         f"(the folder of a {spec.method!r} head is needed{where})")
    return path


def load_checked_head(spec: SpeculativeConfig, target, *, model_dir,
                      draft_head, dtype: torch.dtype, device: torch.device, tokenizer=None):
    """The head ``spec`` needs (``draft_head``, else loaded from its folder; None for
    extract_hidden_states, whose output folder is checked instead), checked against the method
    and the aux layers: the one check of the speculative parts, before anything is built.

    EAGLE-3 aux layer ids, as vLLM picks them: the head config's, else the speculative
    config's ``draft_model_config``, else vLLM's default (2, L // 2, L - 3); the head's become
    the config's (a configured list of another length is an error naming the field)."""
    if spec.drafts_on_host:  # ngram: no head
        head, where = None, None
    elif spec.method == "extract_hidden_states":
        check_output_dir(spec)
        head, where = None, None
    elif draft_head is not None:
        if not isinstance(draft_head, (DraftHead, DraftLM)):
            raise TypeError(f"draft_head={draft_head!r}: must be a DraftHead (see "
                            "specdec.models.heads), a DraftLM (specdec.models.draft_lm) or None")
        head, where = draft_head, "draft_head"
    elif spec.method == "draft_model":  # a separate causal LM (``tokenizer``: the target's)
        head = load_draft_lm(spec.model, target, tokenizer, dtype=dtype, device=device)
        where = f"speculative_config.model={spec.model!r}"
    else:
        path = find_head_dir(spec, model_dir)
        head = load_head(path, target, dtype=dtype, device=device,
                         aux_layer_ids=spec.aux_layer_ids_configured)
        where = f"speculative_config.model={str(path)!r}"
    if head is not None and head.method != spec.method:
        raise ValueError(f"speculative_config.method={spec.method!r}, but {where} is a "
                         f"{head.method!r} head ({type(head).__name__}); allowed: a "
                         f"{spec.method!r} head")
    if spec.uses_aux_hidden_states and head is not None:
        trained = head.aux_layer_ids
        configured = spec.aux_layer_ids_configured
        if configured is not None and len(configured) != len(trained):
            raise ValueError(
                f"eagle_aux_hidden_state_layer_ids={configured!r} has {len(configured)} ids, "
                f"but {where} combines {len(trained)} target layers ({list(trained)})")
        spec.draft_model_config["eagle_aux_hidden_state_layer_ids"] = list(trained)
    if spec.uses_aux_hidden_states:
        spec.aux_layer_ids(target.config.num_hidden_layers)  # the ids exist in the target
    return head


def build_proposer(spec: SpeculativeConfig, target, head: DraftHead | None, sizes: StepSizes,
                   *, block_size: int, num_kv_blocks: int, dtype: torch.dtype,
                   device: torch.device, graph_backend: str = "eager",
                   compile_backend: str = "inductor"):
    """The proposer for ``spec`` over ``head`` (``load_checked_head``'s, None for
    extract_hidden_states and ngram), sized by ``sizes`` (its rows: the largest padded request count)
    -> (proposer, aux_layer_ids the target must return)."""
    aux_ids = spec.aux_layer_ids(target.config.num_hidden_layers) \
        if spec.uses_aux_hidden_states else ()
    cls = get_proposer_class(spec)
    kw = dict(max_num_seqs=sizes.max_num_reqs, block_size=block_size,
              max_model_len=sizes.max_model_len, vocab_size=target.config.vocab_size,
              device=device)
    if spec.drafts_on_host:
        proposer = cls(spec, max_model_len=sizes.max_model_len)
    elif spec.method == "extract_hidden_states":
        output_dir = Path(spec.draft_model_config["output_dir"])  # load_checked_head checked it
        proposer = cls(spec, output_dir=output_dir, num_aux_layers=len(aux_ids),
                       hidden_size=target.config.hidden_size, dtype=dtype, **kw)
    else:
        proposer = cls(spec, head=head, num_kv_blocks=num_kv_blocks, dtype=dtype,
                       graph_backend=graph_backend, compile_backend=compile_backend, **kw)
    return proposer, aux_ids
