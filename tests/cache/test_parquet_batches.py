"""Large row groups read batch by batch (parquet_batches), through pyiceberg's own reader.

pyarrow's dataset scanner, which pyiceberg reads through, decodes a row group whole before it
yields any of it; the batch-wise read must yield the same rows and types, in batches whose
decoded size stays near BATCH_TARGET_BYTES however far the values decode past the file's
statistics.
"""

from __future__ import annotations

import decimal
from pathlib import Path
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from kubeflow_data_cache import parquet_batches
from kubeflow_data_cache.constants import BATCH_TARGET_BYTES, BATCHWISE_MIN_GROUP_ROWS
from kubeflow_data_cache.iceberg_reader import task_batches, task_deletes
from kubeflow_data_cache.parquet_batches import GROWTH, RESIZE_FACTOR, BatchwiseRead, decoded_bytes, leaf_indices
from kubeflow_data_cache.sample import make_catalog
from tests.cache.test_deletes import add_position_deletes, data_files, pyiceberg_ids, writable_table  # noqa: F401

ROWS = 2_500


def _shapes() -> pa.Table:
    """One column of each kind a Parquet file maps to several leaves or to a special type, and
    a top-level name with a dot beside a struct of that prefix (names must not resolve by path)."""
    n = ROWS
    ints = pa.array(range(n), pa.int64())
    return pa.table(
        {
            "id": ints,
            "maybe": pa.array([None if i % 7 == 0 else i * 0.5 for i in range(n)], pa.float64()),
            "text": pa.array([f"row {i}" * (i % 5) for i in range(n)]),
            "blob": pa.array([bytes([i % 256]) * (i % 9) for i in range(n)], pa.binary()),
            "nested": pa.array(
                [{"b": list(range(i % 4)), "c": None if i % 3 else str(i)} for i in range(n)],
                pa.struct([("b", pa.list_(pa.int32())), ("c", pa.string())]),
            ),
            "a.b": ints,
            "a": pa.array([{"b": -i} for i in range(n)], pa.struct([("b", pa.int64())])),
            "tags": pa.array([[("k", i), ("j", -i)][: i % 3] for i in range(n)], pa.map_(pa.string(), pa.int64())),
            "vec": pa.array([[float(i)] * 4 for i in range(n)], pa.list_(pa.float32(), 4)),
            "price": pa.array([decimal.Decimal(i) / 100 for i in range(n)], pa.decimal128(12, 2)),
            "at": pa.array(range(n), pa.timestamp("us", tz="UTC")),
            "day": pa.array(range(n), pa.date32()),
            "flag": pa.array([i % 2 == 0 for i in range(n)]),
            "mood": pa.array(["up", "down", None, "up"] * (n // 4), pa.string()).dictionary_encode(),
        }
    )


def _fragment(path: Path, pre_buffer: bool = True):
    options = ds.ParquetFragmentScanOptions(pre_buffer=pre_buffer, buffer_size=8 << 20)
    return ds.ParquetFileFormat(default_fragment_scan_options=options).make_fragment(pa.OSFile(str(path)))


@pytest.fixture()
def every_group_batchwise(monkeypatch):
    """Every row group read batch by batch, in batches of at most 97 rows: small files then show
    batch and row-group boundaries everywhere."""
    monkeypatch.setattr(parquet_batches, "BATCHWISE_MIN_GROUP_ROWS", 0)
    monkeypatch.setattr(parquet_batches, "MAX_BATCH_ROWS", 97)


@pytest.mark.parametrize("pre_buffer", [True, False])
@pytest.mark.parametrize(
    "columns",
    [
        None,  # every column, in file order
        ["tags", "id", "a.b"],  # some, out of order, the dotted name among them
        ["a"],  # the struct whose child's path is the dotted name
        ["mood", "nested"],
    ],
)
def test_a_batchwise_read_yields_what_the_scanner_yields(tmp_path, every_group_batchwise, columns, pre_buffer):
    path = tmp_path / "shapes.parquet"
    pq.write_table(_shapes(), path, row_group_size=600)  # 5 row groups, the last one short
    fragment = _fragment(path, pre_buffer)
    columns = columns or fragment.physical_schema.names
    read = BatchwiseRead.of(fragment, fragment.physical_schema, columns)
    assert read is not None
    batches = list(read.to_batches())
    scanned = ds.Scanner.from_fragment(_fragment(path), schema=fragment.physical_schema, columns=columns).to_table()
    got = pa.Table.from_batches(batches)
    assert got.schema.equals(scanned.schema) and got.equals(scanned)
    # Batch by batch: each row group (600 rows) starts at one row and grows GROWTH times a batch
    # to 97 (each new reader skips the rows already yielded), none past 97 nor across groups.
    assert GROWTH < 97
    ramp = [1, GROWTH - 1, 97 - GROWTH]
    assert max(b.num_rows for b in batches) == 97
    assert [b.num_rows for b in batches[:12]] == [*ramp, 97, 97, 97, 97, 97, 18, *ramp]


def test_reads_the_scanner_serves_better_are_left_to_it(tmp_path):
    """Small row groups (the scanner holds one or two batches of them, and less beside them);
    no column (rows alone, for columns a file predates); names a file repeats."""
    small, large = tmp_path / "small.parquet", tmp_path / "large.parquet"
    pq.write_table(pa.table({"x": pa.array([1] * BATCHWISE_MIN_GROUP_ROWS, pa.int8())}), small)
    pq.write_table(pa.table({"x": pa.array([1] * (BATCHWISE_MIN_GROUP_ROWS + 1), pa.int8())}), large)
    assert BatchwiseRead.of(_fragment(small), _fragment(small).physical_schema, ["x"]) is None
    assert BatchwiseRead.of(_fragment(large), _fragment(large).physical_schema, ["x"]) is not None
    assert BatchwiseRead.of(_fragment(large), _fragment(large).physical_schema, []) is None
    twice = pa.schema([pa.field("x", pa.int64()), pa.field("x", pa.int64())])
    assert leaf_indices(twice, ["x"]) is None
    # "nested" is two leaves, "a" one, "tags" (a map) two: its keys and its values.
    assert leaf_indices(_shapes().schema, ["tags", "a.b"]) == [6, 8, 9]


def _repeated_value_table(tmp_path, rows: int, value_bytes: int):
    """One Iceberg data file of one row group whose string column holds one value, repeated:
    a Parquet dictionary of one entry, a few KiB on disk, ``rows * value_bytes`` decoded. Written
    from a dictionary array (never decoded here) and added by reference."""
    catalog = make_catalog(str(tmp_path / "wh"), tmp_path / "catalog.db")
    catalog.create_namespace("demo")
    data = pa.table(
        {
            "id": pa.array(range(rows), pa.int64()),
            "text": pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), pa.array(["y" * value_bytes])),
        }
    )
    table = catalog.create_table("demo.repeated", schema=pa.schema([("id", pa.int64()), ("text", pa.string())]))
    path = tmp_path / "repeated.parquet"
    # Without the stored Arrow schema the column reads back as plain strings, as a table's would.
    pq.write_table(data, path, row_group_size=rows, store_schema=False)
    table.add_files([str(path)])
    return catalog.load_table("demo.repeated")


def test_a_row_group_that_decodes_far_past_its_statistics_comes_in_batches_near_the_target(tmp_path):
    """300,000 copies of one 1,000-byte value: ~286 MiB decoded from a few KiB on disk. The
    scanner decoded the row group whole and handed it out 131,072 rows (125 MiB) at a time; read
    batch by batch, a one-row probe sizes the batches, and none decodes past twice the target."""
    rows = 300_000
    table = _repeated_value_table(tmp_path, rows, 1000)
    (task,) = table.scan().plan_files()
    sizes, seen = [], 0
    for batch in task_batches(table, task):
        sizes.append(batch.nbytes)
        assert batch.column("id")[0].as_py() == seen and batch.column("text")[-1].as_py() == "y" * 1000
        seen += batch.num_rows
    assert seen == rows
    assert max(sizes) <= RESIZE_FACTOR * BATCH_TARGET_BYTES, [size >> 20 for size in sizes]


def _dictionary_file(path: Path, values: list[str], indices: list[int], group_rows: int, store_schema: bool) -> Path:
    """A file of one string column written from a dictionary array (its values never repeated in
    memory here), ``group_rows`` rows per row group."""
    column = pa.DictionaryArray.from_arrays(pa.array(indices, pa.int32()), pa.array(values))
    pq.write_table(pa.table({"text": column}), path, row_group_size=group_rows, store_schema=store_schema)
    return path


def _batches_of(path: Path) -> list[pa.RecordBatch]:
    fragment = _fragment(path)
    read = BatchwiseRead.of(fragment, fragment.physical_schema, ["text"])
    assert read is not None
    return read.to_batches()


@pytest.mark.parametrize(
    ("values", "indices"),
    [
        # Short rows for a row group, then one 2 KiB value repeated: the second group's first
        # batch was sized from the first's rows (131,072 rows, 257 MiB).
        (["s", "y" * 2048], [0] * 270_000 + [1] * 270_000),
        # An empty first row, then 4 KiB rows: sized from that row, the next batch held 513 MiB.
        (["", "y" * 4096], [0] + [1] * 269_999),
    ],
)
def test_batches_stay_near_the_target_when_rows_grow_past_the_first_ones(tmp_path, values, indices):
    path = _dictionary_file(tmp_path / "growing.parquet", values, indices, 270_000, store_schema=False)
    rows, largest = 0, 0
    for batch in _batches_of(path):
        rows += batch.num_rows
        largest = max(largest, decoded_bytes(batch))
    assert rows == len(indices)
    assert largest <= RESIZE_FACTOR * BATCH_TARGET_BYTES, largest >> 20


def test_rows_that_grow_part_way_through_a_row_group_are_sized_from_its_stored_bytes(tmp_path, monkeypatch):
    """5,000 rows of 100 B, then distinct 2 KiB ones, in one row group: sized from the first rows
    alone, a batch decoded 20 times its target (721 MiB at the real one); the group's stored
    bytes per row are a floor under what the rows seen say."""
    import os

    monkeypatch.setattr(parquet_batches, "BATCHWISE_MIN_GROUP_ROWS", 0)
    monkeypatch.setattr(parquet_batches, "BATCH_TARGET_BYTES", 256 << 10)
    values = [os.urandom(50).hex() for _ in range(5_000)] + [os.urandom(1024).hex() for _ in range(15_000)]
    path = tmp_path / "growing.parquet"
    pq.write_table(pa.table({"text": values}), path, row_group_size=len(values), use_dictionary=False)
    rows, largest = 0, 0
    for batch in _batches_of(path):
        rows += batch.num_rows
        largest = max(largest, decoded_bytes(batch))
    assert rows == len(values)
    assert largest <= RESIZE_FACTOR * (256 << 10), largest >> 10


def test_a_column_stored_as_a_dictionary_is_read_in_full_batches(tmp_path):
    """Each batch carries the row group's dictionary: counted as the batch's bytes, it made every
    row as large as the dictionary, and 300,000 rows came 4 at a time (200x the scanner's time)."""
    values = [f"{i:064d}" for i in range(50_000)]  # a 3 MiB dictionary
    path = _dictionary_file(tmp_path / "stored.parquet", values, [i % 50_000 for i in range(300_000)], 300_000, True)
    batches = list(_batches_of(path))
    assert pa.types.is_dictionary(batches[0].schema.field("text").type)  # as the scanner reads it
    assert sum(b.num_rows for b in batches) == 300_000 and len(batches) <= 12  # the ramp, then 131,072 a batch


def test_a_uuid_column_reads_as_the_scanner_reads_it(tmp_path):
    """pyarrow's file reader reads a Parquet UUID as the arrow.uuid extension type by default,
    the scanner as fixed_size_binary(16): the schemas differed, and every read of such a file (as
    Java and Spark writers store uuid columns) went to the scanner."""
    import uuid

    rows = BATCHWISE_MIN_GROUP_ROWS + 1
    ids = pa.array([uuid.UUID(int=i).bytes for i in range(rows)], pa.uuid())
    path = tmp_path / "uuids.parquet"
    pq.write_table(pa.table({"id": ids}), path, store_schema=False)
    fragment = _fragment(path)
    assert fragment.physical_schema.field("id").type == pa.binary(16)
    read = BatchwiseRead.of(fragment, fragment.physical_schema, ["id"])
    assert read is not None
    scanned = ds.Scanner.from_fragment(fragment, schema=fragment.physical_schema, columns=["id"]).to_table()
    assert pa.Table.from_batches(list(read.to_batches())).equals(scanned)


def test_positional_deletes_apply_across_batches_and_row_groups(writable_table, every_group_batchwise):  # noqa: F811
    """pyiceberg applies positional deletes by each batch's place in its file: batches of 97
    rows, and deletes on both sides of their boundaries, must leave exactly pyiceberg's rows."""
    first, *_ = data_files(writable_table)
    table = add_position_deletes(writable_table, {first: [0, 96, 97, 98, 193, 194, 400]}, scoped_to_file=True)
    ids = []
    for task in table.scan().plan_files():
        for batch in task_batches(table, task, deletes=task_deletes(table, task)):
            assert batch.num_rows <= 97
            ids.extend(batch.column("id").to_pylist())
    assert sorted(ids) == sorted(pyiceberg_ids(table.metadata_location))
    assert len(ids) == sum(pq.read_metadata(urlparse(path).path).num_rows for path in data_files(table)) - 7


@pytest.mark.parametrize(("limit", "pre_buffered"), [(0, False), (1 << 30, True)])
def test_a_local_file_past_the_prebuffer_limit_is_read_without_it(
    writable_table,  # noqa: F811
    every_group_batchwise,
    monkeypatch,
    limit,
    pre_buffered,
):
    """pyiceberg opens every file pre-buffered; a local one larger than LOCAL_PREBUFFER_MAX_BYTES
    is read without it (iceberg_reader's switch, per read), the batch-wise read included."""
    from kubeflow_data_cache import iceberg_reader

    monkeypatch.setattr(iceberg_reader, "LOCAL_PREBUFFER_MAX_BYTES", limit)
    seen = []
    of = BatchwiseRead.of.__func__

    def spy(cls, fragment, schema, columns):
        seen.append(fragment.format.default_fragment_scan_options.pre_buffer)
        return of(cls, fragment, schema, columns)

    monkeypatch.setattr(BatchwiseRead, "of", classmethod(spy))
    task = writable_table.scan().plan_files()[0]
    assert sum(b.num_rows for b in task_batches(writable_table, task, deletes={})) == task.file.record_count
    assert seen == [pre_buffered]
