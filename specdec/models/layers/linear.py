"""One matmul for several projections of the same input, saved under their HF names.

``MergedLinear(in, {"q_proj": a, "k_proj": b, "v_proj": c})`` holds ONE weight
``[a + b + c, in]`` (and bias), so the forward is one GEMM. The checkpoint boundary keeps the
separate names: ``state_dict()`` of the parent module shows ``q_proj.weight [a, in]``,
``k_proj.weight [b, in]``, ... (row slices of the merged weight, no copy) and no merged key;
``load_state_dict`` accepts those names and concatenates them into the merged weight. So
``expected_tensors``, ``save_pretrained``/``load_pretrained`` and vLLM's loaders see HF's
layout, while ``named_parameters()`` (training, optimizers) see the one merged parameter.

Example: ``MergedLinear(32, {"gate_proj": 48, "up_proj": 48}, bias=False)`` registered as
``mlp.gate_up_proj`` has ``weight [96, 32]``; ``mlp.state_dict()`` has ``gate_proj.weight
[48, 32]`` (= rows 0..47) and ``up_proj.weight [48, 32]`` (= rows 48..95).
"""

import torch
from torch import nn


class MergedLinear(nn.Linear):
    """``x [..., in] -> [..., sum(parts)]``: the parts' outputs concatenated in ``parts`` order.

    Its parent must call :func:`save_merged_as_parts` once (the parent's state dict is where
    the part names live; ``load_state_dict`` hands each child only its own keys).
    """

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool):
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = dict(parts)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, parts={self.parts}"


def save_merged_as_parts(parent: nn.Module) -> None:
    """Make ``parent``'s state dict show every direct MergedLinear child as its parts."""
    parent.register_state_dict_post_hook(_split_state)
    parent.register_load_state_dict_pre_hook(_merge_state)


def _merged_children(parent: nn.Module):
    return [(n, m) for n, m in parent.named_children() if isinstance(m, MergedLinear)]


def _split_state(parent: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    for attr, merged in _merged_children(parent):
        for kind in ("weight", "bias"):
            tensor = state_dict.pop(f"{prefix}{attr}.{kind}", None)
            if tensor is None:
                continue
            for name, rows in zip(merged.parts, tensor.split(list(merged.parts.values()))):
                state_dict[f"{prefix}{name}.{kind}"] = rows


def _merge_state(parent: nn.Module, state_dict: dict, prefix: str, local_metadata, strict,
                 missing_keys, unexpected_keys, error_msgs) -> None:
    """Replace the parts' entries by one merged entry when every part is present (else leave
    them: the load then reports the merged key missing and the parts unexpected)."""
    for attr, merged in _merged_children(parent):
        for kind in ("weight", "bias"):
            keys = [f"{prefix}{name}.{kind}" for name in merged.parts]
            if all(k in state_dict for k in keys):
                state_dict[f"{prefix}{attr}.{kind}"] = torch.cat([state_dict.pop(k) for k in keys])


# CPU dtypes whose GEMM reads a column-major weight faster (benchmarks/bench_cpu_gemm_layout.py:
# float32 decode forwards 1.11-1.26x at 1-16 rows; bfloat16 within the spread, float16 3-7x
# slower)
CPU_GEMM_LAYOUT_DTYPES = (torch.float32,)


def use_cpu_gemm_layout(*models: nn.Module | None) -> int:
    """Store the ``nn.Linear`` weights of ``models`` that live on the CPU in float32
    (``CPU_GEMM_LAYOUT_DTYPES``) column-major: the same ``[out, in]`` tensor (same values,
    names and state dict) with strides ``(1, out)``, i.e. ``W^T [in, out]`` row-major in memory.
    ``F.linear`` then calls the BLAS's non-transposed GEMM, which on the CPU measured runs the
    embedded model's GEMMs up to twice as fast at one row (a whole decode forward 1.1-1.3x at
    1-16 rows). Moves the parameters' storage in place.

    A weight an ``nn.Embedding`` also holds (a tied lm_head) keeps its rows (the embedding
    gathers rows); a weight moved already is left alone (heads share the target's lm_head).
    Returns the number of weights moved."""
    modules = [m for model in models if model is not None for m in model.modules()]
    embedded = {id(m.weight) for m in modules if isinstance(m, nn.Embedding)}
    moved = 0
    for m in modules:
        w = m.weight if isinstance(m, nn.Linear) else None
        if (w is None or id(w) in embedded or w.device.type != "cpu" or w.dim() != 2
                or w.dtype not in CPU_GEMM_LAYOUT_DTYPES or not w.is_contiguous()
                or w.shape[0] == 1 or w.shape[1] == 1):  # a vector has one layout
            continue
        with torch.no_grad():
            w.data = w.data.t().contiguous().t()
        moved += 1
    return moved
