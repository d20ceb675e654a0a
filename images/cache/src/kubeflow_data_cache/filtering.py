"""Row filters: a SQL predicate evaluated with DataFusion on a data node's rows."""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from concurrent.futures import Future

import numpy as np
import pyarrow as pa

from kubeflow_data_cache.constants import FILTER_CACHE_MIN_BYTES, FILTER_CACHE_SHARE, INTERNAL_COLUMN_PREFIX
from kubeflow_data_cache.errors import BadRequestError, server_message, shown
from kubeflow_data_cache.protocol import check_filter
from kubeflow_data_cache.store import NodeStore, indices

ROW_COLUMN = f"{INTERNAL_COLUMN_PREFIX}row"
# Distinct filters whose matches a node keeps; a training job uses one or two.
CACHED_FILTERS = 8
# A filter's plan, optimized, may hold only these: a subquery (IN (SELECT ...), EXISTS) turns into
# joins, which could cost far more than one pass over the rows.
PLAIN_FILTER_NODES = {"Projection", "Filter", "TableScan", "EmptyRelation"}  # the last: a filter folded to false
# Functions whose value changes from call to call: the head and the nodes would count different
# rows for the same filter, and shards would overlap or miss rows.
VOLATILE_CALL = re.compile(r"\b(random|uuid|now|current_time|current_date|current_timestamp)\(", re.IGNORECASE)
# Functions whose output can be far larger than their input: repeat(text, 100000000) took a node
# to 22 GB here. DataFusion's memory pool does not limit scalar functions, so they are refused.
# Nested, replace and regexp_replace of an empty pattern, and encode, multiply a value's length
# at each level: regexp_replace(x, '', 'xxxx', 'g') seven deep, a 247-character filter, took
# 100 rows from 70 to 269 MiB.
GROWING_CALL = re.compile(
    r"\b(repeat|lpad|rpad|array_repeat|list_repeat|array_resize|list_resize|range|generate_series"
    r"|replace|regexp_replace|encode)\(",
    re.IGNORECASE,
)
# String literals in an expression's canonical form, left out of those checks: 'random()' is data.
STRING_LITERAL = re.compile(r'(?:Large)?Utf8(?:View)?\("(?:[^"\\]|\\.)*"\)')


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


def matching_rows(store: NodeStore, predicate: str) -> np.ndarray:
    """Local row numbers (ascending) of the rows for which ``predicate`` is true."""
    import datafusion

    check_filter(predicate)  # also for a count sent to a node directly, not through the head

    batches = []
    for batch, start in zip(store.batches, store.offsets[:-1], strict=True):
        rows = indices(np.arange(start, start + batch.num_rows, dtype=np.int64))  # no numpy.ma: store.indices
        batches.append(batch.append_column(ROW_COLUMN, rows))
    if not batches:
        # No rows to match, but the predicate is checked all the same: a filter refused only once
        # the table has rows would break a job that was accepted while it was empty.
        schema = store.schema.append(pa.field(ROW_COLUMN, pa.int64()))
        batches.append(pa.RecordBatch.from_pylist([], schema=schema))
    ctx = datafusion.SessionContext()
    ctx.register_record_batches("data", [batches])
    table = ctx.table("data")
    try:
        # Parsed as one expression over the table's own columns, never pasted into SQL text: a
        # predicate like "x < 5) UNION ALL SELECT 0 --" cannot add rows, and the row-number
        # column it may not see is not there to name.
        columns = table.select(*(_column(name) for name in store.schema.names))
        condition = columns.parse_sql_expr(predicate)
        calls = STRING_LITERAL.sub("''", condition.canonical_name())
        if VOLATILE_CALL.search(calls):
            raise BadRequestError(
                f"invalid filter {shown(predicate)}: it calls a function whose value changes between calls, so "
                'ranks would see overlapping rows; to sample, use a column, e.g. "id % 10 = 0"'
            )
        if grows := GROWING_CALL.search(calls):
            raise BadRequestError(
                f"invalid filter {shown(predicate)}: {grows.group(1)}() can make values far larger than the rows "
                "(and the data node's memory); a filter compares a row's own values"
            )
        selected = table.filter(condition).select(_column(ROW_COLUMN))
        if not set(_plan_nodes(selected.optimized_logical_plan())) <= PLAIN_FILTER_NODES:
            raise BadRequestError(
                f"invalid filter {shown(predicate)}: subqueries (IN (SELECT ...), EXISTS) are not allowed; "
                "a filter is a predicate over one row's columns"
            )
        result = selected.to_arrow_table()
    except BadRequestError:
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    # DataFusion raises one exception type for parse, plan and type errors; a panic inside it
    # (an overflow) comes as pyo3's PanicException, a BaseException.
    except BaseException as err:
        raise BadRequestError(
            f"invalid filter {shown(predicate)}: {_reason(err)}. A filter is one SQL predicate over the table's "
            f'columns {store.schema.names} (double-quote names with capitals or spaces: "Score" > 3), '
            'e.g. "label = 3 AND feature_a > 0.5"'
        ) from None
    rows = result.column(0).to_numpy()
    return np.sort(rows)


class FilterCache:
    """Matches per predicate, computed once per node; least recently used evicted beyond
    CACHED_FILTERS predicates or a byte budget (a share of the node's rows, since the memory
    check does not count these). The newest always stays: its readers are streaming it."""

    def __init__(self, store: NodeStore):
        self.store = store
        self.budget = max(FILTER_CACHE_MIN_BYTES, int(store.nbytes * FILTER_CACHE_SHARE))
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        # Predicates being matched now: a second request for one waits for the first's result
        # (every reader of a new filter asks at once; the head retries a slow count).
        self._pending: dict[str, Future] = {}

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(rows.nbytes for rows in self._cache.values())

    def rows(self, predicate: str) -> np.ndarray:
        with self._lock:
            if predicate in self._cache:
                self._cache.move_to_end(predicate)
                return self._cache[predicate]
            pending = self._pending.get(predicate)
            computing = pending is None
            if computing:
                pending = self._pending[predicate] = Future()
        if not computing:
            return pending.result()
        try:
            rows = matching_rows(self.store, predicate)
        except BaseException as err:
            with self._lock:
                del self._pending[predicate]
            pending.set_exception(err)
            raise
        with self._lock:
            del self._pending[predicate]
            self._cache[predicate] = rows
            held = sum(r.nbytes for r in self._cache.values())
            while len(self._cache) > 1 and (len(self._cache) > CACHED_FILTERS or held > self.budget):
                held -= self._cache.popitem(last=False)[1].nbytes
        pending.set_result(rows)
        return rows
