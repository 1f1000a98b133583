"""registry: every valid (method, graph_mode) resolves to its class; the rest error."""

import itertools

import pytest

from specdec.config import GRAPH_MODES, METHODS, MTP_ALIASES, SpeculativeConfig
from specdec.proposers.base import Proposer
from specdec.proposers.eagle import EagleProposer
from specdec.proposers.extract_hidden_states import ExtractHiddenStatesProposer
from specdec.proposers.mtp import MtpProposer
from specdec.proposers.torchair_mtp import TorchairMtpProposer
from specdec.proposers.registry import PROPOSERS, get_proposer_class, lookup

EXPECTED = {  # written out independently of the registry's table
    "mtp": MtpProposer,
    "eagle": EagleProposer,
    "eagle3": EagleProposer,
    "extract_hidden_states": ExtractHiddenStatesProposer,
}


def config(method, graph_mode):
    k = 1 if method == "extract_hidden_states" else 3
    return SpeculativeConfig(method, k, graph_mode=graph_mode,
                             draft_model_config={"eagle_aux_hidden_state_layer_ids": [0]})


@pytest.mark.parametrize("method,graph_mode",
                         list(itertools.product(METHODS + MTP_ALIASES, GRAPH_MODES)))
def test_every_valid_config_resolves(method, graph_mode):
    try:
        c = config(method, graph_mode)
    except ValueError:
        assert graph_mode == "torchair" and method in ("eagle", "eagle3", "extract_hidden_states")
        return
    cls = get_proposer_class(c)
    if graph_mode == "torchair":
        assert cls is TorchairMtpProposer
    else:
        assert cls is EXPECTED[c.method]
    assert issubclass(cls, Proposer)


@pytest.mark.parametrize("method,graph_mode", [
    ("eagle", "torchair"), ("extract_hidden_states", "torchair"), ("ngram", "eager"),
    ("deepseek_mtp", "eager"), ("mtp", "piecewise"),
])
def test_unsupported_pairs_error(method, graph_mode):
    with pytest.raises(ValueError) as info:
        lookup(method, graph_mode)
    msg = str(info.value)
    assert f"method={method!r}" in msg and f"graph_mode={graph_mode!r}" in msg
    assert "('mtp', 'torchair')" in msg  # lists what is supported


def test_table_only_holds_known_names():
    for method, graph_mode in PROPOSERS:
        assert method in METHODS and graph_mode in GRAPH_MODES
