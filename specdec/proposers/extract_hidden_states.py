"""ExtractHiddenStatesProposer: saves the target's aux hidden states, drafts one token."""

from specdec.proposers.base import Proposer


class ExtractHiddenStatesProposer(Proposer):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("ExtractHiddenStatesProposer lands with the engine issue")
