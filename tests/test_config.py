"""SpeculativeConfig: vLLM key names, method normalisation, one test per validation rule."""

import json

import pytest

from specdec.config import MTP_ALIASES, SpeculativeConfig

AUX = {"eagle_aux_hidden_state_layer_ids": [1, 2]}


def make(**kw):
    return SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 3, **kw})


def test_defaults_from_the_design_example():
    c = SpeculativeConfig.from_json(
        '{"method": "mtp", "num_speculative_tokens": 3, "disable_padded_drafter_batch": false}')
    assert (c.method, c.num_speculative_tokens, c.graph_mode, c.model) == ("mtp", 3, None, None)
    assert c.is_padded and not c.uses_aux_hidden_states
    assert not make(disable_padded_drafter_batch=True).is_padded


@pytest.mark.parametrize("alias", MTP_ALIASES)
def test_mtp_aliases_normalise(alias):
    assert make(method=alias).method == "mtp"


def test_vllm_mtp_names_are_aliases():
    for name in ("deepseek_mtp", "mimo_mtp", "qwen3_next_mtp", "ernie_mtp", "glm4_moe_mtp",
                 "longcat_flash_mtp", "pangu_ultra_moe_mtp", "step3p5_mtp", "qwen3_5_mtp"):
        assert name in MTP_ALIASES


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_methods_kept(method):
    assert make(method=method, graph_mode="full_cuda_graph").method == method


def test_from_json_round_trip_of_every_field():
    d = {"method": "eagle3", "num_speculative_tokens": 5, "disable_padded_drafter_batch": True,
         "draft_model_config": {"hf_config": AUX}, "model": "heads/eagle3", "graph_mode": "eager"}
    c = SpeculativeConfig.from_json(json.dumps(d))
    assert {f: getattr(c, f) for f in d} == d
    assert c.uses_aux_hidden_states


def assert_error(exc, field, **kw):
    with pytest.raises(exc) as info:
        make(**kw)
    assert field in str(info.value)
    return str(info.value)


def test_unknown_method():
    msg = assert_error(ValueError, "method", method="medusa")
    assert "'medusa'" in msg and "eagle3" in msg and "draft_model" in msg


def test_draft_model_needs_its_folder():
    msg = assert_error(ValueError, "speculative_config.model", method="draft_model")
    assert "method='draft_model'" in msg


def test_method_not_a_string():
    assert_error(TypeError, "method", method=3)


@pytest.mark.parametrize("k", [0, -1])
def test_k_below_one(k):
    assert f"num_speculative_tokens={k}" in assert_error(ValueError, "num_speculative_tokens",
                                                         num_speculative_tokens=k)


@pytest.mark.parametrize("k", [2.0, "3", True, None])
def test_k_not_an_int(k):
    assert_error(TypeError, "num_speculative_tokens", num_speculative_tokens=k)


def test_unknown_key():
    msg = assert_error(ValueError, "speculative_model", speculative_model="x")
    assert "num_speculative_tokens" in msg  # lists what is allowed


@pytest.mark.parametrize("key", ["method", "num_speculative_tokens"])
def test_missing_required_key(key):
    d = {"method": "mtp", "num_speculative_tokens": 1}
    del d[key]
    with pytest.raises(ValueError, match=key):
        SpeculativeConfig.from_dict(d)


def test_not_a_dict():
    with pytest.raises(TypeError, match="dict"):
        SpeculativeConfig.from_json("[1, 2]")


def test_disable_padded_not_a_bool():
    assert_error(TypeError, "disable_padded_drafter_batch", disable_padded_drafter_batch="no")


def test_draft_model_config_not_a_dict():
    assert_error(TypeError, "draft_model_config", draft_model_config=[1])


@pytest.mark.parametrize("method,dmc,where,bad", [
    ("eagle3", {"eagle_aux_hidden_state_layers_ids": [1]}, "draft_model_config",
     "eagle_aux_hidden_state_layers_ids"),  # a misspelling
    ("eagle3", {"num_hidden_layers": 7, **AUX}, "draft_model_config", "num_hidden_layers"),
    ("eagle3", {"hf_config": {**AUX, "x": 1}}, "draft_model_config.hf_config", "'x'"),
    ("eagle3", {"hf_config": {"eagle_config": {**AUX, "y": 1}}},
     "draft_model_config.hf_config.eagle_config", "'y'"),
    ("mtp", AUX, "draft_model_config", "eagle_aux_hidden_state_layer_ids"),
    ("ngram", {"output_dir": "x"}, "draft_model_config", "output_dir"),
    ("eagle3", {"output_dir": "x", **AUX}, "draft_model_config", "output_dir"),
])
def test_draft_model_config_keys_no_method_reads_are_refused(method, dmc, where, bad):
    with pytest.raises(ValueError, match=rf"^{where} has keys \[.*{bad}.*\] that "
                                         rf"method='{method}' does not read; allowed: "):
        make(method=method, draft_model_config=dmc)


@pytest.mark.parametrize("dmc", [AUX, {"hf_config": AUX}, {"eagle_config": AUX},
                                 {"hf_config": {"eagle_config": AUX}}])
def test_the_aux_layer_ids_are_read_wherever_vllm_nests_them(dmc):
    assert make(method="eagle3", draft_model_config=dmc).aux_layer_ids_configured == [1, 2]


@pytest.mark.parametrize("method", ["ngram", "suffix", "extract_hidden_states"])
def test_a_model_folder_is_refused_where_no_folder_is_loaded(method):
    extra = dict(num_speculative_tokens=1, draft_model_config=AUX) \
        if method == "extract_hidden_states" else {}
    assert_error(ValueError, f"model='m': method='{method}' loads no draft folder",
                 method=method, model="m", **extra)


def test_model_not_a_path():
    assert_error(TypeError, "model", model=1)


def test_unknown_graph_mode():
    msg = assert_error(ValueError, "graph_mode", graph_mode="piecewise")
    assert "'piecewise'" in msg and "full_cuda_graph" in msg


@pytest.mark.parametrize("mode", ["torchair", "full_cuda_graph"])
def test_ragged_with_full_graph(mode):
    msg = assert_error(ValueError, "disable_padded_drafter_batch", graph_mode=mode,
                       disable_padded_drafter_batch=True)
    assert mode in msg
    assert not make(graph_mode="eager", disable_padded_drafter_batch=True).is_padded


@pytest.mark.parametrize("mode", ["torchair", "full_cuda_graph"])
def test_graph_modes_wrap_every_drafting_method_but_not_extraction(mode):
    """Graph mode is a step wrapper, not a class: any drafting method takes it."""
    for method in ("eagle", "eagle3", "deepseek_mtp"):
        assert make(method=method, graph_mode=mode).graph_mode == mode
    msg = assert_error(ValueError, "graph_mode", method="extract_hidden_states",
                       graph_mode=mode, draft_model_config={
                           "eagle_aux_hidden_state_layer_ids": [1]})
    assert "extract_hidden_states" in msg


def test_extract_hidden_states_needs_k_one():
    assert_error(ValueError, "num_speculative_tokens", method="extract_hidden_states",
                 num_speculative_tokens=2, draft_model_config=AUX)


def test_extract_hidden_states_needs_padded():
    assert_error(ValueError, "disable_padded_drafter_batch", method="extract_hidden_states",
                 num_speculative_tokens=1, draft_model_config=AUX,
                 disable_padded_drafter_batch=True)


def test_extract_hidden_states_needs_aux_layer_ids():
    assert_error(ValueError, "eagle_aux_hidden_state_layer_ids", method="extract_hidden_states",
                 num_speculative_tokens=1)
    for dmc in (AUX, {"hf_config": AUX}):
        c = make(method="extract_hidden_states", num_speculative_tokens=1, draft_model_config=dmc)
        assert c.aux_layer_ids(4) == (1, 2)


@pytest.mark.parametrize("ids", [[], [1, -1], [1, "2"], 3, [True]])
def test_malformed_aux_layer_ids(ids):
    assert_error(ValueError, "eagle_aux_hidden_state_layer_ids", method="eagle3",
                 draft_model_config={"eagle_aux_hidden_state_layer_ids": ids})


def test_aux_layer_ids_default_is_vllms():
    c = make(method="eagle3")
    assert c.aux_layer_ids(32) == (2, 16, 29)
    assert c.aux_layer_ids(4) == (2, 2, 1)


def test_aux_layer_ids_out_of_range():
    c = make(method="eagle3", draft_model_config={"hf_config": {
        "eagle_aux_hidden_state_layer_ids": [0, 4]}})
    assert c.aux_layer_ids(5) == (0, 4)
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids.*\[4\].*\[0, 4\)"):
        c.aux_layer_ids(4)
    # vLLM's (2, L // 2, L - 3) leaves a target below 4 layers: held inside [0, L)
    assert [make(method="eagle3").aux_layer_ids(n) for n in (1, 2, 3)] == [
        (0, 0, 0), (1, 1, 0), (2, 1, 0)]


def test_a_config_changed_after_it_was_made_is_checked_again():
    """The engine takes a copy of a SpeculativeConfig built anew, so a field set after
    construction is checked as at construction (it was used unchecked); a valid one comes
    back equal."""
    from specdec.engine.inputs import parse_speculative_config
    for method in ("mtp", "eagle", "eagle3", "ngram", "suffix"):
        spec = SpeculativeConfig(method, 3)
        assert parse_speculative_config(spec) == spec
    spec = SpeculativeConfig("ngram", 3)
    spec.num_speculative_tokens = 0
    with pytest.raises(ValueError, match="num_speculative_tokens=0 must be >= 1"):
        parse_speculative_config(spec)
    spec = SpeculativeConfig("suffix", 3)
    spec.suffix_decoding_min_token_prob = 5.0
    with pytest.raises(ValueError, match=r"suffix_decoding_min_token_prob=5.0: allowed"):
        parse_speculative_config(spec)
