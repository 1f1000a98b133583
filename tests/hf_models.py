"""Tiny random models in the layouts of published checkpoints, built WITH transformers, and
transformers' own greedy tokens / logits over them (the reference specdec must match).

Each ``build_<family>(path) -> Path`` writes a seeded float32 model (hidden 64, 2-4 layers,
vocab 512, max_position_embeddings >= 256) through ``save_pretrained``, sharded
(``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``) where the real
checkpoint is. The config uses the real checkpoint's keys with the shapes shrunk; special token
ids are remapped into the small vocab (``128001 -> 501`` etc.).

Two spellings of ``config.json`` (the tensors are the same):
- transformers 5 (what ``save_pretrained`` writes today): ``rope_parameters`` holding
  ``rope_theta`` / ``rope_type`` / scaling keys, ``dtype``; ``num_local_experts`` for Qwen3-MoE.
- transformers 4, as the published checkpoints on the Hub are spelled (``to_t4_spelling``):
  ``rope_theta`` + ``rope_scaling`` (null when plain), ``torch_dtype``, ``num_experts`` for
  Qwen3-MoE, ``"type": "yarn"`` as in Qwen2.5's README, no ``rope_parameters``.

Weights: ``initializer_range`` 0.2 (not 0.02) so attention is peaked and position-sensitive
(RoPE variants and the sliding window change the logits by far more than the tolerances), every
norm weight is ``1 + N(0, 0.1)`` and every bias / routing-bias buffer ``N(0, 0.1)`` (transformers
inits them to ones / zeros, which would leave them untested).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

VOCAB = 512
SEED = 1234
INIT_RANGE = 0.2
SHARD_SIZE = "200KB"  # every tiny model is ~0.5-1.5 MB: 3+ shards

# real special ids remapped into the tiny vocab
LLAMA3_BOS, LLAMA3_EOS = 500, [501, 508, 509]  # 128000; 128001 (<|end_of_text|>), 128008, 128009
QWEN_BOS, QWEN_EOS = 503, 505  # 151643 (<|endoftext|>), 151645 (<|im_end|>)
MINIMAX_BOS, MINIMAX_EOS = 504, 506  # 200034, 200020


def _save(model, path: Path, sharded: bool) -> Path:
    path = Path(path)
    model.save_pretrained(path, max_shard_size=SHARD_SIZE if sharded else "1GB")
    return path


def _build(path: Path, config_cls: str, model_cls: str, *, sharded: bool = True,
           post: Callable | None = None, **config) -> Path:
    """Seeded init, non-trivial norms/biases, optional ``post(model)``, then save_pretrained."""
    import transformers

    torch.manual_seed(SEED)
    config.setdefault("initializer_range", INIT_RANGE)
    cfg = getattr(transformers, config_cls)(**config)
    model = getattr(transformers, model_cls)(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        if post is not None:
            post(model, gen)
    return _save(model, path, sharded)


# ---- Llama ---------------------------------------------------------------------------------
def _llama(path, sharded=True, **kw) -> Path:
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, hidden_act="silu",
                rms_norm_eps=1e-5, attention_bias=False, mlp_bias=False, pretraining_tp=1,
                tie_word_embeddings=False)
    return _build(path, "LlamaConfig", "LlamaForCausalLM", sharded=sharded, **{**base, **kw})


def build_llama2(path) -> Path:
    """Llama-2-7b: MHA (32/32 heads -> 4/4), theta 1e4, no scaling, bos 1 / eos 2, 2 shards."""
    return _llama(path, num_key_value_heads=4, max_position_embeddings=256,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                  bos_token_id=1, eos_token_id=2)


def build_llama3(path) -> Path:
    """Meta-Llama-3-8B: GQA, theta 5e5, NO rope scaling, eos 128001, 4 shards."""
    return _llama(path, max_position_embeddings=256,
                  rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                  bos_token_id=LLAMA3_BOS, eos_token_id=LLAMA3_EOS[0])


def _llama3_scaling(factor: float) -> dict:
    return {"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}  # 8192 -> 64: prompts + 32 tokens cross it


def build_llama31(path) -> Path:
    """Llama-3.1-8B-Instruct: llama3 rope (factor 8), eos list of 3, 4 shards; t5 spelling."""
    return _llama(path, max_position_embeddings=512, rope_parameters=_llama3_scaling(8.0),
                  bos_token_id=LLAMA3_BOS, eos_token_id=list(LLAMA3_EOS))


def build_llama31_t4(path) -> Path:
    """``llama31``'s tensors with config.json in the transformers-4 (Hub) spelling."""
    return to_t4_spelling(build_llama31(path))


def build_llama32(path) -> Path:
    """Llama-3.2-1B: tied embeddings, llama3 rope factor 32, ONE model.safetensors."""
    return _llama(path, sharded=False, max_position_embeddings=512,
                  rope_parameters=_llama3_scaling(32.0), tie_word_embeddings=True,
                  bos_token_id=LLAMA3_BOS, eos_token_id=LLAMA3_EOS[0])


# ---- Mistral -------------------------------------------------------------------------------
def _mistral(path, **kw) -> Path:
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, hidden_act="silu",
                rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2)
    return _build(path, "MistralConfig", "MistralForCausalLM", **{**base, **kw})


def build_mistral_v01(path) -> Path:
    """Mistral-7B-v0.1: sliding_window 4096 -> 16 (every prompt + 32 tokens exceeds it)."""
    return _mistral(path, sliding_window=16,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def build_mistral_v03(path) -> Path:
    """Mistral-7B-v0.3: sliding_window null, theta 1e6, 3 shards."""
    return _mistral(path, sliding_window=None,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


# ---- Qwen ----------------------------------------------------------------------------------
def _qwen2(path, **kw) -> Path:
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, hidden_act="silu",
                rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False,
                use_sliding_window=False, sliding_window=256, max_window_layers=2,
                bos_token_id=QWEN_BOS, eos_token_id=QWEN_EOS)
    return _build(path, "Qwen2Config", "Qwen2ForCausalLM", **{**base, **kw})


def build_qwen25(path) -> Path:
    """Qwen2.5-7B-Instruct: q/k/v biases, untied, theta 1e6, 4 shards."""
    return _qwen2(path, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def build_qwen25_yarn(path) -> Path:
    """Qwen2.5 with the README's YaRN block: factor 4, original_max_position_embeddings 64."""
    return _qwen2(path, rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0,
                                         "factor": 4.0,
                                         "original_max_position_embeddings": 64})


def build_qwen3(path) -> Path:
    """Qwen3-8B: q_norm/k_norm per head, head_dim 32 != 64 / 4, no biases, 5 shards."""
    return _build(path, "Qwen3Config", "Qwen3ForCausalLM", vocab_size=VOCAB, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, hidden_act="silu", rms_norm_eps=1e-6,
                  max_position_embeddings=256, tie_word_embeddings=False, attention_bias=False,
                  use_sliding_window=False, sliding_window=None, max_window_layers=2,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                  bos_token_id=QWEN_BOS, eos_token_id=QWEN_EOS)


def build_qwen3_moe(path) -> Path:
    """Qwen3-30B-A3B: 8 experts top-2 (128 / 8), moe_intermediate 32, norm_topk_prob, head_dim
    32; 3 layers with mlp_only_layers [0] (layer 0 a dense MLP, 1-2 sparse), 16 shards."""
    return _build(path, "Qwen3MoeConfig", "Qwen3MoeForCausalLM", vocab_size=VOCAB,
                  hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, hidden_act="silu", rms_norm_eps=1e-6,
                  max_position_embeddings=256, tie_word_embeddings=False, attention_bias=False,
                  num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                  decoder_sparse_step=1, mlp_only_layers=[0], use_sliding_window=False,
                  sliding_window=None, max_window_layers=3, router_aux_loss_coef=0.001,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                  bos_token_id=QWEN_BOS, eos_token_id=QWEN_EOS)


def _routing_bias(model, gen) -> None:
    """MiniMax-M2's ``e_score_correction_bias`` is zeros at init: make it matter (it is added to
    the sigmoid scores, ~0.5 +- 0.1, for the top-k choice only)."""
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(0.2 * torch.randn(buf.shape, generator=gen))


def build_minimax_m2(path) -> Path:
    """MiniMax-M2: partial rotary (rotary_dim 64 of head_dim 128 -> 16 of 32), q/k RMSNorm over
    the whole projection (qk_norm_type per_layer), sigmoid router + e_score_correction_bias,
    8 local experts top-2, ``block_sparse_moe.experts.{e}.w1/w2/w3`` tensors, sharded."""
    return _build(path, "MiniMaxM2Config", "MiniMaxM2ForCausalLM", post=_routing_bias,
                  vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, hidden_act="silu",
                  rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False,
                  num_local_experts=8, num_experts_per_tok=2, rotary_dim=16,
                  rope_theta=5000000.0, scoring_func="sigmoid", use_routing_bias=True,
                  use_qk_norm=True, qk_norm_type="per_layer", shared_intermediate_size=0,
                  attn_type_list=[1, 1], router_jitter_noise=0.0,
                  bos_token_id=MINIMAX_BOS, eos_token_id=MINIMAX_EOS)


# ---- MiMo: the target and its MTP layer in ONE folder ---------------------------------------
MTP_PREFIX = "model.mtp_layers.0."


def build_mimo(path, *, post: Callable | None = None) -> Path:
    """MiMo-7B-RL: ONE folder holding a Qwen2 target (q/k/v biases; built by transformers as
    ``Qwen2ForCausalLM``, theta 640000) and its MTP layer ``model.mtp_layers.0.*`` (a
    transformers ``Qwen2DecoderLayer``'s tensors + ``token_layernorm``, ``hidden_layernorm``,
    ``input_proj [H, 2H]``, ``final_layernorm``), the MTP tensors in an extra last shard
    (``model-0000n-of-0000n``, index updated). config.json as published: transformers-4
    spelling, ``architectures: ["MiMoForCausalLM"]``, ``model_type: "mimo"``,
    ``num_nextn_predict_layers: 1``, ``auto_map``. ``post(model, gen)`` edits the target."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    import transformers

    path = _qwen2(path, post=post,
                  rope_parameters={"rope_type": "default", "rope_theta": 640000.0})
    hf = transformers.Qwen2Config(**read_config(path))
    config = t4_spelling(read_config(path))
    config.update(architectures=["MiMoForCausalLM"], model_type="mimo",
                  num_nextn_predict_layers=1,
                  auto_map={"AutoConfig": "configuration_mimo.MiMoConfig",
                            "AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM"})
    write_config(path, config)
    torch.manual_seed(SEED + 2)
    layer = Qwen2DecoderLayer(hf, 0)
    gen = torch.Generator().manual_seed(SEED + 3)
    h = hf.hidden_size
    mtp = {}
    for name, p in layer.state_dict().items():
        if name.endswith("norm.weight"):
            p = 1 + 0.1 * torch.randn(p.shape, generator=gen)
        elif name.endswith(".bias"):
            p = 0.1 * torch.randn(p.shape, generator=gen)
        else:
            p = INIT_RANGE * torch.randn(p.shape, generator=gen)
        mtp[MTP_PREFIX + name] = p
    for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        mtp[f"{MTP_PREFIX}{norm}.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    mtp[MTP_PREFIX + "input_proj.weight"] = INIT_RANGE * torch.randn(h, 2 * h, generator=gen)
    add_shard(path, mtp)
    return path


def add_shard(path, tensors: dict[str, torch.Tensor]) -> None:
    """Append ``tensors`` as a new last shard of a sharded folder (shards renamed
    ``-of-0000{n+1}``, the index's weight_map and total_size updated)."""
    from safetensors.torch import save_file

    path = Path(path)
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    old = shard_files(path)
    n = len(old) + 1
    renamed = {name: f"model-{i:05d}-of-{n:05d}.safetensors" for i, name in enumerate(old, 1)}
    for name, new in renamed.items():
        (path / name).rename(path / new)
    last = f"model-{n:05d}-of-{n:05d}.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / last),
              metadata={"format": "pt"})
    index["weight_map"] = {k: renamed[v] for k, v in index["weight_map"].items()}
    index["weight_map"].update(dict.fromkeys(tensors, last))
    index.setdefault("metadata", {})["total_size"] = sum(
        t.numel() * t.element_size() for f in shard_files(path) for t in _load(path / f).values())
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def set_tensors(path, tensors: dict[str, torch.Tensor | None]) -> None:
    """Replace (or, for None, remove) tensors of a sharded folder in the shards holding them."""
    from safetensors.torch import save_file

    path = Path(path)
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    for file in sorted({index["weight_map"][k] for k in tensors}):
        held = _load(path / file)
        for k, v in tensors.items():
            if index["weight_map"][k] == file:
                if v is None:
                    del held[k]
                else:
                    held[k] = v.contiguous()
        save_file(held, str(path / file), metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items()
                           if k not in tensors or tensors[k] is not None}
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _load(file) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(file))


# ---- "cycle" targets: the next token is a fixed function of the current one -----------------
CYCLE = [7 + 13 * k for k in range(32)]  # the tokens a cycle target emits, in their order
CYCLE_CONST = 1.0  # embedding dim 0 (the same for every token); dims 1, 2: the angle


def cycle_angle(token: int) -> int:
    """The angle index (of 2 pi / len(CYCLE)) a cycle target gives ``token``."""
    return CYCLE.index(token) if token in CYCLE else token % len(CYCLE)


def cycle_next(token: int) -> int:
    """A cycle target's greedy next token after ``token``: CYCLE[angle + 1]."""
    return CYCLE[(cycle_angle(token) + 1) % len(CYCLE)]


def cycle_row(k: int, hidden: int) -> torch.Tensor:
    """The lm_head row of CYCLE[k]: it scores a hidden of angle index k - 1 highest."""
    psi = 2 * torch.pi / len(CYCLE)
    row = torch.zeros(hidden, dtype=torch.float64)
    row[1], row[2] = torch.cos(torch.tensor((k - 1) * psi)), torch.sin(torch.tensor((k - 1) * psi))
    return row


def cycle_weights(model, gen) -> None:
    """Make a decoder a cycle target (``post`` of a builder): every layer adds nothing
    (o_proj and down_proj zero) so the final hidden is ``norm(embed(token))`` (norm weight 1);
    ``embed(t) = [CYCLE_CONST, cos(a psi), sin(a psi), 0, ...]`` for t's angle index a; the
    lm_head row of CYCLE[k] is ``cycle_row(k)``, every other row ``[-4, 0, ...]``. The argmax is
    CYCLE[a + 1] by a margin of 1 - cos(psi) (~1.9% of the top logit), whatever the layers'
    other weights: ``cycle_next``."""
    psi = 2 * torch.pi / len(CYCLE)
    emb = model.model.embed_tokens.weight
    vocab, h = emb.shape
    a = torch.tensor([cycle_angle(t) for t in range(vocab)], dtype=torch.float64) * psi
    emb.zero_()
    emb[:, 0], emb[:, 1], emb[:, 2] = CYCLE_CONST, torch.cos(a), torch.sin(a)
    head = model.lm_head.weight
    head.zero_()
    head[:, 0] = -4.0
    for k, t in enumerate(CYCLE):
        head[t] = cycle_row(k, h)
    model.model.norm.weight.fill_(1.0)
    for name, p in model.model.layers.named_parameters():  # dense, MoE and shared experts
        if name.endswith("o_proj.weight") or "down_proj" in name:
            p.zero_()


def build_llama31_cycle(path) -> Path:
    """``llama31`` (transformers Llama, llama3 rope, eos list) made a cycle target."""
    return _llama(path, max_position_embeddings=512, rope_parameters=_llama3_scaling(8.0),
                  bos_token_id=LLAMA3_BOS, eos_token_id=list(LLAMA3_EOS), post=cycle_weights)


def build_mimo_cycle(path) -> Path:
    """``mimo`` whose target is a cycle target (its MTP layer random)."""
    return build_mimo(path, post=cycle_weights)


# ---- Gemma-2, Gemma-3, Phi-3: config.json in the Hub's (transformers-4) spelling -------------
GEMMA_WINDOW = 8  # sliding_window of the Gemma models (4096 / 512 on the Hub)
PHI3_ORIGINAL = 32  # Phi-3's original_max_position_embeddings (4096 on the Hub)


def _gemma(path, config_cls: str, model_cls: str, sharded: bool, **kw) -> Path:
    """A tiny Gemma (hidden 64, head_dim 16, query_pre_attn_scalar 24 != head_dim, window
    GEMMA_WINDOW, tied), its config.json rewritten as the Hub's: ``rope_theta``, no
    ``layer_types`` (the default pattern rebuilds them), ``hidden_act`` next to
    ``hidden_activation``, ``cache_implementation: hybrid``."""
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, hidden_activation="gelu_pytorch_tanh",
                max_position_embeddings=256, query_pre_attn_scalar=24,
                sliding_window=GEMMA_WINDOW, tie_word_embeddings=True, pad_token_id=0,
                eos_token_id=1, bos_token_id=2)
    path = _build(path, config_cls, model_cls, sharded=sharded, **{**base, **kw})
    config = read_config(path)
    for key in ("layer_types", "_sliding_window_pattern"):
        config.pop(key, None)
    rope = config.pop("rope_parameters")
    if "full_attention" in rope:  # Gemma-3's, nested by layer type
        config["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
    config = t4_spelling({**config, "rope_parameters": rope})
    config.update(hidden_act="gelu_pytorch_tanh", cache_implementation="hybrid")
    write_config(path, config)
    return path


def build_gemma2(path) -> Path:
    """gemma-2-9b: attention and final logit soft caps (10 and 5 here, 50 and 30 on the Hub:
    small enough to bite at these scales), 3 layers sliding / full / sliding (transformers'
    default alternation), ``sliding_window_size`` as gemma-2-9b writes it, sharded."""
    path = _gemma(path, "Gemma2Config", "Gemma2ForCausalLM", True, num_hidden_layers=3,
                  attn_logit_softcapping=10.0, final_logit_softcapping=5.0,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    write_config(path, {**read_config(path), "sliding_window_size": GEMMA_WINDOW})
    return path


def build_gemma3(path) -> Path:
    """gemma-3 text (1b's layout: one model.safetensors): q/k norms, no soft caps, 4 layers
    local / local / global / local (``sliding_window_pattern`` 3 here, 6 on the Hub), the
    local layers' ``rope_local_base_freq`` 1e4, the global ones' ``rope_theta`` 1e6 with
    4b's linear ``rope_scaling``."""
    return _gemma(path, "Gemma3TextConfig", "Gemma3ForCausalLM", False, num_hidden_layers=4,
                  sliding_window_pattern=3, rope_local_base_freq=10000.0,
                  rope_theta=1000000.0, rope_scaling={"rope_type": "linear", "factor": 8.0})


def build_phi3(path) -> Path:
    """Phi-3.5-mini: fused ``qkv_proj`` / ``gate_up_proj``, GQA (4/2 heads), ``longrope``
    (``rope_scaling.type``, ``short_factor`` and ``long_factor``) extended from
    ``original_max_position_embeddings`` PHI3_ORIGINAL to 256, ``sliding_window`` 262144 (past
    every position), sharded; config.json in the Hub spelling."""
    half = 64 // 4 // 2

    def scaling():  # a fresh dict each time: transformers fills in the one it is given
        return {"type": "longrope", "short_factor": [1.0 + 0.05 * j for j in range(half)],
                "long_factor": [1.0 + 1.5 * j for j in range(half)]}
    path = _build(path, "Phi3Config", "Phi3ForCausalLM", vocab_size=VOCAB, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256,
                  original_max_position_embeddings=PHI3_ORIGINAL, rms_norm_eps=1e-5,
                  rope_theta=10000.0, rope_scaling=scaling(), sliding_window=262144,
                  bos_token_id=1, eos_token_id=500, pad_token_id=500)
    config = t4_spelling({k: v for k, v in read_config(path).items() if k != "rope_parameters"})
    write_config(path, {**config, "rope_theta": 10000.0, "rope_scaling": scaling()})
    return path


# ---- families specdec must refuse -----------------------------------------------------------
def build_starcoder2(path) -> Path:
    """starcoder2-3b: LayerNorm with biases, a GELU ``c_fc``/``c_proj`` MLP, tied."""
    return _build(path, "Starcoder2Config", "Starcoder2ForCausalLM", sharded=False,
                  vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=0, eos_token_id=0)


BUILDERS: dict[str, Callable[[Path], Path]] = {
    "llama2": build_llama2,
    "llama3": build_llama3,
    "llama31": build_llama31,
    "llama31_t4": build_llama31_t4,
    "llama32": build_llama32,
    "mistral_v01": build_mistral_v01,
    "mistral_v03": build_mistral_v03,
    "qwen25": build_qwen25,
    "qwen25_yarn": build_qwen25_yarn,
    "qwen3": build_qwen3,
    "qwen3_moe": build_qwen3_moe,
    "minimax_m2": build_minimax_m2,
    "mimo": build_mimo,
    "gemma2": build_gemma2,
    "gemma3": build_gemma3,
    "phi3": build_phi3,
    "starcoder2": build_starcoder2,
}
# the published checkpoint is sharded (7B and up); Llama-3.2-1B is one model.safetensors
SHARDED = {"llama2", "llama3", "llama31", "llama31_t4", "mistral_v01", "mistral_v03", "qwen25",
           "qwen25_yarn", "qwen3", "qwen3_moe", "minimax_m2", "mimo", "gemma2", "phi3"}
ARCHITECTURES = {"starcoder2": "Starcoder2ForCausalLM"}  # of the refused families


# ---- config.json rewrites ------------------------------------------------------------------
def read_config(path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def write_config(path, config: dict) -> None:
    (Path(path) / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def t4_spelling(config: dict) -> dict:
    """A transformers-5 config dict in the transformers-4 / Hub spelling (see module doc)."""
    d = dict(config)
    rope = dict(d.pop("rope_parameters", None) or {})
    if rope:
        d["rope_theta"] = rope.pop("rope_theta")
        partial = rope.pop("partial_rotary_factor", None)
        if partial is not None and "rotary_dim" not in d:
            d["partial_rotary_factor"] = partial
        kind = rope.pop("rope_type", "default")
        if kind == "default":
            d["rope_scaling"] = None
        elif kind == "yarn":  # Qwen2.5's README block: {"factor", "original_max_...", "type"}
            d["rope_scaling"] = {**rope, "type": "yarn"}
        else:
            d["rope_scaling"] = {**rope, "rope_type": kind}
    if "dtype" in d:
        d["torch_dtype"] = d.pop("dtype")
    if d.get("model_type") == "qwen3_moe" and "num_local_experts" in d:
        d["num_experts"] = d.pop("num_local_experts")
    if set(d.get("layer_types") or ["x"]) == {"full_attention"}:
        del d["layer_types"]  # Qwen2.5 / Qwen3 Hub configs have none
    if d.get("model_type") == "qwen2" and d.get("use_sliding_window") is False:
        # Qwen2.5's Hub configs carry a window (131072) that use_sliding_window=false turns
        # off; transformers 5 writes null. A small one here: honoring it would change the math.
        d["sliding_window"] = 16
    d["transformers_version"] = "4.51.0"
    return d


def to_t4_spelling(path) -> Path:
    write_config(path, t4_spelling(read_config(path)))
    return Path(path)


def build(name: str, path) -> Path:
    """``BUILDERS[name]``, or for ``<family>_t4`` without a builder of its own, ``<family>``
    rewritten into the transformers-4 spelling."""
    if name in BUILDERS:
        return BUILDERS[name](path)
    if name.endswith("_t4") and name[:-3] in BUILDERS:
        return to_t4_spelling(BUILDERS[name[:-3]](path))
    raise KeyError(f"no builder for {name!r}")


def copy_folder(src, dst) -> Path:
    """A copy of a model folder (to edit its config.json)."""
    shutil.copytree(src, dst)
    return Path(dst)


def shard_files(path) -> list[str]:
    return sorted(p.name for p in Path(path).glob("model-*-of-*.safetensors"))


def tensor_names(path) -> list[str]:
    """Every tensor name the folder's safetensors files hold."""
    from safetensors import safe_open

    names = []
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            names += list(f.keys())
    return sorted(names)


# ---- the transformers reference -------------------------------------------------------------
def reference_cache(model_of, prompts: list[list[int]], max_new: int, logit_prompt: list[int],
                    extra=lambda model: {}):
    """key -> {"tokens": transformers' greedy continuations of ``prompts``, "logits": its last
    logits for ``logit_prompt``, **extra(model)} of the model ``model_of(key)``, computed once
    per key (a module's reference fixture returns this)."""
    cache = {}

    def get(key) -> dict:
        if key not in cache:
            model = model_of(key)
            cache[key] = {"tokens": hf_greedy(None, prompts, max_new, model=model),
                          "logits": hf_last_logits(None, logit_prompt, model=model),
                          **extra(model)}
        return cache[key]
    return get


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager").eval()


def hf_greedy(path, prompts: list[list[int]], max_new_tokens: int = 32, *, model=None,
              honor_eos: bool = False) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (one at a time: no padding).

    EOS is ignored (exactly ``max_new_tokens`` each) by clearing ``eos_token_id`` in the
    model's own generation config: transformers 5 fills every None of a passed
    ``GenerationConfig`` from ``model.generation_config`` (i.e. generation_config.json), so
    ``GenerationConfig(eos_token_id=None)`` alone still stops at eos. ``min_new_tokens`` would
    not do either: it masks the eos logits, changing the argmax whenever an eos id is the
    greedy token. ``honor_eos``: the folder's generation_config as saved (eos ids stop).
    """
    import copy

    from transformers import GenerationConfig

    model = model if model is not None else hf_model(path)
    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    if not honor_eos:
        model.generation_config.eos_token_id = None
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
    out = []
    try:
        with torch.inference_mode():
            for p in prompts:
                ids = torch.tensor([p])
                seq = model.generate(ids, attention_mask=torch.ones_like(ids),
                                     generation_config=gen)
                out.append(seq[0, len(p):].tolist())
    finally:
        model.generation_config = saved
    return out


def hf_last_logits(path, prompt: list[int], *, model=None) -> torch.Tensor:
    """float32 logits [vocab] of the last position of ``prompt`` (one dense forward)."""
    model = model if model is not None else hf_model(path)
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0, -1].float()
