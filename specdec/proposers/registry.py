"""Which proposer class runs a (method, graph_mode) pair: one table, one lookup."""

from specdec.config import SpeculativeConfig
from specdec.proposers.base import Proposer
from specdec.proposers.eagle import EagleProposer
from specdec.proposers.extract_hidden_states import ExtractHiddenStatesProposer
from specdec.proposers.mtp import MtpProposer
from specdec.proposers.torchair_mtp import TorchairMtpProposer

PROPOSERS: dict[tuple[str, str], type[Proposer]] = {
    ("mtp", "eager"): MtpProposer,
    ("mtp", "full_cuda_graph"): MtpProposer,
    ("mtp", "torchair"): TorchairMtpProposer,
    ("eagle", "eager"): EagleProposer,
    ("eagle", "full_cuda_graph"): EagleProposer,
    ("eagle3", "eager"): EagleProposer,
    ("eagle3", "full_cuda_graph"): EagleProposer,
    ("extract_hidden_states", "eager"): ExtractHiddenStatesProposer,
    ("extract_hidden_states", "full_cuda_graph"): ExtractHiddenStatesProposer,
}


def lookup(method: str, graph_mode: str) -> type[Proposer]:
    """The class for a normalised method and a graph mode; ValueError if none."""
    cls = PROPOSERS.get((method, graph_mode))
    if cls is None:
        raise ValueError(f"no proposer for method={method!r} with graph_mode={graph_mode!r}; "
                         f"supported (method, graph_mode): {sorted(PROPOSERS)}")
    return cls


def get_proposer_class(config: SpeculativeConfig) -> type[Proposer]:
    return lookup(config.method, config.graph_mode)
