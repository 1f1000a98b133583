"""Which proposer class runs a method: one table, one lookup. Graph mode is not a class: it
picks the step wrapper's backend (`specdec.graphs`)."""

from specdec.config import SpeculativeConfig
from specdec.proposers.base import Proposer
from specdec.proposers.eagle import Eagle3Proposer, EagleProposer
from specdec.proposers.extract_hidden_states import ExtractHiddenStatesProposer
from specdec.proposers.mtp import MtpProposer
from specdec.proposers.ngram import NgramProposer

PROPOSERS: dict[str, type[Proposer] | type[NgramProposer]] = {
    "mtp": MtpProposer,
    "eagle": EagleProposer,
    "eagle3": Eagle3Proposer,
    "extract_hidden_states": ExtractHiddenStatesProposer,
    "ngram": NgramProposer,  # drafts on the host after each step (LLM._apply), no device step
}


def get_proposer_class(config: SpeculativeConfig) -> type[Proposer]:
    return PROPOSERS[config.method]
