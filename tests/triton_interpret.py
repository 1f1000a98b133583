"""Load a private copy of one specdec/kernels module whose Triton kernels run in the interpreter."""

import importlib.util
import os

import specdec.kernels as kernels


def load_interpreted(name: str):
    """A private copy of ``specdec/kernels/{name}.py`` whose kernels run in the Triton
    interpreter. Setting TRITON_INTERPRET around this one import is enough even when triton
    was imported before (the kernels use builtins and local @jit helpers only); the variable
    is restored, so specdec.kernels' own copy stays compiled on a GPU box."""
    path = os.path.join(os.path.dirname(kernels.__file__), f"{name}.py")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        spec = importlib.util.spec_from_file_location(f"{name}_interpreted", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    return module


# ---- what a GPU would do with an interpreted kernel's launches (no GPU needed) ----

CUDA_TARGET = ("cuda", 90, 32)  # an H100: backend, compute capability, warp size


def launch_args(kernel, launch, batch_sizes):
    """(args, kwargs) of each launch of ``kernel`` made by ``launch(b)`` for each b."""
    calls = []

    def record(*args, **kwargs):
        calls.append((args, kwargs))
    kernel.add_pre_run_hook(record)
    try:
        for b in batch_sizes:
            launch(b)
    finally:
        kernel.pre_run_hooks.remove(record)
    return calls


def as_jit(kernel, **jit_options):
    """(JITFunction of the interpreted ``kernel``'s source, its argument binder, the CUDA
    backend): triton's own objects, as a CUDA process would build them."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    jit = JITFunction(kernel.fn, **{**kernel.kwargs, **jit_options})
    backend = make_backend(GPUTarget(*CUDA_TARGET))
    return jit, create_function_from_signature(jit.signature, jit.params, backend), backend


def compile_cache_keys(kernel, calls, **jit_options) -> list[str]:
    """The compile-cache key a compiled JITFunction of ``kernel``'s source would look up for
    each launch: triton's own binder and key function, with the CUDA backend's
    specialization rules (the interpreter itself keeps no compile cache)."""
    from triton.runtime.jit import compute_cache_key

    _, binder, _ = as_jit(kernel, **jit_options)
    keys = []
    for args, kwargs in calls:
        _, specialization, options = binder(*args, **kwargs)
        keys.append(compute_cache_key({}, specialization, options))
    return keys


def jit_twin(kernel):
    """The compiled-mode JITFunction of an interpreted ``kernel``: the same kernel from
    specdec.kernels' own import (its @jit helpers are JITFunctions too, as the compiler
    needs)."""
    import importlib

    module = importlib.import_module("specdec.kernels." + kernel.fn.__module__.removesuffix(
        "_interpreted"))
    return getattr(module, kernel.fn.__name__)


def compile_for_cuda(kernel, args, kwargs):
    """Compile ``kernel`` (interpreted) for these launch arguments the way triton's JIT does
    on an H100, down to the cubin (triton ships ptxas, so no GPU is needed). Returns the
    CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    _, binder, backend = as_jit(kernel)
    bound, specialization, options = binder(*args, **kwargs)
    twin = jit_twin(kernel)
    options, signature, constexprs, attrs = twin._pack_args(backend, kwargs, bound,
                                                            specialization, options)
    return triton.compile(ASTSource(twin, signature, constexprs, attrs),
                          target=GPUTarget(*CUDA_TARGET), options=options.__dict__)
