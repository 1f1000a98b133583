"""K per step from the engine's own measurements (``num_speculative_tokens_policy="goodput"``).

Each step the policy picks, among the captured K buckets 0..cap, the K that maximises the
step's expected tokens per second, ``E(K) / t(b, K)``:

- ``E(K) = 1 + sum_{j < K} kept[j]``: the tokens one decode emits, where ``kept[j]`` is the
  share of decodes asked for more than j drafts that kept draft j + 1 (accepted >= j + 1; a
  host drafter's request with fewer drafts counts as not kept). A step's decodes were asked
  for min(the previous step's K, its K) drafts: the drafts of a step come from the step
  before, at that step's K;
- ``t(b, K)``: the wall time of a decode-only step (no prefill chunk) of batch-size bucket b
  (the padded request count: steps of one bucket run one captured shape) at K: the least of
  its last ``window`` steps (a preempted step, a garbage collection only add time; one such
  step of 200 ms among 15 ms ones must not make K look slow).

The acceptance shares are exponentially decayed means (``decay`` per observed step) and the
times recent ones, so both follow a workload that changes. A K that a bucket has not run yet, or not for ``refresh_steps`` of its decode-only
steps, runs next (least recently run first) for ``explore_steps`` decode-only steps in a row:
the first after a smaller K verifies that K's drafts (filler after them), the next ones its own,
so the later drafts' acceptance is measured too. A K that another bucket has measured is not
explored at once: its time is estimated from the nearest bucket that ran it (scaled by the two
buckets' times at a K both ran), and it is explored after ``refresh_steps`` of this bucket's own
decode-only steps (a run passes through many buckets as its requests end: exploring each K in
each of them at once cost more than it found). A step with a prefill chunk neither explores nor
times (its cost is not the decode's): it takes the best K known, else ``cap``. ``pick`` keeps
the exploration's place: call it once per step.
"""

import math
from collections import deque
from collections.abc import Callable


class GoodputPolicy:
    def __init__(self, num_speculative_tokens: int, bucket_of: Callable[[int], int], *,
                 refresh_steps: int = 64, explore_steps: int = 2, window: int = 4,
                 decay: float = 0.9):
        self.bucket_of = bucket_of  # batch size -> its bucket (the padded request count)
        self.refresh_steps = refresh_steps
        self.explore_steps = explore_steps
        self.window = window
        self.decay = decay
        # per draft position j: [decayed decodes that kept draft j + 1, decayed decodes run
        # with K > j]
        self.kept = [[0.0, 0.0] for _ in range(num_speculative_tokens)]
        # bucket -> per K: its last ``window`` step seconds, decode-only steps run in the
        # bucket when K last ran
        self.times: dict[int, list[deque]] = {}
        self.last_run: dict[int, list[float]] = {}
        self.steps: dict[int, int] = {}  # bucket -> decode-only steps timed
        self.exploring: dict[int, tuple[int, int]] = {}  # bucket -> (K, decode steps to go)

    def expected_tokens(self, k: int) -> float:
        """E(K): tokens per decode at K (a position never drafted counts as kept)."""
        return 1.0 + sum(hit / n if n else 1.0 for hit, n in self.kept[:k])

    def pick(self, batch_size: int, cap: int, decode_only: bool) -> int:
        """The step's K in 0..cap (see the module docstring)."""
        b = self.bucket_of(batch_size)
        _, last = self._tables(b)
        seconds = self.seconds(b)
        if decode_only:
            k, left = self.exploring.get(b, (0, 0))
            if left and k <= cap:
                self.exploring[b] = (k, left - 1)
                return k
            due = [k for k in range(cap + 1) if seconds[k] is None
                   or self.steps[b] - last[k] >= self.refresh_steps]
            if due:
                k = min(due, key=lambda k: (last[k], k))
                self.exploring[b] = (k, self.explore_steps - 1)
                return k
        known = [k for k in range(cap + 1) if seconds[k] is not None]
        if not known:
            return cap
        return max(known, key=lambda k: self.expected_tokens(k) / seconds[k])

    def seconds(self, b: int) -> list[float | None]:
        """t(b, K) for each K: the least of bucket b's last times at K, else estimated from
        the nearest bucket that ran K (times its ratio to b at a K both ran), else None."""
        least = {o: [min(t) if t else None for t in ts] for o, ts in self.times.items()}
        own = least[b]
        out = list(own)
        nearest = sorted((abs(math.log(o / b)), o) for o in self.times if o != b)
        for k in (k for k, t in enumerate(own) if t is None):
            for _, o in nearest:
                theirs = least[o]
                if theirs[k] is not None:
                    both = [j for j, (x, y) in enumerate(zip(own, theirs))
                            if x is not None and y is not None]
                    out[k] = theirs[k] * (own[both[0]] / theirs[both[0]] if both else 1.0)
                    break
        return out

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
        times[k].append(seconds)
        self.steps[b] += 1
        last[k] = self.steps[b]

    def _tables(self, b: int) -> tuple[list, list]:
        if b not in self.times:
            n = len(self.kept) + 1
            self.times[b] = [deque(maxlen=self.window) for _ in range(n)]
            self.last_run[b], self.steps[b] = [0] * n, 0
        return self.times[b], self.last_run[b]
