"""EagleProposer: EAGLE-1 (method ``eagle``) and EAGLE-3 (method ``eagle3``).

EAGLE-1 drafts from the target's final hidden states; EAGLE-3 from the target's aux-layer
hidden states, concatenated and projected by the head's ``fc``. Steps 2..K feed the draft
layer's own output back (the base class's draft loop).
"""

import torch

from specdec.proposers.base import Proposer
from specdec.proposers.inputs import DraftInputs


class EagleProposer(Proposer):
    def first_pass_hidden(self, x: DraftInputs) -> torch.Tensor:
        if self.config.method != "eagle3":
            return x.hidden_states
        if x.aux_hidden_states is None:
            raise ValueError("method='eagle3' needs the target's aux hidden states "
                             "(eagle_aux_hidden_state_layer_ids)")
        return self.head.combine_hidden_states(x.aux_hidden_states.flatten(1))
