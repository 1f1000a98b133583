"""specdec loads the model families people speculate on and matches transformers token for
token (greedy, 3 prompts x 32 tokens) and logit for logit (last position, 1e-4).

Every family is a tiny random model written by transformers itself (``hf_models``), in two
spellings of its config.json: ``<family>`` as transformers 5 writes it (``rope_parameters``) and
``<family>_t4`` as the published checkpoints are spelled (``rope_theta`` + ``rope_scaling``).
Also: shard layouts, refusals (architectures, rope types, unknown math keys) with errors that
name the culprit, and eos-id lists. ``RESULTS`` (printed with ``-s``) holds one row per case:
loads | tokens equal | max |dlogit|.
"""

import json

import pytest
import torch

from specdec import LLM

import hf_models as H

BASE = ["llama2", "llama3", "llama31", "llama32", "mistral_v01", "mistral_v03", "qwen25",
        "qwen25_yarn", "qwen3", "qwen3_moe", "minimax_m2"]
CASES = BASE + [f"{b}_t4" for b in BASE]
REFUSED = ["starcoder2"]  # Gemma-2/3 and Phi-3: tests/test_gemma_phi3.py

MAX_NEW = 32
TOL = 1e-4
WINDOW = 16  # mistral_v01's sliding_window
ORIGINAL_MAX = 64  # original_max_position_embeddings of the llama3 / yarn rope scalings

_gen = torch.Generator().manual_seed(20240607)
# ids in [3, 500): no bos/eos/pad of any family (their ids are 0-2 and >= 500)
PROMPTS = [torch.randint(3, 500, (n,), generator=_gen).tolist() for n in (5, 17, 40)]
LOGIT_PROMPT = torch.randint(3, 500, (80,), generator=_gen).tolist()  # > WINDOW, > ORIGINAL_MAX
assert all(len(p) + MAX_NEW > WINDOW for p in PROMPTS)
assert len(PROMPTS[-1]) + MAX_NEW > ORIGINAL_MAX and len(LOGIT_PROMPT) > ORIGINAL_MAX

RESULTS: dict[str, dict] = {}  # case -> {"loads", "tokens_equal", "max_dlogit", "error"}


def _row(case: str) -> dict:
    return RESULTS.setdefault(case, {"loads": None, "tokens_equal": None, "max_dlogit": None,
                                     "error": None})


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:100]}" if str(e) else type(e).__name__


def format_results() -> str:
    def cell(v):
        return "-" if v is None else ("yes" if v is True else "NO" if v is False else
                                      f"{v:.1e}" if isinstance(v, float) else str(v))
    lines = [f"{'family':<16} {'loads':<6} {'tokens equal':<13} {'max |dlogit|':<13} error",
             "-" * 76]
    for case in CASES:
        if case in RESULTS:
            r = RESULTS[case]
            lines.append(f"{case:<16} {cell(r['loads']):<6} {cell(r['tokens_equal']):<13} "
                         f"{cell(r['max_dlogit']):<13} {r['error'] or ''}")
    return "\n".join(lines)


@pytest.fixture(scope="module", autouse=True)
def _one_thread_and_table():
    """One intra-op thread: these models are tiny, and on a loaded 2-core machine torch's
    thread pool makes every small op ~10x slower. The table prints at the end (``-s``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    if RESULTS:
        print("\n" + format_results())


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory):
    """name -> the folder of that tiny model, built once per session."""
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = H.build(name, tmp_path_factory.mktemp(name) / "model")
        return cache[name]
    return get


@pytest.fixture(scope="session")
def reference(family_dir):
    """name -> transformers' greedy tokens for PROMPTS, last logits for LOGIT_PROMPT and its
    rope parameters."""
    return H.reference_cache(lambda name: H.hf_model(family_dir(name)), PROMPTS, MAX_NEW,
                             LOGIT_PROMPT, lambda model: {"rope": model.config.rope_parameters})


def load_specdec(path, dtype=torch.float32):
    """The target model alone: ``specdec.models.load_model`` (the registry), or before it
    lands, the Llama loader."""
    try:
        from specdec.models import load_model
    except ImportError:
        from specdec.models.llama import LlamaForCausalLM
        return LlamaForCausalLM.load_pretrained(path, dtype=dtype, device="cpu")
    return load_model(path, dtype=dtype, device="cpu")


def make_llm(path) -> LLM:
    return LLM(model=str(path), max_num_seqs=4, max_model_len=256)


# ---- 1. greedy tokens ------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_match_transformers(case, family_dir, reference):
    path, row = family_dir(case), _row(case)
    try:
        llm = make_llm(path)
    except Exception as e:
        row["loads"], row["error"] = False, _short(e)
        raise
    row["loads"] = True
    want = reference(case)["tokens"]
    outs = llm.generate(PROMPTS, max_tokens=MAX_NEW, ignore_eos=True)
    got = [o.token_ids for o in outs]
    row["tokens_equal"] = got == want
    for i, (g, w) in enumerate(zip(got, want)):
        first = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), None)
        assert g == w, (f"{case}: prompt {i} (len {len(PROMPTS[i])}) diverges at generated "
                        f"token {first}: specdec {g} != transformers {w}")
    assert all(o.finish_reason == "length" for o in outs)


# ---- 2. last-position logits (dense path) ------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
def test_last_logits_match_transformers(case, family_dir, reference):
    path, row = family_dir(case), _row(case)
    try:
        model = load_specdec(path)
    except Exception as e:
        row["error"] = row["error"] or _short(e)
        raise
    ids = torch.tensor(LOGIT_PROMPT)
    with torch.inference_mode():
        hidden, _ = model(ids[None, :], torch.arange(len(ids))[None, :])
        logits = model.compute_logits(hidden[0, -1]).float()
    want = reference(case)["logits"]
    assert logits.shape == want.shape
    diff = (logits - want).abs().max().item()
    row["max_dlogit"] = diff
    assert diff <= TOL, f"{case}: max |dlogit| {diff:.3g} > {TOL} over a {len(ids)}-token prompt"


# ---- 3. the folders are laid out like the real ones --------------------------------------------
@pytest.mark.parametrize("case", CASES + REFUSED)
def test_folder_layout(case, family_dir):
    path = family_dir(case)
    shards = H.shard_files(path)
    if case.removesuffix("_t4") in H.SHARDED:
        assert len(shards) >= 2, f"{case}: expected several shards, got {shards}"
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == set(shards)
        assert not (path / "model.safetensors").exists()
    else:
        assert shards == [] and (path / "model.safetensors").is_file()
    names = set(H.tensor_names(path))
    tied = H.read_config(path).get("tie_word_embeddings", False)
    assert ("lm_head.weight" in names) != tied, "tied models ship no lm_head.weight"


@pytest.mark.parametrize("base", BASE)
def test_t4_spelling_is_the_same_model_for_transformers(base, family_dir, reference):
    """The hand-written transformers-4 spelling parses to the same rope parameters and the
    same tokens in transformers: the ``_t4`` cases test specdec's parsing, not a new model."""
    t5, t4 = H.read_config(family_dir(base)), H.read_config(family_dir(base + "_t4"))
    assert "rope_parameters" in t5 and "rope_theta" not in t5
    assert "rope_parameters" not in t4 and "rope_theta" in t4 and "rope_scaling" in t4
    a, b = reference(base), reference(base + "_t4")
    def rope(r):  # transformers keeps the legacy "type" next to the "rope_type" it adds
        return {k: v for k, v in r["rope"].items() if v is not None and k != "type"}
    assert rope(a) == rope(b)
    assert a["tokens"] == b["tokens"]
    assert torch.equal(a["logits"], b["logits"])


# ---- the reference is sensitive to what the families add -----------------------------------
def _no_rope_scaling(cfg):
    cfg["rope_parameters"] = {"rope_type": "default",
                              "rope_theta": cfg["rope_parameters"]["rope_theta"]}


def _theta_1e4(cfg):
    cfg["rope_parameters"]["rope_theta"] = 10000.0


def _no_window(cfg):
    cfg["sliding_window"] = None


def _full_rotary(cfg):
    cfg["rope_parameters"]["partial_rotary_factor"] = 1.0
    cfg.pop("rotary_dim")


def _no_topk_norm(cfg):
    cfg["norm_topk_prob"] = False


MUTATIONS = {  # family -> (what a loader could get wrong, config edit)
    "llama31": ("llama3 rope scaling ignored", _no_rope_scaling),
    "llama32": ("llama3 rope scaling ignored", _no_rope_scaling),
    "qwen25_yarn": ("yarn ignored", _no_rope_scaling),
    "mistral_v03": ("rope_parameters.rope_theta ignored", _theta_1e4),
    "mistral_v01": ("sliding window ignored", _no_window),
    "minimax_m2": ("rotary over the whole head", _full_rotary),
    "qwen3_moe": ("norm_topk_prob ignored", _no_topk_norm),
}


@pytest.mark.parametrize("base", list(MUTATIONS))
def test_reference_is_sensitive_to_the_family_feature(base, family_dir, reference,
                                                      tmp_path):
    """Dropping the family's feature moves transformers' logits by >> TOL and changes its
    tokens: a loader that ignores the key cannot pass the tests above."""
    what, edit = MUTATIONS[base]
    path = H.copy_folder(family_dir(base), tmp_path / "mutated")
    cfg = H.read_config(path)
    edit(cfg)
    H.write_config(path, cfg)
    model = H.hf_model(path)
    ref = reference(base)
    diff = (H.hf_last_logits(path, LOGIT_PROMPT, model=model) - ref["logits"]).abs().max()
    assert diff > 100 * TOL, f"{base} with {what}: logits move only {diff:.3g}"
    assert H.hf_greedy(path, PROMPTS, MAX_NEW, model=model) != ref["tokens"], what


def test_reference_is_sensitive_to_the_routing_bias(family_dir, reference):
    model = H.hf_model(family_dir("minimax_m2"))
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                assert buf.abs().max() > 0.05
                buf.zero_()
    diff = (H.hf_last_logits(None, LOGIT_PROMPT, model=model) -
            reference("minimax_m2")["logits"]).abs().max()
    assert diff > 100 * TOL


# ---- 4. refusals --------------------------------------------------------------------------
def _raises_naming(fn, *words):
    with pytest.raises(ValueError) as info:
        fn()
    msg = str(info.value)
    for w in words:
        assert w in msg, f"the error does not name {w!r}: {msg}"


@pytest.mark.parametrize("name", REFUSED)
def test_refuses_unsupported_architecture(name, family_dir):
    path, arch = family_dir(name), H.ARCHITECTURES[name]
    _raises_naming(lambda: load_specdec(path), arch)
    _raises_naming(lambda: make_llm(path), arch)


@pytest.mark.parametrize("spelling", ["t5", "t4"])
@pytest.mark.parametrize("rope_type", ["proportional", "foo"])
def test_refuses_unsupported_rope_type(spelling, rope_type, family_dir, tmp_path):
    path = H.copy_folder(family_dir("llama2"), tmp_path / "m")
    cfg = H.read_config(path)
    half = cfg["hidden_size"] // cfg["num_attention_heads"] // 2
    cfg["rope_parameters"] = {"rope_type": rope_type, "rope_theta": 10000.0,
                              "short_factor": [1.0] * half, "long_factor": [2.0] * half,
                              "original_max_position_embeddings": 64}
    H.write_config(path, H.t4_spelling(cfg) if spelling == "t4" else cfg)
    _raises_naming(lambda: load_specdec(path), "rope_type", rope_type)
    _raises_naming(lambda: make_llm(path), "rope_type", rope_type)


@pytest.mark.parametrize("key,value", [("attn_logit_softcapping", 50.0),
                                       ("final_logit_softcapping", 30.0)])
def test_refuses_unknown_key_that_changes_the_math(key, value, family_dir, tmp_path):
    path = H.copy_folder(family_dir("llama2"), tmp_path / "m")
    H.write_config(path, {**H.read_config(path), key: value})
    _raises_naming(lambda: load_specdec(path), key)
    _raises_naming(lambda: make_llm(path), key)


# ---- 5. eos lists ---------------------------------------------------------------------------
def test_any_id_of_the_eos_list_stops(family_dir, reference, tmp_path):
    """Llama-3.1's ``eos_token_id`` is a list of 3: make its 3rd entry the first greedy token of
    prompt 0 and its 2nd entry a later token of prompt 2; both prompts stop there ("eos"),
    as transformers does; prompt 1 stops at whichever comes first, if any."""
    ref = reference("llama31")["tokens"]
    eos = list(H.LLAMA3_EOS)
    third = ref[0][0]
    assert third not in eos, "pick another prompt: its first token is already an eos id"
    j = next(j for j in range(2, MAX_NEW) if ref[2][j] not in ref[2][:j] + [third] + eos)
    second = ref[2][j]
    eos_list = [eos[0], second, third]
    path = H.copy_folder(family_dir("llama31"), tmp_path / "m")
    H.write_config(path, {**H.read_config(path), "eos_token_id": eos_list})
    gen_file = path / "generation_config.json"
    gen_file.write_text(json.dumps({**json.loads(gen_file.read_text()),
                                    "eos_token_id": eos_list}, indent=2))
    want = H.hf_greedy(path, PROMPTS, MAX_NEW, honor_eos=True)
    assert want[0] == [third] and want[2] == ref[2][:j + 1]  # the set-up does what it says
    outs = make_llm(path).generate(PROMPTS, max_tokens=MAX_NEW)
    assert [o.token_ids for o in outs] == want
    for o, w in zip(outs, want):
        assert o.finish_reason == ("eos" if w[-1] in eos_list else "length"), o
    assert outs[0].finish_reason == outs[2].finish_reason == "eos"
