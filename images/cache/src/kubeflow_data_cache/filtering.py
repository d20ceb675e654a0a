"""Row filters: a SQL predicate evaluated with DataFusion on a data node's rows."""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import pyarrow as pa

from kubeflow_data_cache.constants import INTERNAL_COLUMN_PREFIX
from kubeflow_data_cache.errors import BadRequestError, first_line
from kubeflow_data_cache.store import NodeStore

ROW_COLUMN = f"{INTERNAL_COLUMN_PREFIX}row"
# Distinct filters whose matches a node keeps; a training job uses one or two.
CACHED_FILTERS = 8


def matching_rows(store: NodeStore, predicate: str) -> np.ndarray:
    """Local row numbers (ascending) of the rows for which ``predicate`` is true."""
    import datafusion

    if not store.num_rows:
        return np.empty(0, dtype=np.int64)
    batches = []
    for batch, start in zip(store.batches, store.offsets[:-1], strict=True):
        rows = pa.array(np.arange(start, start + batch.num_rows, dtype=np.int64))
        batches.append(batch.append_column(ROW_COLUMN, rows))
    ctx = datafusion.SessionContext()
    ctx.register_record_batches("data", [batches])
    table = ctx.table("data")
    try:
        # Parsed as one expression over the table's own columns, never pasted into SQL text: a
        # predicate like "x < 5) UNION ALL SELECT 0 --" cannot add rows, and the row-number
        # column it may not see is not there to name.
        columns = table.select(*store.schema.names)
        condition = columns.parse_sql_expr(predicate)
        result = table.filter(condition).select(ROW_COLUMN).to_arrow_table()
    except Exception as err:  # DataFusion raises one exception type for parse, plan and type errors
        message = first_line(err)
        raise BadRequestError(
            f"invalid filter {predicate!r}: {message}. A filter is one SQL predicate over the table's "
            f'columns {store.schema.names}, e.g. "label = 3 AND feature_a > 0.5"'
        ) from None
    rows = result.column(0).to_numpy()
    return np.sort(rows)


class FilterCache:
    """Matches per predicate, computed once per node (least recently used evicted)."""

    def __init__(self, store: NodeStore):
        self.store = store
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()

    def rows(self, predicate: str) -> np.ndarray:
        with self._lock:
            if predicate in self._cache:
                self._cache.move_to_end(predicate)
                return self._cache[predicate]
        rows = matching_rows(self.store, predicate)
        with self._lock:
            self._cache[predicate] = rows
            while len(self._cache) > CACHED_FILTERS:
                self._cache.popitem(last=False)
        return rows
