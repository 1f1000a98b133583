"""Which proposer class runs a method: one table, one lookup. Graph mode is not a class: it
picks the step wrapper's backend (`specdec.graphs`)."""

from specdec.config import SpeculativeConfig
from specdec.proposers.base import Proposer
from specdec.proposers.draft_model import DraftLMProposer
from specdec.proposers.eagle import Eagle3Proposer, EagleProposer
from specdec.proposers.extract_hidden_states import ExtractHiddenStatesProposer
from specdec.proposers.mtp import MtpProposer
from specdec.proposers.ngram import NgramProposer
from specdec.proposers.suffix import SuffixProposer

PROPOSERS: dict[str, type[Proposer]] = {
    "mtp": MtpProposer,
    "eagle": EagleProposer,
    "eagle3": Eagle3Proposer,
    "draft_model": DraftLMProposer,  # a separate small causal LM (speculative_config.model)
    "extract_hidden_states": ExtractHiddenStatesProposer,
    # host drafters: drafts from the token ids after each step (Proposer.next_drafts)
    "ngram": NgramProposer,
    "suffix": SuffixProposer,
}


def get_proposer_class(config: SpeculativeConfig) -> type[Proposer]:
    return PROPOSERS[config.method]
