"""Tiny random Qwen3.5 (text) and Qwen3-Next models built and saved by transformers (the
reference specdec must match), with the MTP layer ``mtp.*`` of the published checkpoint added.

``build_qwen3_5(path)``: hidden 64, 3 layers ``[linear, full, linear]`` (``layer_types``),
gated attention 4 heads / 2 kv heads of 16 (partial rotary 0.25 -> 4 channels), gated
DeltaNet 2 key heads / 4 value heads of 16 (grouped), conv kernel 4; ``A_log`` and
``dt_bias`` random; sharded. ``_interval``: no ``layer_types`` (4 layers,
``full_attention_interval`` 2). ``_mtp``: plus ``mtp.{fc [H, 2H], pre_fc_norm_embedding,
pre_fc_norm_hidden, norm, layers.0.*}`` (a full-attention decoder layer) in an extra shard,
``mtp_num_hidden_layers`` 1 in the config.
"""

from __future__ import annotations

from pathlib import Path

import hf_models as H
import torch

QWEN3_5 = {"vocab_size": H.VOCAB, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16,
           "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
           "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "tie_word_embeddings": False,
           "layer_types": ["linear_attention", "full_attention", "linear_attention"],
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                               "partial_rotary_factor": 0.25},
           "bos_token_id": H.QWEN_BOS, "eos_token_id": H.QWEN_EOS}


def _deltanet_params(model, gen) -> None:
    """``dt_bias`` is ones at init: make it matter; ``A_log`` stays transformers' random."""
    for name, p in model.named_parameters():
        if name.endswith("dt_bias"):
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))


def build_qwen3_5(path, post=None, **overrides) -> Path:
    def edit(model, gen):
        _deltanet_params(model, gen)
        if post is not None:
            post(model, gen)
    return H._build(path, "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", post=edit,
                    **{**QWEN3_5, **overrides})


def build_qwen3_5_interval(path) -> Path:
    path = build_qwen3_5(path, num_hidden_layers=4, layer_types=None, full_attention_interval=2)
    cfg = H.read_config(path)
    assert cfg.pop("layer_types") == ["linear_attention", "full_attention"] * 2
    H.write_config(path, {**cfg, "full_attention_interval": 2})
    return path


def saved_shapes(path, prefix: str) -> dict[str, list[int]]:
    """Name -> shape of every tensor under ``prefix`` in the folder's safetensors files."""
    from safetensors import safe_open

    shapes = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            shapes.update({k: f.get_slice(k).get_shape() for k in f.keys()
                           if k.startswith(prefix)})
    return shapes


def mtp_tensors(path) -> dict[str, torch.Tensor]:
    """Seeded random ``mtp.*`` tensors for the target at ``path``: its full-attention layer's
    names and shapes under ``mtp.layers.0.`` plus fc, the two pre-fc norms and the final norm
    (zero-centred norms: ``N(0, 0.1)``)."""
    cfg = H.read_config(path)
    full = cfg["layer_types"].index("full_attention")
    src = f"model.layers.{full}."
    shapes = saved_shapes(path, src)
    gen = torch.Generator().manual_seed(H.SEED + 11)
    h = cfg["hidden_size"]
    out = {}
    for name, shape in sorted(shapes.items()):
        new = "mtp.layers.0." + name[len(src):]
        scale = 0.1 if name.endswith("norm.weight") else H.INIT_RANGE
        out[new] = scale * torch.randn(shape, generator=gen)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{norm}.weight"] = 0.1 * torch.randn(h, generator=gen)
    out["mtp.fc.weight"] = H.INIT_RANGE * torch.randn(h, 2 * h, generator=gen)
    return out


def build_qwen3_5_mtp(path) -> Path:
    path = build_qwen3_5(path)
    H.add_shard(path, mtp_tensors(path))
    H.write_config(path, {**H.read_config(path), "mtp_num_hidden_layers": 1})
    return path


def _router(model, gen) -> None:
    """Random router weights (transformers may leave them zero: ties in the top-k)."""
    _deltanet_params(model, gen)
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            p.copy_(H.INIT_RANGE * torch.randn(p.shape, generator=gen))


QWEN3_NEXT_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 48, "norm_topk_prob": True,
                  "decoder_sparse_step": 1, "mlp_only_layers": [0]}


def build_qwen3_next(path, **overrides) -> Path:
    """Qwen3-Next-80B-A3B shrunk: Qwen3.5's shapes with the fused ``in_proj_qkvz`` /
    ``in_proj_ba`` and, on layers 1-2 (``mlp_only_layers`` [0]), a MoE of 4 experts top-2
    (moe_intermediate 32, ``norm_topk_prob``) plus a shared expert of 48 behind a sigmoid
    gate."""
    return H._build(path, "Qwen3NextConfig", "Qwen3NextForCausalLM", post=_router,
                    **{**QWEN3_5, **QWEN3_NEXT_MOE, **overrides})


BUILDERS = {"qwen3_5": build_qwen3_5, "qwen3_5_interval": build_qwen3_5_interval,
            "qwen3_5_mtp": build_qwen3_5_mtp, "qwen3_next": build_qwen3_next}


# ---- a head that is sometimes right: an MTP layer predicting a near-cycle target -------------
def _near_cycle(scale: float):
    """``post`` making a near-cycle target: ``hf_models.cycle_weights``' embedding and lm_head
    (the next token is ``cycle_next`` of the current one when the layers add nothing), final
    norm weight 0 (scale 1), and every layer's output projections (``out_proj``, ``o_proj``,
    ``down_proj``) scaled by ``scale``: the layers -- the DeltaNet state included -- move the
    argmax off the cycle at some positions."""
    def post(model, gen):
        H.cycle_weights(model, gen)
        model.model.norm.weight.zero_()
        for name, p in model.model.layers.named_parameters():
            if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
                p.copy_(scale * H.INIT_RANGE * torch.randn(p.shape, generator=gen))
    return post


NEAR_CYCLE_SCALE = 0.005  # about half the positions leave the cycle


def build_qwen3_5_mtp_cycle(path) -> Path:
    """A near-cycle target (``_near_cycle``) whose MTP layer predicts the exact cycle: ``fc =
    [I, 0]`` keeps the normed embedding of the next token, its layer adds nothing (o_proj and
    down_proj zero), its norms are 0 (scale 1) and the lm_head is the target's, so a draft is
    ``cycle_next`` of its input token -- right where the target stays on the cycle."""
    path = build_qwen3_5(path, post=_near_cycle(NEAR_CYCLE_SCALE))
    t = mtp_tensors(path)
    h = H.read_config(path)["hidden_size"]
    for name in t:
        if name.endswith(("o_proj.weight", "down_proj.weight", "norm.weight")):
            t[name] = torch.zeros_like(t[name])
    t["mtp.fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    H.add_shard(path, t)
    H.write_config(path, {**H.read_config(path), "mtp_num_hidden_layers": 1})
    return path


BUILDERS["qwen3_5_mtp_cycle"] = build_qwen3_5_mtp_cycle


def build_qwen3_next_mtp(path) -> Path:
    """``qwen3_next`` with MoE on every layer (``mlp_only_layers`` []) and its MTP layer
    ``mtp.*``, whose MLP is then a MoE too (vLLM's rule at layer index 0)."""
    path = build_qwen3_next(path, mlp_only_layers=[])
    H.add_shard(path, mtp_tensors(path))
    return path


BUILDERS["qwen3_next_mtp"] = build_qwen3_next_mtp


def hf_mtp_reference(path, input_ids: torch.Tensor, hidden: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """Draft logits [T, V] of the MTP layer of ``path`` for one sequence, assembled from
    transformers' own decoder layer (``Qwen3_5DecoderLayer`` / ``Qwen3NextDecoderLayer``, a
    full-attention one: gated attention, partial rotary, zero-centred norms; Qwen3-Next's MoE
    with its shared expert), its RMSNorm and rotary, and the published MTP math:
    ``lm_head(norm(layer(fc([norm_e(emb), norm_h(hidden)]))))``, a causal mask.
    input_ids [T], hidden [T, H], positions [T]."""
    import transformers
    from safetensors import safe_open
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_next import modeling_qwen3_next

    cfg = transformers.AutoConfig.from_pretrained(str(path))
    next_ = cfg.model_type == "qwen3_next"
    M = modeling_qwen3_next if next_ else modeling_qwen3_5
    prefix_ = "Qwen3Next" if next_ else "Qwen3_5"
    cfg._attn_implementation = "eager"
    t = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            names = f.keys()
            t.update({k: f.get_tensor(k) for k in names
                      if k.startswith("mtp.") or k in ("model.embed_tokens.weight",
                                                        "lm_head.weight")})
    layer = getattr(M, f"{prefix_}DecoderLayer")(
        cfg, cfg.layer_types.index("full_attention")).eval()
    prefix = "mtp.layers.0."
    state = {k[len(prefix):]: v for k, v in t.items() if k.startswith(prefix)}
    experts = sorted({int(k.split(".")[2]) for k in state if k.startswith("mlp.experts.")})
    if experts:  # transformers keeps the experts as [E, ...] tensors
        state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat(
            [state.pop(f"mlp.experts.{e}.gate_proj.weight"),
             state.pop(f"mlp.experts.{e}.up_proj.weight")]) for e in experts])
        state["mlp.experts.down_proj"] = torch.stack(
            [state.pop(f"mlp.experts.{e}.down_proj.weight") for e in experts])
    layer.load_state_dict(state, strict=True)

    def norm(name):
        n = getattr(M, f"{prefix_}RMSNorm")(cfg.hidden_size, cfg.rms_norm_eps)
        n.weight.data.copy_(t[f"mtp.{name}.weight"])
        return n

    with torch.no_grad():
        emb = t["model.embed_tokens.weight"][input_ids]
        x = torch.cat([norm("pre_fc_norm_embedding")(emb), norm("pre_fc_norm_hidden")(hidden)],
                      -1) @ t["mtp.fc.weight"].T
        x = x[None]
        rotary = getattr(M, "Qwen3NextRotaryEmbedding" if next_ else "Qwen3_5TextRotaryEmbedding")
        rope = rotary(cfg)(x, positions[None])
        n = x.shape[1]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = layer(x, position_embeddings=rope, attention_mask=mask,
                    position_ids=positions[None])
        out = out[0] if isinstance(out, tuple) else out
        return (norm("norm")(out[0]) @ t["lm_head.weight"].T).float()


# ---- the published (multimodal) layout -----------------------------------------------------------
VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
          "out_hidden_size": 64, "patch_size": 4, "spatial_merge_size": 2,
          "temporal_patch_size": 2, "num_position_embeddings": 16}


def build_qwen3_5_vl(path) -> Path:
    """Qwen3.5 as published: ``Qwen3_5ForConditionalGeneration`` (built by transformers) with
    ``QWEN3_5`` as its ``text_config`` -- multimodal rope keys ``mrope_section`` [1, 1, 0] and
    ``mrope_interleaved`` in it, as the published configs have them -- a one-block vision
    tower (``model.visual.*``), the text model under ``model.language_model.*``, and the MTP
    layer ``mtp.*`` in an extra shard."""
    text = {**QWEN3_5, "rope_parameters": {**QWEN3_5["rope_parameters"],
                                           "mrope_section": [1, 1, 0],
                                           "mrope_interleaved": True}}
    path = H._build(path, "Qwen3_5Config", "Qwen3_5ForConditionalGeneration",
                    post=_deltanet_params, text_config=text, vision_config=VISION)
    cfg = H.read_config(path)["text_config"]
    full = cfg["layer_types"].index("full_attention")
    gen = torch.Generator().manual_seed(H.SEED + 13)
    src = f"model.language_model.layers.{full}."
    shapes = saved_shapes(path, src)
    mtp = {"mtp.layers.0." + k[len(src):]: (0.1 if k.endswith("norm.weight") else H.INIT_RANGE)
           * torch.randn(shape, generator=gen) for k, shape in sorted(shapes.items())}
    h = cfg["hidden_size"]
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = 0.1 * torch.randn(h, generator=gen)
    mtp["mtp.fc.weight"] = H.INIT_RANGE * torch.randn(h, 2 * h, generator=gen)
    H.add_shard(path, mtp)
    return path


def hf_vl_model(path):
    """transformers' multimodal model of a ``build_qwen3_5_vl`` folder (the reference)."""
    import transformers
    return transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager").eval()


BUILDERS["qwen3_5_vl"] = build_qwen3_5_vl
