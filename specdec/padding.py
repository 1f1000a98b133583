"""Batch padding and the step plan: SP alignment, capture-size dispatch, one DP sync.

``StepPlanner.plan`` is called once per engine step, by the runner, before the target runs;
the plan it returns sizes the target forward, the sampler and the whole drafter step, on
every DP rank alike (see :class:`StepPlan`).

Worked example (TP=4 with sequence parallelism, capture sizes [1, 2, 4, 8, 16]):
``pad_for_sequence_parallel(6) == 8`` (so SP's reduce-scatter splits evenly); the sizes
1 and 2 are dropped (not multiples of 4); ``dispatch(6) == BatchDescriptor(8, graph=True)``;
``dispatch(17) == BatchDescriptor(20, graph=False)`` (eager above the largest, still TP-aligned).
"""

import logging
from bisect import bisect_left
from dataclasses import dataclass

from specdec.dp import CAPTURE_MIXED, CAPTURE_UNIFORM, DPContext, sync_step_across_dp

logger = logging.getLogger(__name__)


def default_capture_sizes(max_size: int = 512) -> list[int]:
    """vLLM's default cudagraph capture sizes: 1, 2, 4, 8, 16, ..., 256, 272, ... up to max."""
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, max_size + 1, 16))
    return [s for s in sizes if s <= max_size]


@dataclass(frozen=True, slots=True)
class BatchDescriptor:
    num_tokens: int  # padded token (or request) count the forward runs with
    graph: bool  # True: a captured graph size; False: eager (above the largest size)


class BatchPadder:
    """Pads token counts for SP and dispatches them onto graph capture sizes."""

    def __init__(self, capture_sizes: list[int] | None = None, tp_size: int = 1,
                 sequence_parallel: bool = False):
        if tp_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tp_size}")
        sizes = sorted(set(default_capture_sizes() if capture_sizes is None else capture_sizes))
        if any(not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"capture_sizes must be positive ints, got {capture_sizes}")
        self.tp_size = tp_size
        self.sequence_parallel = sequence_parallel and tp_size > 1
        if self.sequence_parallel:
            dropped = [s for s in sizes if s % tp_size]
            if dropped and capture_sizes is not None:  # the defaults are dropped quietly
                logger.warning("sequence parallelism: dropping capture sizes %s (not multiples "
                               "of tensor_parallel_size=%d)", dropped, tp_size)
            sizes = [s for s in sizes if s % tp_size == 0]
        self.capture_sizes = sizes

    def pad_for_sequence_parallel(self, num_tokens: int) -> int:
        """Round up to a multiple of TP when SP is on; identity otherwise."""
        if not self.sequence_parallel:
            return num_tokens
        return -(-num_tokens // self.tp_size) * self.tp_size

    def dispatch(self, num_tokens: int) -> BatchDescriptor:
        """The smallest capture size >= num_tokens, or eager (SP-aligned) above the largest."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        i = bisect_left(self.capture_sizes, num_tokens)
        if i < len(self.capture_sizes):
            return BatchDescriptor(self.capture_sizes[i], graph=True)
        return BatchDescriptor(self.pad_for_sequence_parallel(num_tokens), graph=False)

    def is_aligned(self, num_tokens: int) -> bool:
        return not self.sequence_parallel or num_tokens % self.tp_size == 0


@dataclass(frozen=True, slots=True)
class StepPlan:
    """How one engine step runs, the same on every DP rank (from one packed all-reduce).

    Worked example (K=3, capture sizes [1, 2, 4, 8, 16], DP=1): 3 decode requests verifying 3
    drafts each (12 tokens) -> num_reqs_padded=4, num_tokens_padded=16, a capturable uniform
    decode; a prefill chunk of 5 tokens plus one decode request (9 tokens) -> num_reqs_padded=2,
    num_tokens_padded=16 (dispatch(9)), capturable as a mixed step where the backend captures
    those (else eager); 40 tokens (above the largest size) -> eager.
    """

    num_reqs: int  # B, requests this rank runs (0: an idle rank)
    num_tokens: int  # real tokens this rank runs
    num_reqs_padded: int  # Bp: rows of the logits, the sampler and the draft loop
    num_tokens_padded: int  # Np: the target forward and the drafter's first pass; 0 = all idle
    capturable: bool  # every rank's (Np, Bp) is a capture key: the step replays the graph of
    #                   (Np, Bp) (uniform decode, or a mixed step on a backend that captures them)
    num_tokens_across_dp: tuple[int, ...]  # [dp_size] each rank's own padded token count
    uniform_decode: bool = False  # every rank a uniform decode (or idle): Np == Bp * (1 + K)
    num_spec_tokens: int = 0  # the step's K: drafts (+ filler) verified per uniform decode
    #                           request, drafts proposed per request

    @property
    def all_idle(self) -> bool:
        return self.num_tokens_padded == 0


@dataclass(frozen=True, slots=True)
class StepSizes:
    """The sizes a step is built for, computed once by ``LLM`` and handed down (runner, step
    buffers, proposer). Example: capture sizes [1, 2, 4, 8], K = 3, 3 sequences, a 20-token
    budget -> ``StepSizes.of(padder, 3, 3, 20, 64)``: max_num_reqs 4 (3 padded to a capture
    size), max_num_tokens 21 (the budget + 1 spare token, above every capture size, more than
    a uniform step's 4 x (1 + 3) = 16); with 8 sequences the uniform step sets it: 32."""

    num_speculative_tokens: int  # K; 0 without a drafter
    max_num_seqs: int  # request slots (token-table rows)
    max_num_tokens: int  # Np of the largest padded step a planner can return
    max_num_reqs: int  # Bp of that step (max_num_seqs padded)
    max_model_len: int

    @classmethod
    def of(cls, padder: BatchPadder, num_speculative_tokens: int, max_num_seqs: int,
           max_num_batched_tokens: int, max_model_len: int) -> "StepSizes":
        reqs = padder.dispatch(padder.pad_for_sequence_parallel(max_num_seqs)).num_tokens
        tokens = padder.dispatch(padder.pad_for_sequence_parallel(max_num_batched_tokens + 1))
        return cls(num_speculative_tokens, max_num_seqs,
                   max(tokens.num_tokens, reqs * (1 + num_speculative_tokens)), reqs,
                   max_model_len)


class StepPlanner:
    """Plans each step: SP pad -> dispatch -> one DP sync -> re-dispatch -> TP check.

    ``allow_capture``: uniform decodes in a bucket replay graphs (False: no graph backend, or
    cross-rank layers); ``capture_mixed``: so do steps with prefill chunks whose token and
    request counts are both capture sizes (the backends that capture per (Np, Bp) key).
    ``pad_tokens``: Np is a capture size (the backends with a graph per shape); False (eager,
    compile_dynamic: any shape runs) keeps Np at the tokens fed (+ the padding requests'
    spare token, SP-aligned, the largest over DP ranks), so no step computes padding rows
    past the next capture size (a 9-token draft tree at one request: 9 rows, not 16)."""

    def __init__(self, padder: BatchPadder, dp: DPContext, num_speculative_tokens: int,
                 allow_capture: bool, capture_mixed: bool = False, pad_tokens: bool = True):
        self.padder = padder
        self.dp = dp
        self.num_speculative_tokens = num_speculative_tokens  # K when a step names none
        self.allow_capture = allow_capture
        self.capture_mixed = capture_mixed and allow_capture
        self.pad_tokens = pad_tokens

    def plan(self, num_tokens: int, num_reqs: int, uniform_decode: bool,
             num_spec_tokens: int | None = None) -> StepPlan:
        """num_tokens / num_reqs: this rank's real counts; uniform_decode: every request
        verifies exactly K drafts (layout [B, 1+K]); num_spec_tokens: this rank's K (None:
        the planner's); the plan's is the smallest over DP ranks."""
        k = self.num_speculative_tokens if num_spec_tokens is None else num_spec_tokens
        tokens_per_req = 1 + k  # of a uniform decode request
        pad, dispatch = self.padder.pad_for_sequence_parallel, self.padder.dispatch
        if num_reqs == 0:  # an idle rank can run any shape the others pick
            tokens, reqs, capture = 0, 0, CAPTURE_UNIFORM
        else:
            bucket = dispatch(pad(num_reqs))
            reqs = bucket.num_tokens
            if uniform_decode and bucket.graph and self.pad_tokens:
                tokens, capture = reqs * tokens_per_req, CAPTURE_UNIFORM
            else:
                # padding requests (Bp > B) sample at the last token: keep one padding token
                spare = int(self.dp.size > 1 or reqs > num_reqs)
                fed = pad(num_tokens + spare)
                token_bucket = dispatch(fed)
                tokens = token_bucket.num_tokens if self.pad_tokens else fed
                capture = CAPTURE_MIXED if bucket.graph and token_bucket.graph else 0
            if not self.allow_capture or (capture == CAPTURE_MIXED and not self.capture_mixed):
                capture = 0
        synced = sync_step_across_dp(self.dp, tokens, reqs, capture, k)
        k = synced.num_spec_tokens  # (DP: the smallest; the caller cuts its drafts to it)
        tokens_per_req = 1 + k
        if synced.num_tokens == 0:
            return StepPlan(0, 0, 0, 0, False, synced.num_tokens_across_dp, num_spec_tokens=k)
        uniform = synced.capture == CAPTURE_UNIFORM
        reqs_padded = dispatch(synced.num_reqs).num_tokens
        tokens_padded = (reqs_padded * tokens_per_req if uniform
                         else dispatch(synced.num_tokens).num_tokens if self.pad_tokens
                         else synced.num_tokens)
        for n in (reqs_padded, tokens_padded):
            if not self.padder.is_aligned(n):
                raise AssertionError(f"padded size {n} is not a multiple of "
                                     f"tensor_parallel_size={self.padder.tp_size} with "
                                     "sequence parallelism")
        return StepPlan(num_reqs, num_tokens, reqs_padded, tokens_padded, synced.capture > 0,
                        synced.num_tokens_across_dp, uniform, k)
