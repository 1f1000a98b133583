"""Synthetic targets (random weights, no checkpoint on disk) and matching draft heads, for timing
a device without a download.

``build_synthetic("llama-1b", torch.bfloat16, "cuda", seed=0)`` -> :class:`Synthetic` with a
``LlamaForCausalLM`` of the ~0.85B Llama shape (H=2048, 16 layers, 16 query / 4 KV heads,
intermediate 5632, vocab 32000) and one MTP, EAGLE-1 and EAGLE-3 head built for it (EAGLE-3
reads the target's layers 2, 8, 13, vLLM's default ``(2, L // 2, L - 3)``).
``"llama-tiny"`` is the same recipe at test size.

``init="zeros"`` zeroes every weight instead: every logit ties, so the target and every head
pick token 0 and every draft is accepted -- speculation's best case at the real cost per step.

Fast to build: every module is created on the meta device, cast, then materialised on
``device`` with ``to_empty`` and filled in place (matrices ~ N(0, 0.02), the projections
into the residual stream N(0, 0.02 / sqrt(2 L)) as GPT-2 does, norms 1, biases 0), so no
float32 copy and no CPU-side initialisation of a large model ever exists. With
``device="meta"`` nothing is allocated (parameter counts only).

Parameter count of llama-1b: embed + lm_head 2 * 32000 * 2048 = 131.1M; per layer qkv
2048 * 3072 + o 2048 * 2048 + gate/up/down 3 * 2048 * 5632 + 2 norms = 45.1M, x 16 = 721.5M;
total 852.6M (1.71 GB in bf16: ``weight_bytes``).
"""

import math
from typing import NamedTuple

import torch
from torch import nn

from specdec.models.heads import DraftHead, build_head
from specdec.models.config import ModelConfig
from specdec.models.llama import LlamaForCausalLM

SHAPES = {
    "llama-1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                     num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                     max_position_embeddings=4096),
    # Llama-3.1-8B's shape (the field's headline EAGLE-3 target), default rope
    "llama-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     max_position_embeddings=8192),
    "llama-tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512),
}
HEAD_METHODS = ("mtp", "eagle", "eagle3")
INITS = ("random", "zeros")
INIT_STD = 0.02


class Synthetic(NamedTuple):
    target: LlamaForCausalLM
    heads: dict[str, DraftHead]  # method -> head sharing the target's embed/lm_head


def synthetic_config(name: str) -> ModelConfig:
    if name not in SHAPES:
        raise ValueError(f"synthetic model {name!r}: allowed {sorted(SHAPES)}")
    return ModelConfig(**SHAPES[name], torch_dtype="bfloat16")


def build_synthetic(name: str, dtype: torch.dtype = torch.bfloat16,
                    device: str | torch.device = "cpu", seed: int = 0,
                    methods: tuple[str, ...] = HEAD_METHODS, init: str = "random") -> Synthetic:
    """The target ``name`` and a head per method in ``methods``, in ``dtype`` on ``device``,
    eval mode; the same ``seed`` gives the same weights on the same device. ``init`` in
    INITS."""
    config = synthetic_config(name)
    if init not in INITS:
        raise ValueError(f"init={init!r}: allowed {INITS}")
    unknown = sorted(set(methods) - set(HEAD_METHODS))
    if unknown:
        raise ValueError(f"methods {unknown}: allowed {HEAD_METHODS}")
    n = config.num_hidden_layers
    with torch.device("meta"):
        target = LlamaForCausalLM(config)
        heads = {m: build_head(m, target, **({"eagle_aux_hidden_state_layer_ids":
                                              [2, n // 2, n - 3]} if m == "eagle3" else {}))
                 for m in methods}
    device = torch.device(device)
    gen = None if device.type == "meta" else torch.Generator(device).manual_seed(seed)
    for module in (target, *heads.values()):
        module.to(dtype=dtype).to_empty(device=device)
        if gen is not None and init == "zeros":
            with torch.no_grad():
                for t in (*module.parameters(), *module.buffers()):
                    t.zero_()
        elif gen is not None:
            _init_(module, gen, n)
        module.eval()
    return Synthetic(target, heads)


@torch.no_grad()
def _init_(module: nn.Module, gen: torch.Generator, num_layers: int) -> None:
    residual_std = INIT_STD / math.sqrt(2 * num_layers)
    for name, p in module.named_parameters():
        if p.dim() == 1:
            p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
        else:
            std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else INIT_STD
            p.normal_(0.0, std, generator=gen)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers, each storage counted once (tied weights
    once). A head's shared target embed/lm_head are not its own (not counted).

    Example: nn.Linear(4, 2, bias=False) in bfloat16 -> 4 * 2 * 2 = 16.
    """
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        key = (t.device, t.untyped_storage().data_ptr()) if t.device.type != "meta" else id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total
