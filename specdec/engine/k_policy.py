"""K per step from the engine's own measurements (``num_speculative_tokens_policy="goodput"``).

Each step the policy picks, among the captured K buckets 0..cap, the K that maximises the
step's expected tokens per second, ``E(K) / t(b, K)``:

- ``E(K) = 1 + sum_{j < K} kept[j]``: the tokens one decode emits, where ``kept[j]`` is the
  share of decodes asked for more than j drafts that kept draft j + 1 (accepted >= j + 1; a
  host drafter's request with fewer drafts counts as not kept). A step's decodes were asked
  for min(the previous step's K, its K) drafts: the drafts of a step come from the step
  before, at that step's K;
- ``t(b, K)``: the wall time of a decode-only step (no prefill chunk) of batch-size bucket b
  (the padded request count: steps of one bucket run one captured shape) at K.

Both are exponentially decayed means (``decay`` per observed step), so they follow a workload
that changes. A K that a bucket has not run yet, or not for ``refresh_steps`` of its decode-only
steps, runs next (least recently run first): its cost is measured, and for a K above the
current one the later drafts' acceptance too. A step with a prefill chunk neither explores nor
times (its cost is not the decode's): it takes the best K known, else ``cap``.
"""

from collections.abc import Callable


class GoodputPolicy:
    def __init__(self, num_speculative_tokens: int, bucket_of: Callable[[int], int], *,
                 refresh_steps: int = 64, decay: float = 0.9):
        self.bucket_of = bucket_of  # batch size -> its bucket (the padded request count)
        self.refresh_steps = refresh_steps
        self.decay = decay
        # per draft position j: [decayed decodes that kept draft j + 1, decayed decodes run
        # with K > j]
        self.kept = [[0.0, 0.0] for _ in range(num_speculative_tokens)]
        # bucket -> per K: decayed mean step seconds (None: never run), decode-only steps
        # run in the bucket when K last ran
        self.seconds: dict[int, list[float | None]] = {}
        self.last_run: dict[int, list[float]] = {}
        self.steps: dict[int, int] = {}  # bucket -> decode-only steps timed

    def expected_tokens(self, k: int) -> float:
        """E(K): tokens per decode at K (a position never drafted counts as kept)."""
        return 1.0 + sum(hit / n if n else 1.0 for hit, n in self.kept[:k])

    def pick(self, batch_size: int, cap: int, decode_only: bool) -> int:
        """The step's K in 0..cap (see the module docstring)."""
        b = self.bucket_of(batch_size)
        seconds, last = self._tables(b)
        if decode_only:
            due = [k for k in range(cap + 1) if seconds[k] is None
                   or self.steps[b] - last[k] >= self.refresh_steps]
            if due:
                return min(due, key=lambda k: (last[k], k))
        known = [k for k in range(cap + 1) if seconds[k] is not None]
        if not known:
            return cap
        return max(known, key=lambda k: self.expected_tokens(k) / seconds[k])

    def observe(self, batch_size: int, k: int, seconds: float | None, accepted: list[int],
                asked: int) -> None:
        """One step's result: its K, its wall time (None: not a decode-only step), each
        decode's accepted draft count, and how many drafts each decode was asked for."""
        if accepted:
            for j in range(asked):
                hit, n = self.kept[j]
                self.kept[j] = [self.decay * hit + sum(a > j for a in accepted),
                                self.decay * n + len(accepted)]
        if seconds is None:
            return
        b = self.bucket_of(batch_size)
        times, last = self._tables(b)
        times[k] = seconds if times[k] is None else \
            self.decay * times[k] + (1 - self.decay) * seconds
        self.steps[b] += 1
        last[k] = self.steps[b]

    def _tables(self, b: int) -> tuple[list, list]:
        if b not in self.seconds:
            n = len(self.kept) + 1
            self.seconds[b], self.last_run[b], self.steps[b] = [None] * n, [-1e18] * n, 0
        return self.seconds[b], self.last_run[b]
