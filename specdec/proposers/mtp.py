"""MtpProposer: MTP (method ``mtp`` and its aliases), in any graph mode.

An MTP layer (DeepSeek/MiMo style) drafts from the embedding of the next token and the
target's final hidden state; for K > 1 the same layer runs again on its own output. All of
that is the base class's padded step: this class only names the method. Torchair-MTP is this
class with ``graph_mode="torchair"`` (the step wrapper's torchair backend).
"""

from specdec.proposers.base import HeadProposer


class MtpProposer(HeadProposer):
    pass
