"""Wide rows: served batches and the dataset's conversion runs are bounded in bytes, not only rows.

A 2 KiB embedding per row makes a 64K-row batch 128 MiB; a node gathering a few of those per
concurrent reader, or a trainer converting one, would hold far more than anyone sized for.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

from kubeflow_data_cache import dataset as dataset_module
from kubeflow_data_cache.client import CacheClient
from kubeflow_data_cache.constants import SERVED_BATCH_MAX_BYTES
from kubeflow_data_cache.dataset import CONVERT_MAX_BYTES, DataCacheDataset
from kubeflow_data_cache.protocol import ShardRequest
from kubeflow_data_cache.sample import make_catalog
from tests.conftest import running_cache

WIDTH = 512  # float32 values per row: 2 KiB
ROWS_PER_FILE = 6_000
FILES = 2
ROWS = ROWS_PER_FILE * FILES


@pytest.fixture(scope="module")
def wide_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("wide")
    catalog = make_catalog(str(root / "wh"), root / "catalog.db")
    catalog.create_namespace("s")
    table = None
    for f in range(FILES):
        ids = np.arange(f * ROWS_PER_FILE, (f + 1) * ROWS_PER_FILE, dtype=np.int64)
        values = (np.repeat(ids[:, None], WIDTH, axis=1) + np.arange(WIDTH)).astype(np.float32)
        data = pa.table(
            {"id": pa.array(ids), "vec": pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), WIDTH)}
        )
        table = table or catalog.create_table("s.wide", schema=data.schema)
        table.append(data)
    with running_cache(catalog.load_table("s.wide").metadata_location, data_nodes=2) as cache:
        yield cache


@pytest.mark.parametrize("shuffle", [False, True])
def test_served_batches_stay_under_the_byte_cap(wide_cache, shuffle):
    request = ShardRequest(shuffle=shuffle, seed=1, batch_size=65536)
    ids, largest = [], 0
    with CacheClient(wide_cache.endpoint) as client:
        for batch in client.read_shard(request, interleave=False):
            largest = max(largest, batch.nbytes)
            ids.append(batch.column("id").to_numpy())
    assert np.array_equal(np.sort(np.concatenate(ids)), np.arange(ROWS))
    # Each node holds 6,000 rows (12 MiB): batches of at most 4 MiB, and not needlessly small.
    assert SERVED_BATCH_MAX_BYTES // 2 < largest <= SERVED_BATCH_MAX_BYTES


class RecordingRuns(DataCacheDataset):
    """Records the rows of every run handed to the conversion hook."""

    runs: list[int]

    def from_arrow_rb_to_tensor(self, batch):
        self.runs.append(batch.num_rows)
        return super().from_arrow_rb_to_tensor(batch)


@pytest.mark.parametrize("batch_size", [1000, 5000])
def test_conversion_runs_stay_under_the_byte_cap_but_hold_a_batch(wide_cache, batch_size):
    ds = RecordingRuns(wide_cache.endpoint, batch_size=batch_size, shuffle=True)
    ds.runs = []
    batches = list(ds)
    ids = np.concatenate([b["id"].numpy() for b in batches])
    assert np.array_equal(np.sort(ids), np.arange(ROWS))
    assert batches[0]["vec"].shape == (batch_size, WIDTH)
    row_bytes = 8 + 4 * WIDTH  # id and the vector's values
    # Runs of about CONVERT_MAX_BYTES (4,000 rows of 1000) or, when one batch is larger, one batch.
    assert max(ds.runs) == max(batch_size, CONVERT_MAX_BYTES // row_bytes // batch_size * batch_size)


SMALL_ROWS, LARGE_ROWS, LARGE_VALUE = 20_000, 40, 256 << 10


@pytest.fixture(scope="module")
def skewed_cache(tmp_path_factory):
    """Short rows, with 10 MiB of large values together in the middle (a file of images in a table
    of short rows): a batch cut by the average row (~520 bytes, so ~8,000 rows) held all of them."""
    root = tmp_path_factory.mktemp("skewed")
    catalog = make_catalog(str(root / "wh"), root / "catalog.db")
    catalog.create_namespace("s")
    half = SMALL_ROWS // 2
    values = [b"x" * 8] * half + [bytes([i]) * LARGE_VALUE for i in range(LARGE_ROWS)] + [b"y" * 8] * half
    data = pa.table({"id": pa.array(np.arange(len(values), dtype=np.int64)), "blob": pa.array(values, pa.binary())})
    table = catalog.create_table("s.skewed", schema=data.schema)
    table.append(data)
    with running_cache(catalog.load_table("s.skewed").metadata_location, data_nodes=1) as cache:
        yield cache


def test_the_byte_cut_counts_all_string_columns_together_not_each_against_a_share():
    """Cut per column at the cap over the column count, 100 KiB images beside 39 short labels were
    served a row at a time (2,000 batches where 50 hold 4 MiB each)."""
    from kubeflow_data_cache.store import NodeStore

    rows = 2000
    columns = {"img": pa.array([b"x" * (100 << 10)] * rows, pa.binary())}
    columns |= {f"s{k}": pa.array([f"label{i}" for i in range(rows)]) for k in range(39)}
    batch = pa.record_batch(columns)
    store = NodeStore(batch.schema, [batch])
    served = list(store.slices(0, rows, 65536, None))
    assert sum(b.num_rows for b in served) == rows
    assert len(served) <= 60 and all(b.nbytes <= SERVED_BATCH_MAX_BYTES + (100 << 10) for b in served)


@pytest.mark.parametrize("columns", [None, ("blob",)])
def test_served_batches_of_clustered_large_values_stay_under_the_byte_cap(skewed_cache, columns):
    ids, largest = [], 0
    with CacheClient(skewed_cache.endpoint) as client:
        for batch in client.read_shard(ShardRequest(batch_size=65536, columns=columns)):
            largest = max(largest, batch.nbytes)
            if columns is None:
                ids.append(batch.column("id").to_numpy())
    assert largest <= SERVED_BATCH_MAX_BYTES + LARGE_VALUE  # one row past the cap at most
    if columns is None:
        assert np.array_equal(np.concatenate(ids), np.arange(SMALL_ROWS + LARGE_ROWS))  # in order, each once


def test_the_byte_cut_adds_string_columns_offsets_without_overflowing_32_bits():
    """Two columns' 32-bit offsets summed past 2 GiB wrapped negative, the running total stopped
    being sorted, and 3.6 GB of rows were cut as fitting in 4 MiB. (The offsets are given here as
    a chunk of such values would have them, without allocating gigabytes.)"""
    from kubeflow_data_cache.store import NodeStore

    batch = pa.record_batch({"a": ["x", "y", "z"], "b": ["x", "y", "z"]})
    store = NodeStore(batch.schema, [batch])
    big = np.array([0, 1_800_000_000, 1_800_000_002, 1_800_000_004], dtype=np.int32)
    from kubeflow_data_cache.row_bytes import Term

    variable = store._variable_columns(None)
    assert variable == (0, 1)
    store._offsets[(0, variable)] = ([Term((big,), 1), Term((big,), 1)], 2 * 1_800_000_004, 2 * 1_800_000_000)
    assert store._within_bytes(0, variable, 0, 3, SERVED_BATCH_MAX_BYTES) == 1


def _largest_batch_around_the_large_rows(endpoint, filtered, shuffle, columns=None, check=lambda batch: None) -> int:
    """Read a table whose 40 large rows sit in the middle of short ones: only them and 5 rows
    either side (``filtered``), or all of it; checks every row came once and returns the largest
    batch's bytes. ``check`` sees each batch."""
    half = SMALL_ROWS // 2
    wanted = np.arange(half - 5, half + LARGE_ROWS + 5) if filtered else np.arange(SMALL_ROWS + LARGE_ROWS)
    where = f"id >= {wanted[0]} AND id <= {wanted[-1]}" if filtered else None
    request = ShardRequest(batch_size=65536, columns=columns, filter=where, shuffle=shuffle, seed=3)
    ids, largest = [], 0
    with CacheClient(endpoint) as client:
        for batch in client.read_shard(request):
            check(batch)
            largest = max(largest, batch.nbytes)
            ids.append(batch.column("id").to_numpy())
    assert np.array_equal(np.sort(np.concatenate(ids)), wanted)
    return largest


@pytest.mark.parametrize(("filtered", "shuffle"), [(True, False), (True, True), (False, True)])
def test_gathers_of_clustered_large_values_stay_under_the_byte_cap(skewed_cache, filtered, shuffle):
    """A filter that keeps the large rows alone is gathered in batches sized by the table's average
    row (~8,000 rows here): all 40 of them, 10 MiB, went in one batch, past the cap and past what
    the node's memory guard had counted for the stream. At 5 MiB values and a few hundred per
    batch, past Flight's 2 GiB. A shuffled gather mixes them with short rows, but by chance (4.4 MiB)."""
    largest = _largest_batch_around_the_large_rows(skewed_cache.endpoint, filtered, shuffle)
    assert largest <= SERVED_BATCH_MAX_BYTES + LARGE_VALUE  # one row past the cap at most
    assert largest > SERVED_BATCH_MAX_BYTES // 2  # cut at the cap, not needlessly small


def test_gathers_across_stored_chunks_are_cut_by_each_rows_own_values():
    """A store of several chunks (string columns past 1 GiB are kept in several): each gathered
    row's bytes are read from its own chunk's offsets."""
    from kubeflow_data_cache.store import NodeStore

    big, small = b"x" * (1 << 20), b"y"
    first = pa.record_batch({"id": pa.array(np.arange(0, 8)), "blob": pa.array([big] * 4 + [small] * 4)})
    second = pa.record_batch({"id": pa.array(np.arange(8, 16)), "blob": pa.array([small] * 4 + [big] * 4)})
    store = NodeStore(first.schema, [first, second])
    rows = np.array([4, 12, 5, 13, 0, 8, 1, 14, 15, 2, 3, 6], dtype=np.int64)  # 8 large rows of 12
    served = list(store._gathers(rows, None, store._variable_columns(None), max_bytes=3 << 20))
    assert np.array_equal(np.concatenate([b.column("id").to_numpy() for b in served]), rows)
    # Greedy runs of at most 3 MiB of values (each 1-byte row counts): 4,12,5,13 | 0,8,1 | 14,15,2 | 3,6.
    assert [b.num_rows for b in served] == [4, 3, 3, 2]
    assert all(b.column("blob").nbytes <= (3 << 20) + 64 for b in served)


LONG_LIST = 64 << 10  # int32 token ids: 256 KiB a row


@pytest.fixture(scope="module")
def ragged_cache(tmp_path_factory):
    """Token ids of documents of any length: short ones, with 40 long ones together in the middle
    (10 MiB of them). The average row (~530 bytes) let ~8,000 rows into a batch."""
    root = tmp_path_factory.mktemp("ragged")
    catalog = make_catalog(str(root / "wh"), root / "catalog.db")
    catalog.create_namespace("s")
    half = SMALL_ROWS // 2
    lengths = np.array([2] * half + [LONG_LIST] * LARGE_ROWS + [2] * half)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    tokens = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.arange(offsets[-1]) % 50_000, pa.int32()))
    data = pa.table({"id": pa.array(np.arange(len(lengths), dtype=np.int64)), "tokens": tokens})
    table = catalog.create_table("s.ragged", schema=data.schema)
    table.append(data)
    with running_cache(catalog.load_table("s.ragged").metadata_location, data_nodes=1) as cache:
        yield cache


@pytest.mark.parametrize(("filtered", "shuffle"), [(False, False), (True, False), (False, True)])
def test_served_batches_of_long_lists_stay_under_the_byte_cap(ragged_cache, filtered, shuffle):
    """Lists count their values' bytes as strings do: in order, the 40 long documents went in one
    10 MiB batch."""

    def whole_rows(batch: pa.RecordBatch) -> None:
        lengths = pc.list_value_length(batch.column("tokens")).to_numpy()
        assert set(lengths.tolist()) <= {2, LONG_LIST}  # whole rows, as stored

    largest = _largest_batch_around_the_large_rows(ragged_cache.endpoint, filtered, shuffle, check=whole_rows)
    assert SERVED_BATCH_MAX_BYTES // 2 < largest <= SERVED_BATCH_MAX_BYTES + 4 * LONG_LIST


def test_only_columns_whose_rows_can_differ_in_size_are_counted():
    from kubeflow_data_cache.store import NodeStore

    batch = pa.record_batch(
        {
            "n": pa.array([1, 2]),
            "s": pa.array(["a", "b"]),
            "ids": pa.array([[1], [2, 3]], pa.list_(pa.int32())),
            "pair": pa.array([{"x": 1, "y": 2.0}] * 2),  # every row one size
            "img": pa.array([{"bytes": b"x", "path": "a"}] * 2),
            "fixed": pa.array([[1, 2]] * 2, pa.list_(pa.int64(), 2)),  # every row one size
            "flags": pa.array([[True], [False]], pa.list_(pa.bool_())),
        }
    )
    store = NodeStore(batch.schema, [batch])
    assert store._variable_columns(None) == (1, 2, 4, 6)
    assert store._variable_columns(("img", "n")) == (4,)


class RecordingRunBytes(DataCacheDataset):
    """Records the Arrow bytes of every run handed to the conversion hook; converts the ids only
    (the long lists differ in length: a trainer's own hook would pad or pack them)."""

    run_bytes: list[int]

    def from_arrow_rb_to_tensor(self, batch):
        self.run_bytes.append(batch.nbytes)
        return {"id": torch.tensor(batch.column("id").to_numpy())}


def test_conversion_runs_of_long_rows_after_short_ones_stay_near_the_byte_cap(ragged_cache, monkeypatch):
    """A run's row target comes from the first batch's average row; rows far longer later piled up
    to that many rows before one conversion (an image table whose first batch held thumbnails
    would gather gigabytes). A run is also converted once it holds CONVERT_MAX_BYTES."""
    monkeypatch.setattr(dataset_module, "CONVERT_MAX_BYTES", 1 << 20)
    ds = RecordingRunBytes(ragged_cache.endpoint, batch_size=8)
    ds.run_bytes = []
    ids = np.concatenate([b["id"].numpy() for b in ds])
    assert np.array_equal(ids, np.arange(SMALL_ROWS + LARGE_ROWS))
    # At most the cap plus the transfer batch that passed it (itself at most 4 MiB and a row).
    assert max(ds.run_bytes) <= (1 << 20) + SERVED_BATCH_MAX_BYTES + 8 * LONG_LIST * 4, ds.run_bytes


@pytest.fixture(scope="module")
def nested_cache(tmp_path_factory):
    """Images as Hugging Face stores them (a struct of their bytes and path) and lists of strings,
    short but for 40 large rows together in the middle: neither was cut by bytes, and a filter
    keeping only the large rows gathered all of them (10 MiB each column) in one batch."""
    root = tmp_path_factory.mktemp("nested")
    catalog = make_catalog(str(root / "wh"), root / "catalog.db")
    catalog.create_namespace("s")
    half = SMALL_ROWS // 2
    large = range(half, half + LARGE_ROWS)
    n = SMALL_ROWS + LARGE_ROWS
    images = [
        {"bytes": bytes([i % 256]) * (LARGE_VALUE if i in large else 8), "path": f"img/{i}.jpg"} for i in range(n)
    ]
    tags = [["t" * (LARGE_VALUE // 4)] * 4 if i in large else ["a", "b"] for i in range(n)]
    data = pa.table(
        {
            "id": pa.array(np.arange(n, dtype=np.int64)),
            "image": pa.array(images, pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
            "tags": pa.array(tags, pa.list_(pa.string())),
        }
    )
    table = catalog.create_table("s.nested", schema=data.schema)
    table.append(data)
    with running_cache(catalog.load_table("s.nested").metadata_location, data_nodes=1) as cache:
        yield cache


@pytest.mark.parametrize("column", ["image", "tags"])
@pytest.mark.parametrize(("filtered", "shuffle"), [(False, False), (True, False), (False, True)])
def test_served_batches_of_nested_large_values_stay_under_the_byte_cap(nested_cache, column, filtered, shuffle):
    largest = _largest_batch_around_the_large_rows(nested_cache.endpoint, filtered, shuffle, columns=("id", column))
    assert SERVED_BATCH_MAX_BYTES // 2 < largest <= SERVED_BATCH_MAX_BYTES + LARGE_VALUE + (64 << 10)


@pytest.mark.parametrize("max_bytes", [1000, 200])
def test_gathers_a_few_times_the_cap_are_cut_after_and_larger_ones_before(max_bytes):
    """Text whose longest strings are a few times the average row is gathered whole and cut by the
    gathered batch's own offsets (sizing each row first made shuffled reads 10-15% slower); a
    gather that could pass GATHER_PRECUT_FACTOR times the cap is cut before it is gathered. Both
    give the same greedy runs."""
    from kubeflow_data_cache.store import GATHER_PRECUT_FACTOR, NodeStore

    lengths = np.arange(1, 101)
    batch = pa.record_batch({"id": pa.array(np.arange(100)), "text": pa.array(["x" * int(n) for n in lengths])})
    store = NodeStore(batch.schema, [batch])
    rows = np.random.default_rng(2).permutation(100)[:30]
    assert (max_bytes * GATHER_PRECUT_FACTOR >= 100 * 30) == (max_bytes == 1000)  # one path each
    served = list(store._gathers(rows, None, store._variable_columns(None), max_bytes=max_bytes))
    assert np.array_equal(np.concatenate([b.column("id").to_numpy() for b in served]), rows)
    runs, total = [], 0
    for size in lengths[rows]:  # the greedy cut, by hand
        if total and total + size > max_bytes:
            runs.append(total)
            total = 0
        total += size
    runs.append(total)
    assert [sum(len(s) for s in b.column("text").to_pylist()) for b in served] == runs


@pytest.fixture(scope="module")
def wide_rows_cache(tmp_path_factory):
    """20,000 rows of 4 KiB (80 MiB) on 2 data nodes."""
    root = tmp_path_factory.mktemp("wide-rows")
    catalog = make_catalog(str(root / "wh"), root / "catalog.db")
    catalog.create_namespace("s")
    rng = np.random.default_rng(5)
    rows = 20_000
    data = pa.table({"id": pa.array(np.arange(rows)), "blob": pa.array([rng.bytes(4096) for _ in range(rows)])})
    table = catalog.create_table("s.wide_rows", schema=data.schema)
    table.append(data)
    with running_cache(catalog.load_table("s.wide_rows").metadata_location, data_nodes=2) as cache:
        yield cache


def test_interleaved_windows_of_small_blocks_stay_near_their_byte_size(wide_rows_cache, monkeypatch):
    """Shuffled in blocks under 256 rows, the client takes each stretch of the interleave as one
    window: 65,536 rows whatever their width made this shard one 80 MiB batch (rows over 32 KiB
    passed the 2 GiB a take's offsets hold, and every such read failed). Windows hold about
    TAKEN_WINDOW_BYTES now, in the same order."""
    from kubeflow_data_cache import interleave

    request = ShardRequest(shuffle=True, seed=4, block_size=16)

    def read() -> tuple[np.ndarray, int]:
        ids, largest = [], 0
        with CacheClient(wide_rows_cache.endpoint) as client:
            for batch in client.read_shard(request, interleave=True):
                largest = max(largest, batch.nbytes)
                ids.append(batch.column("id").to_numpy())
        return np.concatenate(ids), largest

    ids, largest = read()
    assert np.array_equal(np.sort(ids), np.arange(20_000))
    assert largest <= interleave.TAKEN_WINDOW_BYTES + 2 * 16 * 4200, largest
    monkeypatch.setattr(interleave, "TAKEN_WINDOW_BYTES", 1 << 40)  # windows of rows alone
    by_rows, largest_by_rows = read()
    assert np.array_equal(ids, by_rows)  # where windows end does not change the order
    assert largest_by_rows > 64 << 20
