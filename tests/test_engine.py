"""End-to-end: speculative decoding with every proposer is lossless against plain greedy."""

import pytest
import torch

from specdec.engine.llm import LLM
from specdec.models.heads import build_head
from specdec.models.config import ModelConfig
from specdec.models.llama import LlamaForCausalLM

from helpers import VOCAB, AUX, PROMPTS, tiny_target, tiny_head, dense_greedy, make_llm

@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def reference(target):
    return [dense_greedy(target, p, 24, 64) for p in PROMPTS]


def test_plain_engine_matches_dense_greedy(target, reference):
    outs = make_llm(target, None, 0, True).generate(PROMPTS, max_tokens=24)
    assert [o.token_ids for o in outs] == reference


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "ragged"])
@pytest.mark.parametrize("method", ["mtp", "eagle", "eagle3"])
def test_speculative_greedy_is_lossless(target, reference, method, padded, k):
    llm = make_llm(target, method, k, padded, head=tiny_head(method, target))
    outs = llm.generate(PROMPTS, max_tokens=24)
    assert [o.token_ids for o in outs] == reference
    assert all(sum(o.num_drafted) > 0 for o in outs)


def test_padded_and_ragged_draft_the_same_tokens(target):
    """Both modes must produce the same drafts for the same inputs (greedy)."""
    drafts = {}
    for padded in (True, False):
        llm = make_llm(target, "eagle3", 3, padded, head=tiny_head("eagle3", target))
        for p in PROMPTS:
            llm.add_request(p, llm_params(24))
        seen = []
        while llm.step() is not None:
            seen.append(sorted((r.request_id, tuple(r.spec_token_ids))
                               for r in llm.scheduler.running))
        drafts[padded] = seen
    assert drafts[True] == drafts[False]


def llm_params(max_tokens):
    from specdec.engine.sequence import SamplingParams
    return SamplingParams(max_tokens=max_tokens)


def test_prompt_longer_than_max_model_len_is_a_clear_error(target):
    llm = make_llm(target, None, 0, True, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len=32"):
        llm.generate([list(range(1, 40))], max_tokens=4)


def test_empty_prompt_is_a_clear_error(target):
    with pytest.raises(ValueError, match=r"prompts\[0\]=\[\] is empty"):
        make_llm(target, None, 0, True).generate([[]], max_tokens=4)


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "ragged"])
def test_request_reaching_max_model_len_mid_draft_is_clamped_and_lossless(target, padded):
    """With K=3 the draft loop runs past max_model_len for the last steps of each request."""
    prompts = [list(range(1, 28)), [9, 8, 7, 6, 5, 4, 3, 2, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]]
    llm = make_llm(target, "eagle", 3, padded, head=tiny_head("eagle", target), max_model_len=33)
    outs = llm.generate(prompts, max_tokens=100, ignore_eos=True)
    ref = [dense_greedy_no_eos(target, p, 33) for p in prompts]
    assert [o.token_ids for o in outs] == ref
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert all(len(p) + len(o.token_ids) == 33 for p, o in zip(prompts, outs))


def dense_greedy_no_eos(target, prompt, max_model_len):
    ids = list(prompt)
    with torch.inference_mode():
        while len(ids) < max_model_len:
            hidden, _ = target(torch.tensor([ids]), torch.arange(len(ids))[None])
            ids.append(int(target.compute_logits(hidden[0, -1]).argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_batch_of_one(target, method):
    llm = make_llm(target, method, 3, True, head=tiny_head(method, target))
    out = llm.generate([PROMPTS[1]], max_tokens=24)
    assert out[0].token_ids == dense_greedy(target, PROMPTS[1], 24, 64)


def test_all_drafts_rejected_still_advances_one_token_per_step(target, reference):
    """An Eagle3 head with a one-token draft vocabulary mapped (d2t) to a token the target
    never emits here: every draft is rejected, every step emits exactly one token."""
    never = min(set(range(VOCAB)) - {t for r in reference for t in r})
    torch.manual_seed(1)
    head = build_head("eagle3", target, eagle_aux_hidden_state_layer_ids=AUX,
                      draft_vocab_size=1).to(torch.float64).eval()
    head.d2t.fill_(never)
    llm = make_llm(target, "eagle3", 3, True, head=head)
    outs = llm.generate(PROMPTS, max_tokens=24)
    assert [o.token_ids for o in outs] == reference
    assert all(sum(o.num_drafted) > 0 and sum(o.num_accepted) == 0 for o in outs)
    assert all(o.acceptance_length == 1.0 for o in outs)
    assert all(n <= 1 for r in llm.steps for n in r.new_tokens.values())


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "ragged"])
def test_all_drafts_accepted(padded):
    """A target whose logits are all equal (zero lm_head) always emits token 0; a head sharing
    that lm_head always drafts 0: every draft is accepted, K+1 tokens per step."""
    target = tiny_target()
    with torch.no_grad():
        target.lm_head.weight.zero_()
    llm = make_llm(target, "mtp", 3, padded, head=tiny_head("mtp", target))
    outs = llm.generate(PROMPTS, max_tokens=20, ignore_eos=True)
    assert all(o.token_ids == [0] * 20 for o in outs)
    for o in outs:
        assert o.num_accepted == o.num_drafted  # every drafted position accepted
        assert o.acceptance_length > 3.0


def test_padded_step_runs_inside_the_sync_guard(target):
    """check_host_syncs=True really guards the padded step: a drafter that syncs fails."""
    from specdec.syncs import HostSyncError
    llm = make_llm(target, "eagle", 2, True, head=tiny_head("eagle", target),
                   check_host_syncs=True)
    proposer = llm.runner.proposer
    original = proposer.first_pass_hidden

    def syncing_first_pass_hidden(features):
        features[0, 0].item()  # a host read of device data
        return original(features)

    proposer.first_pass_hidden = syncing_first_pass_hidden
    with pytest.raises(HostSyncError, match="Tensor.item"):
        llm.generate([PROMPTS[0]], max_tokens=4)


def test_default_generation_runs_without_the_sync_guard(target, monkeypatch):
    """The proof machinery stays out of the production hot loop: no TorchFunctionMode and
    no CUDA sync-debug mode during a default step, and no sync count is reported."""
    from torch.overrides import _get_current_function_mode_stack
    monkeypatch.delenv("SPECDEC_CHECK_HOST_SYNCS")
    llm = make_llm(target, "eagle", 2, True, head=tiny_head("eagle", target))
    seen = []
    original = llm.runner.proposer.first_pass_hidden

    def spy(features):
        seen.append(len(_get_current_function_mode_stack()))
        if torch.cuda.is_available():
            seen.append(torch.cuda.get_sync_debug_mode())
        return original(features)

    llm.runner.proposer.first_pass_hidden = spy
    llm.generate([PROMPTS[0]], max_tokens=8)
    assert seen and set(seen) == {0}
    assert {r.host_syncs for r in llm.steps} == {None}
    assert make_llm(target, None, 0, True, check_host_syncs=True).check_host_syncs


def test_padded_steps_report_zero_syncs_and_ragged_steps_count_them(target):
    counts = {}
    for padded in (True, False):
        llm = make_llm(target, "mtp", 3, padded, head=tiny_head("mtp", target))
        llm.generate(PROMPTS, max_tokens=8)
        counts[padded] = [r.host_syncs for r in llm.steps if r.num_reqs]
    assert set(counts[True]) == {0}
    assert min(counts[False]) > 0


def test_speculative_sampling_preserves_the_target_distribution():
    """Temperature 1 on a 4-token vocabulary: the joint law of the first two generated
    tokens (the second one verified against a draft) matches the target's, by chi-square."""
    torch.manual_seed(3)
    cfg = ModelConfig(vocab_size=4, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=3)
    target = LlamaForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(0.3)  # soften the logits so every token has mass
    prompt = [1, 2]
    with torch.inference_mode():
        h, _ = target(torch.tensor([prompt]), torch.arange(2)[None])
        p1 = torch.softmax(target.compute_logits(h[0, -1]), -1)
        joint = torch.zeros(4, 4, dtype=torch.float64)
        for t1 in range(4):
            h, _ = target(torch.tensor([prompt + [t1]]), torch.arange(3)[None])
            joint[t1] = p1[t1] * torch.softmax(target.compute_logits(h[0, -1]), -1)
    n = 3000
    llm = LLM(target=target, draft_head=tiny_head("mtp", target), dtype=torch.float64,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2},
              max_num_seqs=256, max_num_batched_tokens=1024, max_model_len=16, seed=7)
    outs = llm.generate([prompt] * n, max_tokens=2, temperature=1.0, ignore_eos=True)
    assert sum(sum(o.num_drafted) for o in outs) > 0.9 * n  # the 2nd token was verified
    counts = torch.zeros(4, 4, dtype=torch.float64)
    for o in outs:
        counts[o.token_ids[0], o.token_ids[1]] += 1
    expected = joint * n
    stat = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor(15.0, dtype=torch.float64)
    p_value = torch.special.gammaincc(df / 2, stat / 2)
    assert p_value > 1e-3, (stat, counts, expected)
    # the test can fail: a sampler that always keeps a deterministic draft (any fixed
    # second token per first token) is rejected with these sample sizes
    broken = torch.zeros(4, 4, dtype=torch.float64)
    broken[torch.arange(4), joint.argmax(1)] = joint.sum(1) * n
    stat_broken = ((broken - expected) ** 2 / expected).sum()
    assert torch.special.gammaincc(df / 2, stat_broken / 2) < 1e-3


@pytest.mark.parametrize("kwargs,field", [
    ({"max_model_len": 0}, "max_model_len"), ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"block_size": 0}, "block_size"), ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({"dtype": "float8"}, "dtype"), ({"device": "tpu"}, "device")])
def test_bad_engine_arguments_name_the_field(target, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(target=target, **kwargs)


def test_accepted_drafts_count_only_the_tokens_the_request_kept():
    """Issue 37, item 6: K=20 on a zero-weight target and head (every draft accepted) with
    max_tokens=8: the one verifying step accepts 20 drafts, the request keeps 7 of them
    (plus the prefill's token), and the counters say 7, not 20 (acceptance length 8, not
    more tokens than it emitted)."""
    from specdec.models.synthetic import build_synthetic
    target, heads = build_synthetic("llama-tiny", dtype=torch.float32, device="cpu",
                                    init="zeros", methods=("mtp",))
    llm = LLM(target=target, draft_head=heads["mtp"], max_model_len=128,
              speculative_config={"method": "mtp", "num_speculative_tokens": 20})
    [out] = llm.generate([[1, 2, 3]], max_tokens=8, ignore_eos=True)
    assert len(out.token_ids) == 8 and out.num_decode_steps == 1
    assert out.num_drafted == [1] * 20
    assert out.num_accepted == [1] * 7 + [0] * 13 and out.acceptance_length == 8.0
