"""EagleProposer (method ``eagle``, EAGLE-1) and Eagle3Proposer (method ``eagle3``).

EAGLE-1 drafts from the target's final hidden states (the base class's hooks); EAGLE-3 from
the target's aux-layer hidden states, concatenated and projected by the head's ``fc`` (inside
the padded step, so a captured step includes it). Steps 2..K feed the draft layer's own output
back.
"""

import torch

from specdec.proposers.base import HeadProposer
from specdec.proposers.inputs import DraftInputs


class EagleProposer(HeadProposer):
    pass


class Eagle3Proposer(HeadProposer):
    def draft_features(self, x: DraftInputs) -> torch.Tensor:
        """[Np, A * H] the target's aux-layer hidden states, concatenated."""
        if x.aux_hidden_states is None:
            raise ValueError("method='eagle3' needs the target's aux hidden states "
                             "(eagle_aux_hidden_state_layer_ids)")
        return x.aux_hidden_states.flatten(1)

    def first_pass_hidden(self, features: torch.Tensor) -> torch.Tensor:
        """[Np, H]: the aux states projected by the head's ``fc``."""
        return self.head.combine_hidden_states(features)
