"""Tiny random DeepSeek-V3 models built and saved by transformers (the reference specdec must
match), in the layout of the published checkpoint.

``build_deepseek_v3(path)``: hidden 64, 3 layers (``first_k_dense_replace`` 1: layer 0 a
dense MLP, layers 1-2 MoE), 4 heads, MLA with ``q_lora_rank`` 48, ``kv_lora_rank`` 32, rope
dim 16, nope 32, ``v_head_dim`` 24 (!= nope, so a mix-up shows), YaRN factor 4 over
``original_max_position_embeddings`` 64 with ``mscale`` 1.0 and ``mscale_all_dim`` 0.8 (unequal,
so both the cos/sin factor and the softmax factor differ from 1), 4 routed experts in 2
groups (``topk_group`` 1, top-2), 1 shared expert, ``routed_scaling_factor`` 2.5, routing bias
``N(0, 0.2)``; sharded. ``save_pretrained`` omits ``topk_method``/``scoring_func``: they are
added to config.json, as the published one has them. ``_noq``: ``q_lora_rank`` null
(``q_proj``); ``_t4``: config.json in the Hub spelling (``rope_scaling`` with ``"type":
"yarn"``, ``rope_theta``, ``torch_dtype``).
"""

from __future__ import annotations

from pathlib import Path

import hf_models as H
import torch

DEEPSEEK = dict(vocab_size=H.VOCAB, hidden_size=64, intermediate_size=96,
                moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
                routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
                v_head_dim=24, qk_nope_head_dim=32, n_group=2, topk_group=1,
                num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
                max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_interleave=True, bos_token_id=0, eos_token_id=1,
                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 64, "mscale": 1.0,
                                 "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1})


def build_deepseek_v3(path, post=H._routing_bias, **overrides) -> Path:
    path = H._build(path, "DeepseekV3Config", "DeepseekV3ForCausalLM", post=post,
                    **{**DEEPSEEK, **overrides})
    H.write_config(path, {**H.read_config(path), "topk_method": "noaux_tc",
                          "scoring_func": "sigmoid"})
    return path


def build_deepseek_v3_noq(path) -> Path:
    return build_deepseek_v3(path, q_lora_rank=None)


def build_deepseek_v3_t4(path) -> Path:
    return H.to_t4_spelling(build_deepseek_v3(path))


BUILDERS = {"deepseek_v3": build_deepseek_v3, "deepseek_v3_noq": build_deepseek_v3_noq,
            "deepseek_v3_t4": build_deepseek_v3_t4}


# ---- the MTP layer: model.layers.L.* in the target folder --------------------------------------
def mtp_tensors(path, *, copies: bool = True) -> dict:
    """Seeded random tensors of the MTP layer for the target at ``path`` (DeepSeek-V3's layout,
    GLM-4.5's too), in the published names ``model.layers.L.*`` (L = num_hidden_layers): a
    decoder layer's (the last target layer's names, e.g. MLA + MoE, per-expert
    ``mlp.experts.E.{gate,up,down}_proj``, ``mlp.gate.{weight, e_score_correction_bias}``,
    ``mlp.shared_experts.*``) + ``enorm``, ``hnorm``, ``eh_proj [H, 2H]``, ``shared_head.norm``;
    with ``copies`` also ``embed_tokens`` and ``shared_head.head`` (the target's, as published)."""
    from safetensors import safe_open

    cfg = H.read_config(path)
    h, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    prefix = f"model.layers.{L}."
    names = H.tensor_names(path)
    target = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            target.update({k: f.get_tensor(k) for k in f.keys()})
    gen = torch.Generator().manual_seed(H.SEED + 7)
    out = {}
    for name in names:  # the last (MoE) layer's tensors give the layer's names and shapes
        if name.startswith(f"model.layers.{L - 1}."):
            t = target[name]
            new = prefix + name[len(f"model.layers.{L - 1}."):]
            if name.endswith("norm.weight"):
                out[new] = 1 + 0.1 * torch.randn(t.shape, generator=gen)
            elif name.endswith("e_score_correction_bias"):
                out[new] = 0.2 * torch.randn(t.shape, generator=gen)
            else:
                out[new] = H.INIT_RANGE * torch.randn(t.shape, generator=gen)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        out[f"{prefix}{norm}.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    out[prefix + "eh_proj.weight"] = H.INIT_RANGE * torch.randn(h, 2 * h, generator=gen)
    if copies:
        out[prefix + "embed_tokens.weight"] = target["model.embed_tokens.weight"]
        out[prefix + "shared_head.head.weight"] = target["lm_head.weight"]
    return out


def build_deepseek_v3_mtp(path, copies: bool = True) -> Path:
    """``deepseek_v3`` with its MTP layer in an extra last shard (``num_nextn_predict_layers``
    1 is already in the config transformers writes)."""
    path = build_deepseek_v3(path)
    H.add_shard(path, mtp_tensors(path, copies=copies))
    return path


BUILDERS["deepseek_v3_mtp"] = build_deepseek_v3_mtp
BUILDERS["deepseek_v3_mtp_nocopies"] = lambda path: build_deepseek_v3_mtp(path, copies=False)


def hf_mtp_reference(path, input_ids: torch.Tensor, hidden: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """Draft logits [T, V] of the MTP layer of ``path`` for one sequence, assembled from
    transformers' own decoder layer of the folder's family (``DeepseekV3DecoderLayer``: its
    MLA, rotary and MoE; ``Glm4MoeDecoderLayer`` likewise), its RMSNorm and the published MTP
    math: ``head(norm_sh(layer(eh_proj([enorm(emb), hnorm(hidden)]))))``, emb zeroed at
    position 0, a causal mask. input_ids [T], hidden [T, H], positions [T]."""
    import importlib

    import transformers

    cfg = transformers.AutoConfig.from_pretrained(str(path))
    M = importlib.import_module(f"transformers.models.{cfg.model_type}.modeling_{cfg.model_type}")
    family = cfg.architectures[0].removesuffix("ForCausalLM")  # the classes' prefix
    cfg._attn_implementation = "eager"
    L, h = cfg.num_hidden_layers, cfg.hidden_size
    prefix = f"model.layers.{L}."
    from safetensors import safe_open
    t = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            t.update({k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)})
    layer = getattr(M, f"{family}DecoderLayer")(cfg, L).eval()
    state = {k: v for k, v in t.items() if k in layer.state_dict()}
    e = cfg.n_routed_experts
    state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat(
        [t[f"mlp.experts.{i}.gate_proj.weight"], t[f"mlp.experts.{i}.up_proj.weight"]])
        for i in range(e)])
    state["mlp.experts.down_proj"] = torch.stack([t[f"mlp.experts.{i}.down_proj.weight"]
                                                  for i in range(e)])
    layer.load_state_dict(state, strict=True)

    def norm(name):
        n = getattr(M, f"{family}RMSNorm")(h, cfg.rms_norm_eps)
        n.weight.data.copy_(t[f"{name}.weight"])
        return n

    with torch.no_grad():
        emb = t["embed_tokens.weight"][input_ids].masked_fill((positions == 0)[:, None], 0.0)
        x = torch.cat([norm("enorm")(emb), norm("hnorm")(hidden)], -1) @ t["eh_proj.weight"].T
        x = x[None]
        rope = getattr(M, f"{family}RotaryEmbedding")(cfg)(x, positions[None])
        n = x.shape[1]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = layer(x, attention_mask=mask, position_embeddings=rope,
                    position_ids=positions[None])
        return (norm("shared_head.norm")(out[0]) @ t["shared_head.head.weight"].T).float()


def exact_mtp_tensors(path) -> dict:
    """The MTP layer (``mtp_tensors``, no copies) that predicts a cycle target at ``path``
    (``hf_models.cycle_weights``: every layer adds nothing, the next token is ``cycle_next``
    of the current one) exactly: its decoder layer adds nothing either, ``eh_proj = [I, 0]``
    keeps ``enorm(embed(next token))``, all its norms are 1, and the target's embedding and
    lm_head are shared, so its logits are the target's at the next token."""
    t = mtp_tensors(path, copies=False)
    cfg = H.read_config(path)
    h, prefix = cfg["hidden_size"], f"model.layers.{cfg['num_hidden_layers']}."
    for name in t:
        if name.endswith("o_proj.weight") or "down_proj" in name:
            t[name] = torch.zeros_like(t[name])
        elif name.endswith("norm.weight"):
            t[name] = torch.ones_like(t[name])
    t[prefix + "eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    return t


def build_deepseek_v3_mtp_cycle(path) -> Path:
    """``deepseek_v3`` made a cycle target with an MTP layer that predicts it exactly
    (``exact_mtp_tensors``)."""
    path = build_deepseek_v3(path, post=lambda m, g: (H._routing_bias(m, g),
                                                       H.cycle_weights(m, g)))
    H.add_shard(path, exact_mtp_tensors(path))
    return path


BUILDERS["deepseek_v3_mtp_cycle"] = build_deepseek_v3_mtp_cycle
