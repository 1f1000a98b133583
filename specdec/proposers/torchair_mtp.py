"""TorchairMtpProposer: MTP under the Ascend Torchair graph (graph_mode='torchair')."""

from specdec.proposers.base import Proposer


class TorchairMtpProposer(Proposer):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("TorchairMtpProposer lands with the engine issue")
