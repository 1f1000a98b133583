"""A separate small causal LM as the drafter (method ``draft_model``, vLLM's): any architecture
of the registry, with its own embedding, layers, norm, lm_head and paged KV cache, drafting for
a target of the same tokenizer.

``DraftLM`` gives a whole model the head interface the proposers call
(``forward(ids, positions, hidden, kv) -> (logits_hidden, next_hidden)``, ``compute_logits``,
``kv_cache_spec``); it reads tokens only, never the target's hidden states.
"""

from pathlib import Path

import torch
from torch import nn

from specdec.attention import KVCacheSpec
from specdec.models import checkpoint
from specdec.models.decoder import DecoderForCausalLM


class DraftLM(nn.Module):
    method = "draft_model"
    aux_layer_ids: tuple[int, ...] = ()

    def __init__(self, model: DecoderForCausalLM):
        super().__init__()
        specs = model.kv_cache_spec()
        if not all(isinstance(s, KVCacheSpec) for s in specs):
            raise ValueError(f"a draft model with linear-attention layers "
                             f"({type(model).__name__}) is not supported; allowed: models whose "
                             "every layer is attention")
        self.model = model.eval()
        self.config = model.config

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor | None, kv=None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [N] int64 at their own positions [N] (``hidden`` is not read) -> the
        model's final hidden states [N, H_draft], twice (logits input, next step's hidden)."""
        out, _ = self.model(input_ids, positions, kv=kv)
        return out, out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def draft_to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def kv_cache_spec(self) -> list[KVCacheSpec]:
        return self.model.kv_cache_spec()


def load_draft_lm(path: str | Path, target: DecoderForCausalLM, target_tokenizer, load_model,
                  *, dtype: torch.dtype, device: torch.device) -> DraftLM:
    """The draft model of folder ``path`` for ``target``, built by ``load_model`` (the
    registry's: no model file imports a registry): ValueError naming both when their
    vocabularies differ (size, or the tokenizers' token -> id maps where both folders ship
    one)."""
    where = f"speculative_config.model={str(path)!r}"
    if not (Path(path) / "config.json").exists():
        raise ValueError(f"{where} has no config.json (method='draft_model' needs the folder "
                         "of a causal LM with the target's tokenizer)")
    draft = DraftLM(load_model(path, dtype=dtype, device=device))
    size, want = draft.config.vocab_size, target.config.vocab_size
    if size != want:
        raise ValueError(f"{where}: vocab_size={size}, the target's is {want}; a draft model "
                         "needs the target's vocabulary")
    tokenizer = checkpoint.load_tokenizer(path)
    if tokenizer is not None and target_tokenizer is not None \
            and tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(f"{where}: its tokenizer.json maps tokens to other ids than the "
                         "target's; a draft model needs the target's tokenizer")
    return draft
