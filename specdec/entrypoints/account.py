"""Where a served token's time goes: an opt-in account of wall and CPU time per part of the
served path (``specdec serve --account``). Off, nothing is wrapped and nothing is counted.

Parts, engine process (``run_engine_process``): ``apply`` (adds and aborts), ``step`` (the
engine steps; the tokens they emit are counted), ``send`` (each output pickled down the
pipe), ``wait`` (blocked for a message while idle). API process: ``tokenize`` (prompts and
chats to ids, in worker threads: wall only), ``submit`` (admission and the add down the pipe),
``receive`` (outputs read from the pipe, unpickled and put in the requests' queues),
``detokenize`` (``TextStream.add``), ``serialize`` (JSON of responses and stream chunks).
Each process's CPU time not in a part (HTTP parsing and writing, the event loop, Python's
collections) is its ``rest``.

``GET /account``: both processes' parts as ``{part: {"wall_s", "cpu_s", "calls"}}``, their
total CPU and the wall time since the last ``POST /account/reset``, and the tokens emitted
(the routes and the API process's wrapping: ``account_routes.py``).
"""

import functools
import resource
import time


class Account:
    """Wall and CPU seconds and calls per part of one process, since ``reset``."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.parts: dict[str, list[float]] = {}
        self.tokens = 0
        self._start = (time.perf_counter(), _process_cpu())

    def add(self, part: str, wall: float, cpu: float) -> None:
        p = self.parts.setdefault(part, [0.0, 0.0, 0])
        p[0] += wall
        p[1] += cpu
        p[2] += 1

    def timed(self, fn, part: str):
        """``fn`` (synchronous) counting its wall and this thread's CPU time under ``part``."""
        @functools.wraps(fn)
        def run(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(part, time.perf_counter() - wall, time.thread_time() - cpu)
        return run

    def timed_async(self, fn, part: str):
        """An async ``fn`` whose work runs in worker threads: its wall time only."""
        @functools.wraps(fn)
        async def run(*args, **kwargs):
            wall = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                self.add(part, time.perf_counter() - wall, 0.0)
        return run

    def report(self) -> dict:
        """{"parts": {part: {wall_s, cpu_s, calls}}, "cpu_s", "wall_s", "tokens"}: ``rest`` is
        the process's CPU time outside the parts."""
        wall, cpu = time.perf_counter() - self._start[0], _process_cpu() - self._start[1]
        parts = {k: dict(wall_s=w, cpu_s=c, calls=n) for k, (w, c, n) in self.parts.items()}
        parts["rest"] = dict(wall_s=None, cpu_s=cpu - sum(c for _, c, _ in self.parts.values()),
                             calls=None)
        return dict(parts=parts, cpu_s=cpu, wall_s=wall, tokens=self.tokens)


def _process_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def count_engine(account: Account, loop) -> None:
    """Wrap an ``EngineLoop``'s add, abort and step (tokens counted) in ``account``."""
    loop.add = account.timed(loop.add, "apply")
    loop.abort = account.timed(loop.abort, "apply")
    step = account.timed(loop.step, "step")

    def counted_step():
        out = step()
        if out.step is not None:
            account.tokens += sum(out.step.new_tokens.values())
        return out
    loop.step = counted_step
