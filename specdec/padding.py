"""Batch padding: sequence-parallel alignment and graph-capture-size dispatch.

Worked example (TP=4 with sequence parallelism, capture sizes [1, 2, 4, 8, 16]):
``pad_for_sequence_parallel(6) == 8`` (so SP's reduce-scatter splits evenly); the sizes
1 and 2 are dropped (not multiples of 4); ``dispatch(6) == BatchDescriptor(8, graph=True)``;
``dispatch(17) == BatchDescriptor(20, graph=False)`` (eager above the largest, still TP-aligned).
"""

import logging
from bisect import bisect_left
from dataclasses import dataclass

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
            if dropped:
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
