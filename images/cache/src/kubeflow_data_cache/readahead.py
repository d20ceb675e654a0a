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


class Readahead(Iterator[T]):
    """Yield ``source``'s items in order, computing up to ``depth`` of them ahead.

    The producer thread starts at once, not at the first ``next``, so several streams wrapped
    together all start working. An exception in ``source`` is raised here, in the consumer, after
    the items before it. ``close()`` (also on a never-read one: a client that disconnects) stops
    the producer and closes ``source``.
    """

    def __init__(self, source: Iterator[T], depth: int, name: str = "readahead") -> None:
        if depth < 1:
            raise ValueError(f"depth should be >= 1, got {depth}")
        self._items: queue.Queue = queue.Queue(maxsize=depth)
        self._stopped = threading.Event()
        self._done = False
        threading.Thread(target=self._produce, args=(source,), name=name, daemon=True).start()

    def _put(self, item: object) -> bool:
        while not self._stopped.is_set():
            try:
                self._items.put(item, timeout=_PUT_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, source: Iterator[T]) -> None:
        try:
            for item in source:
                if not self._put(item):
                    return
        except BaseException as err:  # handed to the consumer, which raises it
            self._put(_End(err))
            return
        finally:
            close = getattr(source, "close", None)
            if close is not None:  # a generator source runs its cleanup now, not at GC
                close()
        self._put(_End())

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        item = self._items.get()
        if isinstance(item, _End):
            self._done = True
            self.close()
            if item.error is not None:
                raise item.error
            raise StopIteration
        return item

    def close(self) -> None:
        self._done = True
        self._stopped.set()
