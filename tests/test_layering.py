"""The package layers, read from the source (every import, at module level or in a function):
the lowest modules and kernels, then models, proposers, engine, then the shared command flags
(``specdec/flags.py``) and training, the harnesses and the server, and the ``specdec``
command's dispatch on top; a module imports from its own layer or below. No family file
imports a registry (the registries import the families); the imports form no circle, neither
between modules nor between packages (two packages of one layer import each other one way
at most)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "specdec"
LAYERS = {"models": 1, "proposers": 2, "engine": 3, "flags": 4, "train": 4,
          "bench": 5, "entrypoints": 5, "commands": 6}  # anything else: 0
def module_name(path: Path) -> str:
    parts = ["specdec", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The specdec modules ``path`` imports, at module level or in a function (``from
    specdec.x import y`` is specdec.x.y when that is a module, else specdec.x)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
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
    """The registries (and the packages' ``__init__``, which re-export them) import the model
    files; none of those imports a registry back: every module of ``specdec.models``, the
    registries' families and the helpers beside them (``synthetic``, ``heads.training``)
    alike."""
    registries = {"specdec.models.registry", "specdec.models.heads.registry"}
    allowed = registries | {"specdec.models", "specdec.models.heads"}
    families = {m for m in MODULES if m.startswith("specdec.models.")} - allowed
    assert {"specdec.models.llama", "specdec.models.heads.eagle", "specdec.models.synthetic",
            "specdec.models.heads.training", "specdec.models.draft_lm"} <= families
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


def import_graph() -> dict[str, set[str]]:
    """module -> the specdec modules it imports (package ``__init__`` files included)."""
    return {m: imports(p) & set(MODULES) for m, p in MODULES.items()}


def package_graph(graph: dict[str, set[str]], depth: int) -> dict[str, set[str]]:
    """``graph`` between the packages ``depth`` names deep (2: specdec.engine, specdec.models,
    ...; 3: specdec.models.heads, ...); a shallower module is a node of its own."""
    def top(m):
        return ".".join(m.split(".")[:depth])
    packages: dict[str, set[str]] = {}
    for m, ns in graph.items():
        packages.setdefault(top(m), set()).update(top(n) for n in ns if top(n) != top(m))
    return packages


def test_package_graph_finds_a_circle_between_packages():
    graph = {"specdec.a.x": {"specdec.b.y"}, "specdec.b.z": {"specdec.a.w"}}
    assert cycle(graph) is None
    assert cycle(package_graph(graph, 2)) == ["specdec.a", "specdec.b", "specdec.a"]


def test_modules_form_no_circle():
    """Function-level imports count: a circle that only closes at call time is still one."""
    circle = cycle(import_graph())
    assert circle is None, " -> ".join(circle)


@pytest.mark.parametrize("depth", range(2, max(m.count(".") for m in MODULES) + 1))
def test_packages_form_no_circle(depth):
    """e.g. commands -> entrypoints (dispatch) and entrypoints -> commands (shared flags) is a
    circle, whichever modules the two imports sit in."""
    circle = cycle(package_graph(import_graph(), depth))
    assert circle is None, " -> ".join(circle)


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
