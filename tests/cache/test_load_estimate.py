"""The head's estimate of a data node's load peak, for files a node reads batch by batch
(parquet_batches): against real loads, measured by their resident memory, and as node counts grow.

The estimate is what the head checks against each node's memory before it sends a load
(memory.check_fits). Modelled on the scanner, which decodes a row group whole, it charged every
node the file's largest column for the merge, so more nodes never fitted a file whose column
outgrew one. Read batch by batch, rows of one size make batches of a known size; rows of many
sizes make batches sized by an average row, which clustered large rows overrun up to a row group.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from kubeflow_data_cache.memory import BASELINE_MEMORY_BYTES, MemoryBudgetError, check_fits
from kubeflow_data_cache.plan import (
    FilePlan,
    TablePlan,
    assign_rows,
    estimated_node_memory,
    open_table,
    plan_table,
)
from kubeflow_data_cache.sample import make_catalog
from tests.conftest import json_from_a_fresh_process

# A data node's load in a fresh interpreter, with the node's allocator settings: its resident
# peak above where it stood once the table was planned (sampled every 2 ms), and its rows' bytes.
_LOAD = r"""
import gc, json, os, sys, threading, time, psutil
from kubeflow_data_cache.allocator import configure_data_node
configure_data_node(os.environ)
from kubeflow_data_cache.plan import assign_rows, open_table, plan_table
from kubeflow_data_cache.store import NodeStore
t = open_table(sys.argv[1]); plan, tasks = plan_table(t, sys.argv[1])
a = assign_rows(plan, int(sys.argv[2]))[0]
me = psutil.Process(); gc.collect(); start = me.memory_info().rss; peak = [start]; done = threading.Event()
def watch():
    while not done.is_set():
        peak[0] = max(peak[0], me.memory_info().rss); time.sleep(0.002)
watcher = threading.Thread(target=watch); watcher.start()
store = NodeStore.load(t, tasks, plan.schema, list(a.pieces), int(sys.argv[3]))
done.set(); watcher.join()
print(json.dumps({"peak": peak[0] - start, "rows": store.nbytes}))
"""


def _one_file_table(tmp_path, name: str, data: pa.Table, row_group_rows: int) -> str:
    catalog = make_catalog(str(tmp_path / "wh"), tmp_path / "c.db")
    catalog.create_namespace_if_not_exists("s")
    table = catalog.create_table(
        f"s.{name}", schema=data.schema, properties={"write.parquet.row-group-limit": str(row_group_rows)}
    )
    table.append(data)
    return catalog.load_table(f"s.{name}").metadata_location


def _hex_strings(rows: int, chars: int, seed: int) -> pa.Array:
    """Random hex strings: they compress about 2x, as text and ids do."""
    raw = np.random.default_rng(seed).integers(0, 256, size=(rows, chars // 2), dtype=np.uint8)
    values = np.frombuffer(raw.tobytes().hex().encode(), dtype=np.uint8)
    offsets = np.arange(0, rows * chars + 1, chars, dtype=np.int32)
    return pa.Array.from_buffers(pa.string(), rows, [None, pa.py_buffer(offsets), pa.py_buffer(values)])


@pytest.fixture(scope="module")
def text_table(tmp_path_factory) -> str:
    """One file of 1.2M rows (an id and 64 hex characters), in 3 row groups of 400,000 rows."""
    rows = 1_200_000
    data = pa.table({"id": np.arange(rows, dtype=np.int64), "text": _hex_strings(rows, 64, 0)})
    return _one_file_table(tmp_path_factory.mktemp("text"), "text", data, 400_000)


@pytest.fixture(scope="module")
def floats_table(tmp_path_factory) -> str:
    """One file of 16 columns of random floats (they do not compress), in row groups of 300,000."""
    rows, rng = 600_000, np.random.default_rng(1)
    data = pa.table({f"f{i}": rng.random(rows) for i in range(16)})
    return _one_file_table(tmp_path_factory.mktemp("floats"), "floats", data, 300_000)


@pytest.fixture(scope="module")
def clustered_table(tmp_path_factory) -> str:
    """One row group of 100,000 short rows, then 1,000 of 256 KiB (random: they do not compress):
    batches are sized by the row group's average row, so one batch holds every large row."""
    rng = np.random.default_rng(2)
    values = [rng.bytes(12) for _ in range(100_000)] + [rng.bytes(256 << 10) for _ in range(1000)]
    data = pa.table({"id": np.arange(len(values), dtype=np.int64), "blob": pa.array(values, pa.binary())})
    return _one_file_table(tmp_path_factory.mktemp("clustered"), "clustered", data, 200_000)


def _estimate_and_peak(location: str, nodes: int, threads: int = 2) -> tuple[TablePlan, int, dict]:
    plan, _ = plan_table(open_table(location), location)
    _, estimate = estimated_node_memory(plan, assign_rows(plan, nodes)[0], threads)
    return plan, estimate, json_from_a_fresh_process(_LOAD, location, str(nodes), str(threads))


def test_rows_of_one_size_read_batch_by_batch_are_estimated_at_a_batch(floats_table):
    """A file of large row groups is read a 16 MiB batch at a time, beside its columns' read
    buffers: charged 2.25 row groups per reader, such tables were refused at twice what they
    took; counted as a batch alone, a file of random floats was estimated below its peak."""
    plan, estimate, measured = _estimate_and_peak(floats_table, 1)
    assert all(f.batchwise_window for f in plan.files)
    assert measured["peak"] > measured["rows"]
    assert measured["peak"] <= estimate <= 3 * measured["peak"], (measured, estimate >> 20)


@pytest.mark.parametrize(("table", "nodes"), [("text_table", 1), ("text_table", 8), ("clustered_table", 1)])
def test_rows_of_many_sizes_are_estimated_at_a_row_group_per_reader(request, table, nodes):
    """Their batches are sized by the row group's average row, so rows of one size clustered
    apart decode together: the 1,000 large rows above, as one 250 MiB batch. Counted at one
    16 MiB batch, that load was estimated below what it took."""
    plan, estimate, measured = _estimate_and_peak(request.getfixturevalue(table), nodes)
    assert not any(f.batchwise_window for f in plan.files)
    assert measured["peak"] <= estimate, (measured, estimate >> 20)


def test_more_nodes_fit_a_file_whose_column_is_larger_than_any_node():
    """A file of 4M rows whose embedding column holds 2 GiB: each node merges one batch's share of
    the column, not the column. Charged the column, every node needed 2.4 GiB however many there
    were, and the refusal advised more memory only."""
    schema = pa.schema([("id", pa.int64()), ("embedding", pa.list_(pa.float32(), 128))])
    window = (16 << 20) + 2 * (8 << 20)  # a batch, and two columns' read buffers
    big = FilePlan("file:///t/0.parquet", 4_000_000, (32 << 20, 2 << 30), False, 4, window)
    plan = TablePlan("m", 1, schema, (big,))

    def peaks_for(n: int) -> list[int]:
        return [estimated_node_memory(plan, a, 1)[1] for a in assign_rows(plan, n)]

    assert max(peaks_for(64)) < max(peaks_for(16)) < max(peaks_for(4)) < max(peaks_for(1))
    assert max(peaks_for(64)) < 128 << 20
    budget = BASELINE_MEMORY_BYTES + (1 << 30)  # a 1.4 GiB limit: 1 GiB beside the interpreter
    with pytest.raises(MemoryBudgetError, match=r"use at least (\d) data nodes") as refused:
        check_fits([2 << 30], peaks_for(1), [budget], peaks_for=peaks_for)
    assert "more data nodes alone would not fit" not in str(refused.value)
