"""On CUDA (skipped elsewhere): captured steps equal eager ones token for token, and the
padded step runs under ``torch.cuda.set_sync_debug_mode("error")`` with no sync."""

import pytest
import torch

from specdec import LLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self,",
           "for i in range(10):"]


def generate(method, backend, **kw):
    spec = None if method is None else {"method": method, "num_speculative_tokens": 3}
    llm = LLM(speculative_config=spec, device="cuda", dtype=torch.float32,
              graph_backend=backend, max_num_seqs=4, **kw)
    outs = llm.generate(PROMPTS, max_tokens=48)
    return [o.token_ids for o in outs], [o.num_accepted for o in outs], llm


@pytest.mark.parametrize("method", [None, "mtp", "eagle", "eagle3"])
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
    cuda, cuda_acc, _ = generate("eagle3", "cuda_graph")
    spec = {"method": "eagle3", "num_speculative_tokens": 3}
    outs = LLM(speculative_config=spec, dtype=torch.float32, max_num_seqs=4).generate(
        PROMPTS, max_tokens=48)
    assert cuda == [o.token_ids for o in outs]
    assert cuda_acc == [o.num_accepted for o in outs]


def test_torchair_mtp_compiles_and_equals_eager_on_cuda():
    eager, eager_acc, _ = generate("mtp", "eager")
    spec = {"method": "mtp", "num_speculative_tokens": 3, "graph_mode": "torchair"}
    llm = LLM(speculative_config=spec, device="cuda", dtype=torch.float32, max_num_seqs=4,
              check_host_syncs=True)
    outs = llm.generate(PROMPTS, max_tokens=48)
    assert [o.token_ids for o in outs] == eager
    assert llm.runner.proposer.step_graph.seen  # compiled buckets ran
