"""Graph mode as a wrapper: run a static-shape step function once per bucket with a backend.

A *step function* takes tensors whose shapes are fixed by the bucket (the padded token and
request counts (Np, Bp)), plus *static* keyword values (Python values baked into the graph, part
of its key), and returns a tensor or a tuple of tensors; it reads nothing on the host. The
runner's target step and every proposer's padded draft step are such functions, so one
wrapper gives each of them every backend:

    backend      what a call does
    eager        fn(*args)
    compile      torch.compile(fn, fullgraph=True, dynamic=False): one graph per key
    compile_dynamic  torch.compile(fn, fullgraph=True, dynamic=True): sizes and int static
                 values symbolic, so one graph serves every step of a code path (a new
                 path -- a row layout, a sampling variant -- compiles once at its first use;
                 a step compiled in parts, ``compiled_in_parts``, compiles only the part
                 whose path is new);
                 the runner sends every step through it, not only capture buckets (CPU:
                 inductor fuses the per-op work of small-batch steps into C++ loops). The
                 weights are graph inputs, not frozen constants (``compile_dynamic``)
    torchair     the same through torchair's NPU backend when torch_npu + torchair are
                 installed (specdec.platform.compile_graph), torch.compile elsewhere
    cuda_graph   per key: the first call's args become the static inputs; warm up, capture
                 once with torch.cuda.CUDAGraph (one memory pool shared by every key);
                 later calls copy in each arg not already at its static input's address,
                 and replay. Returns the static outputs.
    replay       the cuda_graph code path without a graph (static inputs and outputs per
                 key, fn run eagerly on the static inputs): proves the capture logic on CPU

The key of a call is (bucket, static values). With cuda_graph/replay the returned tensors are
the key's static outputs: read them before the next call with the same key. ``graphs`` counts
the graphs a wrapper made: a key captured, or each graph dynamo compiled during its calls (a
new key or code path, or a guard that failed).
"""

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec import platform
from specdec.syncs import unguarded

BACKENDS = ("eager", "compile", "compile_dynamic", "torchair", "cuda_graph", "replay")
COMPILING = ("compile", "compile_dynamic", "torchair")


@dataclass(frozen=True)
class Backend:
    """A step wrapper backend, checked once (``resolve_backend``); every other place asks it
    what it does instead of spelling backend names. ``compile_backend``: torch.compile's
    backend where the step is compiled (inductor by default), None where nothing compiles."""

    name: str
    compile_backend: str | None = None

    def __post_init__(self):
        if self.name not in BACKENDS:
            raise ValueError(f"graph_backend={self.name!r}; allowed: {BACKENDS}")
        if self.compiles:
            object.__setattr__(self, "compile_backend", self.compile_backend or "inductor")
            compilers = torch._dynamo.list_backends(exclude_tags=())
            if self.compile_backend not in compilers:
                raise ValueError(f"compile_backend={self.compile_backend!r}; allowed: "
                                 f"{compilers}")
        elif self.compile_backend is not None:
            raise ValueError(f"compile_backend={self.compile_backend!r} is for a compiling "
                             f"graph backend ({', '.join(COMPILING)}); this engine's is "
                             f"{self.name!r} (graph_backend, or "
                             "speculative_config graph_mode 'torchair')")

    @property
    def captures(self) -> bool:
        """Steps replay static inputs and outputs per key (cuda_graph; replay on any device):
        mixed steps are captured too, uniform decodes at start-up."""
        return self.name in ("cuda_graph", "replay")

    @property
    def compiles(self) -> bool:
        return self.name in COMPILING

    @property
    def eager(self) -> bool:
        """Every step runs its step function as it is: nothing captured or compiled."""
        return self.name == "eager"

    @property
    def dynamic(self) -> bool:
        """Every step runs one dynamically compiled step (sizes symbolic, no capture keys);
        its code paths are compiled on throwaway requests at start-up."""
        return self.name == "compile_dynamic"

    @property
    def fixed_shapes(self) -> bool:
        """Uniform decodes run a graph per capture bucket, so a padded decode keeps 1 + K
        tokens (filler after fewer drafts); eager and compile_dynamic steps take any shape."""
        return self.name not in ("eager", "compile_dynamic")


EAGER = Backend("eager")  # the default of a runner or proposer built alone (tests, tools)


def _as_tuple(out) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _dynamo_graphs() -> int:
    """Graphs dynamo has compiled in this process (a few dict reads)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _shapes_symbolic_only(compiled: Callable) -> Callable:
    """``compiled`` traced with sizes and ints symbolic, nothing else: no duck sizing (two
    sizes equal at the first call -- a view's storage offset and the token count -- stay two
    symbols, not a guard that recompiles when they differ) and Python floats (norm eps,
    scales) baked in as constants, not graph inputs wrapped in a host tensor per call;
    outside any torch function mode of the caller (``_outside_torch_function_modes``).
    The two settings are set and restored by hand around each call: ``config.patch``
    builds a context class per call (~50 us; a CPU step makes about four such calls), and
    dynamo reads them only when it traces, which any call may."""
    from torch.fx.experimental import _config as shape_config
    dynamo_config = torch._dynamo.config

    @functools.wraps(compiled)
    def run(*args, **kwargs):
        duck, floats = shape_config.use_duck_shape, dynamo_config.specialize_float
        shape_config.use_duck_shape, dynamo_config.specialize_float = False, True
        try:
            return compiled(*args, **kwargs)
        finally:
            shape_config.use_duck_shape, dynamo_config.specialize_float = duck, floats
    return _outside_torch_function_modes(run)


def _outside_torch_function_modes(compiled: Callable) -> Callable:
    """``compiled`` called with the torch function mode stack empty (restored after): dynamo
    would trace a caller's mode (``check_host_syncs``' sync counter) into every op of the graph
    and guard on it, so a step compiled under it would compile again without it."""
    @functools.wraps(compiled)
    def run(*args, **kwargs):
        modes = [torch._C._pop_torch_function_stack()
                 for _ in range(torch._C._len_torch_function_stack())]
        try:
            return compiled(*args, **kwargs)
        finally:
            for mode in reversed(modes):
                torch._C._push_on_torch_function_stack(mode)
    return run


def _size_asserts() -> bool:
    """Inductor's checks of each input's and extern kernel output's sizes and strides in the
    generated code: off (as vLLM's CPU backend has them), since dynamo's guards check the
    inputs already and on a CPU they cost ~2 us each, about a hundred a decode step;
    TORCHINDUCTOR_SIZE_ASSERTS=1 (inductor's own switch) turns them on to debug."""
    return os.environ.get("TORCHINDUCTOR_SIZE_ASSERTS") == "1"


def compile_dynamic(fn: Callable, compile_backend: str, *,
                    realize_reused: bool = False) -> Callable:
    """``fn`` as the compile_dynamic backend compiles it: full graph, sizes and ints symbolic
    (``_shapes_symbolic_only``), no size asserts (``_size_asserts``). The weights stay graph
    inputs: inductor's ``freezing`` as a compile option froze nothing (dynamo passes a
    model's weights in as inputs unless inductor's global flag is on while it traces), and
    frozen for real (that flag on), a one-request CPU step's float32 matmuls read them
    packed and took 1.32x the time (docs/benchmarks.md, "Weights are graph inputs").
    ``realize_reused``: inductor stores every value read twice instead of inlining it into
    each reader -- for a part that draws counter-based random numbers, whose xor-shifts read
    each value twice: inlined, the loop body doubles with each of them (nine deep), and one
    sampled graph took ~40 s to generate on this 2-core machine instead of ~15 s."""
    options = None
    if compile_backend == "inductor":
        options = {"size_asserts": _size_asserts()} | (
            {"realize_reads_threshold": 1} if realize_reused else {})
    return _shapes_symbolic_only(torch.compile(fn, fullgraph=True, dynamic=True,
                                               backend=compile_backend, options=options))


class _Captured:
    """One bucket's static inputs and outputs (and its CUDA graph, on cuda_graph).

    The first call's arguments become the static inputs (held, so their memory stays
    theirs): persistent buffers passed again at the same address -- the runner's step
    buffers, a captured step's outputs -- cost no copy; any other argument is copied in."""

    def __init__(self, fn: Callable, args: tuple[torch.Tensor, ...], use_cuda_graph: bool,
                 pool):  # fn: the step function with its static values bound
        self.fn = fn
        self.inputs = args
        self.graph = None
        if use_cuda_graph:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: lazy inits and allocator pools outside capture
                    fn(*self.inputs)
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.outputs = _as_tuple(fn(*self.inputs))
            self.graph.replay()  # capturing does not run the work
        else:
            self.outputs = tuple(o.clone() for o in _as_tuple(fn(*self.inputs)))

    def load(self, args: tuple[torch.Tensor, ...]) -> None:
        for static, a in zip(self.inputs, args):
            if static.data_ptr() != a.data_ptr():
                static.copy_(a)


def _taking(fn: Callable, inputs_type: type) -> Callable:
    """``fn`` taking its tensors positionally: packed into ``inputs_type`` (a NamedTuple)."""
    def step(*args: torch.Tensor, **static):
        return fn(inputs_type(*args), **static)
    return step


class StepGraph:
    """``StepGraph(fn, backend)(bucket, *args, **static)``: ``fn(*args, **static)`` through
    the backend; ``run`` picks, for one step, whether that is the captured, compiled or eager
    call.

    ``bucket`` (hashable, e.g. (Np, Bp)) and the static values key the captured graphs; every
    positional arg must be a tensor whose shape is fixed by the bucket (a Python value there
    would be baked into a captured graph silently: pass it as a static value instead).
    On ``compile_dynamic`` there are no keys: ``bucket`` is ignored, int static values are
    symbolic and dynamo's guards pick the graph.
    ``inputs_type``: a NamedTuple class that ``fn`` takes its tensors as (its one positional
    argument); the wrapper still passes them positionally (it keys and copies per tensor).
    ``compiled_in_parts``: on compile_dynamic, what runs instead of ``fn`` compiled whole:
    ``fn``'s work with its parts compiled apart (``compile_dynamic`` above), so a part that
    does not read a static value is not traced again for each of its values (the target
    step's forward: once per row layout, not once per sampling variant).
    """

    def __init__(self, fn: Callable, backend: Backend, inputs_type: type | None = None,
                 compiled_in_parts: Callable | None = None):
        if inputs_type is not None:
            fn = _taking(fn, inputs_type)
            if compiled_in_parts is not None:
                compiled_in_parts = _taking(compiled_in_parts, inputs_type)
        self.fn = fn
        self.backend = backend
        self.captured: dict[tuple, _Captured] = {}  # cuda_graph / replay, by key
        self.seen: set[tuple] = set()  # keys called once (compiled, captured or warmed)
        self.pool = None
        name, compile_backend = backend.name, backend.compile_backend
        if backend.compiles:
            # one graph per key by design (a capture bucket and its static values), not
            # recompilations to be warned about; dynamo counts them per code object
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 128)
        if name == "compile":
            self.compiled = _outside_torch_function_modes(torch.compile(
                fn, fullgraph=True, dynamic=False, backend=compile_backend))
        elif name == "compile_dynamic":
            self.compiled = compiled_in_parts or compile_dynamic(fn, compile_backend)
        elif name == "torchair":
            self.compiled = _outside_torch_function_modes(platform.compile_graph(
                fn, compile_backend))
        else:
            self.compiled = fn
        self.calls = 0  # calls that went through the backend (graph replays on cuda_graph)
        self.graphs = 0  # graphs made: keys captured, graphs dynamo compiled in its calls

    def __call__(self, bucket, *args: torch.Tensor, **static):
        bad = [type(a).__name__ for a in args if not isinstance(a, torch.Tensor)]
        if bad:
            raise TypeError(f"step arguments must be tensors (a Python value would be baked "
                            f"into a captured graph); got {bad}")
        self.calls += 1
        if self.backend.eager:  # nothing to set up: every call is the steady state
            return self.compiled(*args, **static)
        if self.backend.dynamic:
            return self._compiled(*args, **static)
        key = (bucket, *sorted(static.items()))
        captures = self.backend.captures
        if key not in self.seen:  # compile / capture outside the sync guards
            self.seen.add(key)
            with unguarded():
                if not captures:
                    return self._compiled(*args, **static)
                self.graphs += 1
                on_cuda = self.backend.name == "cuda_graph"
                if on_cuda and self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                entry = self.captured[key] = _Captured(
                    functools.partial(self.fn, **static), args, on_cuda,
                    self.pool)
        elif not captures:
            return self._compiled(*args, **static)
        else:
            entry = self.captured[key]
            entry.load(args)
            if entry.graph is not None:
                entry.graph.replay()
            else:
                for out, new in zip(entry.outputs, _as_tuple(entry.fn(*entry.inputs))):
                    out.copy_(new)
        return entry.outputs if len(entry.outputs) > 1 else entry.outputs[0]

    def _compiled(self, *args: torch.Tensor, **static):
        """The compiled call; ``graphs`` counts what dynamo compiled during it."""
        before = _dynamo_graphs()
        out = self.compiled(*args, **static)
        self.graphs += _dynamo_graphs() - before
        return out

    def run(self, inputs: tuple[torch.Tensor, ...], *, capturable: bool, bucket: tuple,
            captured: dict, own: dict, **static):
        """One step: the one place that picks captured, compiled or eager.

        ``inputs``: the step's tensors; ``captured`` / ``own``: the host bounds (static values)
        of a captured step of this key and this step's own (tight) ones; ``static``: the other
        static values. A ``capturable`` step (``StepPlan.capturable``) runs through the backend
        keyed by ``bucket`` with the captured bounds; any other step runs compiled on
        ``compile_dynamic`` (every step, no keys), else eagerly, with its own bounds."""
        if capturable:
            return self(bucket, *inputs, **captured, **static)
        if self.backend.dynamic:
            return self(None, *inputs, **own, **static)
        return self.fn(*inputs, **own, **static)


GRAPH_MODE_BACKENDS = {"eager": "eager", "torchair": "torchair", "full_cuda_graph": "cuda_graph"}


def default_backend(device: torch.device, *, tensor_parallel_size: int = 1,
                    cross_rank: bool = False) -> str:
    """The backend when neither ``graph_backend`` nor ``graph_mode`` is given: ``cuda_graph``
    on CUDA (the captured step, equal to eager token for token: tests/test_cuda.py), else
    eager. Eager on CUDA too where a captured step is refused: several TP ranks (NCCL inside
    a graph has not run here) or ``cross_rank`` (a MoE model under DP: host-side collectives).
    NPU keeps eager (torchair is asked for with graph_mode)."""
    if torch.device(device).type == "cuda" and tensor_parallel_size == 1 and not cross_rank:
        return "cuda_graph"
    return "eager"


def resolve_backend(graph_mode: str | None, graph_backend: str | None,
                    device: torch.device, *, tensor_parallel_size: int = 1,
                    data_parallel_size: int = 1, cross_rank: bool = False,
                    compile_backend: str | None = None) -> Backend:
    """The step wrapper backend, checked: ``graph_backend`` if given, else the one of
    ``speculative_config.graph_mode``, else ``default_backend`` (cuda_graph on CUDA, eager
    elsewhere). ``cross_rank``: the target or head has MoE layers that exchange tokens over
    the DP group. ValueError on a conflict, on cuda_graph off CUDA, on ``compile_backend``
    where nothing compiles, and where the ranks' host-side collectives cannot run inside the
    step (``check_parallel``)."""
    from_mode = GRAPH_MODE_BACKENDS[graph_mode] if graph_mode is not None else None
    if graph_backend is not None:
        Backend(graph_backend)  # the name checked before it is compared
    if graph_backend is not None and from_mode not in (None, graph_backend):
        raise ValueError(f"graph_backend={graph_backend!r} conflicts with speculative_config "
                         f"graph_mode={graph_mode!r} (backend {from_mode!r})")
    name = graph_backend or from_mode or default_backend(
        device, tensor_parallel_size=tensor_parallel_size,
        cross_rank=cross_rank and data_parallel_size > 1)
    if name == "cuda_graph" and device.type != "cuda":
        given = ("graph_backend='cuda_graph'" if graph_backend else
                 "speculative_config graph_mode='full_cuda_graph' (backend 'cuda_graph')")
        allowed = [b for b in BACKENDS if b != "cuda_graph"] if graph_backend else [
            m for m in GRAPH_MODE_BACKENDS if m != "full_cuda_graph"]
        raise ValueError(f"{given} needs a CUDA device, got device={str(device)!r}; allowed "
                         f"here: {', '.join(allowed)}")
    backend = Backend(name, compile_backend)
    check_parallel(backend, tensor_parallel_size, data_parallel_size if cross_rank else 1)
    return backend


def check_parallel(backend: Backend, tensor_parallel_size: int,
                   cross_rank_size: int = 1) -> None:
    """TP steps run eager or ``replay`` (CPU, gloo): torch.compile cannot trace the gloo
    collectives of a step; NCCL inside a CUDA graph has not run here (one GPU at most):
    opt-in with ``specdec.platform.unverified_gpu_paths()``. A MoE model whose layers exchange
    tokens over ``cross_rank_size`` > 1 DP ranks runs eager (host-side gloo collectives)."""
    if cross_rank_size > 1 and not backend.eager:
        raise ValueError(f"graph backend {backend.name!r} with a MoE (cross-rank) model needs "
                         f"data_parallel_size=1, got {cross_rank_size}: its host-side gloo "
                         "collectives cannot run inside a captured or compiled step")
    if tensor_parallel_size == 1 or backend.name in ("eager", "replay"):
        return
    if backend.name == "cuda_graph" and platform.unverified_gpu_paths():
        return
    raise ValueError(
        f"graph_backend={backend.name!r} with tensor_parallel_size={tensor_parallel_size}: "
        "allowed 'eager' or 'replay' ('cuda_graph' needs SPECDEC_UNVERIFIED_GPU_PATHS=1: NCCL "
        "collectives inside a captured graph have not run on a multi-GPU machine here; the "
        "compiling backends cannot trace the step's host-side gloo collectives)")
