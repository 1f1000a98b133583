"""EngineConfig: the engine's sizes, dtype, device and seed, validated once.

``LLM`` builds one from its keyword arguments before it loads anything, then checks it against
the loaded model (``check_model``) and against the memory of the device (``check_memory``).
Every error is a ValueError/TypeError naming the field, the value and what is allowed, e.g.
``EngineConfig(max_model_len=4096).check_model(cfg)`` with ``cfg.max_position_embeddings =
1024`` -> ``ValueError: max_model_len=4096: allowed 2 <= max_model_len <= 1024 (the model's
max_position_embeddings)``.
"""

import os
from dataclasses import dataclass, field

import torch

from specdec import platform
from specdec.checks import check_bool, check_float, check_int
from specdec.attention import KVCacheSpec
from specdec.linear_state import LinearStateSpec
from specdec.models.config import ModelConfig

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16}
# what ``dtype`` takes: "auto" (the default, see ``auto_dtype``), a DTYPES name, or vLLM's
# aliases "half" (float16) and "float" (float32)
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
DTYPE_CHOICES = ("auto", *DTYPES, *DTYPE_ALIASES)
SEED_MAX = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed


DEFAULT_MAX_MODEL_LEN = 512  # or the model's max_position_embeddings when smaller
MIN_MAX_MODEL_LEN = 2  # a 1-token prompt and the one token it generates
DEFAULT_MAX_NUM_SEQS = 16
MAX_SIZED_SEQS = 256  # the most request rows gpu_memory_utilization sizes


@dataclass(slots=True)
class EngineConfig:
    max_model_len: int | None = None  # None: DEFAULT_MAX_MODEL_LEN, bounded by the model
    # None: sized from gpu_memory_utilization (size_kv_cache)
    max_num_seqs: int | None = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = 256
    block_size: int = 16
    # normalised to a torch.dtype; "auto": auto_dtype(checkpoint_dtype, device)
    dtype: str | torch.dtype = "auto"
    # normalised to an available torch.device; None: platform.default_device()
    device: str | torch.device | None = None
    seed: int = 0
    capture_sizes: list[int] | None = None
    tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    data_parallel_size: int = 1
    data_parallel_timeout: float = 600.0  # seconds a DP run may take before it is failed
    # the checkpoint's config.json torch_dtype (or dtype), read only for dtype "auto"
    checkpoint_dtype: str | None = None
    # accelerators: the share of the device's memory the weights and the KV cache may take;
    # max_num_seqs None: the most request rows that share holds (size_kv_cache)
    gpu_memory_utilization: float | None = None
    # reuse the KV blocks of prompt prefixes across requests (vLLM's flag); None: on where the
    # model and drafter allow it (``resolve_prefix_caching``)
    enable_prefix_caching: bool | None = None
    # prefill chunks fill the step's budget (vLLM's chunked prefill); False: a step that ends
    # a prompt starts or continues no other prompt it cannot end (``scheduler``); None:
    # ``resolve_pack_prefill``
    pack_prefill: bool | None = None
    dtype_auto: bool = field(init=False, default=False)  # dtype was "auto"
    device_auto: bool = field(init=False, default=False)  # device was None

    def __post_init__(self):
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, lo=MIN_MAX_MODEL_LEN)
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size",
                     "tensor_parallel_size", "data_parallel_size"):
            if name != "max_num_seqs" or self.max_num_seqs is not None:
                check_int(name, getattr(self, name), lo=1)
        check_int("seed", self.seed, lo=0, hi=SEED_MAX)
        check_bool("sequence_parallel", self.sequence_parallel)
        if self.enable_prefix_caching is not None:
            check_bool("enable_prefix_caching", self.enable_prefix_caching)
        if self.pack_prefill is not None:
            check_bool("pack_prefill", self.pack_prefill)
        if self.capture_sizes is not None:
            if not isinstance(self.capture_sizes, (list, tuple)):
                raise TypeError(f"capture_sizes={self.capture_sizes!r}: must be a list of ints")
            for i, size in enumerate(self.capture_sizes):
                check_int(f"capture_sizes[{i}]", size, lo=1)
        timeout = self.data_parallel_timeout
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool):
            raise TypeError(f"data_parallel_timeout={timeout!r}: must be a number of seconds")
        if not 0 < timeout < float("inf"):
            raise ValueError(f"data_parallel_timeout={timeout!r}: must be finite and > 0")
        self.device_auto = self.device is None
        self.device = platform.torch_device(platform.default_device() if self.device_auto
                                            else self.device)
        self._check_gpu_memory_utilization()
        self.dtype_auto = isinstance(self.dtype, str) and self.dtype == "auto"
        self.dtype = resolve_dtype(self.dtype, self.checkpoint_dtype, self.device)

    def _check_gpu_memory_utilization(self) -> None:
        util = self.gpu_memory_utilization
        if util is None:
            if self.max_num_seqs is None:
                raise ValueError("max_num_seqs=None: give an int >= 1, or "
                                 "gpu_memory_utilization (an accelerator) to size it")
            return
        check_float("gpu_memory_utilization", util, lo=0.0, hi=1.0, lo_open=True)
        if self.device.type == "cpu":
            raise ValueError(
                f"gpu_memory_utilization={util} sizes the KV cache on an accelerator (cuda, "
                "npu); on cpu the KV cache holds max_num_seqs x max_model_len tokens: set "
                "those (allowed here: None)")
        parallel = max(self.data_parallel_size, self.tensor_parallel_size)
        if self.max_num_seqs is None and parallel > 1:
            raise ValueError(
                f"gpu_memory_utilization={util} without max_num_seqs: sizing the KV cache "
                "of data / tensor parallel ranks is not supported yet; give max_num_seqs "
                "(the fraction is then checked on each rank)")

    def describe(self, device_default: bool | None = None) -> str:
        """What was chosen, for the commands' start-up line, e.g. ``"device cpu (default: no
        accelerator), dtype float32 (auto: float32 on CPU; the checkpoint's is float16)"``.
        ``device_default``: the device was the default (None: it was None here)."""
        dtype = str(self.dtype).removeprefix("torch.")
        default = self.device_auto if device_default is None else device_default
        device = f"device {self.device}" + (
            (" (default: the accelerator present)" if self.device.type != "cpu"
             else " (default: no accelerator)") if default else "")
        if not self.dtype_auto:
            return f"{device}, dtype {dtype}"
        ckpt = (f"the checkpoint's is {self.checkpoint_dtype}" if self.checkpoint_dtype
                else "the checkpoint names none")
        why = "float32 on CPU; " if self.device.type == "cpu" else ""
        return f"{device}, dtype {dtype} (auto: {why}{ckpt})"

    def check_num_speculative_tokens(self, k: int) -> None:
        """A decode step feeds 1 + K tokens: the step budget must hold them."""
        if self.max_num_batched_tokens < 1 + k:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens}: must be "
                             f">= 1 + num_speculative_tokens ({1 + k})")

    def resolve_pack_prefill(self, draft_forwards: bool) -> None:
        """Settle ``pack_prefill`` once the drafter is known: None is False on a CPU without
        draft-model forwards in its steps (a step's time grows with its tokens, so a prompt's
        first token should not wait for a later prompt's chunk), True elsewhere: on an
        accelerator a small step costs about what a full one does, and where each step also
        runs a head's or a draft model's forwards an extra step costs more than it saves."""
        if self.pack_prefill is None:
            self.pack_prefill = self.device.type != "cpu" or draft_forwards

    def resolve_prefix_caching(self, why_not: str | None) -> str | None:
        """Settle ``enable_prefix_caching`` once the model and drafter are known; ``why_not``:
        what rules prefix caching out for them (None: nothing). Asked for explicitly it is then
        a ValueError; left at None it is turned off -> the start-up note saying so."""
        if why_not is None:
            if self.enable_prefix_caching is None:
                self.enable_prefix_caching = True
            return None
        if self.enable_prefix_caching:
            raise ValueError(f"enable_prefix_caching=True: {why_not}; allowed: False or None")
        off = self.enable_prefix_caching is None
        self.enable_prefix_caching = False
        return f"prefix caching off: {why_not}" if off else None

    def check_model(self, config: ModelConfig) -> None:
        """max_model_len is bounded by the positions the target was built for (None becomes
        the default, or the model's bound when that is smaller)."""
        limit = config.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = min(DEFAULT_MAX_MODEL_LEN, limit)
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len}: allowed {MIN_MAX_MODEL_LEN} <= "
                             f"max_model_len <= {limit} (the model's max_position_embeddings)")

    @property
    def num_kv_blocks(self) -> int:
        return self.max_num_seqs * -(-self.max_model_len // self.block_size)

    def kv_cache_bytes(self, specs: list[KVCacheSpec | LinearStateSpec], state_slots: int = 1,
                       rows: int | None = None) -> int:
        """The KV caches of these layers (target + draft), the linear-attention state slots
        (``state_slots`` per request row, plus a trash row) and the token table this config
        allocates for ``rows`` request rows (None: max_num_seqs), each of max_model_len
        tokens."""
        rows = self.max_num_seqs if rows is None else rows
        slots = rows * -(-self.max_model_len // self.block_size) * self.block_size
        table = rows * (self.max_model_len + 1) * 4
        state = (rows + 1) * state_slots * sum(
            s.bytes_per_slot() for s in specs if isinstance(s, LinearStateSpec))
        return slots * sum(s.bytes_per_token(self.dtype) for s in specs) + state + table

    def size_kv_cache(self, specs: list[KVCacheSpec | LinearStateSpec],
                      state_slots: int = 1) -> None:
        """``gpu_memory_utilization`` F (after the weights are loaded): the KV cache may take
        F x the device's total memory less what is in use now (weights, other processes).
        The cache holds max_num_seqs rows of max_model_len tokens, so with max_num_seqs None
        it is the most rows that fits (at most MAX_SIZED_SEQS); a given max_num_seqs must
        fit. The step's activations and captured graphs come on top. ValueError when it
        cannot fit."""
        util = self.gpu_memory_utilization
        if util is None:
            return
        total = total_memory(self.device)
        used = total - free_memory(self.device)
        budget = util * total - used
        fixed = self.kv_cache_bytes(specs, state_slots, rows=0)
        per_row = self.kv_cache_bytes(specs, state_slots, rows=1) - fixed
        where = (f"gpu_memory_utilization={util} of {self.device}'s {total / 2**30:.2f} GiB, "
                 f"{used / 2**30:.2f} GiB in use (weights, other processes)")
        if self.max_num_seqs is None:
            rows = min(int((budget - fixed) // per_row), MAX_SIZED_SEQS)
            if rows < 1:
                raise ValueError(f"{where}: one request row of max_model_len="
                                 f"{self.max_model_len} needs {per_row / 2**30:.3f} GiB of KV "
                                 "cache, and none fits; raise gpu_memory_utilization or lower "
                                 "max_model_len")
            self.max_num_seqs = rows
        need = self.kv_cache_bytes(specs, state_slots)
        if need > budget:
            raise ValueError(f"{where}: the KV cache of max_num_seqs={self.max_num_seqs}, "
                             f"max_model_len={self.max_model_len} needs {need / 2**30:.2f} "
                             f"GiB, {max(budget, 0) / 2**30:.2f} GiB are left; lower "
                             "max_num_seqs or max_model_len, or raise gpu_memory_utilization")

    def check_memory(self, specs: list[KVCacheSpec | LinearStateSpec],
                     state_slots: int = 1) -> None:
        """The caches of every rank on this host must fit the device's free memory."""
        need = self.kv_cache_bytes(specs, state_slots)
        ranks = self.data_parallel_size if self.device.type == "cpu" else 1
        free = free_memory(self.device)
        if need * ranks > free:
            raise ValueError(
                f"max_num_seqs={self.max_num_seqs}, max_model_len={self.max_model_len}: the KV "
                f"cache needs {need * ranks / 2**30:.2f} GiB ({ranks} rank(s)), {self.device} "
                f"has {free / 2**30:.2f} GiB free; lower max_num_seqs or max_model_len")


def auto_dtype(checkpoint: str | None, device: torch.device) -> torch.dtype:
    """``dtype="auto"``: float32 on a CPU (bfloat16 / float16 matmuls are slow there), else
    the checkpoint's ``torch_dtype`` (float32 when it names none). ``auto_dtype("bfloat16",
    torch.device("cuda"))`` -> torch.bfloat16. ValueError for a checkpoint dtype specdec does
    not run (give ``dtype`` explicitly then)."""
    if device.type == "cpu" or checkpoint is None:
        return torch.float32
    checkpoint = str(checkpoint).removeprefix("torch.")
    if checkpoint not in DTYPES:
        raise ValueError(f"dtype='auto': the checkpoint's torch_dtype={checkpoint!r} is not "
                         f"one specdec runs; give dtype, allowed {list(DTYPE_CHOICES)}")
    return DTYPES[checkpoint]


def resolve_dtype(value, checkpoint: str | None, device: torch.device) -> torch.dtype:
    """``dtype`` as ``EngineConfig`` takes it: "auto" -> ``auto_dtype(checkpoint, device)``, a
    name or alias -> its torch.dtype, a torch.dtype checked; ValueError / TypeError naming
    the allowed values."""
    if isinstance(value, str) and value == "auto":
        return auto_dtype(checkpoint, device)
    return _dtype(value)


def _dtype(value) -> torch.dtype:
    if isinstance(value, str):
        value = DTYPE_ALIASES.get(value, value)
        if value not in DTYPES:
            raise ValueError(f"dtype={value!r}: allowed {list(DTYPE_CHOICES)}")
        return DTYPES[value]
    if not isinstance(value, torch.dtype):
        raise TypeError(f"dtype={value!r}: must be a str or torch.dtype; allowed "
                        f"{list(DTYPE_CHOICES)}")
    if value not in DTYPES.values():
        raise ValueError(f"dtype={value}: allowed {list(DTYPE_CHOICES)}")
    return value


def total_memory(device: torch.device) -> int:
    """Bytes of an accelerator's memory."""
    return getattr(torch, device.type).mem_get_info(device)[1]


def free_memory(device: torch.device) -> int:
    """Bytes free on ``device`` (host: MemAvailable, else physical pages available)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "npu":
        return torch.npu.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
