"""Issue 51's sampling settings through the engine, on a 16-token vocabulary, without
speculation and under EAGLE-3, MTP and n-gram drafting at K = 1 and 3.

Sampled: every token of every step equals the direct computation (sampling_reference) -- the
target's logits from a dense forward of the step's context and drafts, vLLM's processing with
the drafts before each position counted, and the step's own counter-based random numbers
(acceptance uniforms, the exponential race); a control replays each setting with that setting
off and finds a step it changes, so a setting the engine ignored would fail.
Greedy: each setting's tokens equal plain decoding (no speculation) with the same setting, and
a direct greedy loop (dense forwards, vLLM's processing, argmax); under speculation a penalty
counting an earlier draft of the same step changes the argmax at a later draft position.
"""

from dataclasses import replace

import pytest
import torch

from specdec.engine.llm import LLM
from specdec.engine.runner import processed_variant
from specdec.engine.sequence import SamplingParams
from specdec.models.config import ModelConfig
from specdec.models.heads import build_head
from specdec.models.llama import LlamaForCausalLM

import sampling_reference as ref
from helpers import AUX

VOCAB, EOS = 16, 15
CONFIGS = [(None, 0), ("eagle3", 1), ("eagle3", 3), ("mtp", 1), ("mtp", 3), ("ngram", 1),
           ("ngram", 3)]
IDS = [f"{m or 'plain'}-K{k}" for m, k in CONFIGS]
PROMPTS = [[3, 7, 1], [9, 4, 4, 2], [5], [11, 6, 8, 12], [2, 2, 10], [13, 1, 14, 7, 0],
           [4, 9], [8, 3, 6], [1, 12, 5]]
SAMPLED = {  # one request each, in one batch (with a greedy request among them)
    "temperature": SamplingParams(temperature=0.9),
    "top_k": SamplingParams(temperature=1.0, top_k=3),
    "min_p": SamplingParams(temperature=1.0, min_p=0.3),
    "top_p+top_k": SamplingParams(temperature=1.1, top_p=0.7, top_k=6),
    "repetition_penalty": SamplingParams(temperature=0.8, repetition_penalty=1.8),
    "frequency_penalty": SamplingParams(temperature=0.8, frequency_penalty=1.2),
    "presence_penalty": SamplingParams(temperature=0.8, presence_penalty=-1.5),
    "min_tokens": SamplingParams(temperature=1.0, min_tokens=12, stop_token_ids=[4, 5, 6, 7]),
    "greedy+repetition": SamplingParams(repetition_penalty=2.0),
}
NEUTRAL = dict(top_k=0, min_p=0.0, top_p=1.0, repetition_penalty=1.0, frequency_penalty=0.0,
               presence_penalty=0.0, min_tokens=0)
GREEDY = {
    "repetition_penalty": SamplingParams(repetition_penalty=1.8),
    "frequency_penalty": SamplingParams(frequency_penalty=0.9),
    "presence_penalty": SamplingParams(presence_penalty=1.3),
    "min_tokens": SamplingParams(min_tokens=14, stop_token_ids=[4]),
    "all": SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4,
                          min_tokens=6, top_k=2, min_p=0.5),
}


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      eos_token_id=EOS)
    model = LlamaForCausalLM(cfg).to(torch.float64).eval()
    model.lm_head.weight.data *= 3  # logits spread over a few units: settings bite
    return model


@pytest.fixture(scope="module")
def engines(target):
    """(method, K) -> an LLM over the tiny target (heads seeded), built on first use."""
    built = {}

    def get(method, k):
        if (method, k) not in built:
            spec, head = None, None
            if method is not None:
                spec = {"method": method, "num_speculative_tokens": k}
                if method == "eagle3":
                    spec["draft_model_config"] = {"eagle_aux_hidden_state_layer_ids": AUX}
                if method == "ngram":
                    spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
                else:
                    torch.manual_seed(1)
                    extra = {"eagle_aux_hidden_state_layer_ids": AUX} if method == "eagle3" else {}
                    head = build_head(method, target, **extra).to(torch.float64).eval()
            built[method, k] = LLM(target=target, draft_head=head, speculative_config=spec,
                                   dtype=torch.float64, max_model_len=64, max_num_seqs=16,
                                   max_num_batched_tokens=128, seed=5)
        return built[method, k]
    return get


@torch.inference_mode()
def dense_logits(target, ids: list[int]) -> list[list[float]]:
    """The target's logits at every position of ``ids`` (one causal forward, no KV cache)."""
    hidden, _ = target(torch.tensor([ids]), torch.arange(len(ids))[None])
    return target.compute_logits(hidden[0]).tolist()


def run_recorded(llm, params: list[SamplingParams]):
    """Run one request per prompt (the first len(params)); -> (requests, [(request, context,
    drafts verified, emitted)] for every step that sampled for it)."""
    reqs = [llm.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    steps = []
    while True:
        before = {r.request_id: list(r.token_ids) for r in reqs}
        if llm.step() is None:
            return reqs, steps
        for s in llm.scheduler.scheduled:
            if not s.is_discarded:
                context = before[s.request.request_id]
                steps.append((s.request, context, list(s.spec_token_ids),
                              s.request.token_ids[len(context):]))


def replay(target, r, context, drafts, params) -> list[int]:
    """The step's tokens computed directly (``sampling_reference.replay_step``)."""
    rows = dense_logits(target, context + drafts)
    n = r.num_prompt_tokens
    return ref.replay_step(lambda j: rows[len(context) - 1 + j], context[:n], context[n:],
                           drafts, params, key=params.seed, eos_token_ids=(EOS,))


@pytest.mark.parametrize("method,k", CONFIGS, ids=IDS)
def test_sampled_tokens_equal_the_direct_computation_at_every_draft_position(
        target, engines, method, k):
    """Two batches: every setting but top_p (the step's top-k from a topk of 4,
    ``processed_top4``), then top_p + top_k beside a penalty (the vocabulary sorted)."""
    names = list(SAMPLED)
    params = {name: replace(SAMPLED[name], max_tokens=16, seed=100 + i, ignore_eos=True)
              for i, name in enumerate(names)}
    changed = dict.fromkeys(names, 0)  # steps where the setting changes the tokens
    accepted = 0
    for batch, variant in (([n for n in names if n != "top_p+top_k"], "processed_top4"),
                           (["top_p+top_k", "frequency_penalty"], "processed_sorted")):
        assert processed_variant([params[n] for n in batch], VOCAB) == variant
        reqs, steps = run_recorded(engines(method, k), [params[n] for n in batch])
        for r, context, drafts, emitted in steps:
            p = r.params
            want = replay(target, r, context, drafts, p)
            if r.finish_reason is not None and len(emitted) < len(want):  # ended in the step
                assert emitted == want[:len(emitted)], (r.request_id, context, drafts)
            else:
                assert emitted == want, (r.request_id, context, drafts)
            name = batch[reqs.index(r)]
            changed[name] += replay(target, r, context, drafts, replace(p, **NEUTRAL)) != want
        assert all(len(r.output_token_ids) > 3 for r in reqs)
        accepted += sum(sum(r.num_accepted) for r in reqs)
    assert all(changed[name] for name in names if name != "temperature"), str(changed)
    assert accepted > 0 or method is None


def greedy_reference(target, prompt: list[int], params: SamplingParams) -> list[int]:
    """Plain greedy decoding computed directly: a dense forward per token, vLLM's
    processing, argmax; ends at eos, a stop id or max_tokens."""
    output = []
    while len(output) < params.max_tokens:
        logits = dense_logits(target, prompt + output)[-1]
        tok = ref.argmax(ref.process(logits, prompt, output, params, (EOS,)))
        output.append(tok)
        if tok == EOS or tok in params.stop_token_ids:
            break
    return output


PLAIN_GREEDY: dict[str, list[list[int]]] = {}  # setting -> plain decoding's tokens


@pytest.mark.parametrize("method,k", CONFIGS, ids=IDS)
def test_greedy_with_each_setting_equals_plain_decoding(target, engines, method, k):
    plain, llm = engines(None, 0), engines(method, k)
    for name, setting in GREEDY.items():
        params = [replace(setting, max_tokens=16)] * len(PROMPTS)
        if name not in PLAIN_GREEDY:  # plain decoding once (the engine without a drafter)
            PLAIN_GREEDY[name] = [o.token_ids for o in plain.generate(PROMPTS, params)]
        want = PLAIN_GREEDY[name]
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want, name
        if method is None:
            assert want == [greedy_reference(target, p, params[0]) for p in PROMPTS], name
            assert want != [o.token_ids for o in plain.generate(  # the setting bites
                PROMPTS, SamplingParams(max_tokens=16))], name


def test_a_penalty_changes_the_greedy_argmax_at_a_later_draft_position(target, engines):
    """n-gram, K = 3, frequency penalty 0.5: at some step a draft was accepted and the
    position after it, with that draft counted, has another argmax than without it -- the
    engine emitted what plain decoding with the penalty emits there."""
    params = [SamplingParams(max_tokens=16, frequency_penalty=0.5)] * len(PROMPTS)
    reqs, steps = run_recorded(engines("ngram", 3), params)
    assert [r.output_token_ids for r in reqs] == [
        o.token_ids for o in engines(None, 0).generate(PROMPTS, params)]
    later = 0  # later draft positions whose argmax the drafts before it changed
    for r, context, drafts, emitted in steps:
        rows = dense_logits(target, context + drafts)
        n = r.num_prompt_tokens
        for j in range(1, min(len(emitted), len(drafts) + 1)):  # drafts[:j] accepted
            row = rows[len(context) - 1 + j]
            counted = ref.process(row, context[:n], context[n:] + drafts[:j], r.params)
            uncounted = ref.process(row, context[:n], context[n:], r.params)
            if ref.argmax(counted) != ref.argmax(uncounted):
                later += 1
                assert emitted[j] == ref.argmax(counted)
    assert later > 0


def test_async_scheduling_and_captured_steps_draw_the_same_tokens(target, engines):
    """The processed step fed from the device (async scheduling: the next decode launched
    before the last one is read) and replayed from captured graphs gives the eager engine's
    tokens, sampled and greedy."""
    params = [replace(SAMPLED[name], max_tokens=12, seed=100 + i, ignore_eos=True)
              for i, name in enumerate(SAMPLED)]
    want = [o.token_ids for o in engines("eagle3", 3).generate(PROMPTS, params)]
    spec = {"method": "eagle3", "num_speculative_tokens": 3,
            "draft_model_config": {"eagle_aux_hidden_state_layer_ids": AUX}}
    head = engines("eagle3", 3).runner.proposer.head
    for kw in (dict(async_scheduling=True), dict(graph_backend="replay")):
        llm = LLM(target=target, draft_head=head, speculative_config=spec, dtype=torch.float64,
                  max_model_len=64, max_num_seqs=16, max_num_batched_tokens=128, seed=5, **kw)
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want, kw
        assert any(s.overlapped or s.captured for s in llm.steps), kw
