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
