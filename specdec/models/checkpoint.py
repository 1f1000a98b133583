"""HF-style checkpoint folders: ``config.json`` + one ``model.safetensors``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
SAVE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def save_folder(path: str | Path, config: dict, tensors: dict[str, torch.Tensor],
                dtype: torch.dtype) -> None:
    """Write ``config`` (its ``torch_dtype`` set to ``dtype``) and ``tensors``.

    Floating tensors are cast to ``dtype``; integer tensors (e.g. EAGLE-3 ``d2t``) keep theirs.
    """
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"save dtype={dtype}: allowed {SAVE_DTYPES}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # a fresh contiguous copy each: merged projections hand out row views of one weight
    # (models/merged.py), and safetensors refuses tensors that share storage
    out = {k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu()
           .clone(memory_format=torch.contiguous_format) for k, v in tensors.items()}
    save_file(out, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
    config = dict(config, torch_dtype=str(dtype).removeprefix("torch."))
    (path / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_config(path: str | Path) -> dict:
    file = Path(path) / CONFIG_NAME
    if not file.is_file():
        raise ValueError(f"checkpoint folder {str(path)!r} has no {CONFIG_NAME}")
    return json.loads(file.read_text())


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    file = Path(path) / WEIGHTS_NAME
    if not file.is_file():
        raise ValueError(f"checkpoint folder {str(path)!r} has no {WEIGHTS_NAME}")
    return load_file(str(file))


def check_names(expected: dict[str, torch.Size], got: dict[str, torch.Tensor],
                path: str | Path) -> None:
    """Raise ValueError naming every missing, unexpected and wrongly shaped tensor."""
    missing, unknown = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    if missing or unknown:
        raise ValueError(f"checkpoint {str(path)!r}: missing tensors {missing}, "
                         f"unexpected tensors {unknown}")
    bad = [f"{k}: {tuple(got[k].shape)} != {tuple(s)}" for k, s in expected.items()
           if got[k].shape != s]
    if bad:
        raise ValueError(f"checkpoint {str(path)!r}: wrong shapes {bad}")
