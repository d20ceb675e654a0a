"""Cancel a stream read that waits too long for its next batch.

A data node that froze (a stopped process, a hung pod, a network partition) keeps its TCP
connection open and sends nothing; gRPC alone waits for ever, and every DDP rank with it. Time
spent waiting inside a read is time the node should be sending: a consumer that is slow to ask
is not counted (gRPC's flow control holds the node back then, not the other way round).
"""

from __future__ import annotations

import threading
import time
import weakref
from contextlib import suppress
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

# A watcher with nothing armed for this long ends its thread (the next ``arm`` starts one), so
# a client kept idle holds no thread. A client its owner dropped without closing it (a dataset
# per evaluation, a sweep in one process) ends its thread sooner: the thread holds the watcher
# only weakly, and ends within a tick of it being collected.
IDLE_EXIT_SECONDS = 30.0


class StallWatch:
    """One watcher thread per client while it reads; ``arm`` before a read, ``disarm`` after
    (cheap: a dict op), ``forget`` when the stream is done."""

    def __init__(self, limit_seconds: float) -> None:
        self.limit = limit_seconds
        self._lock = threading.Lock()
        self._armed: dict[int, tuple[float, Any]] = {}  # id(reader) -> (cancel after, reader)
        self._stalled: set[int] = set()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def arm(self, reader: Any, limit: float | None = None) -> None:
        """Cancel ``reader`` unless disarmed within ``limit`` seconds (default: the watcher's)."""
        with self._lock:
            self._armed[id(reader)] = (time.monotonic() + (self.limit if limit is None else limit), reader)
            if self._thread is None:
                self._stop.clear()
                args = (weakref.ref(self), self._stop, min(1.0, self.limit / 4))
                self._thread = threading.Thread(target=_watch, args=args, name="cache-stall-watch", daemon=True)
                self._thread.start()

    def disarm(self, reader: Any) -> None:
        with self._lock:
            self._armed.pop(id(reader), None)

    def stalled(self, reader: Any) -> bool:
        """Whether ``reader`` was cancelled for stalling (it stays so until ``forget``: a cancel
        that lands just after a read returned fails the next read instead)."""
        with self._lock:
            return id(reader) in self._stalled

    def forget(self, reader: Any) -> None:
        with self._lock:
            self._armed.pop(id(reader), None)
            self._stalled.discard(id(reader))

    def close(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
            self._stop.set()
        if thread is not None:
            thread.join()

    def _tick(self, idle_since: float) -> float | None:
        """Cancel the reads past their limit; the new ``idle_since``, or None to end the thread."""
        now = time.monotonic()
        with self._lock:
            if self._armed:
                idle_since = now
            elif now - idle_since >= IDLE_EXIT_SECONDS:
                if self._thread is threading.current_thread():
                    self._thread = None  # the next arm starts a new one
                return None
            expired = [(key, reader) for key, (at, reader) in self._armed.items() if at <= now]
            for key, _ in expired:
                del self._armed[key]
                self._stalled.add(key)
        for _, reader in expired:
            with suppress(flight.FlightError, pa.ArrowException):
                reader.cancel()  # the blocked read returns with an error at once
        return idle_since


def _watch(ref: weakref.ref[StallWatch], stop: threading.Event, tick: float) -> None:
    """The watcher thread: holds its StallWatch only during a tick, so dropping it ends the thread."""
    idle_since: float | None = time.monotonic()
    while not stop.wait(tick):
        watch = ref()
        if watch is None:
            return
        idle_since = watch._tick(idle_since)
        del watch
        if idle_since is None:
            return
