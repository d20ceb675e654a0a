"""Compute the next batches of a stream in a background thread while the current one is sent.

A shuffled DoGet gathers each batch (pyarrow releases the GIL for that) and then Flight writes
it, which blocks until the client's flow-control window has room. Done in one thread the two
alternate and the node idles half the time; with a few batches computed ahead they overlap.
The queue is bounded, so a slow client holds at most ``depth`` extra batches in memory.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")

# How long the producer waits for room before checking whether the consumer went away.
_PUT_POLL_SECONDS = 0.5


class _End:
    """Marks the end of the source, carrying its exception if it failed."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


def readahead(source: Iterator[T], depth: int, name: str = "readahead") -> Iterator[T]:
    """Yield ``source``'s items in order, computing up to ``depth`` of them ahead.

    An exception in ``source`` is raised here, in the consumer, after the items before it.
    Closing this generator early (a client that disconnects) stops the producer thread.
    """
    if depth < 1:
        raise ValueError(f"depth should be >= 1, got {depth}")
    items: queue.Queue = queue.Queue(maxsize=depth)
    stopped = threading.Event()

    def put(item: object) -> bool:
        while not stopped.is_set():
            try:
                items.put(item, timeout=_PUT_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in source:
                if not put(item):
                    return
        except BaseException as err:  # handed to the consumer, which raises it
            put(_End(err))
            return
        finally:
            close = getattr(source, "close", None)
            if close is not None:  # a generator source runs its cleanup now, not at GC
                close()
        put(_End())

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while True:
            item = items.get()
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
            yield item
    finally:
        stopped.set()
