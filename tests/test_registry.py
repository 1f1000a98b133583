"""registry: every method (and MTP alias) resolves to its class, whatever the graph mode."""

import itertools

import pytest
import torch

from specdec.config import GRAPH_MODES, HOST_DRAFT_METHODS, METHODS, MTP_ALIASES, SpeculativeConfig
from specdec.graphs import default_backend, resolve_backend
from specdec.proposers.base import HeadProposer, PaddedProposer, Proposer
from specdec.proposers.draft_model import DraftLMProposer
from specdec.proposers.eagle import Eagle3Proposer, EagleProposer
from specdec.proposers.extract_hidden_states import ExtractHiddenStatesProposer
from specdec.proposers.mtp import MtpProposer
from specdec.proposers.ngram import NgramProposer
from specdec.proposers.suffix import SuffixProposer
from specdec.proposers.registry import PROPOSERS, get_proposer_class

EXPECTED = {  # written out independently of the registry's table
    "mtp": MtpProposer,
    "eagle": EagleProposer,
    "eagle3": Eagle3Proposer,
    "draft_model": DraftLMProposer,
    "extract_hidden_states": ExtractHiddenStatesProposer,
    "ngram": NgramProposer,
    "suffix": SuffixProposer,
}


@pytest.mark.parametrize("method,graph_mode",
                         list(itertools.product(METHODS + MTP_ALIASES, GRAPH_MODES)))
def test_every_method_resolves_to_one_class_in_every_graph_mode(method, graph_mode):
    k = 1 if method == "extract_hidden_states" else 3
    model = "draft-folder" if method == "draft_model" else None  # its one required key
    aux = {"eagle_aux_hidden_state_layer_ids": [0]} if method == "extract_hidden_states" else {}
    try:
        c = SpeculativeConfig(method, k, graph_mode=graph_mode, model=model,
                              draft_model_config=aux)
    except ValueError:
        assert method == "extract_hidden_states" and graph_mode != "eager"
        return
    cls = get_proposer_class(c)
    assert cls is EXPECTED[c.method]
    assert issubclass(cls, HeadProposer) == (c.method not in ("extract_hidden_states",
                                                                "ngram", "suffix"))
    # one interface for every method; ngram and suffix draft on the host from token ids:
    # none of the device-side preparation
    assert issubclass(cls, Proposer)
    assert issubclass(cls, PaddedProposer) == cls.drafts_on_device == (
        c.method not in ("ngram", "suffix"))


def test_the_table_is_exactly_the_config_methods():
    """A method added to config.METHODS and not to PROPOSERS (or the other way) fails here;
    so does a host drafter not named in config.HOST_DRAFT_METHODS (which refuses its
    ``model``)."""
    assert set(PROPOSERS) == set(METHODS)
    assert {m for m, cls in PROPOSERS.items() if not cls.drafts_on_device} == set(
        HOST_DRAFT_METHODS)


@pytest.mark.parametrize("mode,backend", [("eager", "eager"), ("torchair", "torchair"),
                                          (None, "eager")])
def test_graph_mode_picks_the_wrapper_backend(mode, backend):
    assert resolve_backend(mode, None, torch.device("cpu")).name == backend


def test_full_cuda_graph_needs_cuda_and_conflicts_are_errors():
    with pytest.raises(ValueError, match="full_cuda_graph.*needs a CUDA device.*cpu"):
        resolve_backend("full_cuda_graph", None, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^graph_backend='cuda_graph' needs a CUDA device, "
                                         r"got device='cpu'; allowed here: eager, compile,"):
        resolve_backend(None, "cuda_graph", torch.device("cpu"))  # named as it was given
    with pytest.raises(ValueError, match="graph_backend='replay' conflicts"):
        resolve_backend("torchair", "replay", torch.device("cpu"))
    with pytest.raises(ValueError, match="graph_backend='replay' conflicts with "
                                         "speculative_config graph_mode='eager'"):
        resolve_backend("eager", "replay", torch.device("cpu"))  # no graphs asked: not ignored
    assert resolve_backend("eager", "eager", torch.device("cpu")).name == "eager"
    with pytest.raises(ValueError, match="graph_backend='tensorrt'.*allowed"):
        resolve_backend(None, "tensorrt", torch.device("cpu"))
    assert resolve_backend(None, "replay", torch.device("cpu")).name == "replay"


@pytest.mark.parametrize("device,tp,cross_rank,backend", [
    ("cpu", 1, False, "eager"), ("cuda", 1, False, "cuda_graph"), ("cuda:1", 1, False, "cuda_graph"),
    ("cuda", 2, False, "eager"), ("cuda", 1, True, "eager"), ("xpu", 1, False, "eager")])
def test_the_default_backend_is_captured_on_cuda_only(device, tp, cross_rank, backend):
    """No graph_backend and no graph_mode: cuda_graph on one CUDA rank (what tests/test_cuda.py
    proves equal to eager), eager elsewhere and where a captured step is refused (TP ranks, a
    MoE model under DP)."""
    dev = torch.device(device)
    assert default_backend(dev, tensor_parallel_size=tp, cross_rank=cross_rank) == backend
    assert resolve_backend(None, None, dev, tensor_parallel_size=tp, cross_rank=cross_rank,
                           data_parallel_size=2 if cross_rank else 1).name == backend


def test_an_explicit_backend_or_graph_mode_beats_the_cuda_default():
    cuda = torch.device("cuda")
    assert resolve_backend("eager", None, cuda).name == "eager"
    assert resolve_backend("torchair", None, cuda).name == "torchair"
    assert resolve_backend(None, "eager", cuda).name == "eager"
    assert resolve_backend(None, "compile_dynamic", cuda).name == "compile_dynamic"
