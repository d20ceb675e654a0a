"""How much a data node's load decodes at once: whole files while the rows it holds are few,
column groups (store.column_groups) as they approach all of its rows.

pyarrow holds about as much scratch as it decodes (compressed chunks, pages, builders: ~15 MiB
beside the 14 MiB of rows of one 250,000-row file of the sample table), once per read in flight.
Early in a load that scratch sits beside few kept rows; near its end, beside nearly all of them,
which is where a node's resident peak came from (1.38x its rows in the benchmarks). Reading
every file in column groups would bound it throughout, at the price of reopening each file once
per group (~20% more load time here). So the budget is the node's estimated rows times
(1 + READ_SCRATCH_SHARE): a read that starts gets, as its group limit, what is left of it after
the rows of every read started so far and the scratch of those still running. Early reads get
more than their file and read it whole; late ones read in groups of what fits, never smaller
than READ_GROUP_MIN_BYTES (a group reopens its file: its footer), or READ_GROUP_MIN_REMOTE_BYTES
from an object store, where each reopening is requests: on moto over loopback, groups of 4 MiB
made a 1M-row node's load from S3 ~29% slower (against ~15% from local files), and a real
store's request latency is tens of milliseconds.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from kubeflow_data_cache.constants import READ_SCRATCH_SHARE


class DecodeBudget:
    """Group limits for the reads of one load (thread-safe).

    ``kept[i]`` is read ``i``'s estimated rows' bytes; ``unit[i]`` the most of its file it
    decodes at once read whole (a row group's worth of every column, estimated); ``minimum[i]``
    the smallest group worth a reopening of its file (READ_GROUP_MIN_BYTES, or
    READ_GROUP_MIN_REMOTE_BYTES from an object store)."""

    def __init__(self, kept: list[int], unit: list[int], minimum: list[int], share: float = READ_SCRATCH_SHARE):
        self.kept, self._unit, self._minimum = kept, unit, minimum
        self.budget = int((1 + share) * sum(kept))
        self._lock = threading.Lock()
        self._started = 0  # the rows of every read started, in flight or done
        self._scratch: dict[int, int] = {}  # read -> the scratch it was allowed, while it runs

    @contextlib.contextmanager
    def reading(self, index: int) -> Iterator[int]:
        """While read ``index`` runs: yields its group limit in estimated bytes."""
        with self._lock:
            self._started += self.kept[index]
            left = self.budget - self._started - sum(self._scratch.values())
            limit = max(self._minimum[index], left)
            self._scratch[index] = min(limit, self._unit[index])
        try:
            yield limit
        finally:
            with self._lock:
                del self._scratch[index]
