"""What a data node's load has read so far, and which reads are still waiting on storage.

A read from an object store that stalls (an endpoint that accepts and never answers, a throttled
bucket) shows nowhere else: rows stop growing and nothing fails until the SDK's own retries give
up, often after the cache's deadline. The reads in flight, with how long each has waited, let the
node's status, the head's detail and every "not ready within" message name the file to look at.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

# A read waiting longer than this is named in the head's detail while the load goes on
# (at a deadline, the oldest read of each node still loading is named however young).
SLOW_READ_SECONDS = 10.0


class LoadProgress:
    """Rows and bytes decoded by one load, and the reads in flight (thread-safe).

    A read's wait counts from its start or its latest decoded batch: a large file that keeps
    decoding is not waiting, one whose storage stopped answering is.
    """

    def __init__(self, on_read: Callable[[], None] | None = None, on_batch: Callable[[], None] | None = None):
        self._lock = threading.Lock()
        self._on_read = on_read  # after each finished read; may raise to stop the load
        self._on_batch = on_batch  # after each batch decoded (and each column merged); may raise
        self.rows = 0  # decoded and kept, finished reads or not
        self.bytes = 0
        # The part of those whose bytes per row is known: every batch of a read of whole rows, a
        # read in column groups (store.column_groups) once all its groups are in. Rows of a
        # grouped read count above by each group's estimated share, which is all a display
        # needs, but would skew the memory guard's projection where the estimates are off.
        self.settled_rows = 0
        self.settled_bytes = 0
        # The manifests' estimate of the settled rows' bytes, and of all the load's rows (0: none):
        # the guard projects by these where rows differ in size from file to file.
        self.settled_estimate = 0.0
        self.expected_estimate = 0
        self._waiting: dict[int, list] = {}  # token -> [what, since the start or its last batch]
        self._next = 0

    @contextlib.contextmanager
    def reading(self, what: str) -> Iterator[int]:
        """Mark ``what`` (a data file, the table's metadata) as being read until the block ends;
        yields the token that ``batch`` takes."""
        with self._lock:
            token, self._next = self._next, self._next + 1
            self._waiting[token] = [what, time.monotonic()]
        try:
            yield token
        finally:
            with self._lock:
                del self._waiting[token]

    def read(self) -> None:
        """A read finished."""
        if self._on_read:
            self._on_read()

    def batch(self, rows: int = 0, nbytes: int = 0, token: int | None = None, settled: bool = True) -> None:
        """A batch decoded (``rows`` kept of it, ``nbytes`` their size) by read ``token``;
        ``settled=False`` for a column group's batch (counted in ``rows``/``bytes`` only)."""
        with self._lock:
            self.rows += rows
            self.bytes += nbytes
            if settled:
                self.settled_rows += rows
                self.settled_bytes += nbytes
            if token in self._waiting:
                self._waiting[token][1] = time.monotonic()
        if self._on_batch:
            self._on_batch()

    def settle(self, rows: int, nbytes: int, estimate: float = 0.0) -> None:
        """Rows whose bytes are known (a read of whole rows' batch, or a read in column groups
        once all its groups are in), and what the manifests estimated for them, for the memory
        guard."""
        with self._lock:
            self.settled_rows += rows
            self.settled_bytes += nbytes
            self.settled_estimate += estimate
        if self._on_batch:
            self._on_batch()

    def oldest(self) -> tuple[str, float] | None:
        """(what, seconds waited) of the read waiting longest, or None when none is in flight."""
        with self._lock:
            if not self._waiting:
                return None
            what, since = min(self._waiting.values(), key=lambda item: item[1])
        return what, time.monotonic() - since

    def status(self) -> dict[str, Any]:
        oldest = self.oldest()
        return {
            "rows": self.rows,
            "bytes": self.bytes,
            "oldest_read": {"what": oldest[0], "seconds": round(oldest[1], 1)} if oldest else None,
        }

    def describe(self) -> str:
        text = f"{self.rows} rows, {self.bytes >> 20} MiB read"
        oldest = self.oldest()
        if oldest and oldest[1] >= slow_read_seconds():
            text += f"; waiting {oldest[1]:.0f}s on {oldest[0]}"
        return text


def slow_read_seconds() -> float:
    return SLOW_READ_SECONDS  # read when asked, so that tests can lower it


def load_totals(loadings: Iterable[dict[str, Any]]) -> tuple[int, int, float]:
    """(rows, bytes, longest wait of an oldest read) over loads under way, each as
    ``LoadProgress.status()`` gives it: a node's own, or a head's over its nodes' last polls."""
    loadings = list(loadings)
    waits = [(loading.get("oldest_read") or {}).get("seconds", 0.0) for loading in loadings]
    rows = sum(loading.get("rows", 0) for loading in loadings)
    return rows, sum(loading.get("bytes", 0) for loading in loadings), max(waits, default=0.0)


def waiting_reads(
    nodes: Iterable[tuple[int, dict[str, Any]]], at_least: float | None = None, below: float = float("inf")
) -> str:
    """'data node 1 has waited 42s on a read of s3://...' for each node (index, status) whose
    oldest read in flight has waited from ``at_least`` (default SLOW_READ_SECONDS) to ``below``
    seconds; '' when none has."""
    at_least = slow_read_seconds() if at_least is None else at_least
    said = []
    for index, status in nodes:
        oldest = (status.get("loading") or {}).get("oldest_read")
        if oldest and at_least <= oldest["seconds"] < below:
            said.append(f"data node {index} has waited {oldest['seconds']:.0f}s on a read of {oldest['what']}")
    return "; ".join(said)
