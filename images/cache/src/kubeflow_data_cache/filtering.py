"""Row filters: a SQL predicate evaluated with DataFusion on a data node's rows."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from concurrent.futures import Future

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kubeflow_data_cache.constants import FILTER_CACHE_MIN_BYTES, FILTER_CACHE_SHARE, INTERNAL_COLUMN_PREFIX
from kubeflow_data_cache.errors import BadRequestError, server_message, shown
from kubeflow_data_cache.filter_calls import check_calls
from kubeflow_data_cache.filter_decimals import check_decimal_comparisons, may_compute_decimals
from kubeflow_data_cache.filter_overflow import overflow_checks
from kubeflow_data_cache.filter_overflow import refusal as overflow_refusal
from kubeflow_data_cache.protocol import check_filter
from kubeflow_data_cache.store import NodeStore, indices

ROW_COLUMN = f"{INTERNAL_COLUMN_PREFIX}row"
KEEP_COLUMN = f"{INTERNAL_COLUMN_PREFIX}keep"
OVERFLOW_COLUMN = f"{INTERNAL_COLUMN_PREFIX}overflow"
# Distinct filters whose matches a node keeps; a training job uses one or two.
CACHED_FILTERS = 8
# A filter's plan, optimized, may hold only these: a subquery (IN (SELECT ...), EXISTS) turns into
# joins, which could cost far more than one pass over the rows.
PLAIN_FILTER_NODES = {"Projection", "Filter", "TableScan", "EmptyRelation"}  # the last: a filter folded to false
# The rows are handed to DataFusion in slices of at most this many rows, or bytes: a filter's
# intermediate values (an `a || b || ...` chain is up to 129 times a row's value) are per slice,
# and the time limit below is checked between slices.
FILTER_SLICE_ROWS = 1 << 16
FILTER_SLICE_BYTES = 4 << 20
# A filter still evaluating after this long is refused (BadRequestError): one a node's rows take
# longer than that to match is too costly to ask of every node, each time the filter is new to it.
FILTER_TIMEOUT_SECONDS = 120.0
# Refusals a node remembers, so that readers retrying a filter that ran out of time (the head
# retries a slow count) are answered at once instead of starting it again; one that ran out of
# time (which the node's load at the moment had a part in) for FILTER_TIMEOUT_MEMORY_SECONDS.
REMEMBERED_REFUSALS = 64
FILTER_TIMEOUT_MEMORY_SECONDS = 300.0


def matched_rows(parts: Iterable[range | np.ndarray], matches: np.ndarray) -> Iterator[np.ndarray]:
    """``sharding.node_rows`` parts placed among a filter's ``matches`` (positions among the
    matching rows) as local row numbers: a range as a view of the matches, not a copy. An
    in-order stream's one range covers the node's whole part of the shard, and copying it held 16
    bytes per matching row (150 MiB for 10M rows) for the stream's life, uncounted."""
    for part in parts:
        yield matches[part.start : part.stop : part.step] if isinstance(part, range) else matches[part]


class FilterTooCostlyError(BadRequestError):
    """A filter still matching after its time limit: refused, and tried again only after a while."""


def _column(name: str):
    """A column by its exact name: SQL identifiers fold to lower case unless quoted."""
    import datafusion

    return datafusion.col('"' + name.replace('"', '""') + '"')


def _plan_nodes(plan) -> list[str]:
    return [type(plan.to_variant()).__name__] + [kind for child in plan.inputs() for kind in _plan_nodes(child)]


def _reason(err: BaseException) -> str:
    """What DataFusion says is wrong, in one line. Its message starts with the step that failed
    ("Optimizer rule 'simplify_expressions' failed") and ends, after "caused by", with the
    cause the user can act on ("Cannot cast string 'abc' to value of Int64 type")."""
    lines = [line.strip() for line in server_message(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    causes = [i for i, line in enumerate(lines) if line.lower() == "caused by"]
    reason = lines[causes[-1] + 1] if causes and causes[-1] + 1 < len(lines) else lines[0]
    return reason.rstrip(".")  # the caller ends the sentence


# DataFusion's causes that have a form that works, and what it is.
HINTS = (
    (
        "divide by zero",
        " (every branch of a CASE and both sides of an AND are evaluated on every row, so a guard does not "
        "help; divide by nullif(<divisor>, 0), which makes the row's value NULL)",
    ),
    # MIN / -1, abs(MIN) and the like: DataFusion's own error, which names no way out.
    (
        "overflow",
        " (arithmetic past its type's range: compute it in a wider type, CAST integer operands AS "
        "DECIMAL(38, 0), or any operands AS DOUBLE)",
    ),
    ("time64", " (compare a time column with a string: t < '01:00:00')"),
    ("fixedsizebinary(16)", " (a uuid column compares with its 16 bytes in hex: u = X'<32 hex digits>')"),
)


def _hint(reason: str) -> str:
    """How to write what DataFusion refused, where its cause has a known fix ('' otherwise)."""
    lowered = reason.lower()
    return next((hint for cause, hint in HINTS if cause in lowered), "")


def _slices(store: NodeStore) -> list[pa.RecordBatch]:
    """The node's rows as zero-copy slices (FILTER_SLICE_ROWS, FILTER_SLICE_BYTES), each with
    its local row numbers in ROW_COLUMN."""
    rows = store.num_rows
    row_bytes = max(1, store.nbytes // rows) if rows else 1
    size = max(1, min(FILTER_SLICE_ROWS, FILTER_SLICE_BYTES // row_bytes))
    slices = []
    structs = [i for i, field in enumerate(store.schema) if _holds_struct(field.type)]
    for batch, offset in zip(store.batches, store.offsets[:-1], strict=True):
        for start in range(0, batch.num_rows, size):
            piece = batch.slice(start, size)
            for i in structs:
                piece = piece.set_column(i, piece.schema.field(i), _struct_offset_in_children(piece.column(i)))
            first = int(offset) + start
            numbers = indices(np.arange(first, first + piece.num_rows, dtype=np.int64))  # no numpy.ma: store.indices
            slices.append(piece.append_column(ROW_COLUMN, numbers))
    return slices or [_empty_slice(store)]


def _empty_slice(store: NodeStore) -> pa.RecordBatch:
    """No rows, the slices' schema: what a filter is checked and planned against. So a node
    without rows checks it all the same: a filter refused only once the table has rows would
    break a job that was accepted while it was empty."""
    return pa.RecordBatch.from_pylist([], schema=store.schema.append(pa.field(ROW_COLUMN, pa.int64())))


def _table_of(slices: list[pa.RecordBatch]):
    import datafusion

    ctx = datafusion.SessionContext()
    ctx.register_record_batches("data", [slices])
    return ctx.table("data")


def _holds_struct(t: pa.DataType) -> bool:
    """A struct (with fields) at any depth inside ``t``: in a struct, a list of any kind or a
    map's items, what _struct_offset_in_children rebuilds."""
    if pa.types.is_struct(t):
        return t.num_fields > 0
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _holds_struct(t.value_type)
    if pa.types.is_map(t):
        return _holds_struct(t.item_type)
    return False


def _struct_offset_in_children(column: pa.Array) -> pa.Array:
    """The same values, rebuilt so that DataFusion reads them as Arrow means them:

    - each struct with its nulls passed down to its fields (``flatten``): under a null struct a
      field holds a placeholder (a Parquet reader's 0, or a value of a required field), which
      DataFusion reads as the field's value. Top-level structs only, this left a struct inside a
      list or map matching `l[1]['c'] = 0` where the struct was null;
    - with offset 0 at every struct and fixed-size list level (the slice's offset moved into the
      leaf columns, and a list's offsets rebased onto the values it spans). DataFusion (arrow-rs
      59) panics on a sliced struct whose child is a struct, or a sliced fixed-size list of
      structs ("assertion failed: end <= self.len()"): every filter on such a table failed
      past its first slice.

    Zero-copy for the values; only validity bitmaps, and a list's offsets, are new."""
    t = column.type
    if not _holds_struct(t):
        return column
    mask = column.is_null() if column.null_count else None
    if pa.types.is_struct(t):
        children = [_struct_offset_in_children(child) for child in column.flatten()]
        return pa.StructArray.from_arrays(children, fields=list(t), mask=mask)
    if pa.types.is_fixed_size_list(t):
        size = t.list_size
        values = column.values.slice(column.offset * size, len(column) * size)
        return pa.FixedSizeListArray.from_arrays(_struct_offset_in_children(values), type=t, mask=mask)
    offsets = column.offsets  # this slice's, into values that may span more rows
    first = offsets[0].as_py()
    spanned = offsets[-1].as_py() - first
    rebased = pc.subtract(offsets, pa.scalar(first, offsets.type)) if first else offsets
    if pa.types.is_map(t):
        keys = column.keys.slice(first, spanned)
        items = _struct_offset_in_children(column.items.slice(first, spanned))
        return pa.MapArray.from_arrays(rebased, keys, items, type=t, mask=mask)
    values = _struct_offset_in_children(column.values.slice(first, spanned))
    return type(column).from_arrays(rebased, values, type=t, mask=mask)


def matching_rows(
    store: NodeStore,
    predicate: str,
    timeout: float = FILTER_TIMEOUT_SECONDS,
    executing: contextlib.AbstractContextManager | None = None,
) -> np.ndarray:
    """Local row numbers (ascending) of the rows for which ``predicate`` is true. ``executing``
    is held while the matching runs (FilterCache: one at a time), not while the predicate is
    checked and planned: a mistake in a filter is named at once, whatever else is matched."""
    check_filter(predicate)  # also for a count sent to a node directly, not through the head

    # Checked and planned against the schema alone: the rows are registered only once this
    # filter's turn to match comes. Their slices (and a row-number column, 8 bytes a row) made
    # while waiting took ~6 MiB per waiting filter on a 500K-row node: 64 new filters at once
    # took a node 100 MiB past its memory limit, though only one matched at a time.
    table = _table_of([_empty_slice(store)])
    matched = []
    try:
        # Parsed as one expression over the table's own columns, never pasted into SQL text: a
        # predicate like "x < 5) UNION ALL SELECT 0 --" cannot add rows, and the row-number
        # column it may not see is not there to name.
        columns = table.select(*(_column(name) for name in store.schema.names))
        condition = columns.parse_sql_expr(predicate)
        check_calls(condition, predicate)

        def type_of(expr) -> pa.DataType:
            return columns.select(expr).schema().field(0).type

        if may_compute_decimals(store.schema, predicate):
            check_decimal_comparisons(condition, type_of, predicate)
        overflows = overflow_checks(condition, type_of)
        # Planned as a filter, which checks that the predicate is a boolean and what it becomes.
        selected = table.filter(condition).select(_column(ROW_COLUMN))
        if not set(_plan_nodes(selected.optimized_logical_plan())) <= PLAIN_FILTER_NODES:
            raise BadRequestError(
                f"invalid filter {shown(predicate)}: subqueries (IN (SELECT ...), EXISTS) are not allowed; "
                "a filter is a predicate over one row's columns"
            )
        # Run as a projection of the predicate's value: one output batch per slice, so the time
        # is checked after each (a filter's stream skips slices without a match, so one that
        # matched nothing was never checked). A null value drops its row, as WHERE does.
        # Each integer operation's overflow check rides along, one column each (filter_overflow).
        checked = [check.failed.alias(f"{OVERFLOW_COLUMN}{i}") for i, check in enumerate(overflows)]
        with executing or contextlib.nullcontext():
            started = time.monotonic()  # once its turn comes: waiting is not the filter's cost
            rows_table = _table_of(_slices(store))
            for batch in rows_table.select(
                _column(ROW_COLUMN), condition.alias(KEEP_COLUMN), *checked
            ).execute_stream():
                rows, keep, *failed = batch.to_pyarrow().columns
                for check, column in zip(overflows, failed, strict=True):
                    if pc.any(column).as_py():
                        raise overflow_refusal(predicate, check)
                if not pa.types.is_null(keep.type):  # a predicate that is NULL ("CASE ... THEN NULL END") keeps none
                    matched.append(rows.filter(keep).to_numpy())
                if time.monotonic() - started > timeout:
                    raise FilterTooCostlyError(
                        f"filter {shown(predicate)} is too costly: this data node's {store.num_rows} rows "
                        f"took more than {timeout:.0f} s to match; filter on plain comparisons of columns, or keep a "
                        "column that marks the rows to read"
                    )
    except BadRequestError:
        raise
    except (KeyboardInterrupt, SystemExit, MemoryError):  # the node's state, not the filter's fault
        raise
    # DataFusion raises one exception type for parse, plan and type errors; a panic inside it
    # (an overflow) comes as pyo3's PanicException, a BaseException.
    except BaseException as err:
        reason = _reason(err)
        raise BadRequestError(
            f"invalid filter {shown(predicate)}: {reason}{_hint(reason)}. A filter is one SQL predicate over the table's "
            f'columns {store.schema.names} (double-quote names with capitals or spaces: "Score" > 3), '
            'e.g. "label = 3 AND feature_a > 0.5"'
        ) from None
    rows = np.concatenate(matched) if matched else np.empty(0, dtype=np.int64)
    return np.sort(rows)


class FilterCache:
    """Matches per predicate, computed once per node, with their figures (NodeStore.figures_of:
    nulls and list lengths per column, what a ``count`` answers); least recently used evicted
    beyond CACHED_FILTERS predicates or a byte budget (a share of the node's rows, since the
    memory check does not count these). The newest always stays: its readers are streaming it."""

    def __init__(self, store: NodeStore):
        self.store = store
        self.budget = max(FILTER_CACHE_MIN_BYTES, int(store.nbytes * FILTER_CACHE_SHARE))
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, tuple[np.ndarray, dict]] = OrderedDict()
        # Predicates being matched now: a second request for one waits for the first's result
        # (every reader of a new filter asks at once; the head retries a slow count).
        self._pending: dict[str, Future] = {}
        # Predicates refused, newest last: message and until when (a BadRequestError about the
        # filter, which the same rows always give again: for as long as it is kept).
        self._refused: OrderedDict[str, tuple[str, float]] = OrderedDict()
        # Different predicates are matched one at a time: each match holds DataFusion's working
        # memory and the figures' full-column buffers, and 64 readers asking for 64 new filters
        # at once (a filter per rank) took 2 nodes 115 MiB past their memory limit, while one
        # match at a time uses what DataFusion's threads give a single query anyway.
        self._one_match = threading.Lock()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(rows.nbytes for rows, _ in self._cache.values())

    def rows(self, predicate: str) -> np.ndarray:
        """Local row numbers (ascending) of the rows ``predicate`` keeps."""
        return self.matched(predicate)[0]

    def matched(self, predicate: str) -> tuple[np.ndarray, dict]:
        """The matches and their figures, computed together once: computed per ``count`` call,
        the figures took full-column buffers each time (23 MiB on a 2.5M-row node), and 24 ranks
        asking at once for a new filter took a node 250 MiB past its memory limit."""
        with self._lock:
            if predicate in self._cache:
                self._cache.move_to_end(predicate)
                return self._cache[predicate]
            refused = self._refused.get(predicate)
            if refused is not None and time.monotonic() < refused[1]:
                raise BadRequestError(refused[0])
            pending = self._pending.get(predicate)
            computing = pending is None
            if computing:
                pending = self._pending[predicate] = Future()
        if not computing:
            return pending.result()
        try:
            rows = matching_rows(self.store, predicate, executing=self._one_match)
            with self._one_match:
                matched = (rows, self.store.figures_of(rows))
        except BaseException as err:
            with self._lock:
                del self._pending[predicate]
                if isinstance(err, BadRequestError):
                    lasting = not isinstance(err, FilterTooCostlyError)
                    until = math.inf if lasting else time.monotonic() + FILTER_TIMEOUT_MEMORY_SECONDS
                    self._refused[predicate] = (str(err), until)
                    self._refused.move_to_end(predicate)
                    while len(self._refused) > REMEMBERED_REFUSALS:
                        self._refused.popitem(last=False)
            pending.set_exception(err)
            raise
        with self._lock:
            del self._pending[predicate]
            self._cache[predicate] = matched
            held = sum(r.nbytes for r, _ in self._cache.values())
            while len(self._cache) > 1 and (len(self._cache) > CACHED_FILTERS or held > self.budget):
                held -= self._cache.popitem(last=False)[1][0].nbytes
        pending.set_result(matched)
        return matched
