"""Every Triton kernel is launched through Triton's own ``kernel[grid](...)``, and the Triton
paths not yet run on a GPU are taken only when opted in.

A direct ``CompiledKernel[grid](*args)`` launch passed every CPU test and broke every
kernel's second launch on CUDA (its ``__getitem__`` indexes ``grid[0..2]``); nothing in the
package may call a compiled binary directly.
"""

import ast
import pathlib

import pytest
import torch

import specdec
from specdec import kernels, platform
from specdec.attention import KVCache, KVCacheSpec
from specdec.models.layers.rotary import RotaryEmbedding

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


# ---- Triton paths not yet run on a GPU are opt-in --------------------------------------------
@pytest.mark.parametrize("specs,unverified", [
    ([KVCacheSpec(2, 8)], False),
    ([KVCacheSpec(2, 8), KVCacheSpec(2, 8, sliding_window=4)], True),
    ([KVCacheSpec(1, 12, value_dim=8)], True),
])
def test_window_and_latent_caches_take_the_torch_formulas_unless_opted_in(
        specs, unverified, monkeypatch):
    monkeypatch.delenv(platform.UNVERIFIED_GPU_PATHS_ENV, raising=False)
    assert KVCache(specs, 1, 4, torch.float32, "cpu").torch_attention == unverified
    monkeypatch.setenv(platform.UNVERIFIED_GPU_PATHS_ENV, "1")
    assert not KVCache(specs, 1, 4, torch.float32, "cpu").torch_attention


def test_the_rope_and_cache_write_kernel_is_the_default_where_triton_runs(monkeypatch):
    """It has run on a GPU: no opt-in; paged caches take it where Triton runs, never on a CPU."""
    monkeypatch.delenv(platform.UNVERIFIED_GPU_PATHS_ENV, raising=False)
    assert not KVCache([KVCacheSpec(2, 8)], 1, 4, torch.float32, "cpu").fused_rope_write
    monkeypatch.setattr(platform, "triton_available", lambda device: True)
    assert KVCache([KVCacheSpec(2, 8)], 1, 4, torch.float32, "cpu").fused_rope_write


@pytest.mark.parametrize("params,interleaved,unverified", [
    ({"rope_theta": 1e4}, False, False),
    ({"rope_theta": 1e4, "partial_rotary_factor": 0.5}, False, True),
    ({"rope_theta": 1e4}, True, True),
])
def test_partial_and_interleaved_rope_skip_the_dispatcher_unless_opted_in(
        params, interleaved, unverified, monkeypatch):
    calls = []
    dispatched = kernels.apply_rope
    monkeypatch.setattr(kernels, "apply_rope",
                        lambda *a, **k: calls.append(1) or dispatched(*a, **k))
    rope = RotaryEmbedding(8, params, 64, interleaved=interleaved).tables(torch.arange(3),
                                                                          torch.float32)
    x = torch.randn(3, 2, 8)
    monkeypatch.delenv(platform.UNVERIFIED_GPU_PATHS_ENV, raising=False)
    default = rope.apply(x)
    assert len(calls) == (0 if unverified else 1)
    monkeypatch.setenv(platform.UNVERIFIED_GPU_PATHS_ENV, "1")
    assert torch.equal(rope.apply(x), default) and len(calls) == (1 if unverified else 2)
