"""kernels/launch.py's direct launch, checked against Triton's own launch path on CPU.

After its first launch a kernel is called through its compiled binary with the arguments
``Launcher.key_and_args`` builds, and a binary is reused for every launch with the same key.
So: (1) those arguments are exactly what Triton binds (tensors as their addresses, the
constexprs last), and (2) two launches share a key exactly when they share Triton's compile
cache key (with the CUDA backend's specialization rules): sharing a binary Triton would not
share would misread an argument. Both over recorded launches of every kernel the engine
launches: batch sizes, dtypes, constexpr variants, aligned and unaligned views, strides that
are and are not multiples of 16, ints equal to 1. The CUDA run itself is in test_cuda.py.
"""

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from specdec.kernels.launch import Launcher, jit_unspecialized  # noqa: E402
from specdec.kernels.reference import PaddedPrep  # noqa: E402
from triton_interpret import as_jit, compile_cache_keys, launch_args, load_interpreted  # noqa: E402

TP = load_interpreted("triton_padded")
NORM = load_interpreted("triton_norm")
ROPE = load_interpreted("triton_rope")
ATTN = load_interpreted("triton_paged_attention")
KERNELS = [TP._prepare_inputs_kernel, TP._shift_left_kernel, TP._scatter_kernel,
           TP._advance_draft_step_kernel, TP._padded_step_kernel, NORM._add_rms_norm_kernel,
           ROPE._rope_kernel, ATTN._paged_attention_kernel]


def randint(gen, low, high, shape, dtype=torch.int32):
    return torch.randint(low, high, shape, generator=gen, dtype=dtype)


def unaligned(t: torch.Tensor) -> torch.Tensor:
    """The same values at an address 4 bytes past a 16-byte boundary (or more for wide types)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape)
    return buf.copy_(t)


def padded_cases(gen):
    table = randint(gen, -1, 50, (40, 9))
    cases = []
    for b in (1, 16, 17):
        for int64 in (False, True):
            idx = torch.int64 if int64 else torch.int32
            for k in (0, 3, 4):
                cases.append(lambda b=b, idx=idx, k=k: TP.prepare_padded_step(
                    randint(gen, -1, 50, (b, k + 1)), torch.zeros(b, dtype=torch.bool), table,
                    torch.arange(b, dtype=idx), randint(gen, 0, 10, (b,)),
                    torch.arange(b, dtype=torch.int32), torch.arange(b + 1, dtype=torch.int32),
                    50, out=PaddedPrep.empty(b, "cpu")))
            cases.append(lambda b=b: TP.prepare_inputs_padded(
                torch.arange(b, dtype=torch.int32), torch.ones(b, dtype=torch.int32),
                torch.arange(b + 1, dtype=torch.int32)))
            cases.append(lambda b=b, idx=idx: TP.shift_first_pass_input_ids(
                torch.arange(b + 3, dtype=idx), torch.arange(b, dtype=idx),
                torch.arange(b, dtype=torch.int32)))
            num_reqs = torch.tensor(b, dtype=idx) if int64 else b
            cases.append(lambda b=b, num_reqs=num_reqs: TP.advance_draft_step(
                torch.arange(b), torch.ones(b, dtype=torch.int32), table, num_reqs, 4, 30))
    return cases


def model_cases(gen):
    """The forward's kernels: rows of 16 (aligned strides) and 24 / 12 elements, aligned and
    unaligned views, a one-column block table (its stride is 1)."""
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        for hidden in (16, 24):
            for view in (lambda t: t, unaligned):
                x, res = (view(torch.randn(3, hidden, generator=gen).to(dtype)) for _ in range(2))
                w = view(torch.ones(hidden, dtype=dtype))
                cases.append(lambda x=x, res=res, w=w: NORM.add_rms_norm(x, res, w, 1e-6))
        for d in (8, 12):
            qkv = torch.randn(3, 12, d, generator=gen).to(dtype)
            cos, sin = (torch.randn(3, 1, d, generator=gen).to(dtype) for _ in range(2))
            for heads in (8, 4):
                cases.append(lambda x=qkv[:, :heads], cos=cos, sin=sin: ROPE.apply_rope(x, cos,
                                                                                       sin))
            qsl = torch.tensor([0, 2, 3], dtype=torch.int32)
            seq_lens = torch.tensor([3, 2], dtype=torch.int32)
            for width in (1, 16, 5):
                table = torch.arange(2 * width, dtype=torch.int32).view(2, width)
                block_size = 4 if width > 1 else 8
                k, v = (torch.randn(2 * width * block_size, 2, d, generator=gen).to(dtype)
                        for _ in range(2))
                plan = ATTN.plan_paged_attention(qsl, seq_lens, table, 3, 8, block_size)
                cases.append(lambda q=qkv[:, :8], k=k, v=v, plan=plan: ATTN.paged_attention(
                    q, k, v, plan))
    return cases


@pytest.fixture(scope="module")
def recorded():
    """{interpreted kernel: [(args, kwargs) of each launch]} over every case."""
    gen = torch.Generator().manual_seed(1)
    cases = padded_cases(gen) + model_cases(gen)
    return {kernel: launch_args(kernel, lambda _: [case() for case in cases], [None])
            for kernel in KERNELS}


@pytest.mark.parametrize("kernel", KERNELS, ids=[k.fn.__name__ for k in KERNELS])
def test_launcher_passes_the_arguments_triton_binds(recorded, kernel):
    jit, binder, _ = as_jit(kernel)
    launcher = Launcher(jit)
    for args, kwargs in recorded[kernel]:
        bound, _, _ = binder(*args, **kwargs)
        expected = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in bound.values()]
        assert launcher.key_and_args(args, kwargs)[1] == expected


@pytest.mark.parametrize("kernel", KERNELS, ids=[k.fn.__name__ for k in KERNELS])
def test_launcher_key_selects_the_binary_triton_would(recorded, kernel):
    calls = recorded[kernel]
    launcher = Launcher(as_jit(kernel)[0])
    ours = [launcher.key_and_args(args, kwargs)[0] for args, kwargs in calls]
    tritons = compile_cache_keys(kernel, calls)
    assert len(set(ours)) == len(set(tritons)) == len(set(zip(ours, tritons)))


def test_the_recorded_launches_cover_several_binaries(recorded):
    binaries = {k.fn.__name__: len(set(compile_cache_keys(k, calls)))
                for k, calls in recorded.items()}
    # unspecialized: int32/int64 indices, K (BLOCK_COLS), num_reqs on the host or the device
    assert binaries["_padded_step_kernel"] == 6
    assert binaries["_shift_left_kernel"] == binaries["_advance_draft_step_kernel"] == 2
    # specialized: alignment, strides % 16, a stride of 1, on top of dtypes and constexprs
    assert binaries["_add_rms_norm_kernel"] > 2 * 2 and binaries["_paged_attention_kernel"] > 2 * 2


def test_an_int_out_of_int32_gets_its_own_binary():
    kernel = TP._prepare_inputs_kernel
    t = torch.zeros(4, dtype=torch.int32)
    calls = [((t, t, t, t, t, n), {"BLOCK_ROWS": 128}) for n in (5, 2**31 - 1, 2**31, 2**63)]
    launcher = Launcher(as_jit(kernel)[0])
    ours = [launcher.key_and_args(args, kwargs)[0] for args, kwargs in calls]
    tritons = compile_cache_keys(kernel, calls)
    assert len(set(ours)) == len(set(tritons)) == len(set(zip(ours, tritons))) == 3


def test_launcher_needs_the_constexprs_last():
    def kernel(x_ptr, n, BLOCK: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, BLOCK), n)

    def constexpr_first(BLOCK: tl.constexpr, x_ptr, n):
        tl.store(x_ptr + tl.arange(0, BLOCK), n)

    with pytest.raises(ValueError, match="constexpr parameters must come after"):
        Launcher(triton.jit(constexpr_first))
    assert Launcher(triton.jit(kernel)).specialized == [(True, True), (True, True)]
    assert Launcher(jit_unspecialized(kernel)).specialized == [(False, False), (False, False)]
