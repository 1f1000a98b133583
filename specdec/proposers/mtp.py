"""MtpProposer: MTP (method ``mtp`` and its aliases), eager or full-graph.

An MTP layer (DeepSeek/MiMo style) drafts from the embedding of the next token and the
target's final hidden state; for K > 1 the same layer runs again on its own output. All of
that is the base class's draft loop: this class only names the method.
"""

from specdec.proposers.base import Proposer


class MtpProposer(Proposer):
    pass
