"""Synthetic targets (random weights, no checkpoint on disk) and matching draft heads, for timing
a device without a download.

``build_synthetic("llama-1b", torch.bfloat16, "cuda", seed=0)`` -> :class:`Synthetic` with a
``LlamaForCausalLM`` of the ~0.85B Llama shape (H=2048, 16 layers, 16 query / 4 KV heads,
intermediate 5632, vocab 32000) and one MTP, EAGLE-1 and EAGLE-3 head built for it (EAGLE-3
reads the target's layers 2, 8, 13, vLLM's default ``(2, L // 2, L - 3)``).
``"llama-tiny"`` is the same recipe at test size. The shapes (``SHAPES``, HF config dicts):

* ``llama-1b``, ``llama-tiny``: above.
* ``llama-8b``: Llama-3.1-8B (default rope); its EAGLE-3 head is shaped as the published
  yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: ``draft_vocab_size`` 32000 (``lm_head [32000, 4096]``)
  and ``d2t`` offsets into the 128256-token vocabulary (``DRAFT_VOCAB``). ``llama-tiny``'s
  EAGLE-3 head is the same at its scale: 64 draft ids of 256 (32000 / 128256 = 1/4).
* ``deepseek-16b``: DeepSeek-V3's architecture at the size of its ``config_16B.json``
  (DeepSeek-V2-Lite's shape): MLA (no q LoRA, kv_lora_rank 512, qk 128 + 64 rope, v 128), 27
  layers (layer 0 dense, intermediate 10944; layers 1-26 MoE: 64 routed experts of 1408, top-6,
  2 shared), H=2048, 16 heads, vocab 102400, with DeepSeek-V3's routing (sigmoid, ``noaux_tc``,
  one group) and one MTP layer (``DeepseekMtpHead``, method ``mtp``, over the target's
  embedding and lm_head). Target 15.71B parameters (31.41 GB in bf16), MTP layer 0.59B
  (1.19 GB): 32.6 GB in all, leaving an 80 GB GPU ~47 GB for activations and the (latent,
  576 values per token per layer) KV cache.
* ``deepseek-tiny``: the same recipe at test size (3 layers, 8 experts, top-2, 2 shared).

Which heads each shape has: ``head_methods(name)`` (Llama: mtp, eagle, eagle3; DeepSeek: mtp).

``init="zeros"`` zeroes every weight instead: every logit ties, so the target and every head
pick id 0 and every draft is accepted -- speculation's best case at the real cost per step.
An EAGLE-3 head with a draft vocabulary drafts draft id 0 then, which ``d2t`` maps to target
id ``0 + d2t[0]``; the synthetic draft vocabulary is the target ids ``i * V // D`` for draft
id ``i`` (sorted, spread over the vocabulary, as the published heads' ids of the D most
frequent tokens are sorted), so ``d2t[0] = 0`` and the draft is the target's own argmax
(id 0). The published heads also ship ``t2d`` (the [V] bool mask of those ids): Eagle3Head
skips it as vLLM does, so the synthetic head holds none (128 KB for llama-8b's).

``acceptance=(r1, ..., rK)`` (zero weights only) gives every head a ``DraftProfile``: the
target's argmax is token 0 at every position, and the head's draft at depth d is 0 (accepted)
with probability ``r_d / r_{d-1}`` and token 1 (rejected) otherwise, drawn from its own seeded
generator on the device, so draft position d is accepted at rate ``r_d`` -- vLLM's acceptance
rate per position (EAGLE-3 on Llama-3.1-8B: about .75, .6, .45 at K=3, vLLM issue #20780) --
at the head's real cost per step.

Fast to build: every module is created on the meta device, cast, then materialised on
``device`` with ``to_empty`` and filled in place (matrices ~ N(0, 0.02), the projections
into the residual stream N(0, 0.02 / sqrt(2 L)) as GPT-2 does, norms 1, biases and buffers 0,
``d2t`` the mapping above), so no float32 copy and no CPU-side initialisation of a large model
ever exists. With ``device="meta"`` nothing is allocated (parameter counts only).

Parameter count of llama-1b: embed + lm_head 2 * 32000 * 2048 = 131.1M; per layer qkv
2048 * 3072 + o 2048 * 2048 + gate/up/down 3 * 2048 * 5632 + 2 norms = 45.1M, x 16 = 721.5M;
total 852.6M (1.71 GB in bf16: ``weight_bytes``).
"""

import math
from dataclasses import replace
from typing import NamedTuple

import torch
from torch import nn

from specdec.models.config import ModelConfig
from specdec.models.decoder import DecoderForCausalLM
from specdec.models.deepseek import DeepseekV3ForCausalLM
from specdec.models.heads.base import DraftHead
from specdec.models.heads.deepseek_mtp import DeepseekMtpHead
from specdec.models.heads.training import build_head
from specdec.models.llama import LlamaForCausalLM

LLAMA, DEEPSEEK = [LlamaForCausalLM.__name__], [DeepseekV3ForCausalLM.__name__]
# HF config dicts
SHAPES = {
    "llama-1b": dict(architectures=LLAMA, vocab_size=32000, hidden_size=2048,
                     intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                     num_key_value_heads=4, max_position_embeddings=4096),
    # Llama-3.1-8B's shape (the field's headline EAGLE-3 target), default rope
    "llama-8b": dict(architectures=LLAMA, vocab_size=128256, hidden_size=4096,
                     intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, max_position_embeddings=8192),
    "llama-tiny": dict(architectures=LLAMA, vocab_size=256, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=512),
    # DeepSeek-V3's config_16B.json (DeepSeek-V2-Lite's shape), V3's routing, one MTP layer
    "deepseek-16b": dict(architectures=DEEPSEEK, vocab_size=102400, hidden_size=2048,
                         intermediate_size=10944, moe_intermediate_size=1408,
                         num_hidden_layers=27, first_k_dense_replace=1, num_attention_heads=16,
                         num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
                         qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                         n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
                         n_group=1, topk_group=1, routed_scaling_factor=1.0,
                         norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
                         num_nextn_predict_layers=1, max_position_embeddings=4096),
    "deepseek-tiny": dict(architectures=DEEPSEEK, vocab_size=256, hidden_size=64,
                          intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                          first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                          q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
                          qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                          num_experts_per_tok=2, n_shared_experts=2, n_group=1, topk_group=1,
                          routed_scaling_factor=1.0, norm_topk_prob=True,
                          scoring_func="sigmoid", topk_method="noaux_tc",
                          num_nextn_predict_layers=1, max_position_embeddings=512),
}
# EAGLE-3 draft_vocab_size where it is not the target's: the published Llama-3.1-8B head's,
# and llama-tiny's at the same 1/4 scale
DRAFT_VOCAB = {"llama-8b": 32000, "llama-tiny": 64}
HEAD_METHODS = ("mtp", "eagle", "eagle3")  # every method some shape has
# the families the shapes use, with the head methods each has
FAMILY_METHODS = {LlamaForCausalLM: HEAD_METHODS, DeepseekV3ForCausalLM: ("mtp",)}
FAMILIES = {cls.__name__: cls for cls in FAMILY_METHODS}
INITS = ("random", "zeros")
SYNTHETIC_DTYPE = "bfloat16"  # the shapes' torch_dtype: dtype "auto" on an accelerator
INIT_STD = 0.02


class DraftProfile:
    """Drafts at a set acceptance rate per position over a zero-weight target (argmax 0).

    rates [K]: the rate at which draft position d is accepted, non-increasing in [0, 1]
    (position d is reached only through d-1): the draft at depth d is token 0 with probability
    ``rates[d] / rates[d-1]`` (``rates[0]`` at depth 0; 0 after a rate of 0), else token 1.
    ``apply`` draws on the device from its own generator: no host read.

    Example: rates (0.75, 0.6, 0.45) -> depth probabilities (0.75, 0.8, 0.75)."""

    def __init__(self, rates, seed: int, device: torch.device):
        rates = tuple(rates)
        if not rates or any(not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0
                            for r in rates):
            raise ValueError(f"acceptance={list(rates)}: allowed one rate per draft position, "
                             "each in [0, 1]")
        if any(b > a for a, b in zip(rates, rates[1:])):
            raise ValueError(f"acceptance={list(rates)}: rates must not increase with the "
                             "position (position d is reached only through position d-1)")
        self.rates = rates
        depth = [r / before if before > 0 else 0.0 for r, before in zip(rates, (1.0, *rates))]
        self.depth_probability = torch.tensor(depth, dtype=torch.float32, device=device)
        self.generator = torch.Generator(device).manual_seed(seed)

    def apply(self, drafts: torch.Tensor) -> torch.Tensor:
        """drafts [R, k] int32 (k <= K) -> [R, k] int32 of 0 (accepted) and 1 (rejected)."""
        u = torch.rand(drafts.shape, generator=self.generator, device=drafts.device)
        hit = u < self.depth_probability[:drafts.shape[1]]
        return (~hit).to(drafts.dtype)


class Synthetic(NamedTuple):
    target: DecoderForCausalLM
    heads: dict[str, DraftHead]  # method -> head sharing the target's embed/lm_head


def synthetic_config(name: str) -> ModelConfig:
    if name not in SHAPES:
        raise ValueError(f"synthetic model {name!r}: allowed {sorted(SHAPES)}")
    shape = SHAPES[name]
    return ModelConfig.from_dict({**shape, "torch_dtype": SYNTHETIC_DTYPE, "bos_token_id": 0,
                                  "eos_token_id": 0},
                                 FAMILIES[shape["architectures"][0]])


def head_methods(name: str) -> tuple[str, ...]:
    """The draft-head methods synthetic ``name`` has, e.g. ``deepseek-tiny`` -> ("mtp",)."""
    return FAMILY_METHODS[FAMILIES[synthetic_config(name).architectures[0]]]


def build_synthetic(name: str, dtype: torch.dtype = torch.bfloat16,
                    device: str | torch.device = "cpu", seed: int = 0,
                    methods: tuple[str, ...] | None = None, init: str = "random",
                    acceptance: tuple[float, ...] | None = None) -> Synthetic:
    """The target ``name`` and a head per method in ``methods`` (default: every one of
    ``head_methods(name)``), in ``dtype`` on ``device``, eval mode; the same ``seed`` gives the
    same weights on the same device. ``init`` in INITS; ``acceptance``: each head's
    ``DraftProfile`` rates (``init="zeros"`` only: the target's argmax is known then)."""
    config = synthetic_config(name)
    if init not in INITS:
        raise ValueError(f"init={init!r}: allowed {INITS}")
    if acceptance is not None and init != "zeros":
        raise ValueError(f"acceptance={list(acceptance)} needs init='zeros' (the target's "
                         f"argmax is token 0 only then), not init={init!r}")
    allowed = head_methods(name)
    methods = allowed if methods is None else methods
    unknown = sorted(set(methods) - set(allowed))
    if unknown:
        raise ValueError(f"methods {unknown}: allowed {allowed} for {name}")
    with torch.device("meta"):
        target = FAMILIES[config.architectures[0]](config)
        heads = {m: _head(name, m, target) for m in methods}
    device = torch.device(device)
    gen = None if device.type == "meta" else torch.Generator(device).manual_seed(seed)
    for module in (target, *heads.values()):
        module.to(dtype=dtype).to_empty(device=device)
        if gen is not None:
            _init_(module, gen, config.num_hidden_layers, init)
        module.eval()
    if acceptance is not None:
        for head in heads.values():
            head.draft_profile = DraftProfile(acceptance, seed, device)
    return Synthetic(target, heads)


def synthetic_engine(name: str, method: str | None, *, dtype: torch.dtype,
                     device: str | torch.device, seed: int = 0, init: str = "zeros",
                     acceptance: tuple[float, ...] | None = None) -> dict:
    """``LLM(target=, draft_head=)`` arguments: the synthetic ``name`` and its head for
    ``method`` (None for a method no shape has a head for: ngram, suffix, none); with
    ``acceptance`` the head drafts at those rates (``DraftProfile``)."""
    has_head = method in head_methods(name)
    if acceptance is not None and not has_head:
        raise ValueError(f"acceptance={list(acceptance)} sets a draft head's rates; "
                         f"method={method!r} has none on {name} (allowed: "
                         f"{list(head_methods(name))})")
    target, heads = build_synthetic(name, dtype, device, seed, (method,) if has_head else (),
                                    init, acceptance)
    return dict(target=target, draft_head=heads.get(method))


def _head(name: str, method: str, target: DecoderForCausalLM) -> DraftHead:
    config = target.config
    if config.architectures == DEEPSEEK:  # the target's layer L, as DeepSeek-V3 stores it
        return DeepseekMtpHead(replace(config, extra=dict(config.extra)), target)
    if method != "eagle3":
        return build_head(method, target)
    n = config.num_hidden_layers
    return build_head(method, target, eagle_aux_hidden_state_layer_ids=[2, n // 2, n - 3],
                      draft_vocab_size=DRAFT_VOCAB.get(name, config.vocab_size))


@torch.no_grad()
def _init_(module: nn.Module, gen: torch.Generator, num_layers: int, init: str) -> None:
    """Fill ``module``'s (uninitialised) tensors in place as the module docstring says."""
    residual_std = INIT_STD / math.sqrt(2 * num_layers)
    for name, p in module.named_parameters():
        if init == "zeros" or p.dim() == 1:
            p.fill_(1.0 if init == "random" and name.endswith("norm.weight") else 0.0)
        else:
            std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else INIT_STD
            p.normal_(0.0, std, generator=gen)
    for b in module.buffers():
        b.zero_()
    d2t = getattr(module, "d2t", None)
    if d2t is not None:
        d2t.copy_(draft_vocab_ids(len(d2t), module.config.vocab_size, d2t.device)
                  - torch.arange(len(d2t), device=d2t.device))


def draft_vocab_ids(draft_vocab: int, vocab: int, device=None) -> torch.Tensor:
    """The target id of each synthetic draft id: ``i * vocab // draft_vocab`` ([draft_vocab]
    int64, sorted, distinct, starting at 0). E.g. (4, 10) -> [0, 2, 5, 7]."""
    return torch.arange(draft_vocab, device=device) * vocab // draft_vocab


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
