"""EagleProposer: EAGLE-1 and EAGLE-3 heads."""

from specdec.proposers.base import Proposer


class EagleProposer(Proposer):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("EagleProposer lands with the engine issue")
