"""Holding a Ctrl-C back while worker processes are started or stopped.

A ``KeyboardInterrupt`` raised inside multiprocessing's handshake with the forkserver
(``Process.start``) can leave the main process blocked for good reading a pid that never
comes, and one raised inside a shutdown's joins leaves processes and shared memory
behind. :func:`sigint_deferred` records a SIGINT that arrives meanwhile and delivers it
once the block is over, to whatever handler was there before.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Runs the block with SIGINT held back; a SIGINT received meanwhile is raised again
    at its end, under the previous handler (so, by default, ``KeyboardInterrupt`` is
    raised there). Outside the main thread, or where SIGINT's handler was not installed
    from Python, the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is None:  # installed outside Python: it could not be put back
        yield
        return
    caught: list[int] = []

    def record(signum: int, _frame: FrameType | None) -> None:
        caught.append(signum)

    signal.signal(signal.SIGINT, record)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            # Raised again rather than calling the handler: SIG_DFL and SIG_IGN act as
            # they would have, and a Python handler runs (raises) right here.
            signal.raise_signal(signal.SIGINT)
