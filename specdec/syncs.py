"""Catch host-device synchronizations, on any device.

`forbid_host_sync()` raises `HostSyncError` on an op that would make the host wait
for the device on an accelerator; `count_host_syncs()` records such ops instead.
Both work on CPU too (where nothing really syncs) by intercepting torch calls with a
`TorchFunctionMode`, so the tests on a CPU box check the same rule. On CUDA,
`forbid_host_sync()` also turns on `torch.cuda.set_sync_debug_mode("error")`.

Intercepted: Tensor.item / tolist / cpu / numpy / __array__, `.to()` a CPU device,
__bool__ / __int__ / __float__ / __index__ / __format__ / __repr__ / __contains__,
nonzero, argwhere, one-argument where, masked_select, unique, unique_consecutive,
repeat_interleave with tensor repeats and no output_size, equal, allclose,
torch.tensor / as_tensor of Python data, and indexing (get or set) with a boolean
mask or a tensor slice bound. `x[mask] = python_scalar` is allowed (it becomes a
masked_fill, which does not sync).
"""

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

Tensor = torch.Tensor

_ALWAYS_SYNC = {
    Tensor.item: "Tensor.item",
    Tensor.tolist: "Tensor.tolist",
    Tensor.cpu: "Tensor.cpu",
    Tensor.numpy: "Tensor.numpy",
    Tensor.__array__: "Tensor.__array__",
    Tensor.__bool__: "Tensor.__bool__",
    Tensor.__int__: "Tensor.__int__",
    Tensor.__float__: "Tensor.__float__",
    Tensor.__index__: "Tensor.__index__",
    Tensor.__format__: "Tensor.__format__",
    Tensor.__repr__: "Tensor.__repr__",
    Tensor.__contains__: "Tensor.__contains__",
    Tensor.nonzero: "Tensor.nonzero",
    torch.nonzero: "torch.nonzero",
    torch.argwhere: "torch.argwhere",
    Tensor.argwhere: "Tensor.argwhere",
    torch.masked_select: "torch.masked_select",
    Tensor.masked_select: "Tensor.masked_select",
    torch.unique: "torch.unique",
    Tensor.unique: "Tensor.unique",
    torch.unique_consecutive: "torch.unique_consecutive",
    Tensor.unique_consecutive: "Tensor.unique_consecutive",
    torch.equal: "torch.equal",
    Tensor.equal: "Tensor.equal",
    torch.allclose: "torch.allclose",
    Tensor.allclose: "Tensor.allclose",
}


class HostSyncError(RuntimeError):
    """An op inside `forbid_host_sync()` would synchronize host and device."""


def _is_cpu(device) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cpu"


def _syncing_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    for part in parts:
        if isinstance(part, Tensor) and part.dtype == torch.bool:
            return True
        if isinstance(part, slice) and any(isinstance(b, Tensor)
                                           for b in (part.start, part.stop, part.step)):
            return True
    return False


def _getitem(args, kwargs) -> str | None:
    if _syncing_index(args[1]):
        return "Tensor.__getitem__ (boolean mask or tensor slice bound)"
    return None


def _setitem(args, kwargs) -> str | None:
    if _syncing_index(args[1]) and isinstance(args[2], Tensor):
        return "Tensor.__setitem__ (boolean mask or tensor slice bound)"
    return None


def _where(args, kwargs) -> str | None:
    return "torch.where (one argument: nonzero)" if len(args) + len(kwargs) == 1 else None


def _repeat_interleave(args, kwargs) -> str | None:
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if args else None)
    if isinstance(repeats, Tensor) and kwargs.get("output_size") is None:
        return "repeat_interleave (tensor repeats without output_size)"
    return None


def _from_python_data(name: str):
    def check(args, kwargs) -> str | None:
        if args and not isinstance(args[0], Tensor):
            return f"torch.{name} (from Python data)"
        return None
    return check


def _to(args, kwargs) -> str | None:
    targets = [*args[1:], kwargs.get("device")]
    if any(_is_cpu(t) for t in targets):
        return "Tensor.to (CPU)"
    if any(isinstance(t, Tensor) and t.device.type == "cpu" for t in targets) \
            and args[0].device.type != "cpu":
        return "Tensor.to (a CPU tensor)"
    return None


# func -> (args, kwargs) -> the op's name if that call would sync, else None. Every other
# function never syncs: one dict lookup decides for nearly every call the guards see.
_CHECKS = {func: (lambda args, kwargs, name=name: name) for func, name in _ALWAYS_SYNC.items()}
_CHECKS.update({
    Tensor.__getitem__: _getitem,
    Tensor.__setitem__: _setitem,
    torch.where: _where,
    torch.repeat_interleave: _repeat_interleave,
    Tensor.repeat_interleave: _repeat_interleave,
    torch.tensor: _from_python_data("tensor"),
    torch.as_tensor: _from_python_data("as_tensor"),
    Tensor.to: _to,
})


class _HostSide(threading.local):
    """This thread's ``host_side()`` / ``unguarded()`` nesting (the guard modes are per
    thread too: another thread's block must not blind this thread's guard)."""
    depth = 0


_host_side = _HostSide()


@contextmanager
def host_side():
    """Mark a block whose tensors live in host memory by design (e.g. gloo's CPU-group
    all-reduce buffers): reading them is not a host-device sync, so the guards skip it."""
    depth = _host_side.depth
    try:  # set inside the try: an interrupt while entering leaves the depth as it was
        _host_side.depth = depth + 1
        yield
    finally:
        _host_side.depth = depth


@contextmanager
def unguarded():
    """Suspend the guards for warm-up, graph capture and compilation (compilers and capture
    may sync by design): the guards prove the steady-state step, not its one-time set-up."""
    cuda = torch.cuda.is_available()
    previous = torch.cuda.get_sync_debug_mode() if cuda else 0
    with host_side():
        try:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
            yield
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(previous)


class _SyncMode(TorchFunctionMode):
    def __init__(self, on_sync):
        super().__init__()
        self.on_sync = on_sync

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        check = _CHECKS.get(func)
        # (traced into a graph by a compiler: a sync would break fullgraph; not checked)
        if check is not None and not _host_side.depth and not torch.compiler.is_compiling():
            name = check(args, kwargs)
            if name is not None:
                self.on_sync(name)
        return func(*args, **kwargs)


@contextmanager
def _guard(mode: _SyncMode):
    """``with mode:``, then the torch function mode stack back to its depth before, however
    the block ends: a KeyboardInterrupt (a signal handler's) can land between the mode's push
    and the ``with``'s set-up, or in its exit before the pop, and would leave the guard on
    for every later torch call of the thread."""
    depth = torch._C._len_torch_function_stack()
    try:
        with mode:
            yield
    finally:
        while torch._C._len_torch_function_stack() > depth:
            torch._C._pop_torch_function_stack()


def _raise(name: str):
    raise HostSyncError(f"host-device sync inside forbid_host_sync(): {name}")


@contextmanager
def forbid_host_sync():
    """Raise HostSyncError on any op that would synchronize host and device."""
    cuda = torch.cuda.is_available()
    if cuda:
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
    try:
        with _guard(_SyncMode(_raise)):
            yield
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(previous)


@dataclass
class SyncCount:
    ops: list[str] = field(default_factory=list)  # names of the syncing ops, in call order

    @property
    def count(self) -> int:
        return len(self.ops)


@contextmanager
def count_host_syncs():
    """Count (and name) the syncing ops run inside the block:
    `with count_host_syncs() as syncs: ...; syncs.count, syncs.ops`."""
    counter = SyncCount()
    with _guard(_SyncMode(counter.ops.append)):
        yield counter
