"""The model runner: turns a scheduled step into device tensors, runs target, sampler, drafter.

``prepare`` is host work (Python lists -> one copy per tensor); ``execute`` is device work
only, so in padded mode it runs inside ``forbid_host_sync`` end to end.
"""

from dataclasses import dataclass

import time

import torch

from specdec.dp import DPContext, sync_batch_across_dp
from specdec.attention import AttentionMetadata, KVCache
from specdec.engine.rejection_sampler import rejection_sample
from specdec.engine.scheduler import ScheduledRequest
from specdec.models.llama import LlamaForCausalLM
from specdec.models.moe import attach_parallel
from specdec.padding import BatchPadder
from specdec.proposers.inputs import DraftInputs


@dataclass
class StepBatch:
    """One target step's inputs, already on the device."""

    num_reqs: int  # B
    num_tokens: int  # real tokens (before padding)
    uniform_decode: bool  # every request verifies exactly K drafts
    input_ids: torch.Tensor  # [N] int64, N = padded token count
    positions: torch.Tensor  # [N] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [B, K+1] int64, token row of each verified position
    draft_token_ids: torch.Tensor  # [B, K] int32 drafts being verified (0-padded)
    num_draft_tokens: torch.Tensor  # [B] int32
    cu_num_draft_tokens: torch.Tensor  # [B] int32 inclusive cumsum
    discard_mask: torch.Tensor  # [B] bool
    rows: torch.Tensor  # [B] int64 token-table rows
    temperature: torch.Tensor  # [B] float32
    top_p: torch.Tensor | None  # [B] float32; None when no request filters (skips a sort)


class ModelRunner:
    def __init__(self, target: LlamaForCausalLM, proposer, *, num_spec_tokens: int,
                 max_num_seqs: int, max_model_len: int, block_size: int, num_kv_blocks: int,
                 aux_layer_ids: tuple[int, ...], padder: BatchPadder, dp: DPContext,
                 device: torch.device, dtype: torch.dtype, seed: int = 0):
        cfg = target.config
        self.target = target
        self.proposer = proposer
        self.k = num_spec_tokens
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.aux_layer_ids = aux_layer_ids
        self.padder = padder
        self.dp = dp
        self.device = device
        self.kv = KVCache(cfg.num_hidden_layers, num_kv_blocks, block_size,
                          cfg.num_key_value_heads, cfg.head_dim, dtype, device)
        self.token_table = torch.full((max_num_seqs, max_model_len + 1), -1, dtype=torch.int32,
                                      device=device)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.last_draft_seconds = 0.0  # drafter share of the last execute()
        # MoE layers (target and draft head) exchange tokens over the DP group; SP shards
        sp = padder.tp_size if padder.sequence_parallel else 1
        for model in (target, getattr(proposer, "head", None)):
            if model is not None:
                attach_parallel(model, dp, sp)
        if proposer is not None:
            proposer.bind_runner(self)

    # ---- host side -------------------------------------------------------------------------
    def write_prompt(self, row: int, token_ids: list[int]) -> None:
        self.token_table[row].fill_(-1)
        self.token_table[row, :len(token_ids)] = torch.tensor(token_ids, dtype=torch.int32)

    def padded_num_tokens(self, num_tokens: int) -> int:
        """SP pad, dispatch, DP sync, re-dispatch: the count every DP rank runs the target at.

        0 means every rank is idle (an idle rank contributes 0, not a padded size).
        """
        desc = self.padder.dispatch(self.padder.pad_for_sequence_parallel(num_tokens))
        synced = sync_batch_across_dp(self.dp, desc.num_tokens if num_tokens else 0, desc.graph)
        if synced.num_tokens == 0:
            return 0
        padded = self.padder.dispatch(synced.num_tokens).num_tokens
        if not self.padder.is_aligned(padded):
            raise AssertionError(f"padded num_tokens={padded} is not TP-aligned")
        return padded

    def prepare(self, scheduled: list[ScheduledRequest], num_padded: int) -> StepBatch:
        ids, pos, slots, qsl, seq_lens, logits_idx, drafts, ndraft = [], [], [], [0], [], [], [], []
        table = torch.zeros(len(scheduled), self.max_blocks_per_req, dtype=torch.int32)
        for i, s in enumerate(scheduled):
            r, start, n = s.request, s.request.num_computed_tokens, s.num_tokens
            if s.spec_token_ids:  # decode: the last known token, then the drafts to verify
                ids += [r.token_ids[start]] + s.spec_token_ids
            else:
                ids += r.token_ids[start:start + n]
            for p in range(start, start + n):
                pos.append(p)
                slots.append(r.block_ids[p // self.block_size] * self.block_size
                             + p % self.block_size)
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            d = len(s.spec_token_ids)
            last = qsl[-1] - 1
            logits_idx.append([last - d + min(j, d) for j in range(self.k + 1)])
            drafts.append(s.spec_token_ids + [0] * (self.k - d))
            ndraft.append(d)
            table[i, :len(r.block_ids)] = torch.tensor(r.block_ids, dtype=torch.int32)
        pad = num_padded - len(ids)
        ids += [0] * pad
        pos += [0] * pad
        slots += [-1] * pad
        dev = self.device

        def t(x, dtype):
            return torch.tensor(x, dtype=dtype).to(dev, non_blocking=True)

        attn = AttentionMetadata(
            slot_mapping=t(slots, torch.int64), query_start_loc=t(qsl, torch.int32),
            seq_lens=t(seq_lens, torch.int32), block_table=table.to(dev),
            max_seq_len=max(seq_lens))
        ndraft_t = t(ndraft, torch.int32)
        return StepBatch(
            num_reqs=len(scheduled), num_tokens=qsl[-1],
            uniform_decode=all(len(s.spec_token_ids) == self.k for s in scheduled),
            input_ids=t(ids, torch.int64),
            positions=t(pos, torch.int64), attn=attn, logits_indices=t(logits_idx, torch.int64),
            draft_token_ids=t(drafts, torch.int32).view(len(scheduled), self.k),
            num_draft_tokens=ndraft_t, cu_num_draft_tokens=torch.cumsum(ndraft_t, 0, dtype=torch.int32),
            discard_mask=t([s.is_discarded for s in scheduled], torch.bool),
            rows=t([s.request.row for s in scheduled], torch.int64),
            temperature=t([s.request.params.temperature for s in scheduled], torch.float32),
            top_p=None if all(s.request.params.top_p == 1.0 for s in scheduled)
            else t([s.request.params.top_p for s in scheduled], torch.float32))

    # ---- device side -----------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, b: StepBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (sampled_token_ids [B, K+1] int32 with -1 for discarded rows, drafts [B, K] int32)."""
        hidden, aux = self.target(b.input_ids, b.positions, kv=self.kv.bind(b.attn),
                                  aux_layer_ids=self.aux_layer_ids)
        logits = self.target.compute_logits(hidden[b.logits_indices.flatten()])
        logits = logits.view(b.num_reqs, self.k + 1, -1)
        sampled = rejection_sample(logits, b.draft_token_ids, b.num_draft_tokens, b.temperature,
                                   b.top_p, generator=self.generator)
        sampled = torch.where(b.discard_mask[:, None], -1, sampled)
        self._record_sampled(b, sampled)
        self.last_draft_seconds = 0.0
        if self.proposer is None:
            return sampled, None
        start = time.perf_counter()
        drafts = self.proposer.propose(DraftInputs(
            num_reqs=b.num_reqs, uniform_decode=b.uniform_decode, input_ids=b.input_ids,
            positions=b.positions,
            hidden_states=hidden, aux_hidden_states=aux, attn=b.attn, sampled_token_ids=sampled,
            discard_mask=b.discard_mask, cu_num_draft_tokens=b.cu_num_draft_tokens,
            token_table=self.token_table, rows=b.rows))
        # host wall time of the drafter call (on CPU the work itself; on an accelerator the
        # launch time only: timing the device would need a sync)
        self.last_draft_seconds = time.perf_counter() - start
        return sampled, drafts

    def _record_sampled(self, b: StepBatch, sampled: torch.Tensor) -> None:
        """Append valid sampled tokens to the device token table (no host round trip)."""
        width = self.token_table.shape[1]
        # sampled[r, j] is the token at position seq_len - num_draft + j
        first = (b.attn.seq_lens - b.num_draft_tokens).to(torch.int64)
        cols = (first[:, None] + torch.arange(sampled.shape[1], device=sampled.device))
        cols = cols.clamp_(max=width - 1)
        rows = b.rows[:, None].expand_as(cols)
        old = self.token_table[rows, cols]
        self.token_table[rows, cols] = torch.where(sampled >= 0, sampled, old)

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int) -> None:
        """An idle DP rank's step: the same forwards and collectives as a busy rank's."""
        attn = AttentionMetadata.dummy(num_tokens, self.device)
        zeros = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        self.target(zeros, zeros, kv=self.kv.bind(attn), aux_layer_ids=self.aux_layer_ids)
        if self.proposer is not None:
            self.proposer.dummy_run(num_tokens)
