"""The step's host inputs, from TP rank 0 (the driver, which schedules and plans) to its TP
peers: one broadcast of the step buffers' host bytes per step.

The broadcast tensor is ``StepBuffers.wire``: a header of int64 words, then every host field
the step runs on. Header: ``[kind, num_reqs, num_tokens, num_reqs_padded, num_tokens_padded,
capturable, uniform_decode, variant, max_seq_len, graph_seq_len, max_query_len, prompt_words,
num_spec_tokens, num_tokens_across_dp[0..D-1]]``; kind is STEP,
DUMMY (an idle DP rank's step: the same forwards, no inputs) or STOP (every DP rank is idle:
the peers return from ``serve``). New prompts enter the driver's token table between steps;
when there are some (``prompt_words`` > 0) a second broadcast carries them, int32
``[row, length, tokens..., row, length, tokens...]``, so every rank's token table (the backup
tokens of the padded draft step) stays the same.

Worked example (D=1): a decode step of 2 requests, K=1, padded to 2 requests / 4 tokens, greedy,
longest sequence 9, max_model_len 64, no new prompt -> header
``[1, 2, 4, 2, 4, 1, 1, 0, 9, 64, 2, 0, 1, 4]``, one broadcast.
"""

import torch

from specdec.distributed import TPContext
from specdec.engine.step_buffers import StepBuffers
from specdec.padding import StepPlan

STEP, DUMMY, STOP = 1, 2, 3
FIXED = 13  # header words before num_tokens_across_dp


def header_words(dp_size: int) -> int:
    return FIXED + dp_size


class StepBroadcast:
    """Driver: ``send``; peer: ``receive``. Both hold the same StepBuffers and token table."""

    def __init__(self, tp: TPContext, buffers: StepBuffers, token_table: torch.Tensor,
                 variants: tuple[str, ...]):
        self.tp, self.buffers, self.token_table = tp, buffers, token_table
        self.variants = variants  # the runner's sampling variants, sent by index
        self.prompts: list[tuple[int, list[int]]] = []  # driver: written since the last send

    def note_prompt(self, row: int, token_ids: list[int]) -> None:
        """Driver: a prompt written into the token table, for the peers at the next send."""
        if self.tp.size > 1:
            self.prompts.append((row, list(token_ids)))

    def send(self, kind: int, plan: StepPlan | None = None, lens: tuple[int, int, int] = (0, 0, 0),
             variant: str = "greedy") -> None:
        """Driver: the step's header and host buffers (filled by ``prepare`` for STEP);
        ``lens``: the StepBatch's (max_seq_len, graph_seq_len, max_query_len)."""
        if self.tp.size == 1:
            return
        words = [w for row, ids in self.prompts for w in (row, len(ids), *ids)]
        h = self.buffers.header
        h.zero_()
        h[0], h[11] = kind, len(words)
        h[8:11] = torch.tensor(lens)
        if plan is not None:
            h[1:8] = torch.tensor([plan.num_reqs, plan.num_tokens, plan.num_reqs_padded,
                                   plan.num_tokens_padded, int(plan.capturable),
                                   int(plan.uniform_decode), self.variants.index(variant)])
            h[12] = plan.num_spec_tokens
            h[FIXED:] = torch.tensor(plan.num_tokens_across_dp)
        self.tp.broadcast(self.buffers.wire)
        if words:
            self.tp.broadcast(torch.tensor(words, dtype=torch.int32))
        self.prompts.clear()

    def receive(self) -> tuple[int, StepPlan | None, tuple[int, int, int], str]:
        """Peer: (kind, plan, lens, variant) of the driver's next step (``send``'s); the host
        buffers are copied to the device and new prompts written to the token table."""
        self.tp.broadcast(self.buffers.wire)
        h = self.buffers.header.tolist()
        kind, lens, nwords = h[0], tuple(h[8:11]), h[11]
        if nwords:
            words = self.tp.broadcast(torch.empty(nwords, dtype=torch.int32)).tolist()
            i = 0
            while i < nwords:
                row, n = words[i], words[i + 1]
                self.token_table[row].fill_(-1)
                self.token_table[row, :n] = torch.tensor(words[i + 2:i + 2 + n],
                                                         dtype=torch.int32)
                i += 2 + n
        if kind == STOP:
            return kind, None, lens, "greedy"
        plan = StepPlan(h[1], h[2], h[3], h[4], bool(h[5]), tuple(h[FIXED:]), bool(h[6]), h[12])
        if kind == STEP:  # (an accelerator's async copy of the previous step is done: the
            # driver sent this step after reading its results, which waited on collectives
            # that come after that copy on this rank's stream)
            self.buffers.copy_to_device()
        return kind, plan, lens, self.variants[h[7]]
