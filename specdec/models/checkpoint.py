"""HF-style checkpoint folders: ``config.json`` + one ``model.safetensors``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
TOKENIZER_NAME = "tokenizer.json"
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
    """The folder's ``config.json`` as a dict; ValueError naming the file when it is missing,
    not JSON, or not a JSON object."""
    file = Path(path) / CONFIG_NAME
    if not file.is_file():
        raise ValueError(f"checkpoint folder {str(path)!r} has no {CONFIG_NAME}")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: must be a JSON object, got a {type(config).__name__}")
    return config


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The folder's tensors; ValueError naming the file when it is missing or unreadable, and
    naming the tensor when one holds NaN or inf (one reduction per tensor)."""
    file = Path(path) / WEIGHTS_NAME
    if not file.is_file():
        raise ValueError(f"checkpoint folder {str(path)!r} has no {WEIGHTS_NAME}")
    try:
        tensors = load_file(str(file))
    except SafetensorError as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e})") from None
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{file}: tensor {name!r} holds non-finite values (NaN or inf)")
    return tensors


def load_tokenizer(path: str | Path):
    """The folder's ``tokenizer.json`` (a ``tokenizers.Tokenizer``), or None when absent."""
    file = Path(path) / TOKENIZER_NAME
    if not file.exists():
        return None
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception for every parse error
        raise ValueError(f"{file}: not a readable tokenizer ({e})") from None


def naming_folder(path: str | Path, build):
    """``build()`` with a config/tensor ValueError or TypeError prefixed by the folder."""
    try:
        return build()
    except (ValueError, TypeError) as e:
        if str(path) in str(e):
            raise
        raise type(e)(f"checkpoint {str(path)!r}: {e}") from None


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
