"""Triton kernels for the padded-drafting formulas (CUDA via ``triton``, NPU via
``triton-ascend``), each right beside the wrapper that checks its inputs and launches it.

Every wrapper returns exactly what its torch reference returns (``reference.py``, the
oracle; ``tests/test_kernels_triton.py`` compares them under ``TRITON_INTERPRET=1``):

    prepare_padded_step         = gather_backup_tokens + prepare_next_token_ids_padded
                                  + prepare_inputs_padded, one launch, into ``out=`` buffers
    prepare_inputs_padded       = prepare_inputs_padded
    shift_first_pass_input_ids  = shift_first_pass_input_ids   (two launches: shift, scatter)
    advance_draft_step          = advance_draft_step

Every runtime argument (batch sizes, strides, pointers) is ``do_not_specialize``: one
compiled kernel serves every batch size (only the grid changes). Every kernel is launched
through Triton's own ``kernel[grid](...)``; a captured step (CUDA graph) replays the launches
with no host work at all.
Indices and token ids are int32 in and int32 out, except where the reference uses int64:
the first pass's input ids (int32 or int64, kept), the indices ``rows`` and
``token_indices_to_sample`` (int32 or int64, as the engine passes them), and the draft
loop's positions and slot mapping (int64). Each accepted dtype is one compiled variant.
"""

import inspect

import torch
import triton
import triton.language as tl

from specdec.kernels.reference import DraftStep, PaddedPrep

ROWS_PER_PROGRAM = 128  # requests per program
TOKENS_PER_PROGRAM = 1024  # tokens per program (first-pass shift)


def _check(name: str, t, dtypes: tuple[torch.dtype, ...], ndim: int,
           device: torch.device | None = None) -> None:
    """Launch preconditions: a tensor of an allowed dtype and rank, unit stride on its
    last dim (rows may be strided), on ``device`` when given."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}.dtype={t.dtype} is not allowed; allowed: "
                        f"{', '.join(str(d) for d in dtypes)}")
    if t.dim() != ndim:
        raise ValueError(f"{name}.shape={tuple(t.shape)} must have {ndim} dims")
    if ndim > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}.stride()={t.stride()} must have a unit last stride")
    if device is not None and t.device != device:
        raise ValueError(f"{name}.device={t.device} must be {device}, like the first input")


def jit_unspecialized(fn):
    """``triton.jit`` with every runtime parameter ``do_not_specialize``: one compiled kernel
    for every batch size, stride and address (for kernels too small for the alignment and
    divisibility hints to matter)."""
    runtime = [name for name, p in inspect.signature(fn).parameters.items()
               if p.annotation is not tl.constexpr]
    return triton.jit(fn, do_not_specialize=runtime)


def _grid(n: int, per_program: int) -> tuple[int]:
    return (triton.cdiv(n, per_program),)


# Reductions use tl.reduce with these local combiners, not tl.min / tl.sum: triton's own
# @jit helpers are decorated once, when triton.language is imported, so only kernels
# built from builtins and local @jit functions run under an interpreter switched on later
# (the tests load a private copy of this module with TRITON_INTERPRET=1).
@triton.jit
def _minimum(a, b):
    return tl.minimum(a, b)


@triton.jit
def _add(a, b):
    return a + b


# ---- per-request rows: next token + valid count + backup token, num rejected ----

@triton.jit
def _next_token_rows(r, live, sampled_ptr, sampled_stride, num_cols, discard_ptr, table_ptr,
                     table_stride, table_len, rows_ptr, seq_lens_ptr, vocab_size,
                     BLOCK_COLS: tl.constexpr):
    """(valid count, next token, backup token) of rows ``r``."""
    c = tl.arange(0, BLOCK_COLS)
    tok = tl.load(sampled_ptr + r[:, None].to(tl.int64) * sampled_stride + c[None, :],
                  mask=live[:, None] & (c[None, :] < num_cols), other=-1)
    valid = (tok >= 0) & (tok < vocab_size)
    # Length of the valid prefix = the first invalid column (columns past num_cols
    # read -1, so a fully valid row counts num_cols).
    count = tl.reduce(tl.where(valid, BLOCK_COLS, c[None, :]), 1, _minimum)
    discard = tl.load(discard_ptr + r, mask=live, other=0) != 0
    count = tl.where(discard, 0, count)
    last = tl.reduce(tl.where(c[None, :] == count[:, None] - 1, tok, 0), 1, _add)
    # Backup: the request's own known token at seq_len, -1 past the table.
    row = tl.load(rows_ptr + r, mask=live, other=0).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + r, mask=live, other=0)
    known = seq_len < table_len
    backup = tl.load(table_ptr + row * table_stride + tl.minimum(seq_len, table_len - 1),
                     mask=live & known, other=-1)
    return count, tl.where(count > 0, last, backup), backup


@triton.jit
def _rejected_rows(r, live, cu_ptr, valid):
    """num_rejected of rows ``r`` from the inclusive draft cumsum and the valid counts."""
    num_draft = (tl.load(cu_ptr + r, mask=live, other=0)
                 - tl.load(cu_ptr + r - 1, mask=live & (r > 0), other=0))
    return tl.where(num_draft > 0, num_draft + 1 - valid, 0)


# ---- the whole per-request prep in one launch ----

@jit_unspecialized
def _padded_step_kernel(sampled_ptr, sampled_stride, num_cols, discard_ptr,
                        table_ptr, table_stride, table_len, rows_ptr, seq_lens_ptr,
                        cu_ptr, qsl_ptr, next_ptr, valid_ptr, backup_ptr, sample_ptr,
                        rejected_ptr, vocab_size, num_rows,
                        BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    live = r < num_rows
    count, next_id, backup = _next_token_rows(
        r, live, sampled_ptr, sampled_stride, num_cols, discard_ptr, table_ptr, table_stride,
        table_len, rows_ptr, seq_lens_ptr, vocab_size, BLOCK_COLS)
    rejected = _rejected_rows(r, live, cu_ptr, count)
    end = tl.load(qsl_ptr + r + 1, mask=live, other=0)
    tl.store(next_ptr + r, next_id, mask=live)
    tl.store(valid_ptr + r, count, mask=live)
    tl.store(backup_ptr + r, backup, mask=live)
    tl.store(sample_ptr + r, end - 1 - rejected, mask=live)
    tl.store(rejected_ptr + r, rejected, mask=live)


def prepare_padded_step(sampled_token_ids: torch.Tensor, discard_mask: torch.Tensor,
                        token_table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                        cu_num_draft_tokens: torch.Tensor, query_start_loc: torch.Tensor,
                        vocab_size: int, out: PaddedPrep) -> PaddedPrep:
    """One launch for reference.prepare_padded_step. sampled [B, K+1] int32, discard_mask
    [B] bool, token_table [R, L] int32, rows [B] int32/int64, seq_lens / cu_num_draft_tokens
    [B] int32, query_start_loc [B+1] int32, out: five [B] int32 (unit stride; the 1-D inputs
    too). Only O(1) checks here (the launch itself is the hot path)."""
    b, cols = sampled_token_ids.shape
    if out.num_rejected.shape[0] != b or query_start_loc.shape[0] != b + 1:
        raise ValueError(f"out has {out.num_rejected.shape[0]} rows and query_start_loc "
                         f"{query_start_loc.shape[0]}; need {b} and {b + 1}")
    _padded_step_kernel[_grid(b, ROWS_PER_PROGRAM)](
        sampled_token_ids, sampled_token_ids.stride(0), cols, discard_mask.view(torch.int8),
        token_table, token_table.stride(0), token_table.shape[1], rows, seq_lens,
        cu_num_draft_tokens, query_start_loc, *out, vocab_size, b,
        BLOCK_ROWS=ROWS_PER_PROGRAM, BLOCK_COLS=triton.next_power_of_2(cols))
    return out


# ---- sample index + num rejected ----

@jit_unspecialized
def _prepare_inputs_kernel(cu_ptr, valid_ptr, qsl_ptr, sample_ptr, rejected_ptr, num_rows,
                           BLOCK_ROWS: tl.constexpr):
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    live = r < num_rows
    valid = tl.load(valid_ptr + r, mask=live, other=0)
    rejected = _rejected_rows(r, live, cu_ptr, valid)
    end = tl.load(qsl_ptr + r + 1, mask=live, other=0)
    tl.store(sample_ptr + r, end - 1 - rejected, mask=live)
    tl.store(rejected_ptr + r, rejected, mask=live)


def prepare_inputs_padded(cu_num_draft_tokens: torch.Tensor, valid_count: torch.Tensor,
                          query_start_loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cu_num_draft_tokens [B], valid_count [B], query_start_loc [B+1], all int32
    -> (token_indices_to_sample, num_rejected), each [B] int32."""
    dev = cu_num_draft_tokens.device
    _check("cu_num_draft_tokens", cu_num_draft_tokens, (torch.int32,), 1)
    _check("valid_count", valid_count, (torch.int32,), 1, dev)
    _check("query_start_loc", query_start_loc, (torch.int32,), 1, dev)
    b = cu_num_draft_tokens.shape[0]
    if valid_count.shape[0] != b or query_start_loc.shape[0] != b + 1:
        raise ValueError(f"valid_count.shape={tuple(valid_count.shape)} and query_start_loc."
                         f"shape={tuple(query_start_loc.shape)} must be ({b},) and ({b + 1},)")
    sample_idx, rejected = (torch.empty(b, dtype=torch.int32, device=dev) for _ in range(2))
    _prepare_inputs_kernel[_grid(b, ROWS_PER_PROGRAM)](
        cu_num_draft_tokens, valid_count, query_start_loc, sample_idx, rejected, b,
        BLOCK_ROWS=ROWS_PER_PROGRAM)
    return sample_idx, rejected


# ---- first-pass input ids: shift left, scatter the next tokens ----

@jit_unspecialized
def _shift_left_kernel(ids_ptr, out_ptr, num_tokens, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < num_tokens
    src = tl.where(i < num_tokens - 1, i + 1, i)  # the last token keeps its own id
    tl.store(out_ptr + i, tl.load(ids_ptr + src, mask=live), mask=live)


@jit_unspecialized
def _scatter_kernel(out_ptr, index_ptr, value_ptr, num_rows, BLOCK_ROWS: tl.constexpr):
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    live = r < num_rows
    index = tl.load(index_ptr + r, mask=live, other=0)
    value = tl.load(value_ptr + r, mask=live, other=0)
    tl.store(out_ptr + index, value.to(out_ptr.dtype.element_ty), mask=live)


def shift_first_pass_input_ids(target_input_ids: torch.Tensor,
                               token_indices_to_sample: torch.Tensor,
                               next_token_ids: torch.Tensor) -> torch.Tensor:
    """target_input_ids [N] int32/int64, token_indices_to_sample [B] int32/int64 (distinct,
    in [0, N)), next_token_ids [B] int32 -> [N] in target_input_ids' dtype. Two launches in
    stream order: the scatter must land after the shift (no grid-wide barrier)."""
    dev = target_input_ids.device
    _check("target_input_ids", target_input_ids, (torch.int32, torch.int64), 1)
    _check("token_indices_to_sample", token_indices_to_sample, (torch.int32, torch.int64), 1,
           dev)
    _check("next_token_ids", next_token_ids, (torch.int32,), 1, dev)
    n, b = target_input_ids.shape[0], token_indices_to_sample.shape[0]
    if next_token_ids.shape[0] != b:
        raise ValueError(f"next_token_ids.shape={tuple(next_token_ids.shape)} must be ({b},) "
                         "like token_indices_to_sample")
    out = torch.empty_like(target_input_ids)
    _shift_left_kernel[_grid(n, TOKENS_PER_PROGRAM)](target_input_ids, out, n,
                                                     BLOCK=TOKENS_PER_PROGRAM)
    _scatter_kernel[_grid(b, ROWS_PER_PROGRAM)](out, token_indices_to_sample, next_token_ids, b,
                                                BLOCK_ROWS=ROWS_PER_PROGRAM)
    return out


# ---- one draft-loop step: positions, slots, seq_lens ----

@jit_unspecialized
def _advance_draft_step_kernel(positions_ptr, seq_lens_ptr, table_ptr, table_stride,
                               blocks_per_row, num_reqs, max_model_len,
                               out_positions_ptr, out_input_positions_ptr, out_slots_ptr,
                               out_seq_lens_ptr, num_rows, BLOCK_SIZE: tl.constexpr,
                               NUM_REQS_ON_DEVICE: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    live = r < num_rows
    if NUM_REQS_ON_DEVICE:
        num_reqs = tl.load(num_reqs)
    pos = tl.load(positions_ptr + r, mask=live, other=0) + 1
    inactive = (r >= num_reqs) | (pos >= max_model_len)
    input_pos = tl.where(inactive, 0, pos)
    lookup = tl.minimum(input_pos, blocks_per_row * BLOCK_SIZE - 1)
    block = tl.load(table_ptr + r.to(tl.int64) * table_stride + lookup // BLOCK_SIZE,
                    mask=live & ~inactive, other=0).to(tl.int64)
    slot = tl.where(inactive, -1, block * BLOCK_SIZE + lookup % BLOCK_SIZE)
    seq_len = tl.load(seq_lens_ptr + r, mask=live, other=0)
    tl.store(out_positions_ptr + r, pos, mask=live)
    tl.store(out_input_positions_ptr + r, input_pos, mask=live)
    tl.store(out_slots_ptr + r, slot, mask=live)
    tl.store(out_seq_lens_ptr + r, tl.where(inactive, 1, seq_len + 1), mask=live)


def advance_draft_step(positions: torch.Tensor, seq_lens: torch.Tensor,
                       block_table: torch.Tensor, num_reqs: int | torch.Tensor,
                       block_size: int, max_model_len: int) -> DraftStep:
    """positions [Bp] int64 (>= 0), seq_lens [Bp] int32, block_table [Bp, M] int32,
    num_reqs a host int or a 0-dim int tensor on the device -> DraftStep (positions,
    input_positions, slot_mapping int64; seq_lens int32)."""
    dev = positions.device
    _check("positions", positions, (torch.int64,), 1)
    _check("seq_lens", seq_lens, (torch.int32,), 1, dev)
    _check("block_table", block_table, (torch.int32,), 2, dev)
    rows = positions.shape[0]
    if seq_lens.shape[0] != rows or block_table.shape[0] < rows:
        raise ValueError(f"seq_lens.shape={tuple(seq_lens.shape)} must be ({rows},) and "
                         f"block_table.shape={tuple(block_table.shape)} must have >= {rows} rows")
    on_device = isinstance(num_reqs, torch.Tensor)
    if on_device:
        _check("num_reqs", num_reqs, (torch.int32, torch.int64), 0, dev)
    out = DraftStep(torch.empty_like(positions), torch.empty_like(positions),
                    torch.empty_like(positions), torch.empty_like(seq_lens))
    _advance_draft_step_kernel[_grid(rows, ROWS_PER_PROGRAM)](
        positions, seq_lens, block_table, block_table.stride(0), block_table.shape[1], num_reqs,
        max_model_len, *out, rows, BLOCK_SIZE=block_size, NUM_REQS_ON_DEVICE=on_device,
        BLOCK_ROWS=ROWS_PER_PROGRAM)
    return out
