"""Torchair-MTP: the whole K-step draft loop as one static graph per batch bucket."""

import logging

import pytest
import torch
import torch._dynamo.utils as dynamo_utils

from specdec.engine.llm import LLM
from specdec.engine.sequence import SamplingParams
from specdec.models.heads import build_head
from specdec.models.llama import LlamaConfig, LlamaForCausalLM

K = 3


@pytest.fixture(scope="module")
def models():
    """A tiny vocabulary so a random MTP head is right often enough for varied acceptance."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=7)
    target = LlamaForCausalLM(cfg).to(torch.float64).eval()
    torch.manual_seed(1)
    return target, build_head("mtp", target).to(torch.float64).eval()


def make_llm(models, graph_mode, capture_sizes=(1, 2, 4)):
    target, head = models
    spec = {"method": "mtp", "num_speculative_tokens": K, "graph_mode": graph_mode,
            "draft_model_config": {"compile_backend": "eager"}}  # dynamo traces fullgraph
    return LLM(target=target, draft_head=head, speculative_config=spec, dtype=torch.float64,
               max_num_batched_tokens=32, max_model_len=160, max_num_seqs=4,
               capture_sizes=list(capture_sizes))


def run(llm, prompts, max_tokens):
    reqs = [llm.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            for p in prompts]
    drafts = []
    while llm.step() is not None:
        drafts.append([list(r.spec_token_ids) for r in reqs])
    return [r.output_token_ids for r in reqs], drafts, reqs


PROMPTS = [[1, 2, 3], [4, 5], [6, 1, 1, 2, 5], [3]]


def test_graph_mode_equals_eager_mtp_token_for_token(models):
    eager_out, eager_drafts, _ = run(make_llm(models, "eager"), PROMPTS, 90)
    llm = make_llm(models, "torchair")
    graph_out, graph_drafts, reqs = run(llm, PROMPTS, 90)
    assert graph_out == eager_out
    assert graph_drafts == eager_drafts  # the drafts themselves, step by step
    proposer = llm.runner.proposer
    assert proposer.graph_steps >= 20
    accepted = {tuple(r.num_accepted) for r in reqs}
    assert len(accepted) > 1 and any(sum(a) > 0 for a in accepted)  # acceptance varied


def test_zero_recompilations_after_warmup(models):
    llm = make_llm(models, "torchair")
    run(llm, PROMPTS, 40)  # warm-up: compiles the buckets a 4-then-fewer batch hits
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    before = llm.runner.proposer.graph_steps
    _, _, reqs = run(llm, PROMPTS, 200)
    steps = llm.runner.proposer.graph_steps - before
    assert steps >= 50
    assert {len(set(r.num_accepted)) for r in reqs} != {1}  # varying acceptance per position
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs


def test_batch_above_largest_bucket_runs_eager_with_one_warning(models, caplog):
    eager_out, _, _ = run(make_llm(models, "eager"), PROMPTS, 20)
    llm = make_llm(models, "torchair", capture_sizes=(1, 2))
    with caplog.at_level(logging.WARNING, logger="specdec.proposers.torchair_mtp"):
        out, _, _ = run(llm, PROMPTS, 20)
    assert out == eager_out
    warnings = [r for r in caplog.records if "above the largest graph bucket" in r.message]
    assert len(warnings) == 1


def test_ragged_graph_mode_is_a_config_error(models):
    target, head = models
    with pytest.raises(ValueError, match="disable_padded_drafter_batch"):
        LLM(target=target, draft_head=head, speculative_config={
            "method": "mtp", "num_speculative_tokens": K, "graph_mode": "torchair",
            "disable_padded_drafter_batch": True})
