"""TorchairMtpProposer: MTP in static-shape graph mode (graph_mode="torchair").

A decode batch where every request verifies exactly K drafts has the layout
``[B, 1 + K]``: padded to a bucket of Bp requests, every drafter shape depends on Bp only.
The whole K-step draft loop -- padded preparation, first pass, K-1 loop steps and their
metadata updates -- is one pure function compiled as one graph per bucket: with
``torchair`` when ``torch_npu`` is present, ``torch.compile(fullgraph=True, dynamic=False)``
elsewhere. Prefill and mixed batches run the eager draft loop; batches above the largest
bucket too, with a one-time warning. Padded mode only (the config rejects ragged + graph).
"""

import logging

import torch

from specdec.attention import AttentionMetadata
from specdec.platform import compile_graph
from specdec.kernels import (
    gather_backup_tokens,
    prepare_inputs_padded,
    prepare_next_token_ids_padded,
    shift_first_pass_input_ids,
)
from specdec.proposers.base import Proposer, _pad_rows
from specdec.proposers.inputs import DraftInputs

logger = logging.getLogger(__name__)


class TorchairMtpProposer(Proposer):
    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        backend = config.draft_model_config.get("compile_backend", "inductor")
        self.draft_graph = compile_graph(self._draft_loop, backend)
        self._warned_eager = False
        self.graph_steps = 0  # draft steps that ran the compiled graph

    def bind_runner(self, runner) -> None:
        # The graph path syncs one batch size per step, the eager path two (tokens, then
        # requests): with a cross-rank (MoE) head under DP, ranks taking different paths
        # would issue different collectives.
        if runner.dp.size > 1 and self.has_cross_rank_layers:
            raise ValueError("graph_mode='torchair' with a MoE draft head needs "
                             f"data_parallel_size=1, got {runner.dp.size}")
        super().bind_runner(runner)

    @torch.inference_mode()
    def propose(self, x: DraftInputs) -> torch.Tensor:
        if not x.uniform_decode:  # prefill chunks or truncated drafts: no static layout
            return super().propose(x)
        b, k1 = x.num_reqs, self.k + 1
        graph, bp, _ = self.determine_batch_execution_and_padding(b)
        if not graph:
            if not self._warned_eager:
                logger.warning("torchair MTP: batch of %d requests is above the largest graph "
                               "bucket; drafting eagerly", b)
                self._warned_eager = True
            return super().propose(x)
        n = b * k1
        pad = bp - b
        backup = gather_backup_tokens(x.token_table, x.rows, x.attn.seq_lens)
        placeholder = torch.full((pad, k1), -1, dtype=torch.int32, device=self.device)
        placeholder[:, 0] = 0  # padding rows "accept" token 0: every index stays in range
        drafts = self.draft_graph(
            torch.cat([x.sampled_token_ids, placeholder]),
            _pad_rows(x.discard_mask, bp), _pad_rows(backup, bp),
            _pad_rows(x.input_ids[:n], bp * k1), _pad_rows(x.positions[:n], bp * k1),
            _pad_rows(x.hidden_states[:n], bp * k1),
            torch.cat([x.attn.slot_mapping[:n],
                       x.attn.slot_mapping.new_full((pad * k1,), -1)]),
            torch.cat([x.attn.seq_lens, x.attn.seq_lens.new_ones(pad)]),
            _pad_rows(x.attn.block_table, bp),
            torch.full((), b, dtype=torch.int32, device=self.device))
        self.graph_steps += 1
        return drafts[:b]

    def _draft_loop(self, sampled, discard, backup, target_ids, positions, hidden, slots,
                    seq_lens, block_table, num_reqs):
        """The whole draft step for Bp requests of 1+K tokens each -> drafts [Bp, K] int32.

        sampled [Bp, K+1] int32; discard, backup, seq_lens [Bp]; target_ids, positions,
        slots [Bp*(K+1)]; hidden [Bp*(K+1), H]; block_table [Bp, M]; num_reqs: 0-dim int32.
        Every shape depends on Bp only; nothing here reads a value on the host.
        """
        bp, k1 = sampled.shape
        dev = sampled.device
        qsl = torch.arange(bp + 1, dtype=torch.int32, device=dev) * k1
        cu_num_draft = torch.arange(1, bp + 1, dtype=torch.int32, device=dev) * (k1 - 1)
        next_ids, valid = prepare_next_token_ids_padded(sampled, discard, backup,
                                                        self.vocab_size)
        sample_idx, num_rejected = prepare_inputs_padded(cu_num_draft, valid, qsl)
        sample_idx = sample_idx.to(torch.int64)
        ids = shift_first_pass_input_ids(target_ids, sample_idx, next_ids)
        attn = AttentionMetadata(slots, qsl, seq_lens, block_table, self.max_model_len)
        logits_h, next_h = self.head(ids, positions, hidden, kv=self.kv.bind(attn))
        token = self.sample(logits_h[sample_idx])
        drafts = [token] + self.draft_loop_steps(
            token, next_h[sample_idx], positions[sample_idx], seq_lens, num_rejected, num_reqs,
            block_table, self.max_model_len)
        return torch.stack(drafts, dim=1)
