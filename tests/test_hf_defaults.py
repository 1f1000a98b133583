"""A key a published ``config.json`` leaves out means what transformers' config class gives
it for that ``model_type``; specdec holds those values once per family (``HF_DEFAULTS``).

- The table cannot drift: for every supported ``model_type``, each entry equals transformers'
  value on configs of random shapes (hypothesis; a value computed from the shape, such as
  Llama's ``head_dim``, would differ), and every key the loader reads that transformers gives
  a fixed default has its entry.
- Folders as published load: a tiny random model per ``model_type`` written by transformers,
  its config.json then stripped of every key whose value is the class default (as the Hub's
  files leave out gemma-2-2b's ``tie_word_embeddings``; tied ones hold no ``lm_head.weight``),
  loads in specdec and equals transformers' logits and greedy tokens.
"""

import inspect
from dataclasses import fields

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import LLM
from specdec.models import load_model
from specdec.models.config import LAYOUT_KEYS, REFUSED_VALUES, ModelConfig
from specdec.models.layers.rotary import ROPE_CONFIG_KEYS
from specdec.models.registry import ARCHITECTURES

import hf_deepseek as D
import hf_glm4_moe as G
import hf_gpt_oss as O
import hf_models as H
import hf_qwen3_5 as Q

FAMILIES = {cls.MODEL_TYPE: cls for cls in ARCHITECTURES.values()}
# MiMo's config class is remote code subclassing Qwen2Config
TRANSFORMERS_TYPE = {"mimo": "qwen2"}
# what a config must name (no default), and the ids that are never defaulted (config.py)
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads")
NOT_DEFAULTED = {"bos_token_id", "eos_token_id", "pad_token_id"}
ROPE_KEYS = ("rope_theta", "partial_rotary_factor", "rope_scaling", "rope_local_base_freq")
OTHER_SHAPE = dict(vocab_size=1000, hidden_size=96, intermediate_size=80, num_hidden_layers=5,
                   num_attention_heads=6)


def config_class(model_type: str):
    from transformers import CONFIG_MAPPING
    return CONFIG_MAPPING[TRANSFORMERS_TYPE.get(model_type, model_type)]


def transformers_value(cfg, key: str):
    """The value transformers' config ``cfg`` holds for table key ``key`` (the rotary keys in
    their transformers-4 spelling, read from ``rope_parameters``)."""
    rope = cfg.rope_parameters
    full = rope.get("full_attention", rope)
    if key == "rope_theta":
        return full["rope_theta"]
    if key == "rope_local_base_freq":
        return rope["sliding_attention"]["rope_theta"]
    if key == "partial_rotary_factor":
        return full.get("partial_rotary_factor")
    if key == "rope_scaling":
        return {k: v for k, v in full.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if key == "full_attention_interval":
        return next((i + 1 for i, t in enumerate(cfg.layer_types) if t == "full_attention"), None)
    return getattr(cfg, key)


def read_keys(family) -> set[str]:
    """Every top-level key ``ModelConfig.from_dict`` reads for ``family``."""
    names = {f.name for f in fields(ModelConfig)} - {"extra", "architectures",
                                                     "rope_by_layer_type", "torch_dtype"}
    return (names | set(ROPE_CONFIG_KEYS) | set(REFUSED_VALUES) | LAYOUT_KEYS
            | family.CONFIG_KEYS)


SHAPES = st.builds(
    lambda heads, head, layers, inter, vocab: dict(
        num_attention_heads=heads, hidden_size=heads * head, num_hidden_layers=layers,
        intermediate_size=inter, vocab_size=vocab),
    st.sampled_from([2, 4, 6, 8]), st.sampled_from([8, 16, 32]), st.integers(4, 9),
    st.sampled_from([64, 96, 160]), st.sampled_from([512, 1024, 32000]))


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
@settings(max_examples=10, deadline=None)
@given(shape=SHAPES)
def test_each_default_is_transformers_value(model_type, shape):
    cfg = config_class(model_type)(**shape)
    for key, value in FAMILIES[model_type].HF_DEFAULTS.items():
        assert transformers_value(cfg, key) == value, f"{model_type}: {key}"


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_fixed_default_of_a_read_key_is_in_the_table(model_type):
    """The keys the loader reads that transformers' class takes with a default (an argument of
    its ``__init__``) the same for two shapes; the rotary ones as one ``rope_parameters``."""
    family, cls = FAMILIES[model_type], config_class(model_type)
    table, read = family.HF_DEFAULTS, read_keys(family)
    assert set(table) <= read, f"{model_type}: keys the loader does not read"
    a, b = cls(), cls(**OTHER_SHAPE)
    args = set(inspect.signature(cls.__init__).parameters)
    fixed = {k for k in read & args if getattr(a, k) == getattr(b, k)}
    wanted = fixed - NOT_DEFAULTED - set(SHAPE_KEYS) - {"rope_parameters", "rope_scaling"}
    assert sorted(wanted - set(table)) == [], f"{model_type}: defaults missing"
    rope = {"rope_type": "default", **table.get("rope_scaling", {}),
            "rope_theta": table["rope_theta"]}
    if "partial_rotary_factor" in table:
        rope["partial_rotary_factor"] = table["partial_rotary_factor"]
    if "rope_local_base_freq" in table:
        rope = {"full_attention": rope, "sliding_attention": {
            "rope_type": "default", "rope_theta": table["rope_local_base_freq"]}}
    assert rope == a.rope_parameters


# ---- folders as published ------------------------------------------------------------------
BUILDERS = {
    "llama": H.build_llama32, "mistral": H.build_mistral_v01, "qwen2": H.build_qwen25,
    "mimo": H.build_mimo, "qwen3": H.build_qwen3, "qwen3_moe": H.build_qwen3_moe,
    "minimax_m2": H.build_minimax_m2, "deepseek_v3": D.build_deepseek_v3,
    "glm4_moe": G.build_glm, "qwen3_5_text": Q.build_qwen3_5, "qwen3_next": Q.build_qwen3_next,
    "gemma2": H.build_gemma2, "gemma3_text": H.build_gemma3, "phi3": H.build_phi3,
    "gpt_oss": O.build,
}
MAX_NEW = 8
_gen = torch.Generator().manual_seed(49)
PROMPT = torch.randint(3, 500, (40,), generator=_gen).tolist()  # > every window, > Phi-3's 32


def as_published(config: dict) -> dict:
    """``config`` without the keys whose value is transformers' class default for a config of
    its shape (the shape, ``model_type`` and ``architectures`` kept)."""
    cls = config_class(config["model_type"])
    base = cls(**{k: config[k] for k in SHAPE_KEYS})

    def default(key, value) -> bool:
        try:
            return transformers_value(base, key) == value
        except (AttributeError, KeyError, TypeError):
            return False
    return {k: v for k, v in config.items()
            if k in ("model_type", "architectures", *SHAPE_KEYS) or not default(k, v)}


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """model_type -> (the folder as published, transformers' logits and tokens)."""
    cache = {}

    def get(model_type):
        if model_type not in cache:
            root = tmp_path_factory.mktemp(model_type)
            path = BUILDERS[model_type](root / "model")
            ref = path
            if model_type in TRANSFORMERS_TYPE:  # transformers reads MiMo's target as Qwen2
                ref = H.copy_folder(path, root / "ref")
                H.write_config(ref, {**H.read_config(ref), "model_type": "qwen2",
                                     "architectures": ["Qwen2ForCausalLM"]})
            model = H.hf_model(ref)
            want = {"logits": H.hf_last_logits(None, PROMPT, model=model),
                    "tokens": H.hf_greedy(None, [PROMPT], MAX_NEW, model=model)[0]}
            H.write_config(path, as_published(H.read_config(path)))
            cache[model_type] = path, want
        return cache[model_type]
    return get


def test_every_supported_model_type_has_a_published_folder():
    assert sorted(BUILDERS) == sorted(FAMILIES)


@pytest.mark.parametrize("model_type", sorted(BUILDERS))
def test_a_folder_as_published_loads_and_equals_transformers(model_type, published,
                                                             one_torch_thread):
    path, want = published(model_type)
    config = H.read_config(path)
    if config.get("tie_word_embeddings", FAMILIES[model_type].HF_DEFAULTS.get(
            "tie_word_embeddings")):
        assert "lm_head.weight" not in H.tensor_names(path)
    model = load_model(path)
    ids = torch.tensor(PROMPT)
    with torch.inference_mode():
        hidden, _ = model(ids[None], torch.arange(len(ids))[None])
        logits = model.compute_logits(hidden[0, -1])
    diff = (logits - want["logits"]).abs().max().item()
    assert diff <= 1e-4, f"{model_type}: max |dlogit| {diff:.3g}"
    out = LLM(model=str(path), max_num_seqs=2, max_model_len=128).generate(
        [PROMPT], max_tokens=MAX_NEW, ignore_eos=True)[0]
    assert out.token_ids == want["tokens"]


# ---- one home per architecture fact ---------------------------------------------------------
def _subclasses(cls) -> set:
    return {c for s in cls.__subclasses__() for c in {s} | _subclasses(s)}


def test_every_target_family_is_registered_and_its_tables_derive():
    """Each decoder class of specdec.models is in ``FAMILIES`` (a family added to one place and
    not the registry fails here); the tables derive from its class: the architecture is the
    class's name, its model_type (or its multimodal checkpoint's) reads back to it, one
    architecture per model_type."""
    from specdec.models.decoder import DecoderForCausalLM
    from specdec.models.registry import ARCHITECTURE_OF_MODEL_TYPE, FAMILIES

    defined = {c for c in _subclasses(DecoderForCausalLM) if c.__module__.startswith(
        "specdec.models.")}
    assert defined == set(FAMILIES)
    assert all(ARCHITECTURES[cls.__name__] is cls and cls.MODEL_TYPE for cls in FAMILIES)
    assert len(ARCHITECTURE_OF_MODEL_TYPE) == len(ARCHITECTURES)
    for arch, cls in ARCHITECTURES.items():
        assert ARCHITECTURE_OF_MODEL_TYPE[cls.MULTIMODAL_MODEL_TYPE or cls.MODEL_TYPE] == arch


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_each_architecture_is_transformers_class_of_its_model_type(arch):
    """transformers' class of that name reads a config of the family's model_type (MiMo's is
    remote code: its Qwen2 base)."""
    import transformers

    cls = ARCHITECTURES[arch]
    model_type = cls.MULTIMODAL_MODEL_TYPE or cls.MODEL_TYPE
    hf = getattr(transformers, arch if model_type != "mimo" else "Qwen2ForCausalLM")
    assert hf.config_class.model_type == TRANSFORMERS_TYPE.get(model_type, model_type)
