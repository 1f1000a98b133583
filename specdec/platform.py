"""The one module where optional hardware imports live.

Nothing else in specdec imports ``torch_npu`` or probes for ``triton`` /
``triton-ascend``: callers ask here. Detection uses ``importlib`` only, so asking never
imports ``torch_npu``; it is imported when a device asks for it (``torch_device("npu")``).

Which backend runs the padded kernels (``specdec.kernels``):

    device type   kernels                    needs
    cuda          Triton (triton_padded.py)  ``triton``
    npu           Triton (triton_padded.py)  ``torch_npu`` and ``triton-ascend``
    anything else torch reference            --

The Triton interpreter (``TRITON_INTERPRET=1``) is for tests only; CPU always runs the
torch reference.
"""

import functools
import importlib
import importlib.metadata
import importlib.util
import os

import torch


@functools.cache
def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@functools.cache
def _has_distribution(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@functools.cache
def triton_available(device: torch.device) -> bool:
    """Whether the Triton kernels run on ``device`` (see the module table). An ``npu``
    device exists only once torch_npu is imported (``torch_device``)."""
    kind = torch.device(device).type
    if kind == "cuda":
        return _has_module("triton")
    if kind == "npu":
        return _has_module("torch_npu") and _has_distribution("triton-ascend")
    return False


# Code paths only a GPU can exercise that have not yet run on one: the Triton MLA kernel, the
# paged-attention window, the partial / interleaved rotary kernel, and cuda_graph with tensor
# parallelism (NCCL inside a graph). Off by default (the torch formulas / an error run instead)
# until this is "1"; set it for the first GPU run of tests/test_cuda.py, then make them the
# default.
UNVERIFIED_GPU_PATHS_ENV = "SPECDEC_UNVERIFIED_GPU_PATHS"


def unverified_gpu_paths() -> bool:
    """Whether the GPU paths not yet run on a GPU are switched on (``UNVERIFIED_GPU_PATHS_ENV``)."""
    return os.environ.get(UNVERIFIED_GPU_PATHS_ENV, "0") == "1"


def available_devices() -> list[str]:
    """The devices this process can use, e.g. ``['cpu']`` or ``['cpu', 'cuda:0', 'cuda:1']``."""
    found = ["cpu"]
    if torch.cuda.is_available():
        found += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    npu = getattr(torch, "npu", None)  # registered once torch_npu is imported
    if npu is not None and npu.is_available():
        found += [f"npu:{i}" for i in range(npu.device_count())]
    return found


def default_device() -> str:
    """The device an engine runs on when none is given (``LLM``, generate, serve, bench):
    ``cuda`` when this torch sees a CUDA device, else ``npu`` when torch_npu is installed
    and sees one, else ``cpu`` (vLLM's rule: the accelerator when one is present)."""
    if torch.cuda.is_available():
        return "cuda"
    if _has_module("torch_npu"):
        importlib.import_module("torch_npu")  # registers torch.npu
        if torch.npu.is_available():
            return "npu"
    return "cpu"


def torch_device(spec: str | torch.device) -> torch.device:
    """``torch.device(spec)``, importing ``torch_npu`` first for an ``npu`` device (it
    registers the device type). ValueError naming the available devices when ``spec`` is not
    a device, asks for ``npu`` without torch_npu, or is not available in this process
    (``torch_device("cuda")`` on a CPU-only build)."""
    if not isinstance(spec, (str, torch.device)):
        raise TypeError(f"device={spec!r}: must be a str or torch.device")
    name = str(spec)
    if name.split(":")[0] == "npu":
        if not _has_module("torch_npu"):
            raise ValueError(f"device={name!r} needs torch_npu, which is not installed; "
                             f"available: {available_devices()}")
        importlib.import_module("torch_npu")
    try:
        device = torch.device(spec)
    except RuntimeError as e:
        raise ValueError(f"device={name!r} is not a torch device; available: "
                         f"{available_devices()}") from e
    available = available_devices()
    index = 0 if device.index is None else device.index
    if device.type != "cpu" and f"{device.type}:{index}" not in available:
        raise ValueError(f"device={name!r} is not available in this process; available: "
                         f"{available}")
    return device


def compile_graph(fn, backend: str = "inductor"):
    """``fn`` compiled as one static graph per input shape: torchair's NPU backend when
    ``torch_npu`` and ``torchair`` are installed, else ``torch.compile`` with ``backend``
    ("inductor", "aot_eager", "eager", ...)."""
    if _has_module("torch_npu") and _has_module("torchair"):
        torchair = importlib.import_module("torchair")
        backend = torchair.get_npu_backend(compiler_config=torchair.CompilerConfig())
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)
