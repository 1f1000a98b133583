"""Synthetic targets and heads to time a device without a download.

``build_synthetic("llama-1b", ...)`` is a ~0.85B Llama shape (H=2048, 16 layers, GQA 16/4,
intermediate 5632, vocab 32000) with MTP / EAGLE / EAGLE-3 heads built to match. Weights are
``"random"`` (normal, std 0.02: drafts are almost never accepted) or ``"zeros"`` (every
logit ties, so target and drafts both pick token 0: every draft is accepted) -- the two ends
of the acceptance range, at the real cost per step. Built on the meta device and materialised
on the target device, so no CPU copy of the weights is ever made.
"""

import torch

from specdec.models.heads import build_head
from specdec.models.llama import LlamaConfig, LlamaForCausalLM

SHAPES = {
    "llama-1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                     num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                     max_position_embeddings=4096),
    "llama-tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
}
INITS = ("random", "zeros")


def _materialise(module: torch.nn.Module, device, dtype, init: str, seed: int):
    module = module.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if init == "zeros":
                p.zero_()
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        for b in module.buffers():
            b.zero_()
    return module.eval()


def build_synthetic(shape: str, *, dtype: torch.dtype = torch.bfloat16,
                    device: str | torch.device = "cpu", init: str = "random", seed: int = 0,
                    heads: tuple[str, ...] = ("mtp", "eagle", "eagle3")):
    """-> (target, {method: head}). ``shape`` in SHAPES, ``init`` in INITS."""
    if shape not in SHAPES:
        raise ValueError(f"synthetic shape={shape!r}; allowed: {sorted(SHAPES)}")
    if init not in INITS:
        raise ValueError(f"synthetic init={init!r}; allowed: {INITS}")
    cfg = LlamaConfig(**SHAPES[shape], eos_token_id=SHAPES[shape]["vocab_size"] - 1)
    with torch.device("meta"):
        target = LlamaForCausalLM(cfg)
    target = _materialise(target, device, dtype, init, seed)
    n = cfg.num_hidden_layers
    out = {}
    for i, method in enumerate(heads):
        extra = {"eagle_aux_hidden_state_layer_ids": [2, n // 2, n - 3]} if method == "eagle3" else {}
        with torch.device("meta"):
            head = build_head(method, target, **extra)
        out[method] = _materialise(head, device, dtype, init, seed + 1 + i)
    return target, out


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters one forward reads (shared tensors counted once)."""
    seen = {}
    for p in model.parameters():
        seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())
