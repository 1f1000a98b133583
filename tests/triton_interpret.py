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
