"""Launching a Triton kernel with little host time: Triton's binary, without its per-call binding.

``kernel[grid](*args)`` spends tens of µs of host time per call (measured on an H100 host with
triton 3.6: 23 µs for a 3-argument kernel, 60 µs for the 18-argument prep kernel): it binds and
specializes every argument, hashes a cache key, and its C launcher asks the driver to validate
every tensor's pointer (``cuPointerGetAttribute``). At decode batch sizes that is far more than
the kernel's own device time. ``Launcher`` launches through Triton on the first call of each
key (compiling, and validating the pointers once), keeps the compiled kernel Triton returns,
and afterwards calls it directly (``CompiledKernel[grid](*args)``, Triton's own entry point)
with the tensors passed as device addresses, which its launcher takes as they are.

That is sound when the key holds everything Triton specializes a binary on, by its rules:
each tensor's dtype and device and (unless ``do_not_specialize``/``_on_alignment``) whether
its address is 16-byte aligned; each int's width (i32, i64, u64) and (unless
``do_not_specialize``) whether it is 1 or a multiple of 16; every other argument's type; the
constexprs. ``tests/test_launch.py`` checks that two launches share a key exactly when
Triton's own cache key is shared. Only CUDA takes the direct path; under
``TRITON_INTERPRET=1`` and on an NPU every call goes through ``kernel[grid]``, with no key.
"""

import inspect

import torch
import triton
import triton.language as tl


def jit_unspecialized(fn):
    """``triton.jit`` with every runtime parameter ``do_not_specialize``: one compiled kernel
    for every batch size, stride and address (for kernels too small for the alignment and
    divisibility hints to matter)."""
    runtime = [name for name, p in inspect.signature(fn).parameters.items()
               if p.annotation is not tl.constexpr]
    return triton.jit(fn, do_not_specialize=runtime)


class Launcher:
    """``Launcher(kernel)(grid, *args, **constexprs)`` = ``kernel[grid](*args, **constexprs)``;
    ``args`` are the kernel's runtime parameters in order, ``constexprs`` its constexpr
    parameters, which must come last in the kernel's signature, in their declared order."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled: dict[tuple, object] = {}  # key -> triton CompiledKernel (CUDA only)
        params = getattr(kernel, "params", [])  # none on the interpreter's InterpretedFunction
        # False: every call through kernel[grid] (the interpreter; set on an NPU's first call)
        self.direct = bool(params)
        # per runtime parameter: (specialized on value, specialized on alignment)
        self.specialized = [(not p.do_not_specialize, not p.do_not_specialize and not
                             p.do_not_specialize_on_alignment)
                            for p in params if not p.is_constexpr]
        if [p.is_constexpr for p in params] != sorted(p.is_constexpr for p in params):
            raise ValueError(f"{kernel.fn.__name__}: constexpr parameters must come after the "
                             "runtime ones")

    def key_and_args(self, args: tuple, constexprs: dict) -> tuple[tuple, list]:
        """(cache key, the compiled kernel's arguments: tensors as device addresses, then the
        constexpr values)."""
        key = list(constexprs.values())
        flat = list(args)
        for i, (a, (by_value, by_alignment)) in enumerate(zip(args, self.specialized)):
            if isinstance(a, torch.Tensor):
                flat[i] = ptr = a.data_ptr()
                key.append((a.dtype, a.get_device(), by_alignment and ptr % 16 == 0))
            elif type(a) is int:
                width = 32 if -2**31 <= a < 2**31 else 64 if a < 2**63 else 65  # i32 i64 u64
                key.append((width, a == 1, a % 16 == 0) if by_value else width)
            else:
                key.append(type(a))
        return tuple(key), flat + list(constexprs.values())

    def __call__(self, grid: tuple[int, ...], *args, **constexprs) -> None:
        if not self.direct:
            self.kernel[grid](*args, **constexprs)
            return
        key, flat = self.key_and_args(args, constexprs)
        compiled = self.compiled.get(key)
        if compiled is not None:
            compiled[grid](*flat)
            return
        compiled = self.kernel[grid](*args, **constexprs)
        # the direct path is known to hold for a CUDA binary only (not an NPU's)
        if not (isinstance(compiled, triton.compiler.CompiledKernel)
                and any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)):
            self.direct = False
        elif list(constexprs) == [p.name for p in self.kernel.params if p.is_constexpr]:
            self.compiled[key] = compiled  # (constexprs in another order: Triton's path)
