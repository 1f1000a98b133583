"""Training text: the Python standard library's own ``.py`` files, split by a path hash.

A file is held out when ``int(sha256(relpath)[:8], 16) % 20 == 0`` (``relpath``: POSIX path
relative to ``sysconfig.get_paths()["stdlib"]``), i.e. about 5% of files.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
             "encodings"}  # encodings: machine-generated codec tables
MAX_FILE_BYTES = 256 * 1024


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relpath: str) -> bool:
    """The split rule: ``is_held_out("json/decoder.py")`` is fixed forever by the sha256."""
    return int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16) % 20 == 0


def list_files(root: Path | None = None) -> tuple[list[str], list[str]]:
    """Sorted (train, held_out) relative paths of stdlib ``.py`` files; files under a
    ``SKIP_DIRS`` directory or over 256 KiB are left out."""
    root = root or stdlib_root()
    train, held = [], []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if SKIP_DIRS & set(rel.split("/")[:-1]) or p.stat().st_size > MAX_FILE_BYTES:
            continue
        (held if is_held_out(rel) else train).append(rel)
    return train, held


def read_texts(relpaths: list[str], root: Path | None = None) -> list[str]:
    root = root or stdlib_root()
    return [(root / r).read_text(encoding="utf-8", errors="replace") for r in relpaths]


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE; ``<|endoftext|>`` is id 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_stream(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts as one int64 stream, each followed by the eos id (a newline's ids where the
    tokenizer has no ``<|endoftext|>``: any user's tokenizer makes the benchmark prompts)."""
    eos = tok.token_to_id(EOS)
    sep = [eos] if eos is not None else tok.encode("\n").ids
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.extend(sep)
    return torch.tensor(ids, dtype=torch.int64)


def sample_windows(stream: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` random windows ``[n, length]`` of the stream (seeded by ``gen``)."""
    starts = torch.randint(0, len(stream) - length, (n,), generator=gen)
    return torch.stack([stream[s:s + length] for s in starts.tolist()])


def heldout_prompts(tok: Tokenizer, n: int, length: int, seed: int = 0) -> torch.Tensor:
    """``n`` prompts ``[n, length]`` drawn (seeded) from the held-out files' token stream."""
    _, held = list_files()
    gen = torch.Generator().manual_seed(seed)
    return sample_windows(encode_stream(tok, read_texts(held)), n, length, gen)
