"""On CUDA (skipped elsewhere): captured steps equal eager ones token for token, and the
padded step runs under ``torch.cuda.set_sync_debug_mode("error")`` with no sync."""

import pytest
import torch

from specdec import LLM
from specdec.engine.runner import STARTUP_VARIANTS

from helpers import run_arrivals, uniform_flags

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self,",
           "for i in range(10):"]


def speculative_config(method, spec_extra=None) -> dict | None:
    spec = None if method is None else {"method": method, "num_speculative_tokens": 3,
                                        **(spec_extra or {})}
    if method == "draft_model":  # the target's own folder drafts (accepted at every position)
        from specdec.engine.llm import DEFAULT_MODEL
        spec["model"] = str(DEFAULT_MODEL)
    return spec


def build(method, backend, spec_extra=None, **kw):
    return LLM(speculative_config=speculative_config(method, spec_extra), device="cuda",
               dtype=torch.float32, graph_backend=backend, max_num_seqs=4, **kw)


def generate(method, backend, **kw):
    llm = build(method, backend, **kw)
    outs = llm.generate(PROMPTS, max_tokens=48)
    return [o.token_ids for o in outs], [o.num_accepted for o in outs], llm


def assert_captured_cuda_equals_cpu():
    """EAGLE-3 K=3 captured on CUDA gives the CPU torch path's greedy tokens and acceptance
    (float32) -> the CUDA engine."""
    cuda, cuda_acc, llm = generate("eagle3", "cuda_graph")
    spec = {"method": "eagle3", "num_speculative_tokens": 3}
    outs = LLM(speculative_config=spec, device="cpu", dtype=torch.float32,
               max_num_seqs=4).generate(PROMPTS, max_tokens=48)
    assert cuda == [o.token_ids for o in outs]
    assert cuda_acc == [o.num_accepted for o in outs]
    return llm


@pytest.mark.parametrize("method", [None, "mtp", "eagle", "eagle3", "draft_model"])
def test_cuda_graph_steps_equal_eager(method):
    eager, eager_acc, _ = generate(method, "eager")
    captured, captured_acc, llm = generate(method, "cuda_graph")
    assert captured == eager and captured_acc == eager_acc
    assert llm.runner.target_graph.captured  # decode steps really replayed graphs


@pytest.mark.parametrize("backend", ["eager", "cuda_graph"])
def test_padded_steps_run_under_the_cuda_sync_error_mode(backend):
    _, _, llm = generate("eagle3", backend, check_host_syncs=True)
    assert {s.host_syncs for s in llm.steps if s.num_reqs} == {0}


def test_cuda_kernels_give_the_cpu_tokens():
    """The CUDA path (Triton paged attention, rotary, add+RMSNorm, prep) against the CPU's
    torch formulas: the same greedy tokens and acceptance, float32, captured."""
    assert_captured_cuda_equals_cpu()


@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_torchair_graph_mode_compiles_and_equals_eager_on_cuda(method):
    eager, eager_acc, _ = generate(method, "eager")
    spec = {"method": method, "num_speculative_tokens": 3, "graph_mode": "torchair"}
    llm = LLM(speculative_config=spec, device="cuda", dtype=torch.float32, max_num_seqs=4,
              check_host_syncs=True)
    outs = llm.generate(PROMPTS, max_tokens=48)
    assert [o.token_ids for o in outs] == eager
    assert llm.runner.proposer.step_graph.seen  # compiled buckets ran


def test_padded_kernels_equal_the_torch_reference_at_every_batch_size():
    """One compiled binary per padded kernel serves every batch size (do_not_specialize);
    every call, any batch size and index dtype, must equal the reference."""
    from specdec.kernels import reference, triton_padded as tp

    gen = torch.Generator().manual_seed(0)
    table = torch.randint(-1, 50, (300, 9), generator=gen, dtype=torch.int32)
    for b in (1, 5, 64, 129, 1, 300):
        for rows_dtype in (torch.int32, torch.int64):
            sampled = torch.randint(-1, 50, (b, 4), generator=gen, dtype=torch.int32)
            args = (sampled, torch.rand(b, generator=gen) < 0.2, table,
                    torch.randperm(300, generator=gen)[:b].to(rows_dtype),
                    torch.randint(0, 12, (b,), generator=gen, dtype=torch.int32),
                    torch.arange(b, dtype=torch.int32) * 3,
                    torch.arange(b + 1, dtype=torch.int32) * 4, 50)
            expected = reference.prepare_padded_step(
                *args, out=reference.PaddedPrep.empty(b, "cpu"))
            cuda = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
            got = tp.prepare_padded_step(*cuda, out=reference.PaddedPrep.empty(b, "cuda"))
            assert all(torch.equal(g.cpu(), e) for g, e in zip(got, expected)), (b, rows_dtype)
            positions = torch.randint(0, 40, (b,), generator=gen)
            step_args = (positions, args[4], table[:b], b // 2, 4, 30)
            expected = reference.advance_draft_step(*step_args)
            got = tp.advance_draft_step(*[a.cuda() if isinstance(a, torch.Tensor) else a
                                          for a in step_args])
            assert all(torch.equal(g.cpu(), e) for g, e in zip(got, expected)), b
    with pytest.raises(ValueError, match="cpu tensor"):  # a host tensor is refused, not read
        tp.prepare_padded_step(*cuda[:6], args[6], 50, out=reference.PaddedPrep.empty(b, "cuda"))


def test_the_default_backend_on_cuda_is_cuda_graph():
    llm = LLM(device="cuda", max_num_seqs=4)
    assert llm.graph_backend == "cuda_graph" and llm.runner.target_graph.captured
    assert llm.startup.startswith("cuda_graph: ")


@pytest.mark.parametrize("method", [None, "eagle3"])
def test_captured_mixed_and_sampled_steps_equal_eager(method):
    """Steps with prefill chunks and sampled requests replay CUDA graphs (every step fits a
    capture size here) with eager's tokens and acceptance (counter-based random numbers)."""
    kw = dict(capture_sizes=(1, 2, 4, 8, 16, 32, 64), max_num_batched_tokens=32)
    eager = run_arrivals(build(method, "eager", **kw), PROMPTS)
    llm = build(method, "cuda_graph", **kw)
    assert run_arrivals(llm, PROMPTS) == eager
    assert all(s.captured for s in llm.steps if s.num_reqs)


@pytest.mark.parametrize("method", [None, "eagle3"])
def test_uniform_decodes_capture_nothing_after_start_up(method, monkeypatch):
    """Start-up captures every bucket's uniform decode in each sampling variant: greedy and
    sampled decode steps capture nothing more; steps with a prefill chunk capture their
    (Np, Bp, bound) keys at first use, each counted once in its step's record."""
    kw = dict(capture_sizes=(1, 2, 4, 8, 16, 32, 64), max_num_batched_tokens=32)
    llm = build(method, "cuda_graph", **kw)
    graph, uniform = llm.runner.target_graph, uniform_flags(llm, monkeypatch)
    warm_up = set(graph.seen)
    assert {dict(key[1:])["variant"] for key in warm_up} == set(STARTUP_VARIANTS)
    run_arrivals(llm, PROMPTS)
    decodes = [s for s, flag in zip(llm.steps, uniform, strict=True) if flag]
    assert decodes and all(s.captured and not s.new_graphs for s in decodes)
    made = sum(s.new_graphs.get("target", 0) for s in llm.steps)
    assert made == len(graph.seen - warm_up) > 0


@pytest.mark.parametrize("method", ["eagle3", "draft_model", "ngram"])
def test_k_per_step_captured_equals_eager(method):
    """K per step (3 alone, 1 at 2-3 requests, 0 at 4+) with arrivals and sampled requests:
    each K's captured steps give eager's tokens and acceptance; every step with a request
    replayed a graph."""
    kw = dict(capture_sizes=(1, 2, 4, 8, 16, 32, 64), max_num_batched_tokens=32)
    schedule = {"num_speculative_tokens_per_batch_size": [[2, 3, 1], [4, 8, 0]]}
    eager = run_arrivals(build(method, "eager", spec_extra=schedule, **kw), PROMPTS)
    llm = build(method, "cuda_graph", spec_extra=schedule, **kw)
    assert run_arrivals(llm, PROMPTS) == eager
    assert all(s.captured for s in llm.steps if s.num_reqs)
    assert {s.num_spec_tokens for s in llm.steps if s.num_reqs} >= {0, 1, 3}


def test_fused_rope_and_cache_write_on_cuda_and_in_the_step():
    """The rotary + K/V write kernel (the CUDA default since it passed here on an H100)
    against the torch formula in bf16 on the GPU, then in the engine: the same greedy tokens
    and acceptance as the CPU's torch path, captured."""
    from specdec.kernels import rope_torch
    from specdec.kernels.triton_rope import rope_write_kv
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(64, 48, 128, device="cuda", generator=g).bfloat16()
    cos, sin = (torch.randn(64, 1, 128, device="cuda", generator=g).bfloat16()
                for _ in range(2))
    slots = torch.randperm(200, device="cuda", generator=g)[:64]
    k, v = (torch.zeros(201, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k_ref, v_ref = (torch.zeros(201, 8, 128, device="cuda") for _ in range(2))
    q = rope_write_kv(qkv, cos, sin, slots, k, v, 32)
    q_ref = rope_torch.rope_write_kv(qkv.float(), cos.float(), sin.float(), slots, k_ref,
                                     v_ref, 32)
    for got, want in ((q, q_ref), (k, k_ref), (v, v_ref)):
        torch.testing.assert_close(got, want.bfloat16())
    llm = assert_captured_cuda_equals_cpu()
    assert llm.runner.kv.fused_rope_write and llm.runner.proposer.kv.fused_rope_write


def test_triton_rms_norm_on_cuda_and_in_the_step():
    """The RMSNorm kernel without a residual (the CUDA default since it passed here on an
    H100) against F.rms_norm in bf16 on the GPU, then in the engine (every RMSNorm module
    through it): the CPU's greedy tokens and acceptance, captured."""
    from specdec.kernels.triton_norm import rms_norm
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 4096, device="cuda", generator=g).bfloat16()
    w = torch.randn(4096, device="cuda", generator=g).bfloat16()
    want = torch.nn.functional.rms_norm(x, w.shape, w, 1e-5)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), want)
    assert_captured_cuda_equals_cpu()


@pytest.mark.parametrize("method", [None, "eagle3"])
def test_async_scheduling_equals_sync_on_cuda(method):
    """The next decode launched before the host read (pinned copy + event, then the device-side
    inputs): the synchronous tokens and acceptance, no host sync inside the steps."""
    sync, sync_acc, _ = generate(method, "cuda_graph")
    got, got_acc, llm = generate(method, "cuda_graph", async_scheduling=True,
                                 check_host_syncs=True)
    assert got == sync and got_acc == sync_acc
    assert any(s.overlapped for s in llm.steps)
    assert {s.host_syncs for s in llm.steps if s.num_reqs} == {0}


@pytest.mark.parametrize("tree", [{"speculative_token_tree": [(0,), (1,), (0, 0), (1, 0),
                                                               (0, 0, 0)]},
                                  {"tree_topk": 2, "num_draft_tokens": 6}],
                         ids=["static", "dynamic"])
@pytest.mark.parametrize("method", ["mtp", "eagle3", "draft_model"])
def test_captured_draft_tree_equals_eager(method, tree):
    """A draft tree's step (the Triton paged-attention kernel's tree mask, the accepted path's
    K/V moved, the head's per-depth forwards; a draft model's root forward first) captured:
    eager's tokens and acceptance, and the CPU's greedy tokens; no host sync in the step."""
    eager, eager_acc, _ = generate(method, "eager", spec_extra=tree)
    captured, captured_acc, llm = generate(method, "cuda_graph", spec_extra=tree,
                                           check_host_syncs=True)
    assert captured == eager and captured_acc == eager_acc
    assert llm.runner.target_graph.captured
    assert {s.host_syncs for s in llm.steps if s.num_reqs} == {0}
    cpu = LLM(speculative_config=speculative_config(method, tree), device="cpu",
              dtype=torch.float32, max_num_seqs=4).generate(PROMPTS, max_tokens=48)
    assert captured == [o.token_ids for o in cpu]


def hybrid_two_turns(folder, method, device: str, backend: str) -> tuple[list, list, LLM]:
    """A tiny Qwen3.5's reply to a 35-token prompt, then its reply to prompt + reply + 3
    tokens (a prefix-cache hit into the first reply: 64 of 68 tokens) -> (first reply,
    second reply, the engine)."""
    spec = method and {"method": method, "num_speculative_tokens": 2}
    first = [(i * 5 + 3) % 400 + 3 for i in range(35)]
    llm = LLM(folder, spec, device=device, dtype=torch.float32, max_model_len=96,
              graph_backend=backend, check_host_syncs=True)
    reply = llm.generate([first], max_tokens=30, ignore_eos=True)[0].token_ids
    second = llm.generate([first + reply + [4, 5, 6]], max_tokens=10, ignore_eos=True)[0]
    assert sum(s.prefix_cache_hits for s in llm.steps) == 64
    return reply, second.token_ids, llm


@pytest.mark.parametrize("method", [None, "mtp"])
def test_hybrid_prefix_cache_hits_captured_on_cuda_equal_the_cpu(tmp_path, method):
    """Qwen3.5 (gated DeltaNet + gated attention, its MTP layer) captured on CUDA with
    prefix caching on (the state staged in the captured steps, snapshots restored): the
    CPU's greedy tokens, no sync in a step."""
    pytest.importorskip("transformers")  # writes the checkpoint
    import hf_qwen3_5
    folder = hf_qwen3_5.build_qwen3_5_mtp(tmp_path / "qwen3_5")
    *cuda, llm = hybrid_two_turns(folder, method, "cuda", "cuda_graph")
    *cpu, _ = hybrid_two_turns(folder, method, "cpu", "eager")
    assert cuda == cpu
    assert {s.host_syncs for s in llm.steps if s.num_reqs} == {0}
