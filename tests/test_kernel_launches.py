"""Every Triton kernel is launched through Triton's own ``kernel[grid](...)``.

A direct ``CompiledKernel[grid](*args)`` launch passed every CPU test and broke every
kernel's second launch on CUDA (its ``__getitem__`` indexes ``grid[0..2]``); nothing in the
package may call a compiled binary directly.
"""

import ast
import pathlib

import specdec

PACKAGE = pathlib.Path(specdec.__file__).parent


def jit_kernels(tree: ast.Module) -> set[str]:
    """Names of the module's functions decorated with triton.jit / jit_unspecialized."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            for d in node.decorator_list:
                text = ast.unparse(d)
                if text in ("triton.jit", "jit_unspecialized") or text.startswith("triton.jit("):
                    names.add(node.name)
    return names


def host_code(tree: ast.Module, kernels: set[str]):
    """Every node outside the Triton functions (device code may call its @jit helpers)."""
    for stmt in tree.body:
        if not (isinstance(stmt, ast.FunctionDef) and stmt.name in kernels):
            yield from ast.walk(stmt)


def test_no_compiled_kernel_is_called_directly():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        kernels = jit_kernels(tree)
        launches = set()
        for node in host_code(tree, kernels):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) and \
                    isinstance(node.func.value, ast.Name):
                launches.add(id(node.func.value))  # kernel[grid](...)
        for node in host_code(tree, kernels):
            if "CompiledKernel" in (getattr(node, "id", None), getattr(node, "attr", None)):
                offenders.append(f"{path.name}:{node.lineno} names CompiledKernel")
            elif isinstance(node, ast.Name) and node.id in kernels and id(node) not in launches:
                offenders.append(f"{path.name}:{node.lineno} uses {node.id} other than "
                                 "as kernel[grid](...)")
    assert not offenders, offenders


def test_every_kernel_module_launches_its_kernels():
    """Control for the check above: it sees the kernels and their launches."""
    tree = ast.parse((PACKAGE / "kernels" / "triton_padded.py").read_text())
    kernels = jit_kernels(tree)
    assert "_padded_step_kernel" in kernels
    launched = {n.func.value.id for n in ast.walk(tree) if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Subscript) and isinstance(n.func.value, ast.Name)}
    assert {k for k in kernels if k.endswith("_kernel")} <= launched
