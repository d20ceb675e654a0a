"""A data node's rows: read from Parquet via pyiceberg, kept as Arrow record batches.

Rows keep their load order; ``offsets`` maps a local row number to (batch, row) with one
binary search, so ranges are served as zero-copy slices and shuffled rows with one gather per
batch involved.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kubeflow_data_cache.allocator import serve_pool
from kubeflow_data_cache.constants import STORE_CHUNK_BYTES, STORE_CHUNK_ROWS
from kubeflow_data_cache.errors import BadRequestError, TableLoadError
from kubeflow_data_cache.plan import Piece

log = logging.getLogger(__name__)


def compact(batches: deque[pa.RecordBatch]) -> list[pa.RecordBatch]:
    """Merge the reader's small batches into chunks of up to STORE_CHUNK_ROWS rows.

    A shuffled read gathers rows; one gather from one chunk is several times faster than
    gathers across many small batches. Chunks are merged one at a time and their sources
    dropped as we go, so the extra memory is one chunk, never a second copy of the table.
    """
    out: list[pa.RecordBatch] = []
    while batches:
        group, rows, nbytes = [], 0, 0
        while batches and (
            not group
            or (rows + batches[0].num_rows <= STORE_CHUNK_ROWS and nbytes + batches[0].nbytes <= STORE_CHUNK_BYTES)
        ):
            batch = batches.popleft()
            group.append(batch)
            rows, nbytes = rows + batch.num_rows, nbytes + batch.nbytes
        out.append(group[0] if len(group) == 1 else pa.concat_batches(group))
        del group
    return out


def _own_copy(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A slice keeps its parent's whole buffers alive; copy partial slices so they don't."""
    return batch.take(pa.array(np.arange(batch.num_rows, dtype=np.int64)))


def warm_reader(table, task) -> None:
    """Read one batch of one file and drop it. The first Parquet read in a process sets up
    the reader stack (hundreds of ms); doing it while the cluster forms keeps it out of the load.
    A failure here is left for the real read to report."""
    from pyiceberg.expressions import AlwaysTrue
    from pyiceberg.io.pyarrow import ArrowScan

    with contextlib.suppress(Exception):
        batches = ArrowScan(table.metadata, table.io, table.schema(), AlwaysTrue()).to_record_batches([task])
        next(iter(batches), None)


def read_piece(table, task, piece: Piece) -> list[pa.RecordBatch]:
    """Rows ``[piece.start, piece.stop)`` of one file, deletes applied, via pyiceberg's reader
    (which also handles schema evolution by field id)."""
    from pyiceberg.expressions import AlwaysTrue
    from pyiceberg.io.pyarrow import ArrowScan

    scan = ArrowScan(table.metadata, table.io, table.schema(), AlwaysTrue())
    out: list[pa.RecordBatch] = []
    pos = 0
    try:
        for batch in scan.to_record_batches([task]):
            a, b = max(piece.start, pos), min(piece.stop, pos + batch.num_rows)
            if a < b:
                part = batch.slice(a - pos, b - a)
                out.append(part if part.num_rows == batch.num_rows else _own_copy(part))
            pos += batch.num_rows
            if pos >= piece.stop:
                break
    except Exception as err:
        raise TableLoadError(f"cannot read data file {piece.path}: {err}") from err
    got = sum(b.num_rows for b in out)
    if got != piece.stop - piece.start:
        raise TableLoadError(
            f"data file {piece.path} has {pos} row(s) after deletes, expected at least {piece.stop}: "
            "the table changed under the cache; point METADATA_LOC at the current metadata and restart"
        )
    return out


class NodeStore:
    """The loaded rows of one data node, immutable once built."""

    def __init__(self, schema: pa.Schema, batches: list[pa.RecordBatch]):
        self.schema = schema
        self.batches = [b for b in batches if b.num_rows]
        sizes = [b.num_rows for b in self.batches]
        self.offsets = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64))).astype(np.int64)
        self.num_rows = int(self.offsets[-1])
        self.nbytes = sum(b.nbytes for b in self.batches)

    @classmethod
    def load(
        cls,
        table,
        tasks: dict,
        schema: pa.Schema,
        pieces: list[Piece],
        threads: int,
        progress: Callable[[int, int], None] | None = None,
    ) -> NodeStore:
        """Read every piece in parallel (pyarrow releases the GIL), keeping piece order."""
        lock = threading.Lock()
        done = {"rows": 0, "bytes": 0}

        def read(piece: Piece) -> list[pa.RecordBatch]:
            batches = read_piece(table, tasks[piece.path], piece)
            with lock:
                done["rows"] += sum(b.num_rows for b in batches)
                done["bytes"] += sum(b.nbytes for b in batches)
                if progress:
                    progress(done["rows"], done["bytes"])
            return batches

        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="load") as pool:
            results = list(pool.map(read, pieces))
        batches = deque(b.cast(schema) if b.schema != schema else b for part in results for b in part)
        del results
        store = cls(schema, compact(batches))
        # Give cached decode buffers back to the OS (immediate under the data node's jemalloc).
        pa.default_memory_pool().release_unused()
        return store

    def project(self, columns: tuple[str, ...] | None) -> pa.Schema:
        if columns is None:
            return self.schema
        unknown = [c for c in columns if c not in self.schema.names]
        if unknown:
            raise BadRequestError(f"unknown column(s) {unknown}; the table has {self.schema.names}")
        return pa.schema([self.schema.field(c) for c in columns])

    def _select(self, batch: pa.RecordBatch, columns: tuple[str, ...] | None) -> pa.RecordBatch:
        return batch if columns is None else batch.select(list(columns))

    def slices(self, lo: int, hi: int, batch_rows: int, columns) -> Iterator[pa.RecordBatch]:
        """Rows ``[lo, hi)`` as zero-copy slices of at most ``batch_rows`` rows."""
        pos = lo
        while pos < hi:
            i = int(np.searchsorted(self.offsets, pos, side="right")) - 1
            start = pos - int(self.offsets[i])
            n = min(hi - pos, self.batches[i].num_rows - start, batch_rows)
            yield self._select(self.batches[i].slice(start, n), columns)
            pos += n

    def take(self, rows: np.ndarray, columns) -> pa.RecordBatch:
        """Rows at the given local positions, in that order: one gather per stored chunk touched."""
        if len(rows) == 0:
            return pa.RecordBatch.from_pylist([], schema=self.project(columns))
        # Gather outputs live for one batch each: a pool that keeps its pages (allocator.py).
        pool = serve_pool()
        if len(self.batches) == 1:
            return pc.take(self._select(self.batches[0], columns), pa.array(rows), memory_pool=pool)
        which = np.searchsorted(self.offsets, rows, side="right") - 1
        # A stable sort on small chunk numbers is a radix sort: O(n), order kept inside a chunk.
        order = np.argsort(which.astype(np.int32), kind="stable")
        counts = np.bincount(which, minlength=len(self.batches))
        parts, pos = [], 0
        for i in np.flatnonzero(counts):
            sel = order[pos : pos + counts[i]]
            pos += counts[i]
            local = pa.array(rows[sel] - self.offsets[i])
            parts.append(pc.take(self._select(self.batches[i], columns), local, memory_pool=pool))
        if len(parts) == 1:
            return parts[0]
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        return pc.take(pa.concat_batches(parts, memory_pool=pool), pa.array(inverse), memory_pool=pool)

    def iter_rows(self, parts, batch_rows: int, columns) -> Iterator[pa.RecordBatch]:
        """Serve ``sharding.node_rows`` output: ranges as slices, index arrays as gathers."""
        for part in parts:
            if isinstance(part, range):
                yield from self.slices(part.start, part.stop, batch_rows, columns)
            else:
                for start in range(0, len(part), batch_rows):
                    yield self.take(part[start : start + batch_rows], columns)
