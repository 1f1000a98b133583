"""GLM-4.5 / 4.6 (``Glm4MoeForCausalLM``: q/k/v biases, per-head q/k norm, partial rotary,
DeepSeek-V3's MoE above a dense first layer) and its MTP layer ``model.layers.L.*`` (vLLM's
``glm4_moe_mtp``, alias ``mtp``): specdec equals transformers on tiny random models
transformers itself wrote -- greedy tokens through ``LLM`` and last-position logits; the MTP
layer's draft logits equal the reference assembled from transformers' ``Glm4MoeDecoderLayer``;
speculative greedy equals plain greedy, padded and ragged; an MTP layer that predicts the
target exactly is always accepted. Omitted keys mean transformers' defaults; what GLM does not
have is refused naming the key. (Tensor parallelism: ``test_tp_layers`` ``glm4_moe``.)"""

from pathlib import Path

import hf_deepseek as D
import hf_models as H
import pytest
import torch
from helpers import folder_builder
from hf_glm4_moe import BUILDERS

from specdec import LLM
from specdec.models import load_model
from specdec.models.heads import load_head

CASES = ["glm45", "glm_air_t4"]
MAX_NEW = 32
TOL = 1e-4
_gen = torch.Generator().manual_seed(20250728)
PROMPTS = [torch.randint(3, 500, (n,), generator=_gen).tolist() for n in (5, 17, 40)]
LOGIT_PROMPT = torch.randint(3, 500, (80,), generator=_gen).tolist()
ENGINE = dict(max_num_seqs=4, max_model_len=256)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    return folder_builder(BUILDERS, tmp_path_factory)


@pytest.fixture(scope="module")
def reference(glm_dir):
    return H.reference_cache(lambda name: H.hf_model(glm_dir(name)), PROMPTS, MAX_NEW,
                             LOGIT_PROMPT)


@pytest.fixture(scope="module")
def plain(glm_dir):
    return [o.token_ids for o in LLM(model=str(glm_dir("glm45")), **ENGINE).generate(
        PROMPTS, max_tokens=MAX_NEW, ignore_eos=True)]


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_and_last_logits_match_transformers(case, glm_dir, reference, plain):
    path = glm_dir(case)
    got = plain if case == "glm45" else [o.token_ids for o in LLM(
        model=str(path), **ENGINE).generate(PROMPTS, max_tokens=MAX_NEW, ignore_eos=True)]
    assert got == reference(case)["tokens"]
    model = load_model(path)
    ids = torch.tensor(LOGIT_PROMPT)
    with torch.inference_mode():
        hidden, _ = model(ids[None], torch.arange(len(ids))[None])
        logits = model.compute_logits(hidden[0, -1])
    diff = (logits - reference(case)["logits"]).abs().max().item()
    assert diff <= TOL, f"{case}: max |dlogit| {diff:.3g}"


def test_layers_are_what_the_config_says(glm_dir):
    from specdec.models.layers.mlp import MLP
    from specdec.models.layers.moe import MoEMLP

    model = load_model(glm_dir("glm45"))
    dense, moe = (layer.mlp for layer in model.model.layers)
    assert isinstance(dense, MLP) and isinstance(moe, MoEMLP)
    assert moe.topk_method == "noaux_tc" and moe.routed_scaling_factor == 2.5
    assert hasattr(moe, "shared_experts") and moe.e_score_correction_bias.abs().max() > 0.05
    attn = model.model.layers[0].self_attn
    assert attn.qk_norm == "head" and attn.qkv_proj.bias is not None and attn.head_dim == 32
    assert model.rotary.rotary_dim == 16
    assert load_model(glm_dir("glm_air_t4")).model.layers[0].self_attn.qk_norm is None


def _edited(glm_dir, tmp_path, edit) -> Path:
    path = H.copy_folder(glm_dir("glm45"), tmp_path / "m")
    cfg = H.read_config(path)
    edit(cfg)
    H.write_config(path, cfg)
    return path


def test_omitted_keys_mean_transformers_defaults(glm_dir, tmp_path):
    """Without partial_rotary_factor, first_k_dense_replace, norm_topk_prob,
    n_shared_experts: transformers' 0.5, 1, true, 1 -- the same model."""
    def drop(cfg):
        del cfg["rope_parameters"]["partial_rotary_factor"]
        for key in ("first_k_dense_replace", "norm_topk_prob", "n_shared_experts"):
            del cfg[key]

    a, b = load_model(_edited(glm_dir, tmp_path, drop)), load_model(glm_dir("glm45"))
    assert a.rotary.rotary_dim == 16
    ids = torch.tensor(LOGIT_PROMPT[:20])
    with torch.inference_mode():
        assert torch.equal(a(ids[None], torch.arange(20)[None])[0],
                           b(ids[None], torch.arange(20)[None])[0])


@pytest.mark.parametrize("what,edit", [
    ("partial rotary ignored", lambda c: c["rope_parameters"].update(partial_rotary_factor=1.0)),
    ("routed_scaling_factor ignored", lambda c: c.update(routed_scaling_factor=1.0)),
])
def test_reference_is_sensitive_to_the_glm_feature(what, edit, glm_dir, reference, tmp_path):
    diff = H.hf_last_logits(_edited(glm_dir, tmp_path, edit), LOGIT_PROMPT) - \
        reference("glm45")["logits"]
    assert diff.abs().max() > 100 * TOL, what


@pytest.mark.parametrize("key,value", [("topk_method", "greedy"), ("scoring_func", "softmax"),
                                       ("first_k_dense_replace", -1), ("use_qk_norm", "yes"),
                                       ("n_group", 3)])
def test_refuses_what_is_not_implemented_naming_the_key(key, value, glm_dir, tmp_path):
    with pytest.raises(ValueError, match=key):
        load_model(_edited(glm_dir, tmp_path, lambda c: c.update({key: value})))


# ---- the MTP layer (model.layers.L.* of the target folder) ---------------------------------
@pytest.mark.parametrize("case", CASES)
def test_mtp_draft_logits_equal_transformers_layer_plus_mtp_math(case, glm_dir, tmp_path):
    """The target loader skips layer 2; the head reads only it (its own embedding / head
    copies when present, else the target's) and equals the reference assembled from
    transformers' Glm4MoeDecoderLayer at every position of a 40-token sequence."""
    path = glm_dir(case)
    target = load_model(path)
    head = load_head(path, target)
    assert type(head).__name__ == "Glm4MoeMtpHead"
    assert hasattr(head.layer, "embed_tokens") == (case == "glm45")
    ids = torch.tensor(PROMPTS[2])
    pos = torch.arange(len(ids))
    nxt = torch.cat([ids[1:], ids[:1]])
    with torch.inference_mode():
        hidden, _ = target(ids[None], pos[None])
        out, _ = head(nxt[None], pos[None], hidden)
        got = head.compute_logits(out[0])
    if case != "glm45":  # the reference reads the copies: give it the target's
        path = H.copy_folder(path, tmp_path / "with_copies")
        H.add_shard(path, {"model.layers.2.embed_tokens.weight": target.model.embed_tokens.weight,
                           "model.layers.2.shared_head.head.weight": target.lm_head.weight})
    want = D.hf_mtp_reference(path, nxt, hidden[0], pos)
    assert (got - want).abs().max().item() <= TOL
    assert head.kv_cache_spec() == [target.kv_cache_spec()[0]]


def test_more_than_one_mtp_layer_is_refused_naming_the_key(glm_dir, tmp_path):
    path = _edited(glm_dir, tmp_path, lambda c: c.update(num_nextn_predict_layers=2))
    with pytest.raises(ValueError, match="num_nextn_predict_layers=2"):
        load_head(path, load_model(path))


@pytest.mark.parametrize("method,k,ragged", [("mtp", 2, False), ("glm4_moe_mtp", 3, True)])
def test_mtp_speculative_greedy_equals_plain(method, k, ragged, glm_dir, plain):
    """The MTP layer is found in the target folder (no head folder), under either name."""
    llm = LLM(model=str(glm_dir("glm45")), **ENGINE,
              speculative_config={"method": method, "num_speculative_tokens": k,
                                  "disable_padded_drafter_batch": ragged})
    assert type(llm.runner.proposer.head).__name__ == "Glm4MoeMtpHead"
    outs = llm.generate(PROMPTS, max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.token_ids for o in outs] == plain
    assert sum(sum(o.num_drafted) for o in outs) > 0


@pytest.mark.parametrize("ragged", [False, True])
def test_an_exact_mtp_layer_is_always_accepted(ragged, glm_dir):
    """Every draft accepted (acceptance length K + 1 on every verifying step but the last,
    cut by max_tokens) and the tokens are the cycle's."""
    k, n = 3, 24
    llm = LLM(model=str(glm_dir("glm_cycle")), **ENGINE,
              speculative_config={"method": "mtp", "num_speculative_tokens": k,
                                  "disable_padded_drafter_batch": ragged})
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, max_tokens=n, ignore_eos=True)):
        expected, t = [], prompt[-1]
        for _ in range(n):
            t = H.cycle_next(t)
            expected.append(t)
        assert out.token_ids == expected
        assert out.num_accepted == out.num_drafted and sum(out.num_drafted) > 0
        assert out.acceptance_length >= k + 1 - k / out.num_decode_steps
