"""A data node's rows: read from Parquet via pyiceberg, kept as Arrow record batches.

Rows keep their load order; ``offsets`` maps a local row number to (batch, row) with one
binary search, so ranges are served as zero-copy slices and shuffled rows with one gather per
batch involved.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kubeflow_data_cache import row_bytes
from kubeflow_data_cache.allocator import serve_pool, trim_glibc_malloc
from kubeflow_data_cache.column_concat import concat_releasing
from kubeflow_data_cache.constants import (
    READ_GROUP_MIN_BYTES,
    READ_GROUP_MIN_REMOTE_BYTES,
    SERVED_BATCH_MAX_BYTES,
    STORE_CHUNK_VARIABLE_BYTES,
)
from kubeflow_data_cache.decode_budget import DecodeBudget
from kubeflow_data_cache.errors import BadRequestError, DataCacheError, TableLoadError
from kubeflow_data_cache.iceberg_reader import is_remote, task_batches, task_deletes
from kubeflow_data_cache.load_progress import LoadProgress
from kubeflow_data_cache.offsets import has_offsets, rebased_nbytes, value_offsets
from kubeflow_data_cache.plan import Piece, estimate_column_bytes, file_read_error
from kubeflow_data_cache.protocol import widen

log = logging.getLogger(__name__)

# (stored batch, column set) entries of a store's offsets kept for cutting served batches by bytes.
MAX_KEPT_OFFSETS = 1024


def _variable_bytes(batch: pa.RecordBatch) -> int:
    """The largest size among the batch's non-primitive columns (strings, lists, structs...): its
    bytes, or the most entries its 32-bit offsets span where that is more. A list of booleans
    spans 8 values per byte: merged by bytes alone, 2^31 of them (256 MiB) overflowed its offsets
    and failed the load."""
    sizes = [max(col.nbytes, _offset_span(col)) for col in batch.columns if not pa.types.is_primitive(col.type)]
    return max(sizes, default=0)


def _offset_span(arr: pa.Array) -> int:
    """The most entries any 32-bit offsets of ``arr`` span, at every level: a string's bytes, a
    list's child values."""
    t = arr.type
    if len(arr) == 0:
        return 0
    if pa.types.is_string(t) or pa.types.is_binary(t):
        offsets = value_offsets(arr)
        return int(offsets[-1] - offsets[0])
    if pa.types.is_list(t) or pa.types.is_map(t):
        first, last = arr.offsets[0].as_py(), arr.offsets[-1].as_py()  # this slice's, unlike .values
        return max(last - first, _offset_span(arr.values.slice(first, last - first)))
    if pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _offset_span(arr.flatten())
    if pa.types.is_struct(t):
        return max((_offset_span(arr.field(i)) for i in range(t.num_fields)), default=0)
    return 0


def _merge(group: list[pa.RecordBatch], schema: pa.Schema, on_column: Callable[[], None]) -> pa.RecordBatch:
    """One batch from ``group``, merged a column at a time, each source chunk released as soon as
    it is copied (column_concat): the extra memory is one chunk, not a second copy of the rows
    or of a column."""
    if len(group) == 1:
        return group.pop()
    table = pa.Table.from_batches(group, schema=schema)
    group.clear()
    sources = table.columns
    del table
    merged = []
    for i in range(len(sources)):
        chunks = sources[i].chunks
        sources[i] = None  # ``chunks`` now holds the column's only references
        merged.append(concat_releasing(chunks))
        on_column()
    return pa.RecordBatch.from_arrays(merged, schema=schema)


def compact(
    batches: deque[pa.RecordBatch],
    schema: pa.Schema,
    variable_limit: int = STORE_CHUNK_VARIABLE_BYTES,
    on_column: Callable[[], None] = lambda: None,
) -> list[pa.RecordBatch]:
    """Merge the reader's batches into as few chunks as the 32-bit offsets of variable-width
    columns allow (one chunk for a numeric table, however large).

    A shuffled read gathers rows, and a gather from one chunk is several times faster than the
    same gather across chunks (5M rows: ~5x for numeric columns). Chunks are merged one at a
    time and their sources dropped as we go; ``on_column`` runs after each column merged (the
    load's memory guard: merging holds two copies of one column at a time).
    """
    out: list[pa.RecordBatch] = []
    while batches:
        group, variable = [], 0
        while batches and (not group or variable + _variable_bytes(batches[0]) <= variable_limit):
            batch = batches.popleft()
            group.append(batch)
            variable += _variable_bytes(batch)
        del batch
        out.append(_merge(group, schema, on_column))
    return out


def indices(rows: np.ndarray) -> pa.Array:
    """``rows`` as an Arrow int64 array, without a copy where they are int64 already.

    Not ``pa.array(rows)``: its first call in a process imports ``numpy.ma`` (pyarrow checks for
    masked arrays). Where no bytecode is cached (``PYTHONDONTWRITEBYTECODE``, a venv installed
    without compiling) that compiles ~350 KB of Python in the middle of a data node's first
    shuffled stream: glibc's heap grew ~7 MiB for it, freed but resident until the node went
    idle, the largest part of the node's peak while serving a 3-column shuffled epoch.
    """
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(rows), [None, pa.py_buffer(rows)])


def _own_copy(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A slice keeps its parent's whole buffers alive; copy partial slices so they don't."""
    return batch.take(indices(np.arange(batch.num_rows, dtype=np.int64)))


# pyiceberg's types whose Arrow form is a few bytes a row, whatever the file holds.
FIXED_WIDTH_TYPES = frozenset(
    {
        "BooleanType",
        "IntegerType",
        "LongType",
        "FloatType",
        "DoubleType",
        "DateType",
        "TimeType",
        "TimestampType",
        "TimestamptzType",
        "TimestampNanoType",
        "TimestamptzNanoType",
        "DecimalType",
        "UUIDType",
    }
)


def warm_reader(table, task) -> None:
    """Read one batch of one column of one file and drop it. The first Parquet read in a process
    sets up the reader stack (hundreds of ms); doing it while the cluster forms keeps it out of
    the load. One column, the file's smallest of fixed width: every column of a batch fetched a
    whole row group from S3 on each node (12 MB of 48 MB at each start) and decoded it outside the
    load's memory budget. No warm-up for a table without such a column: its smallest column by
    bytes on disk was a string one repeated (dictionary-encoded), whose one batch decoded 650 MiB
    on every node, also outside the budget. A failure here is left for the real read to report."""
    field = _warm_up_field(table, task)
    if field is None:
        return
    with contextlib.suppress(Exception), contextlib.closing(task_batches(table, task, [field])) as batches:
        next(batches, None)


def _warm_up_field(table, task) -> int | None:
    """The top-level fixed-width column (numbers, booleans, dates and times, decimals, UUIDs) the
    file stores in the fewest bytes (its statistics): a batch of it decodes to a few bytes a row,
    whatever the file holds. None where the table has none."""
    sizes = task.file.column_sizes or {}
    # By name, as pyiceberg has more primitives of variable width than strings and binaries
    # (geometry, geography), and may add others.
    fixed = [f for f in table.schema().fields if type(f.field_type).__name__ in FIXED_WIDTH_TYPES]
    return min(fixed, key=lambda f: sizes.get(f.field_id, float("inf"))).field_id if fixed else None


def column_groups(
    table, task, schema: pa.Schema | None, limit: int | None, expansions: dict[int, float] | None = None
) -> list[tuple[tuple[int, ...] | None, float]]:
    """The columns of one data file in read groups, as (top-level Iceberg field ids, the group's
    share of the file's estimated Arrow bytes); ``[(None, 1.0)]`` for one read of every column.

    pyarrow decodes a row group's columns together and holds about as much again as it yields
    while it does (compressed chunks, pages, builders): ~15 MiB beside 14 MiB of rows for one
    250,000-row file of the sample table. Columns are grouped in schema order up to ``limit``
    estimated bytes per group (a column larger than that is a group of its own), so a read holds
    one group's scratch instead of the row group's. Each group reopens the file (its footer, a
    request on S3), hence groups of several MiB, not one per column."""
    if limit is None or schema is None:
        return [(None, 1.0)]
    fields = _iceberg_fields(table, schema)
    if fields is None:
        return [(None, 1.0)]
    # Only this file's statistics at hand: a column it has no size for is sized as values, which
    # errs high (a smaller group), never low.
    sizes = estimate_column_bytes(task.file, schema, fields, task.file.record_count, expansions)
    groups: list[tuple[list[int], int]] = []
    for field, size in zip(fields, sizes, strict=True):
        if groups and groups[-1][1] + size <= limit:
            groups[-1][0].append(field.field_id)
            groups[-1] = (groups[-1][0], groups[-1][1] + size)
        else:
            groups.append(([field.field_id], size))
    if len(groups) <= 1:
        return [(None, 1.0)]
    total = sum(size for _, size in groups)
    return [(tuple(ids), size / total if total else 1 / len(groups)) for ids, size in groups]


def read_piece(
    table,
    task,
    piece: Piece,
    on_batch: Callable[[int, int], None] = lambda rows, nbytes: None,
    schema: pa.Schema | None = None,
    group_bytes: int | None = None,
    on_settled: Callable[[int, int], None] | None = None,
    expansions: dict[int, float] | None = None,
) -> list[pa.RecordBatch]:
    """Rows ``[piece.start, piece.stop)`` of one file, deletes applied, via pyiceberg's reader
    (which also handles schema evolution by field id). ``on_batch(rows kept, their bytes)`` runs
    after each decoded batch and may raise to stop the read (the load's memory guard).

    With ``schema`` (the cache's), the rows kept are cast to it before they are copied: a
    file stored with view types (string_view, binary_view) decodes to them, and pyarrow has no
    take kernel for those, so copying part of such a batch failed the load. With ``schema`` and
    ``group_bytes``, the columns are read in groups (column_groups) and put side by side; each
    group's rows count toward ``on_batch`` by its share of the estimated bytes, so rows and
    bytes grow together, and ``on_settled(rows, bytes)`` is called once all groups are in; a
    read of whole rows calls ``on_settled`` with each batch, as ``on_batch``."""
    groups = column_groups(table, task, schema, group_bytes, expansions) if piece.stop > piece.start else [(None, 1.0)]
    credit, reported, read_bytes = 0.0, 0, 0

    def count(rows: int, nbytes: int, share: float) -> None:
        nonlocal credit, reported, read_bytes
        credit += rows * share
        step = min(int(credit), piece.stop - piece.start) - reported
        reported += step
        read_bytes += nbytes
        on_batch(step, nbytes)
        if on_settled is not None and len(groups) == 1:
            on_settled(step, nbytes)

    try:
        deletes = task_deletes(table, task) if len(groups) > 1 else None
        parts = []
        for field_ids, share in groups:
            sub = schema
            if field_ids is not None:
                names = _group_names(table, field_ids)
                sub = pa.schema([schema.field(name) for name in names])
            batches = _read_columns(
                table, task, piece, field_ids, deletes, sub, lambda rows, nbytes, s=share: count(rows, nbytes, s)
            )
            parts.append(batches if len(groups) == 1 else pa.Table.from_batches(batches, schema=sub))
    except DataCacheError:
        raise  # the guard's own refusal, already saying what to fix
    except Exception as err:
        raise TableLoadError(file_read_error(piece.path, err, table.io.properties.get("s3.endpoint"))) from err
    if reported < piece.stop - piece.start:
        on_batch(piece.stop - piece.start - reported, 0)
        if on_settled is not None and len(groups) == 1:
            on_settled(piece.stop - piece.start - reported, 0)
    if on_settled is not None and len(groups) > 1:
        on_settled(piece.stop - piece.start, read_bytes)
    return parts[0] if len(groups) == 1 else _side_by_side(parts, schema)


def _iceberg_fields(table, schema: pa.Schema) -> list | None:
    """The table's top-level Iceberg fields in the order of the cache's ``schema`` (what
    estimate_column_bytes takes), or None where a name of it is not the table's."""
    by_name = {f.name: f for f in table.schema().fields}
    if any(name not in by_name for name in schema.names):
        return None
    return [by_name[name] for name in schema.names]


def _group_names(table, field_ids: tuple[int, ...]) -> list[str]:
    wanted = set(field_ids)
    return [f.name for f in table.schema().fields if f.field_id in wanted]


def _side_by_side(parts: list[pa.Table], schema: pa.Schema) -> list[pa.RecordBatch]:
    """Column groups' rows as batches of every column, in ``schema`` order, without a copy: the
    groups hold the same rows, and a table's batches are cut wherever any column's are."""
    columns = {}
    for group in parts:
        columns.update(zip(group.column_names, group.columns, strict=True))
    return pa.Table.from_arrays([columns[name] for name in schema.names], schema=schema).to_batches()


def _read_columns(table, task, piece: Piece, field_ids, deletes, schema, on_batch) -> list[pa.RecordBatch]:
    """One read of ``piece`` for the columns ``field_ids`` (None: all), cast to ``schema``."""
    out: list[pa.RecordBatch] = []
    pos = 0
    # The piece that ends the file (as planned) reads on to the file's end: rows past what the
    # manifest counted would otherwise be left out of the cache without a word.
    tail = piece.file_rows is not None and piece.stop >= piece.file_rows
    with contextlib.closing(task_batches(table, task, field_ids, deletes)) as batches:
        for batch in batches:
            if tail and pos + batch.num_rows > piece.stop:
                _more_rows_than_planned(piece, pos + batch.num_rows)
            a, b = max(piece.start, pos), min(piece.stop, pos + batch.num_rows)
            kept = 0
            if a < b:
                part = batch.slice(a - pos, b - a)
                if schema is not None and part.schema != schema:
                    part = part.cast(schema)  # the rows kept only: a few of a large file's
                out.append(part if part.num_rows == batch.num_rows else _own_copy(part))
                kept = out[-1].nbytes
            pos += batch.num_rows
            on_batch(max(0, b - a), kept)
            if pos >= piece.stop and not tail:
                break
    got = sum(b.num_rows for b in out)
    if got != piece.stop - piece.start:
        # Data files never change once committed, so newer metadata would count the same: the
        # file itself was changed (or the manifest's count is wrong). Pointing METADATA_LOC
        # elsewhere, as this once advised, fixes nothing.
        raise TableLoadError(
            f"data file {piece.path} has {pos} row(s) after deletes, expected at least {piece.stop} by the "
            f"table's metadata (which counts {piece.file_rows}): the file was changed after it was committed, "
            "or the manifest's record_count is wrong; the cache refuses to serve fewer rows than the table "
            "holds. Repair the table (rewrite the file through the catalog) and restart the cache"
        )
    return out


def _more_rows_than_planned(piece: Piece, at_least: int) -> None:
    raise TableLoadError(
        f"data file {piece.path} has at least {at_least} live row(s), but the table's metadata "
        f"counts {piece.file_rows}: the file was changed after it was committed, or the manifest's "
        "record_count is wrong; the cache refuses to leave rows out. Repair the table (rewrite the "
        "file through the catalog) and restart the cache"
    )


def decode_budget(
    table, tasks: dict, schema: pa.Schema, pieces: list[Piece], expansions: dict[int, float] | None = None
) -> DecodeBudget | None:
    """The load's DecodeBudget from manifest estimates; None (read every file whole) where the
    cache's schema does not name the table's columns one to one."""
    fields = _iceberg_fields(table, schema)
    if fields is None:
        return None
    kept, unit, minimum = [], [], []
    for piece in pieces:
        data_file = tasks[piece.path].file
        # Columns added after a file are sized as values here (the head dates files by their
        # snapshots; the budget errs toward smaller reads).
        whole = sum(estimate_column_bytes(data_file, schema, fields, data_file.record_count, expansions))
        kept.append(whole * (piece.stop - piece.start) // max(1, data_file.record_count))
        unit.append(whole // max(1, len(data_file.split_offsets or ())))
        minimum.append(READ_GROUP_MIN_REMOTE_BYTES if is_remote(piece.path) else READ_GROUP_MIN_BYTES)
    return DecodeBudget(kept, unit, minimum)


# A gather whose largest rows could make it more than this many times the byte cap is cut
# before it is gathered (NodeStore._gathers); a smaller one is cut after, by its own offsets.
GATHER_PRECUT_FACTOR = 4


def _cut(batch: pa.RecordBatch, max_bytes: int) -> Iterator[pa.RecordBatch]:
    """``batch`` in zero-copy slices of at most ``max_bytes`` of variable-size values (or one row)."""
    terms = [
        t
        for j, field in enumerate(batch.schema)
        if row_bytes.varies(field.type)
        for t in row_bytes.terms(batch.column(j))
    ]
    n = batch.num_rows
    if row_bytes.span_bytes(terms, 0, n) <= max_bytes:
        yield batch
        return
    for start, stop in _runs(row_bytes.prefix_bytes(terms, 0, n), max_bytes):
        yield batch.slice(start, stop - start)


def _runs(prefix: np.ndarray, max_bytes: int) -> Iterator[tuple[int, int]]:
    """Greedy runs ``[start, stop)`` of rows holding at most ``max_bytes`` each (or one row), from
    ``prefix``: the bytes of the first ``i`` rows, for i in 0..n."""
    pos, n = 0, len(prefix) - 1
    while pos < n:
        stop = max(pos + 1, int(np.searchsorted(prefix, int(prefix[pos]) + max_bytes, side="right")) - 1)
        yield pos, stop
        pos = stop


def _length_bounds(columns: Iterator[pa.Array]) -> tuple[int, int] | None:
    """The fewest and most values of the lists in ``columns`` (null lists aside); None: no list."""
    return _bounds(pc.list_value_length(col) for col in columns)


def _list_depth(t: pa.DataType) -> int:
    """How many variable-length list levels ``t`` nests, outermost first (list<list<int>>: 2)."""
    depth = 0
    while pa.types.is_list(t) or pa.types.is_large_list(t):
        depth, t = depth + 1, t.value_type
    return depth


def _inner_length_bounds(columns: Iterator[tuple[pa.Array, np.ndarray | None]], depth: int) -> list[list[int] | None]:
    """Per list level inside the outermost (list<list<int>>: the inner lists), the fewest and most
    values a list there holds, over ``columns``: (a list column's chunk, the sorted positions of
    its rows to count, None for all). None for a level that holds no list.

    From the lists' offsets alone, never their values: flatten() or take() copied the values of
    every row counted (a filter's count over 2 GiB of lists of lists took 7 s and 1.5 GiB)."""
    levels: list[list[int] | None] = [None] * (depth - 1)
    for col, rows in columns:
        lists = col
        selected = np.ones(len(col), dtype=bool) if rows is None else np.zeros(len(col), dtype=bool)
        if rows is not None:
            selected[rows] = True
        for level in range(depth - 1):
            if lists.null_count:
                selected &= ~lists.is_null().to_numpy(zero_copy_only=False)
            # ``offsets`` follow a slice; ``values`` is the whole child they point into.
            offsets, child = lists.offsets.to_numpy(), lists.values
            starts, stops = offsets[:-1][selected], offsets[1:][selected]
            # The child's lists inside a selected row: +1 where a row's range starts, -1 where it ends.
            edges = np.bincount(starts, minlength=len(child) + 1) - np.bincount(stops, minlength=len(child) + 1)
            selected = np.cumsum(edges[:-1]) > 0
            if child.null_count:
                selected &= ~child.is_null().to_numpy(zero_copy_only=False)
            lengths = np.diff(child.offsets.to_numpy())[selected]
            if len(lengths):
                levels[level] = widen(levels[level], int(lengths.min()), int(lengths.max()))
            lists = child
    return levels


def _bounds(arrays: Iterator[pa.Array]) -> tuple[int, int] | None:
    """The least and the most value over ``arrays`` (nulls aside); None where there is none."""
    low = high = None
    for values in arrays:
        bounds = pc.min_max(values)
        lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
        if lo is not None:
            low, high = (lo, hi) if low is None else (min(low, lo), max(high, hi))
    return None if low is None else (low, high)


class NodeStore:
    """The loaded rows of one data node, immutable once built."""

    def __init__(self, schema: pa.Schema, batches: list[pa.RecordBatch]):
        self.schema = schema
        self.batches = [b for b in batches if b.num_rows]
        sizes = [b.num_rows for b in self.batches]
        self.offsets = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64))).astype(np.int64)
        self.num_rows = int(self.offsets[-1])
        self.column_bytes = {name: sum(b.column(i).nbytes for b in self.batches) for i, name in enumerate(schema.names)}
        # Per column (null lists, for list columns): readers that cannot take nulls refuse them
        # before their first batch rather than at the batch that holds one (head: FlightInfo).
        self.null_counts = {
            name: sum(b.column(i).null_count for b in self.batches) for i, name in enumerate(schema.names)
        }
        # Per variable-length list column, the fewest and the most values a row's list holds:
        # readers that stack lists into tensors refuse one whose rows differ before their first
        # batch (head: FlightInfo), rather than change a tensor's width half way through.
        self.list_lengths = {
            name: bounds
            for i, (name, t) in enumerate(zip(schema.names, schema.types, strict=True))
            if (pa.types.is_list(t) or pa.types.is_large_list(t))
            and (bounds := _length_bounds(b.column(i) for b in self.batches)) is not None
        }
        # The same per level inside lists of lists: a tensor needs every inner list alike too, and
        # lists of 2 inner lists of 2 values, then of 1, failed only at the rows that change.
        self.inner_list_lengths = {
            name: _inner_length_bounds(((b.column(i), None) for b in self.batches), depth)
            for i, (name, t) in enumerate(zip(schema.names, schema.types, strict=True))
            if (depth := _list_depth(t)) > 1
        }
        self.nbytes = sum(self.column_bytes.values())
        # Per column with strings or lists: the offsets an in-order stream rebases (offsets.py),
        # which the stream holds a window of while it is sent (the serving memory guard).
        self.rebased_bytes = {
            name: sum(rebased_nbytes(b.column(i)) for b in self.batches)
            for i, (name, t) in enumerate(zip(schema.names, schema.types, strict=True))
            if has_offsets(t)
        }
        # (stored batch, variable-size columns) -> their row_bytes terms, all their values' bytes
        # and the largest row's in it (_chunk_offsets: where served batches are cut by bytes).
        self._offsets: dict[tuple[int, tuple[int, ...]], tuple[list[row_bytes.Term], int, int]] = {}

    def figures_of(self, rows: np.ndarray) -> dict[str, dict]:
        """``null_counts`` and ``list_lengths`` as above, of the sorted row indices ``rows`` (a
        filter's matches) alone: a filter may keep some, all or none of the nulls, and lists of
        some lengths only. Columns without nulls in the node's rows are left out (none in any
        subset); every list column is measured, since lists of one length here and another on
        the next node are ragged too."""
        nulls = [name for name, n in self.null_counts.items() if n]
        edges = np.searchsorted(rows, self.offsets)
        parts = [  # each batch holding matches, with their positions in it
            (batch, rows[edges[b] : edges[b + 1]] - self.offsets[b])
            for b, batch in enumerate(self.batches)
            if edges[b + 1] > edges[b]
        ]
        null_counts = {
            name: sum(
                int(np.count_nonzero(batch.column(name).is_null().to_numpy(zero_copy_only=False)[local]))
                for batch, local in parts
            )
            for name in nulls
        }
        lengths = {
            name: _bounds(pc.list_value_length(batch.column(name)).take(indices(local)) for batch, local in parts)
            for name in self.list_lengths
        }
        inner = {
            name: _inner_length_bounds(((batch.column(name), local) for batch, local in parts), len(levels) + 1)
            for name, levels in self.inner_list_lengths.items()
        }
        return {
            "null_counts": {name: n for name, n in null_counts.items() if n},
            "list_lengths": {name: list(bounds) for name, bounds in lengths.items() if bounds is not None},
            **({"inner_list_lengths": inner} if inner else {}),  # tables with lists of lists only
        }

    @classmethod
    def load(
        cls,
        table,
        tasks: dict,
        schema: pa.Schema,
        pieces: list[Piece],
        threads: int,
        progress: LoadProgress | None = None,
        expansions: dict[int, float] | None = None,
    ) -> NodeStore:
        """Read every piece in parallel (pyarrow releases the GIL), keeping piece order.
        ``expansions``: the head's measured column expansions, for the same estimates as its plan."""
        progress = progress or LoadProgress()
        budget = decode_budget(table, tasks, schema, pieces, expansions)
        if budget is not None:
            progress.expected_estimate = sum(budget.kept)

        def read(index: int) -> list[pa.RecordBatch]:
            piece = pieces[index]
            with progress.reading(piece.path) as token, budget_for(index) as group_bytes:
                batches = read_piece(
                    table,
                    tasks[piece.path],
                    piece,
                    lambda rows, nbytes: progress.batch(rows, nbytes, token, settled=False),
                    schema,
                    group_bytes,
                    lambda rows, nbytes: progress.settle(rows, nbytes, rows * estimate_per_row(index)),
                    expansions,
                )
            # A data node's glibc keeps what is freed (its raised trim threshold, for serving):
            # its start-up's garbage (imports, table open, planning: ~4 MiB) and what each read
            # freed sat under the rows through the load's last read, its resident peak (1.37x
            # the rows above an idle node on the benchmark's 2-node cluster, 1.30x trimmed here).
            trim_glibc_malloc()
            progress.read()
            return batches

        def estimate_per_row(index: int) -> float:
            return budget.kept[index] / max(1, pieces[index].stop - pieces[index].start) if budget else 0.0

        def budget_for(index: int):
            return contextlib.nullcontext(None) if budget is None else budget.reading(index)

        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="load") as pool:
            results = list(pool.map(read, range(len(pieces))))
        batches = deque(b for part in results for b in part)  # cast to ``schema`` by read_piece
        del results
        store = cls(schema, compact(batches, schema, on_column=progress.batch))
        # Give cached decode buffers back to the OS (immediate under the data node's jemalloc), and
        # glibc's free memory: the read batches' C++ objects, about 1.25 KB a column array (1,000
        # small files of 200 columns left 224 MiB resident beside 15 MiB of rows until a trim).
        pa.default_memory_pool().release_unused()
        trim_glibc_malloc()
        return store

    def project(self, columns: tuple[str, ...] | None) -> pa.Schema:
        if columns is None:
            return self.schema
        names = set(self.schema.names)  # a new list on each access: asked per column, wide tables took seconds
        unknown = [c for c in columns if c not in names]
        if unknown:
            raise BadRequestError(f"unknown column(s) {unknown}; the table has {self.schema.names}")
        return pa.schema([self.schema.field(c) for c in columns])

    def batch_rows(
        self, requested: int, columns: tuple[str, ...] | None, max_bytes: int = SERVED_BATCH_MAX_BYTES
    ) -> int:
        """Rows per served batch: ``requested``, or fewer where the columns' average row would
        make a batch larger than ``max_bytes`` (at least one row)."""
        row_bytes = self.row_bytes(columns)
        return max(1, min(requested, int(max_bytes // row_bytes) if row_bytes else requested))

    def row_bytes(self, columns: tuple[str, ...] | None) -> float:
        """The average bytes of a row's ``columns`` (all when None)."""
        names = self.schema.names if columns is None else columns
        return sum(self.column_bytes[name] for name in names) / max(1, self.num_rows)

    def rebased_bytes_of(self, rows: int, columns: tuple[str, ...] | None) -> int:
        """The offsets an in-order stream of ``rows`` rows of ``columns`` rebases, on average."""
        names = self.schema.names if columns is None else columns
        return int(rows * sum(self.rebased_bytes.get(name, 0) for name in names) / max(1, self.num_rows))

    def served_bytes_bound(
        self, rows: int, columns: tuple[str, ...] | None, batch_rows: int | None = None, filtered: bool = False
    ) -> int:
        """What ``rows`` gathered rows of ``columns`` hold at most (with ``batch_rows``: one
        served batch of that many), for the serving memory guard.

        The average row would do for rows of one size. A ``filtered`` read can keep only the
        largest rows: a filter on 200 images among 20,000 short rows was counted at ~130 KiB a
        stream and held 12.5 MiB. So there the variable values count at the largest row, up to
        all of them (or, in one batch, up to what is gathered before the byte cut: _gathers). A
        shuffled read without a filter takes rows as they come, about the average, so it counts
        the average and one largest row: counted at the worst case too, one 200 KB document in
        a text table made every stream count 4 MiB a batch (5x), a burst of readers refused
        early."""
        average = rows * self.row_bytes(columns)
        variable = self._variable_columns(columns)
        if not variable or not rows or not self.num_rows:
            return int(average)
        _, total, largest = self._variable_sizes(variable)
        if not filtered:
            return int(average + min(largest, total))
        worst = min(rows * largest, total)
        if batch_rows is not None and worst > GATHER_PRECUT_FACTOR * SERVED_BATCH_MAX_BYTES:
            worst = max(SERVED_BATCH_MAX_BYTES, largest)  # cut before it is gathered (_gathers)
        # The average row already holds the variable values at their average: add what is worse.
        return int(average + max(0.0, worst - rows * total / self.num_rows))

    def _variable_columns(self, columns: tuple[str, ...] | None) -> tuple[int, ...]:
        """The indices of the columns among ``columns`` (all when None) whose rows can differ in
        size: strings, binaries, lists and maps, and structs or fixed-size lists holding them."""
        names = self.schema.names if columns is None else columns
        indices = [self.schema.get_field_index(name) for name in names]
        return tuple(i for i in indices if row_bytes.varies(self.schema.field(i).type))

    def _select(self, batch: pa.RecordBatch, columns: tuple[str, ...] | None) -> pa.RecordBatch:
        return batch if columns is None else batch.select(list(columns))

    def slices(
        self, lo: int, hi: int, batch_rows: int, columns, max_bytes: int = SERVED_BATCH_MAX_BYTES
    ) -> Iterator[pa.RecordBatch]:
        """Rows ``[lo, hi)`` as zero-copy slices of at most ``batch_rows`` rows, each holding at
        most ``max_bytes`` of variable-size values (strings, binaries, lists, at any depth)
        together (or one row).

        ``batch_rows`` comes from the average row: where large values sit together (a file of
        images in a table of short rows) one slice of that many rows held 200 MiB, and Flight
        refuses a batch over 2 GiB. Their offsets say where to cut, without reading the values."""
        variable = self._variable_columns(columns)
        pos = lo
        while pos < hi:
            i = int(np.searchsorted(self.offsets, pos, side="right")) - 1
            start = pos - int(self.offsets[i])
            n = min(hi - pos, self.batches[i].num_rows - start, batch_rows)
            if variable:
                n = self._within_bytes(i, variable, start, n, max_bytes)
            yield self._select(self.batches[i].slice(start, n), columns)
            pos += n

    def _chunk_offsets(self, i: int, variable: tuple[int, ...]) -> tuple[list[row_bytes.Term], int, int]:
        """Stored batch ``i``'s variable bytes in the ``variable`` columns, as row_bytes terms
        (views of their offsets, no copy), all of them together, and the most one row holds:
        where to cut a served batch by bytes, without reading the values."""
        key = (i, variable)
        found = self._offsets.get(key)
        if found is None:
            if len(self._offsets) >= MAX_KEPT_OFFSETS:  # clients choose the column sets
                self._offsets.clear()
            batch = self.batches[i]
            terms = [term for j in variable for term in row_bytes.terms(batch.column(j))]
            total = row_bytes.span_bytes(terms, 0, batch.num_rows)
            found = self._offsets[key] = (terms, total, row_bytes.largest_row_bytes(terms, batch.num_rows))
        return found

    def _variable_sizes(self, variable: tuple[int, ...]) -> tuple[list[list[row_bytes.Term]], int, int]:
        """Over every stored batch: each one's terms (_chunk_offsets), all their values' bytes, and
        the most one row holds."""
        chunks = [self._chunk_offsets(i, variable) for i in range(len(self.batches))]
        return [c[0] for c in chunks], sum(c[1] for c in chunks), max(c[2] for c in chunks)

    def _within_bytes(self, i: int, variable: tuple[int, ...], start: int, n: int, max_bytes: int) -> int:
        """How many of the ``n`` rows from ``start`` of stored batch ``i`` hold at most
        ``max_bytes`` of the ``variable`` columns' values together (at least one row)."""
        terms, chunk_bytes, _ = self._chunk_offsets(i, variable)
        if chunk_bytes <= max_bytes or row_bytes.span_bytes(terms, start, start + n) <= max_bytes:
            return n
        together = row_bytes.prefix_bytes(terms, start, start + n)
        return max(1, int(np.searchsorted(together, max_bytes, side="right")) - 1)

    def _gathers(
        self, rows: np.ndarray, columns, variable: tuple[int, ...], max_bytes: int = SERVED_BATCH_MAX_BYTES
    ) -> Iterator[pa.RecordBatch]:
        """``take(rows)``, cut where the values of the ``variable`` columns gathered pass
        ``max_bytes`` together (each batch at least one row), as in-order slices are.

        ``rows`` are as many as the table's average row allows in a batch; a filter that keeps
        the large values alone (the images of a table of short rows) gathered 10 MiB in a batch
        sized for 4 MiB, beyond what the node's memory guard counted for the stream (and past
        Flight's 2 GiB, at larger values). Where the largest rows could make the gather more
        than GATHER_PRECUT_FACTOR times the cap, rows are sized one by one and cut before they
        are gathered; where less (text whose longest strings are a few times the average row),
        the gathered batch is cut by its own offsets, in zero-copy slices: sizing each row
        first had made shuffled reads of such tables 10-15% slower."""
        if variable and len(rows) > 1:
            chunk_terms, total, largest = self._variable_sizes(variable)
            bound = min(total, largest * len(rows))
            if bound > GATHER_PRECUT_FACTOR * max_bytes:
                prefix = np.concatenate(([0], np.cumsum(self._value_bytes(rows, chunk_terms))))
                for start, stop in _runs(prefix, max_bytes):
                    yield self.take(rows[start:stop], columns)
                return
            if bound > max_bytes:
                yield from _cut(self.take(rows, columns), max_bytes)
                return
        yield self.take(rows, columns)

    def _value_bytes(self, rows: np.ndarray, chunk_terms: list[list[row_bytes.Term]]) -> np.ndarray:
        """Each row's variable bytes, from ``chunk_terms[chunk]`` (_chunk_offsets)."""
        if len(self.batches) == 1:
            return row_bytes.rows_bytes(chunk_terms[0], rows)
        sizes = np.zeros(len(rows), dtype=np.int64)
        which = np.searchsorted(self.offsets, rows, side="right") - 1
        for i in np.unique(which):
            mask = which == i
            sizes[mask] = row_bytes.rows_bytes(chunk_terms[i], rows[mask] - self.offsets[i])
        return sizes

    def take(self, rows: np.ndarray, columns) -> pa.RecordBatch:
        """Rows at the given local positions, in that order: one gather per stored chunk touched."""
        if len(rows) == 0:
            return pa.RecordBatch.from_pylist([], schema=self.project(columns))
        # Gather outputs live for one batch each: a pool that keeps its pages (allocator.py).
        pool = serve_pool()
        if len(self.batches) == 1:
            # One bounds check here, not one per column inside Arrow's take (a third of its time,
            # 11% of a data node's CPU in a shuffled epoch); still an error, never a stray read.
            # Checked on the very array Arrow reads (a masked array's min ignored a hidden 10**12).
            checked = np.ascontiguousarray(rows, dtype=np.int64)
            if int(checked.min()) < 0 or int(checked.max()) >= self.num_rows:
                raise IndexError(f"row index out of bounds for a data node of {self.num_rows} rows")
            return pc.take(
                self._select(self.batches[0], columns), indices(checked), boundscheck=False, memory_pool=pool
            )
        which = np.searchsorted(self.offsets, rows, side="right") - 1
        # A stable sort on small chunk numbers is a radix sort: O(n), order kept inside a chunk.
        order = np.argsort(which.astype(np.int32), kind="stable")
        counts = np.bincount(which, minlength=len(self.batches))
        parts, pos = [], 0
        for i in np.flatnonzero(counts):
            sel = order[pos : pos + counts[i]]
            pos += counts[i]
            local = indices(rows[sel] - self.offsets[i])
            parts.append(pc.take(self._select(self.batches[i], columns), local, memory_pool=pool))
        if len(parts) == 1:
            return parts[0]
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        return pc.take(pa.concat_batches(parts, memory_pool=pool), indices(inverse), memory_pool=pool)

    def iter_rows(self, parts, batch_rows: int, columns) -> Iterator[pa.RecordBatch]:
        """Serve ``sharding.node_rows`` output: ranges as slices, index arrays as gathers of
        ``batch_rows`` rows (but the last), however the arrays are cut; fewer where their
        variable-size values would pass SERVED_BATCH_MAX_BYTES (slices and gathers alike)."""
        variable = self._variable_columns(columns)
        pending: list[np.ndarray] = []
        held = 0
        for part in parts:
            if isinstance(part, range):
                if held:
                    yield from self._gathers(np.concatenate(pending), columns, variable)
                    pending, held = [], 0
                yield from self.slices(part.start, part.stop, batch_rows, columns)
                continue
            pending.append(part)
            held += len(part)
            if held < batch_rows:
                continue
            rows = np.concatenate(pending) if len(pending) > 1 else pending[0]
            full = held // batch_rows * batch_rows
            for start in range(0, full, batch_rows):
                yield from self._gathers(rows[start : start + batch_rows], columns, variable)
            # A copy of what is left, not a view that would keep all of ``rows`` alive while the
            # next part's order is computed.
            pending, held = ([rows[full:].copy()], held - full) if held > full else ([], 0)
        if held:
            yield from self._gathers(np.concatenate(pending), columns, variable)
