"""EagleProposer: EAGLE-1 (method ``eagle``) and EAGLE-3 (method ``eagle3``).

EAGLE-1 drafts from the target's final hidden states; EAGLE-3 from the target's aux-layer
hidden states, concatenated and projected by the head's ``fc`` (inside the padded step, so a
captured step includes it). Steps 2..K feed the draft layer's own output back.
"""

import torch

from specdec.proposers.base import DraftModelProposer
from specdec.proposers.inputs import DraftInputs


class EagleProposer(DraftModelProposer):
    def draft_features(self, x: DraftInputs) -> torch.Tensor:
        if self.config.method != "eagle3":
            return x.hidden_states
        if x.aux_hidden_states is None:
            raise ValueError("method='eagle3' needs the target's aux hidden states "
                             "(eagle_aux_hidden_state_layer_ids)")
        return x.aux_hidden_states.flatten(1)  # [Np, A * H]

    def first_pass_hidden(self, features: torch.Tensor) -> torch.Tensor:
        if self.config.method != "eagle3":
            return features
        return self.head.combine_hidden_states(features)
