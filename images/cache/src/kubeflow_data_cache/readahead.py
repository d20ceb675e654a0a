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

    By default ``depth`` items wait in the queue and the producer computes one more, which it
    holds until there is room. With ``count_in_progress`` the producer waits for room before it
    computes the next item, so at most ``depth`` exist ahead of the consumer, the one being
    computed included: a data node's gathered batches, where each is megabytes.

    The producer thread starts at once, not at the first ``next``, so several streams wrapped
    together all start working. An exception in ``source`` is raised here, in the consumer, after
    the items before it. ``close()`` (also on a never-read one: a client that disconnects) stops
    the producer and closes ``source``.
    """

    def __init__(
        self, source: Iterator[T], depth: int, name: str = "readahead", count_in_progress: bool = False
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth should be >= 1, got {depth}")
        self._items: queue.Queue = queue.Queue(maxsize=depth)
        # Taken before computing an item, given back when the consumer takes one (then the queue
        # never fills: it holds at most depth items, the end marker included).
        self._room = threading.Semaphore(depth) if count_in_progress else None
        self._stopped = threading.Event()
        self._done = False
        threading.Thread(target=self._produce, args=(source,), name=name, daemon=True).start()

    def _wait_room(self) -> bool:
        while not self._stopped.is_set():
            if self._room is None or self._room.acquire(timeout=_PUT_POLL_SECONDS):
                return True
        return False

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
            items = iter(source)
            while self._wait_room():
                try:
                    item = next(items)
                except StopIteration:
                    break
                if not self._put(item):
                    return
                # Not held while the next one is computed: the consumer may be done with it.
                del item
            else:
                return  # closed while waiting for room
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
        if self._room is not None:
            self._room.release()
        return item

    def close(self) -> None:
        self._done = True
        self._stopped.set()
