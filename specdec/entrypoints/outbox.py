"""Messages from the API process to an engine process's pipe, sent by a thread of their own.

The event loop reads the pipe (``loop.add_reader``); sending on the loop would block it while
the pipe is full, and uvloop's ``add_reader`` makes the descriptor non-blocking, where
``Connection.send`` of a message larger than the pipe's free space fails partway with
``BlockingIOError`` (a burst of requests, or one request with a large ``n``, did that and
took the engine for dead). So the descriptor is made blocking again and the messages go
through a queue to one thread, in order; only that thread waits for the engine to drain the
pipe.
"""

import asyncio
import os
import queue
import threading
from multiprocessing.connection import Connection

_STOP = object()


class Outbox:
    """Sends ``put`` messages on ``conn`` in order, from its own thread; ``on_error`` runs on
    ``loop`` once a send fails (the process at the other end is gone). Create it after the
    loop's ``add_reader`` on ``conn``."""

    def __init__(self, conn: Connection, loop: asyncio.AbstractEventLoop, on_error):
        os.set_blocking(conn.fileno(), True)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(conn, loop, on_error),
                                        name="specdec-outbox", daemon=True)
        self._thread.start()

    def put(self, msg) -> None:
        self._queue.put(msg)

    def close(self, timeout_s: float) -> None:
        """Send what was put, then end the thread (waits up to ``timeout_s``)."""
        self._queue.put(_STOP)
        self._thread.join(timeout_s)

    def _run(self, conn: Connection, loop: asyncio.AbstractEventLoop, on_error) -> None:
        while (msg := self._queue.get()) is not _STOP:
            try:
                conn.send(msg)
            except OSError:
                if not loop.is_closed():
                    loop.call_soon_threadsafe(on_error)
                return
