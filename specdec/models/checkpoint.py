"""HF-style checkpoint folders: ``config.json`` + the weights in any layout ``transformers``
writes (one ``model.safetensors``, safetensors shards + ``model.safetensors.index.json``, one
``pytorch_model.bin``, ``.bin`` shards + ``pytorch_model.bin.index.json``), read a file at a
time."""

from __future__ import annotations

import json
import math
import re
import zipfile
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
BIN_NAME = "pytorch_model.bin"
BIN_INDEX_NAME = "pytorch_model.bin.index.json"
WEIGHTS_NAMES = (WEIGHTS_NAME, WEIGHTS_INDEX_NAME, BIN_NAME, BIN_INDEX_NAME)  # by preference
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")  # save_folder's shards
CONFIG_NAME = "config.json"
TOKENIZER_NAME = "tokenizer.json"
SAVE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def save_folder(path: str | Path, config: dict, tensors: dict[str, torch.Tensor],
                dtype: torch.dtype, max_shard_bytes: int | None = None) -> None:
    """Write ``config`` (its ``torch_dtype`` set to ``dtype``) and ``tensors``.

    Floating tensors are cast to ``dtype``; integer tensors (e.g. EAGLE-3 ``d2t``) keep theirs.
    When ``max_shard_bytes`` is given and the tensors need more, they go greedily in name order
    to ``model-0000i-of-0000n.safetensors`` files of at most ``max_shard_bytes`` (a larger tensor
    gets a file of its own) plus ``model.safetensors.index.json``, the layout
    ``save_pretrained(max_shard_size=...)`` writes; else to one ``model.safetensors``. Weight files
    an earlier save left (``model.safetensors``, the index, shards) are removed first, since a
    stale ``model.safetensors`` would shadow new shards.
    """
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"save dtype={dtype}: allowed {SAVE_DTYPES}")
    if max_shard_bytes is not None and (type(max_shard_bytes) is not int or max_shard_bytes < 1):
        raise ValueError(f"max_shard_bytes={max_shard_bytes!r}: must be a positive int")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for old in path.iterdir():
        if old.name in (WEIGHTS_NAME, WEIGHTS_INDEX_NAME) or SHARD_NAME.fullmatch(old.name):
            old.unlink()
    sizes = {k: v.numel() * (dtype.itemsize if v.is_floating_point() else v.element_size())
             for k, v in tensors.items()}
    shards = _shards(sizes, max_shard_bytes)
    weight_map = {}
    for i, names in enumerate(shards, 1):
        name = (WEIGHTS_NAME if len(shards) == 1
                else f"model-{i:05d}-of-{len(shards):05d}.safetensors")
        # a fresh contiguous copy each: merged projections hand out row views of one weight
        # (merged q/k/v, gate/up), and safetensors refuses tensors that share storage
        out = {k: (tensors[k].to(dtype) if tensors[k].is_floating_point() else tensors[k])
               .detach().cpu().clone(memory_format=torch.contiguous_format) for k in names}
        save_file(out, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, name))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (path / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config = dict(config, torch_dtype=str(dtype).removeprefix("torch."))
    (path / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _shards(sizes: dict[str, int], max_bytes: int | None) -> list[list[str]]:
    """Names in sorted order, cut greedily into runs of at most ``max_bytes`` (None: one run)."""
    shards, size = [[]], 0
    for name in sorted(sizes):
        if max_bytes is not None and shards[-1] and size + sizes[name] > max_bytes:
            shards, size = shards + [[]], 0
        shards[-1].append(name)
        size += sizes[name]
    return shards


# top-level keys of a multimodal config that belong to its text model
_TEXT_KEYS_OUTSIDE = ("tie_word_embeddings", "bos_token_id", "eos_token_id", "torch_dtype",
                      "dtype")


def load_config(path: str | Path, architecture_of: dict[str, str] | None = None) -> dict:
    """The folder's ``config.json`` as a dict; ValueError naming the file when it is missing,
    not JSON, or not a JSON object. ``architecture_of`` (model_type -> architecture, the
    registry's ``ARCHITECTURE_OF_MODEL_TYPE``): a config naming no architectures gets its
    model_type's, as transformers' AutoModelForCausalLM picks (ValueError naming an unknown
    one). A multimodal config (a ``text_config`` object) reads as its text model's: the
    ``text_config`` with ``architectures`` and the text keys set only at the top level,
    rotary ``mrope_*`` keys dropped (specdec feeds text only, whose three position streams
    are one, where multimodal rope is the plain rope of those positions); its vision keys are
    not read."""
    file = Path(path) / CONFIG_NAME
    if not file.is_file():
        raise ValueError(f"checkpoint folder {str(path)!r} has no {CONFIG_NAME}")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: must be a JSON object, got a {type(config).__name__}")
    if architecture_of is not None and not config.get("architectures") and \
            config.get("model_type") is not None:
        arch = architecture_of.get(config["model_type"])
        if arch is None:
            raise ValueError(f"{file} names no architectures, and model_type="
                             f"{config['model_type']!r} is not a supported one; allowed: "
                             f"{sorted(architecture_of)}")
        config = {**config, "architectures": [arch]}
    if isinstance(config.get("text_config"), dict):
        return _text_model_config(config)
    return config


def _text_model_config(config: dict) -> dict:
    text = dict(config["text_config"], architectures=config.get("architectures"))
    for key in _TEXT_KEYS_OUTSIDE:
        if key in config and text.get(key) is None:
            text[key] = config[key]
    rope = text.get("rope_parameters")
    if isinstance(rope, dict):
        text["rope_parameters"] = {k: v for k, v in rope.items() if not k.startswith("mrope")}
    return text


def weight_files(path: str | Path) -> list[Path]:
    """The folder's weight files, by preference: ``model.safetensors``; the distinct files of
    ``model.safetensors.index.json``'s weight_map, sorted; ``pytorch_model.bin``; those of
    ``pytorch_model.bin.index.json``. ValueError naming the folder and the four names when none
    is there, and naming the index when it is unreadable or names a missing file."""
    return _layout(path)[0]


def _layout(path: str | Path) -> tuple[list[Path], Path | None, dict[str, Path]]:
    """(``weight_files``, the index or None, its weight_map: tensor name -> file)."""
    folder = Path(path)
    for name in WEIGHTS_NAMES:
        file = folder / name
        if not file.is_file():
            continue
        if not name.endswith(".index.json"):
            return [file], None, {}
        weight_map = {k: folder / v for k, v in _weight_map(file).items()}
        files = sorted(set(weight_map.values()))
        for f in files:
            if not f.is_file():
                raise ValueError(f"{file}: its weight_map names {f.name!r}, which is missing")
        return files, file, weight_map
    raise ValueError(f"checkpoint folder {str(path)!r} has none of {', '.join(WEIGHTS_NAMES)}")


def _weight_map(index: Path) -> dict[str, str]:
    """The index's weight_map; ValueError naming the index when it is not JSON or has none."""
    try:
        data = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{index}: not valid JSON ({e})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str)
                                                   for v in weight_map.values()):
        raise ValueError(f"{index}: needs a \"weight_map\" object of tensor name -> file name")
    return weight_map


# name -> (dim, start, stop), or a list of them (their pieces concatenated along dim: a fused
# tensor's rows of several parts), or None (the whole tensor)
Part = "tuple[int, int, int] | list[tuple[int, int, int]]"
Shard = Callable[[str], "Part | None"]


def iter_tensors(path: str | Path, *, skip: Callable[[str], bool] | None = None,
                 shape_only: Callable[[str], bool] | None = None, shard: Shard | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """The folder's (name, tensor) pairs as stored (dtype, shape), file by file in
    ``weight_files`` order, with only the file being read open. Tensors are views of their
    memory-mapped file and keep it mapped: drop each before taking the next to hold at most one
    file (``.bin`` files older than torch 1.6's zip format are read whole). ValueError naming
    the file when it is unreadable, the file and the tensor when one holds NaN or inf (one
    reduction per tensor), and the index and the tensor when the index and the files disagree
    on where a tensor is (listed for another file, or held by none). ``skip(name)``: left out
    (in a safetensors file, never read); ``shape_only(name)``: a meta tensor of its stored shape
    and dtype (never read or checked); ``shard(name)``: ``(dim, start, stop)`` reads only
    that slice along dim 0 or 1 (a tensor-parallel rank's part; a safetensors file reads no
    other byte of it), None the whole tensor."""
    files, index, weight_map = _layout(path)
    absent = []
    for file in files:
        absent += yield from _file_tensors(file, index, weight_map, skip or _never,
                                           shape_only or _never, shard or _whole)
    if absent:
        raise ValueError(f"{index}: its weight_map lists tensors {sorted(absent)}, "
                         "which none of its files holds")


def _never(name: str) -> bool:
    return False


def _whole(name: str) -> None:
    return None


def take(t, part, file, name: str) -> torch.Tensor:
    """``part`` of ``t`` (a tensor or a safetensors slice): one (dim, start, stop), or the
    concatenation of a list of them along their dim (``Shard``)."""
    shape = t.shape if isinstance(t, torch.Tensor) else t.get_shape()
    if isinstance(part, list):
        return torch.cat([t[_slice_key(shape, p, file, name)] for p in part], dim=part[0][0])
    return t[_slice_key(shape, part, file, name)]


def _slice_key(shape, part: tuple[int, int, int], file: Path, name: str) -> tuple:
    """The index of ``part`` = (dim, start, stop); ValueError naming the tensor when the slice
    does not fit its stored shape."""
    dim, start, stop = part
    if dim not in (0, 1) or dim >= len(shape) or not 0 <= start < stop <= shape[dim]:
        raise ValueError(f"{file}: tensor {name!r} of shape {tuple(shape)} has no slice "
                         f"[{start}:{stop}] along dim {dim} (a tensor-parallel shard)")
    return (slice(start, stop),) if dim == 0 else (slice(None), slice(start, stop))


def _file_tensors(file: Path, index: Path | None, weight_map: dict[str, Path], skip,
                  shape_only, shard) -> Generator[tuple[str, torch.Tensor], None, list[str]]:
    """One file's (name, tensor) pairs, checked for NaN/inf and against the index: ValueError
    for a tensor it puts elsewhere; returns those it puts here that the file lacks."""
    if file.suffix == ".safetensors":
        try:
            handle = safe_open(str(file), framework="pt")
        except SafetensorError as e:
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from None
        with handle as f:
            names = list(f.keys())
            _check_index(index, weight_map, file, names)
            for name in names:
                if skip(name):
                    continue
                if shape_only(name):
                    piece = f.get_slice(name)
                    yield name, torch.empty(piece.get_shape(), device="meta",
                                            dtype=_SAFETENSORS_DTYPES[piece.get_dtype()])
                    continue
                part = shard(name)
                if part is None:
                    yield name, _finite(file, name, f.get_tensor(name))
                    continue
                yield name, _finite(file, name, take(f.get_slice(name), part, file, name))
    else:
        tensors = _load_bin(file)
        names = list(tensors)
        _check_index(index, weight_map, file, names)
        for name in names:
            t = tensors.pop(name)
            if skip(name):
                continue
            part = shard(name)
            if part is not None:
                t = take(t, part, file, name)
            yield name, (t.to("meta") if shape_only(name) else _finite(file, name, t))
    held = set(names)
    return [k for k, v in weight_map.items() if v == file and k not in held]


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
                       "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    """A ``torch.save``d state dict, memory-mapped (files older than torch 1.6's zip format are
    read whole); ValueError naming the file when it is not a readable dict of tensors."""
    try:
        tensors = torch.load(file, map_location="cpu", weights_only=True,
                             mmap=zipfile.is_zipfile(file))
    except Exception as e:  # corrupt input raises RuntimeError, UnpicklingError, EOFError, ...
        reason = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
        raise ValueError(f"{file}: not a readable PyTorch weights file ({reason})") from None
    if not isinstance(tensors, dict):
        raise ValueError(f"{file}: not a readable PyTorch weights file "
                         f"(holds a {type(tensors).__name__}, not a dict of name -> tensor)")
    for k, v in tensors.items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            raise ValueError(f"{file}: not a readable PyTorch weights file (entry {k!r} holds a "
                             f"{type(v).__name__}, not a dict of name -> tensor)")
    return tensors


def _check_index(index: Path | None, weight_map: dict[str, Path], file: Path,
                 names: list[str]) -> None:
    """ValueError naming the index and a tensor ``file`` holds that the index puts in another
    file or in none."""
    if index is None:
        return
    for name in sorted(names):
        if weight_map.get(name) != file:
            where = (f"maps it to {weight_map[name].name}" if name in weight_map
                     else "does not list it")
            raise ValueError(f"{index}: tensor {name!r} is in {file.name} but the index {where}")


def _finite(file: Path, name: str, t: torch.Tensor) -> torch.Tensor:
    """``t``; ValueError naming the file and the tensor when a floating ``t`` holds NaN/inf.
    One min/max pass (both propagate NaN), with no temporary as large as ``t`` (isfinite makes
    two, which would add most of a shard to the peak memory)."""
    if t.is_floating_point() and t.numel() > 0 and t.dtype not in FP8_DTYPES:
        lo, hi = torch.aminmax(t)  # (an fp8 weight is checked once dequantized)
        if not (math.isfinite(lo.item()) and math.isfinite(hi.item())):
            raise ValueError(f"{file}: tensor {name!r} holds non-finite values (NaN or inf)")
    return t


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All the folder's tensors in one dict (``iter_tensors``' errors); it holds the whole model,
    so prefer ``load_into`` for large ones."""
    return dict(iter_tensors(path))


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIX = ".weight_scale_inv"


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor,
                      block: tuple[int, int]) -> torch.Tensor:
    """Block-quantized FP8 (DeepSeek-V3's and Qwen3-FP8's ``weight_block_size``) -> float32:
    weight [O, I] fp8, scale_inv [ceil(O/bo), ceil(I/bi)] -> weight * scale_inv of its block.
    Example (block 2x2): weight [[1, 1, 2]], scale_inv [[0.5, 4]] -> [[0.5, 0.5, 8]]."""
    bo, bi = block
    o, i = weight.shape
    if scale_inv.shape != (-(-o // bo), -(-i // bi)):
        raise ValueError(f"weight_scale_inv shape {tuple(scale_inv.shape)} does not tile a "
                         f"{tuple(weight.shape)} weight in {bo}x{bi} blocks")
    scale = scale_inv.float().repeat_interleave(bo, 0)[:o].repeat_interleave(bi, 1)[:, :i]
    return weight.float() * scale


def scale_slice(part, block: tuple[int, int], name: str):
    """The slice of ``name``'s ``weight_scale_inv`` that scales the weight slice ``part`` =
    (dim, start, stop): its blocks along dim. ValueError naming the tensor when the slice cuts
    a block (a rank would need another rank's scale). Example (block 128x128): rows
    (0, 1536, 3072) -> scale rows (0, 12, 24); rows (0, 64, 128) -> refused."""
    if isinstance(part, list):
        return [scale_slice(p, block, name) for p in part]
    dim, start, stop = part
    size = block[dim]
    if start % size or stop % size:
        raise ValueError(f"tensor {name!r}: its tensor-parallel / expert-parallel slice "
                         f"[{start}:{stop}] along dim {dim} cuts a {block[0]}x{block[1]} FP8 "
                         "scale block (quantization_config.weight_block_size); allowed: slices "
                         f"on multiples of {size}")
    return dim, start // size, stop // size


def _dequantized(tensors, block: tuple[int, int] | None, file_of: str):
    """(name, tensor) pairs with each fp8 ``X.weight`` and its ``X.weight_scale_inv`` (in any
    order, any shard) replaced by one float32 ``X.weight``; at most the pairs still waiting
    for their other half are held."""
    if block is None:  # no local reference: a yielded tensor keeps its whole file mapped
        yield from tensors
        return
    pending: dict[str, torch.Tensor] = {}
    for name, t in tensors:
        if name.endswith(SCALE_SUFFIX):
            key = name.removesuffix(SCALE_SUFFIX) + ".weight"
        elif t.dtype in FP8_DTYPES:
            key = name
        else:
            yield name, t
            del t
            continue
        if key not in pending:
            pending[key] = t.clone()  # held past its file
            del t
            continue
        other = pending.pop(key)
        weight, scale_inv = (t, other) if name == key else (other, t)
        del t, other
        yield key, _finite(file_of, key, dequantize_blocks(weight, scale_inv, block))
        del weight, scale_inv
    if pending:
        raise ValueError(f"{file_of}: fp8 weights without their weight_scale_inv (or the "
                         f"reverse): {sorted(pending)}")


# e2m1 (FP4) code -> value: sign bit 3, then 2 exponent bits and 1 mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_SUFFIXES = ("_blocks", "_scales")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 (gpt-oss's experts, OCP microscaling) -> float32: blocks [..., R, G, 16] uint8
    (32 e2m1 codes of a block, two a byte, the low nibble first), scales [..., R, G] uint8
    (e8m0: the block's factor ``2 ** (s - 127)``) -> [..., R, G * 32]. E.g. one block whose
    first byte is 0x2F and scale 128: values [-6 * 2, 1 * 2, ...] (0xF = -6, 0x2 = 1)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or \
            blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"mxfp4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales "
                         f"{tuple(scales.shape)} {scales.dtype}: need uint8 [..., G, 16] and "
                         "[..., G]")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., G, 32]
    values = torch.ldexp(lut[codes], scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2)


def dequantized_mxfp4(tensors, file_of: str):
    """(name, tensor) pairs with each ``X_blocks`` [E, R, G, 16] and its ``X_scales`` (any
    order, any shard) replaced by one float32 ``X`` [E, G * 32, R] (``dequantize_mxfp4``, the
    last two dims swapped as transformers does: gpt-oss's unquantized layout [E, in, out]); at
    most the pairs still waiting for their other half are held."""
    pending: dict[str, torch.Tensor] = {}
    for name, t in tensors:
        if not name.endswith(MXFP4_SUFFIXES):
            yield name, t
            del t
            continue
        key, suffix = name[:-7], name[-7:]
        if key not in pending:
            pending[key] = t.clone()  # held past its file
            del t
            continue
        other = pending.pop(key)
        blocks, scales = (t, other) if suffix == "_blocks" else (other, t)
        del t, other
        yield key, _finite(file_of, key, dequantize_mxfp4(blocks, scales).transpose(-1, -2))
        del blocks, scales
    if pending:
        raise ValueError(f"{file_of}: mxfp4 tensors without their _blocks or _scales half: "
                         f"{sorted(pending)}")


def load_into(dest: dict[str, torch.Tensor], path: str | Path, *,
              rename: Callable[[str], str | None] | None = None,
              ignore: Callable[[str], bool] | None = None,
              weight_block_size: tuple[int, int] | None = None,
              shard: Shard | None = None,
              convert: Callable[[Iterator, str], Iterator] | None = None) -> None:
    """Copy the folder's tensors into ``dest`` (name -> preallocated tensor, views such as row
    slices of a merged weight allowed; ``copy_`` casts the dtype), one file at a time: peak host
    memory is about one weight file on top of ``dest``.

    ``rename(name)`` maps a checkpoint name to a ``dest`` name (None skips the tensor);
    ``ignore(name)``, on the renamed name, skips it when true (a skipped tensor's bytes are
    never read from a safetensors file, unless ``convert`` rewrites the names first). After all files, one ValueError
    naming every missing (in ``dest``, not in the checkpoint), unexpected (not in ``dest``) and
    wrongly shaped tensor; ``iter_tensors``' errors on the way. ``weight_block_size``: the
    checkpoint is block-quantized FP8 (``quantization_config``): each fp8 weight is dequantized
    with its ``weight_scale_inv`` before it is copied (``dequantize_blocks``). ``shard(name)``,
    on the renamed name: read only that slice of the tensor (``iter_tensors``); of an fp8
    weight, its scale blocks' slice too (``scale_slice``: a slice that cuts a block is
    refused).
    ``convert(pairs, folder)``: a family's rewrite of the (stored name, tensor) stream before
    renaming (gpt-oss: MXFP4 pairs dequantized, stacked experts split into each expert's
    tensors).
    """
    seen, unexpected, bad = set(), set(), []
    by_stored = skip = None
    if (ignore is not None or rename is not None) and convert is None:
        def skip(name: str) -> bool:  # never read what would be dropped
            weight = name.removesuffix(SCALE_SUFFIX) + ".weight" \
                if name.endswith(SCALE_SUFFIX) else name  # an fp8 scale goes with its weight
            renamed = rename(weight) if rename is not None else weight
            return renamed is None or (ignore is not None and ignore(renamed))
    if shard is not None:
        def by_stored(name: str):
            scale = weight_block_size is not None and name.endswith(SCALE_SUFFIX)
            weight = name.removesuffix(SCALE_SUFFIX) + ".weight" if scale else name
            renamed = rename(weight) if rename is not None else weight
            part = None if renamed is None else shard(renamed)
            # an fp8 weight's scale: the blocks of its weight's slice
            return scale_slice(part, weight_block_size, weight) if scale and part else part
    with torch.no_grad():
        tensors = _dequantized(iter_tensors(path, skip=skip, shard=by_stored),
                               weight_block_size, str(path))
        for name, t in (tensors if convert is None else convert(tensors, str(path))):
            name = rename(name) if rename is not None else name
            if name is not None and not (ignore is not None and ignore(name)):
                seen.add(name)
                if shard is not None and name in dest and t.shape != dest[name].shape \
                        and (part := shard(name)) is not None:  # whole until ``convert``
                    t = take(t, part, path, name)
                if name not in dest:
                    unexpected.add(name)
                elif t.shape != dest[name].shape:
                    bad.append(f"{name}: got {tuple(t.shape)} "
                               f"!= expected {tuple(dest[name].shape)}")
                else:
                    dest[name].copy_(t)
            del t  # it keeps its whole file mapped: let that go before the next file is read
    kinds = (("missing tensors", sorted(dest.keys() - seen)),
             ("unexpected tensors", sorted(unexpected)), ("wrong shapes", sorted(bad)))
    if any(items for _, items in kinds):
        raise ValueError(f"checkpoint {str(path)!r}: "
                         + ", ".join(f"{kind} {items}" for kind, items in kinds if items))


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
