"""The package layers, read from the source (every import, at module level or in a function):
the lowest modules and kernels, then models, proposers, engine, then the commands (bench,
entrypoints, commands, train); a module imports from its own layer or below. No family file
imports a registry (the registries import the families), and neither the head modules nor
the module-level imports of the package as a whole form a circle."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "specdec"
LAYERS = {"models": 1, "proposers": 2, "engine": 3,
          "train": 4, "bench": 4, "entrypoints": 4, "commands": 4}  # anything else: 0


def module_name(path: Path) -> str:
    parts = ["specdec", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, module_level_only: bool = False) -> set[str]:
    """The specdec modules ``path`` imports (``from specdec.x import y`` is specdec.x.y when
    that is a module, else specdec.x)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("specdec")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specdec"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in MODULES else node.module)
    return found


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.get(parts[1], 0) if len(parts) > 1 else 0


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "specdec"))
def test_no_module_imports_a_higher_layer(module):
    up = {m for m in imports(MODULES[module]) if layer(m) > layer(module)}
    assert not up, f"{module} (layer {layer(module)}) imports {sorted(up)}"


def test_no_family_file_imports_a_registry():
    """The registries import the target and head families (and what those import); none of
    those imports a registry back (``heads.training``, which no registry imports, may)."""
    registries = {"specdec.models.registry", "specdec.models.heads.registry"}
    seen, todo = set(), list(registries)
    while todo:
        for m in imports(MODULES[todo.pop()]) & set(MODULES):
            if m not in seen and m not in registries:
                seen.add(m)
                todo.append(m)
    families = {m for m in seen if m.startswith("specdec.models.")}
    assert {"specdec.models.llama", "specdec.models.heads.eagle"} <= families
    offenders = {m: sorted(imports(MODULES[m]) & registries) for m in families}
    assert not {m: r for m, r in offenders.items() if r}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` (module -> modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n, path + [n])):
                return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m, [m])):
            return found
    return None


def test_cycle_finds_a_circle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_head_modules_form_no_circle():
    heads = {m: imports(p) & set(MODULES) for m, p in MODULES.items()
             if m.startswith("specdec.models.heads.")}
    assert len(heads) >= 5 and cycle(heads) is None


def test_module_level_imports_form_no_circle():
    """Package ``__init__`` files re-export and are left out; a lazy import in a function
    body (a rank process building its engine) is not a circle at import time."""
    graph = {m: {n for n in imports(p, module_level_only=True) if n in MODULES}
             for m, p in MODULES.items() if p.name != "__init__.py"}
    assert cycle(graph) is None


SERVE_STACK = ("uvicorn", "fastapi", "starlette", "aiohttp", "httpx", "openai",
               "prometheus_client")


def test_the_cuda_tests_need_no_serve_stack():
    """tests/test_cuda.py on a box with torch, triton and pytest alone (a GPU image): the
    serve stack unimportable, it is collected (and skipped here, on CPU) without an error."""
    import subprocess
    import sys
    blocked = "; ".join(f"sys.modules[{m!r}] = None" for m in SERVE_STACK)
    code = (f"import sys; {blocked}; import pytest; sys.exit(pytest.main(['tests/test_cuda.py', "
            "'-q', '-p', 'no:cacheprovider', '-o', 'addopts=', '--collect-only']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=ROOT.parent, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "test_cuda_graph_steps_equal_eager" in r.stdout
