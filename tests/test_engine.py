"""End-to-end: speculative decoding with every proposer is lossless against plain greedy."""

import pytest
import torch

from specdec.engine.llm import LLM
from specdec.models.heads import build_head
from specdec.models.llama import LlamaConfig, LlamaForCausalLM

VOCAB = 96
AUX = [1, 2, 3]
# a batch mixing short and long prompts; a 16-token budget forces chunked prefill
PROMPTS = [[5, 9, 13], list(range(1, 41)), [7], [(i * 7) % VOCAB for i in range(23)], [3, 3]]


def tiny_target(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      eos_token_id=VOCAB - 1)
    return LlamaForCausalLM(cfg).to(torch.float64).eval()


def tiny_head(method: str, target: LlamaForCausalLM, seed: int = 1):
    torch.manual_seed(seed)
    extra = {"eagle_aux_hidden_state_layer_ids": AUX} if method == "eagle3" else {}
    return build_head(method, target, **extra).to(torch.float64).eval()


def dense_greedy(target: LlamaForCausalLM, prompt: list[int], max_tokens: int,
                 max_model_len: int) -> list[int]:
    """Plain greedy decoding with full dense recomputation (no KV cache, no engine)."""
    ids = list(prompt)
    out = []
    with torch.inference_mode():
        while len(out) < max_tokens and len(ids) < max_model_len:
            x = torch.tensor([ids])
            hidden, _ = target(x, torch.arange(len(ids))[None])
            tok = int(target.compute_logits(hidden[0, -1]).argmax())
            ids.append(tok)
            out.append(tok)
            if tok == target.config.eos_token_id:
                break
    return out


def make_llm(target, method, k, padded, head=None, **kw):
    spec = None
    if method is not None:
        spec = {"method": method, "num_speculative_tokens": k,
                "disable_padded_drafter_batch": not padded}
        if method == "eagle3":
            spec["draft_model_config"] = {"eagle_aux_hidden_state_layer_ids": AUX}
    kw.setdefault("max_num_batched_tokens", 16)
    kw.setdefault("max_model_len", 64)
    kw.setdefault("max_num_seqs", 4)
    return LLM(target=target, draft_head=head, speculative_config=spec, dtype=torch.float64, **kw)


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
