"""A data node's store: how loaded batches are merged, and how rows are served from them."""

from __future__ import annotations

import subprocess
import sys
from collections import deque

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubeflow_data_cache.constants import STORE_CHUNK_VARIABLE_BYTES
from kubeflow_data_cache.errors import BadRequestError
from kubeflow_data_cache.store import NodeStore, compact, indices

SCHEMA = pa.schema([("id", pa.int64()), ("x", pa.float32()), ("text", pa.string())])


def batches(sizes: list[int]) -> list[pa.RecordBatch]:
    out, start = [], 0
    for n in sizes:
        ids = np.arange(start, start + n, dtype=np.int64)
        out.append(pa.record_batch([ids, ids.astype(np.float32), pa.array([f"row-{i}" for i in ids])], schema=SCHEMA))
        start += n
    return out


def test_a_numeric_table_becomes_one_chunk_however_many_batches():
    numeric = pa.schema([SCHEMA.field("id"), SCHEMA.field("x")])
    source = [b.select(["id", "x"]) for b in batches([1000] * 40)]
    (chunk,) = compact(deque(source), numeric)
    assert chunk.num_rows == 40_000 and chunk.column("id").to_numpy().tolist() == list(range(40_000))


def test_string_columns_keep_each_chunk_under_the_offset_limit():
    source = batches([1000] * 10)
    per_batch = max(b.column("text").nbytes for b in source)
    chunks = compact(deque(source), SCHEMA, variable_limit=3 * per_batch)
    assert [c.num_rows for c in chunks] == [3000, 3000, 3000, 1000]
    assert all(c.column("text").nbytes <= 3 * per_batch for c in chunks)
    assert pa.Table.from_batches(chunks).column("text").to_pylist() == [f"row-{i}" for i in range(10_000)]


@pytest.mark.parametrize(
    "column",
    [
        pa.array([[True] * 64] * 100, pa.list_(pa.bool_())),  # 8 values a byte
        pa.array([{"flags": [False] * 64}] * 100, pa.struct([("flags", pa.list_(pa.bool_()))])),
        pa.array([[[True] * 8] * 8] * 100, pa.list_(pa.list_(pa.bool_()))),
    ],
)
def test_lists_of_booleans_are_merged_by_the_values_their_offsets_span_not_their_bytes(column):
    """A list of booleans holds 8 values a byte: merged up to 1 GiB of bytes, 2^31 of them (256 MiB)
    overflowed its 32-bit offsets and failed the load. Here 6,400 values in 1.2 KB a batch."""
    schema = pa.schema([("flags", column.type)])
    source = [pa.record_batch([column], schema=schema) for _ in range(4)]
    chunks = compact(deque(source), schema, variable_limit=13_000)  # two batches' values, ten batches' bytes
    assert [c.num_rows for c in chunks] == [200, 200]
    assert pa.Table.from_batches(chunks).column(0).to_pylist() == column.to_pylist() * 4
    assert STORE_CHUNK_VARIABLE_BYTES < 2**31  # so a chunk's offsets never overflow


def test_a_batch_over_the_limit_stands_alone_rather_than_failing():
    chunks = compact(deque(batches([10, 5000, 10])), SCHEMA, variable_limit=1)
    assert [c.num_rows for c in chunks] == [10, 5000, 10]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=12),
    limit_batches=st.integers(1, 5),
    rows=st.data(),
    batch_rows=st.integers(1, 500),
)
def test_gathers_and_slices_match_the_rows_whatever_the_chunks(sizes, limit_batches, rows, batch_rows):
    source = batches(sizes)
    limit = limit_batches * max(1, max(b.column("text").nbytes for b in source))
    store = NodeStore(SCHEMA, compact(deque(source), SCHEMA, variable_limit=limit))
    total = sum(sizes)
    assert store.num_rows == total
    if not total:
        return
    picked = np.asarray(rows.draw(st.permutations(range(total))), dtype=np.int64)
    # Index arrays cut anywhere come back as batches of exactly batch_rows (but the last).
    cuts = sorted(rows.draw(st.lists(st.integers(0, total), max_size=4)))
    parts = [picked[a:b] for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
    served = list(store.iter_rows(parts, batch_rows, ("id", "text")))
    assert [b.num_rows for b in served[:-1]] == [batch_rows] * (len(served) - 1)
    got = pa.Table.from_batches(served)
    assert got.column("id").to_pylist() == picked.tolist()
    assert got.column("text").to_pylist() == [f"row-{i}" for i in picked]
    sliced = pa.Table.from_batches(list(store.iter_rows([range(0, total)], batch_rows, None)))
    assert sliced.column("id").to_pylist() == list(range(total))


def test_unknown_columns_are_refused_with_the_table_columns():
    store = NodeStore(SCHEMA, batches([5]))
    with pytest.raises(BadRequestError, match=r"unknown column\(s\) \['nope'\]"):
        store.project(("nope",))


def test_index_arrays_reach_arrow_without_a_copy():
    rows = np.arange(10, dtype=np.int64)[::-1].copy()
    arr = indices(rows)
    assert arr.type == pa.int64() and arr.to_pylist() == rows.tolist()
    assert arr.buffers()[1].address == rows.ctypes.data
    assert indices(np.array([3, 1], dtype=np.int32)).to_pylist() == [3, 1]  # a filter's matches


def test_gathering_does_not_import_numpy_ma():
    """pa.array(ndarray) imports numpy.ma on its first call: without cached bytecode that
    compiled it in the middle of a data node's first shuffled stream (~7 MiB of heap)."""
    script = (
        "import sys, numpy as np, pyarrow as pa\n"
        "from kubeflow_data_cache.store import NodeStore\n"
        "rows = pa.record_batch({'id': pa.array(list(range(150)), pa.int64())})\n"
        "store = NodeStore(rows.schema, [rows])\n"
        "assert 'numpy.ma' not in sys.modules, 'imported before any gather'\n"
        "got = list(store.iter_rows([np.array([120, 3, 57], dtype=np.int64)], 2, None))\n"
        "assert [b.column(0).to_pylist() for b in got] == [[120, 3], [57]]\n"
        "assert 'numpy.ma' not in sys.modules, 'numpy.ma was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_figures_of_a_filters_matches_count_their_nulls_and_list_lengths_across_batches():
    """What the head tells readers of a filter, before their first batch: only the matched rows'
    nulls and list lengths, wherever the node's batches split them."""
    schema = pa.schema([("x", pa.int64()), ("v", pa.list_(pa.float32())), ("n", pa.int64())])

    def batch(xs, vs):
        return pa.record_batch(
            [pa.array(xs, pa.int64()), pa.array(vs, schema.field("v").type), pa.array([1] * len(xs))], schema=schema
        )

    store = NodeStore(
        schema, [batch([None, 1, 2], [[1.0], [1.0, 2.0], None]), batch([3, None], [[1.0, 2.0, 3.0], [4.0]])]
    )
    assert store.figures_of(np.array([0, 1, 2, 3, 4])) == {
        "null_counts": {"x": 2, "v": 1},
        "list_lengths": {"v": [1, 3]},
    }
    assert store.figures_of(np.array([1, 3])) == {"null_counts": {}, "list_lengths": {"v": [2, 3]}}
    assert store.figures_of(np.array([2])) == {"null_counts": {"v": 1}, "list_lengths": {}}
    assert store.figures_of(np.array([], dtype=np.int64)) == {"null_counts": {}, "list_lengths": {}}


@pytest.mark.parametrize("bad", [-1, 10, 1 << 40])
def test_a_gather_past_a_single_chunk_node_is_an_error_not_a_stray_read(bad):
    """Arrow's take checks no bounds there (one numpy check per gather instead of one per column)."""
    batch = pa.record_batch({"id": pa.array(np.arange(10)), "s": pa.array([str(i) for i in range(10)])})
    store = NodeStore(batch.schema, [batch])
    taken = store.take(np.array([9, 0, 3]), None)
    assert taken.column(0).to_pylist() == [9, 0, 3] and taken.column(1).to_pylist() == ["9", "0", "3"]
    with pytest.raises(IndexError, match="row index out of bounds for a data node of 10 rows"):
        store.take(np.array([1, bad, 2]), ["id"])
    # Checked as Arrow reads them: a masked array's min and max leave out a hidden bad index.
    with pytest.raises(IndexError, match="row index out of bounds"):
        store.take(np.ma.array([1, 1 << 40, 2], mask=[0, 1, 0]), ["id"])
    with pytest.raises(IndexError, match="row index out of bounds"):
        store.take(np.array([1, (1 << 64) - 1], dtype=np.uint64), ["id"])


def _nested_values(depth: int):
    leaf = st.integers(0, 9)
    for _ in range(depth):
        leaf = st.one_of(st.none(), st.lists(leaf, max_size=4))
    return leaf


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    depth=st.sampled_from([2, 3]),
    large=st.booleans(),
)
def test_inner_list_lengths_count_each_level_of_the_rows_asked_for(data, depth, large):
    """Against the lists themselves (to_pylist), over slices, null lists at every level and a
    subset of rows: the counting reads offsets only."""
    from kubeflow_data_cache.store import _inner_length_bounds

    kind = pa.int64()
    for level in range(depth):
        kind = pa.large_list(kind) if large and level == depth - 1 else pa.list_(kind)
    values = data.draw(st.lists(_nested_values(depth), max_size=20))
    column = pa.array(values, kind)
    start = data.draw(st.integers(0, len(column)))
    column = column.slice(start, data.draw(st.integers(0, len(column) - start)))
    rows = data.draw(st.none() | st.sets(st.integers(0, max(0, len(column) - 1))).map(sorted))
    rows = None if rows is None else np.array([r for r in rows if r < len(column)], dtype=np.int64)

    expected: list[list[int] | None] = [None] * (depth - 1)
    level_lists = [column.to_pylist()[r] for r in (range(len(column)) if rows is None else rows)]
    for level in range(depth - 1):
        level_lists = [inner for outer in level_lists if outer is not None for inner in outer]
        lengths = [len(inner) for inner in level_lists if inner is not None]
        expected[level] = [min(lengths), max(lengths)] if lengths else None
    assert _inner_length_bounds(iter([(column, rows)]), depth) == expected


def test_a_filters_count_of_lists_of_lists_copies_none_of_their_values():
    """figures_of took the matched rows' lists (their values too) for every list-of-lists column:
    7 s and 1.5 GiB for a count over 2 GiB of such lists."""
    script = """
import numpy as np, pyarrow as pa
from kubeflow_data_cache.store import NodeStore
rows, inner, width = 65536, 8, 64  # 128 MiB of floats, held by numpy, not Arrow's pool
values = pa.array(np.zeros(rows * inner * width, np.float32))
lists = pa.ListArray.from_arrays(pa.array(np.arange(0, rows * inner * width + 1, width, dtype=np.int32)), values)
grid = pa.ListArray.from_arrays(pa.array(np.arange(0, rows * inner + 1, inner, dtype=np.int32)), lists)
batch = pa.record_batch({"grid": grid})
store = NodeStore(batch.schema, [batch])
before = pa.default_memory_pool().max_memory()
figures = store.figures_of(np.arange(0, rows, 2, dtype=np.int64))
assert figures["inner_list_lengths"] == {"grid": [[width, width]]}, figures
print(pa.default_memory_pool().max_memory() - before)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) < 16 << 20  # a copy of the matched values: 64 MiB


@pytest.mark.parametrize("with_number", [True, False])
def test_the_warm_up_read_decodes_a_fixed_width_column_or_nothing(tmp_path, monkeypatch, with_number):
    """The smallest column on disk was a repeated string (dictionary-encoded: a few KiB), and its
    one warm-up batch decoded 650 MiB on every data node, outside the load's memory budget."""
    from kubeflow_data_cache import store
    from kubeflow_data_cache.plan import open_table, scan_tasks
    from tests.cache.conftest import table_in_files

    rows = 10_000
    columns = {"s": pa.array(["x" * 1000] * rows)}
    if with_number:
        columns["id"] = pa.array(np.arange(rows, dtype=np.int64))
    location = table_in_files(tmp_path, pa.table(columns))
    table = open_table(location, {})
    (task,) = scan_tasks(table, location).values()
    assert task.file.column_sizes[1] < task.file.column_sizes.get(2, 1 << 30)  # the string is smallest on disk
    read = []
    real = store.task_batches
    monkeypatch.setattr(store, "task_batches", lambda t, k, ids: read.append(ids) or real(t, k, ids))
    store.warm_reader(table, task)
    assert read == ([[2]] if with_number else [])  # the id column, or no warm-up at all


def test_the_warm_up_never_takes_a_variable_width_primitive():
    """pyiceberg has primitives of variable width besides strings and binaries (geometry): one,
    smallest on disk, was taken for a fixed-width column."""
    from types import SimpleNamespace

    from pyiceberg.schema import Schema
    from pyiceberg.types import GeometryType, LongType, NestedField, StringType

    from kubeflow_data_cache.store import _warm_up_field

    schema = Schema(
        NestedField(1, "id", LongType()), NestedField(2, "shape", GeometryType()), NestedField(3, "s", StringType())
    )
    task = SimpleNamespace(file=SimpleNamespace(column_sizes={1: 80_000, 2: 4_000, 3: 1000}))
    assert _warm_up_field(SimpleNamespace(schema=lambda: schema), task) == 1
