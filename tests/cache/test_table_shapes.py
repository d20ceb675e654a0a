"""Tables as they look after a while in production: an evolved schema, partitioned files.

The cache reads each file through pyiceberg's own reader, which maps a file's columns to the
current schema by field id. These tests pin that down end to end: a cache over such a table
serves exactly what ``scan().to_arrow()`` reads, split across more data nodes than one file.
"""

from __future__ import annotations

import pyarrow as pa
import pytest
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.transforms import IdentityTransform
from pyiceberg.types import DoubleType, LongType, NestedField, StringType

from kubeflow_data_cache.client import CacheClient
from kubeflow_data_cache.dataset import DataCacheDataset
from kubeflow_data_cache.protocol import ShardRequest
from kubeflow_data_cache.sample import make_catalog
from tests.conftest import running_cache

ROWS_PER_APPEND = 1000


def _served(endpoint: str, request: ShardRequest) -> pa.Table:
    with CacheClient(endpoint) as client:
        batches = list(client.read_shard(request))
    return pa.Table.from_batches(batches).sort_by("id")


def _expected(table: Table, row_filter: str | None = None) -> pa.Table:
    scan = table.scan(row_filter=row_filter) if row_filter else table.scan()
    return scan.to_arrow().sort_by("id")


def _same_rows(served: pa.Table, expected: pa.Table) -> bool:
    """Equal values, column by column; the cache serves ``string`` where pyiceberg reads ``large_string``."""
    return served.column_names == expected.column_names and served.cast(expected.schema).equals(expected)


@pytest.fixture()
def catalog(tmp_path):
    cat = make_catalog(str(tmp_path / "wh"), tmp_path / "catalog.db")
    cat.create_namespace("demo")
    return cat


def _evolved_table(catalog) -> Table:
    """Three generations of files: the first schema, then renamed + widened + added, then one
    column dropped and another added (absent from every file, so null throughout)."""
    first = pa.schema([pa.field("id", pa.int64()), pa.field("x", pa.int32()), pa.field("f", pa.float32())])
    table = catalog.create_table("demo.evolved", schema=first)
    ids = pa.array(range(ROWS_PER_APPEND), pa.int64())
    table.append(
        pa.table(
            {
                "id": ids,
                "x": pa.array(range(ROWS_PER_APPEND), pa.int32()),
                "f": pa.array([1.5] * ROWS_PER_APPEND, pa.float32()),
            }
        )
    )
    with table.update_schema() as update:
        update.rename_column("x", "x_renamed")
        update.update_column("x", LongType())  # the rename is applied at commit: still called x here
        update.update_column("f", DoubleType())
        update.add_column("extra", DoubleType())
    table = catalog.load_table("demo.evolved")
    ids = pa.array(range(ROWS_PER_APPEND, 2 * ROWS_PER_APPEND), pa.int64())
    table.append(
        pa.table(
            {
                "id": ids,
                "x_renamed": ids,
                "f": pa.array([2.5] * ROWS_PER_APPEND),
                "extra": pa.array([3.0] * ROWS_PER_APPEND),
            }
        )
    )
    with table.update_schema() as update:
        update.delete_column("extra")
        update.add_column("note", StringType())
    return catalog.load_table("demo.evolved")


@pytest.mark.slow
def test_an_evolved_schema_is_served_as_pyiceberg_reads_it(catalog):
    table = _evolved_table(catalog)
    assert len(list(table.scan().plan_files())) == 2
    expected = _expected(table)
    assert expected.column_names == ["id", "x_renamed", "f", "note"]

    with running_cache(table.metadata_location, data_nodes=3) as cache:
        served = _served(cache.endpoint, ShardRequest())
        # The renamed, widened column through the training client: the old files' int32 values
        # arrive under the new name as int64, the float32 ones as float64.
        dataset = DataCacheDataset(cache.endpoint, batch_size=256, columns=["id", "x_renamed", "f"])
        batches = list(dataset)

    assert _same_rows(served, expected)
    assert served.schema.field("x_renamed").type == pa.int64() and served.schema.field("f").type == pa.float64()
    assert served.column("note").null_count == served.num_rows == 2 * ROWS_PER_APPEND
    assert all(b["x_renamed"].dtype == b["id"].dtype and b["f"].dtype.is_floating_point for b in batches)
    ids = [i for b in batches for i in b["id"].tolist()]
    renamed = [v for b in batches for v in b["x_renamed"].tolist()]
    floats = [v for b in batches for v in b["f"].tolist()]
    assert sorted(ids) == list(range(2 * ROWS_PER_APPEND)) and renamed == ids
    assert sorted(floats) == [1.5] * ROWS_PER_APPEND + [2.5] * ROWS_PER_APPEND


def _partitioned_table(catalog) -> Table:
    schema = Schema(
        NestedField(1, "id", LongType(), required=False),
        NestedField(2, "category", StringType(), required=False),
        NestedField(3, "value", DoubleType(), required=False),
    )
    spec = PartitionSpec(PartitionField(source_id=2, field_id=1000, transform=IdentityTransform(), name="category"))
    table = catalog.create_table("demo.partitioned", schema=schema, partition_spec=spec)
    for generation, categories in enumerate((3, 5)):
        ids = range(generation * ROWS_PER_APPEND, (generation + 1) * ROWS_PER_APPEND)
        table.append(
            pa.table(
                {
                    "id": pa.array(ids, pa.int64()),
                    "category": [f"c{i % categories}" for i in ids],
                    "value": [i * 0.5 for i in ids],
                }
            )
        )
    return catalog.load_table("demo.partitioned")


@pytest.mark.slow
def test_a_partitioned_table_is_served_whole_and_filtered_on_its_partition_column(catalog):
    table = _partitioned_table(catalog)
    assert len(list(table.scan().plan_files())) == 8  # one file per category per append
    condition = "category = 'c4' AND id >= 1500"
    expected_filtered = _expected(table, "category == 'c4' and id >= 1500")
    assert 0 < expected_filtered.num_rows < ROWS_PER_APPEND

    with running_cache(table.metadata_location, data_nodes=4) as cache:
        served = _served(cache.endpoint, ShardRequest())
        filtered = _served(cache.endpoint, ShardRequest(filter=condition))
        shards = [_served(cache.endpoint, ShardRequest(shard=i, num_shards=3, shuffle=True, seed=7)) for i in range(3)]

    assert _same_rows(served, _expected(table))
    assert _same_rows(filtered, expected_filtered)
    shard_ids = [i for shard in shards for i in shard.column("id").to_pylist()]
    assert sorted(shard_ids) == list(range(2 * ROWS_PER_APPEND)), "shuffled shards: every row once"


def test_a_file_stored_with_view_types_is_served_when_nodes_split_it(catalog, tmp_path):
    """A Parquet file whose Arrow schema says string_view / binary_view (written by another tool)
    decodes to those types, and pyarrow cannot take rows of them: a node keeping part of such a
    file failed its load, so the same table loaded on one node and not on two."""
    import pyarrow.parquet as pq
    from pyiceberg.types import BinaryType

    schema = Schema(
        NestedField(1, "id", LongType(), required=False),
        NestedField(2, "s", StringType(), required=False),
        NestedField(3, "b", BinaryType(), required=False),
    )
    table = catalog.create_table("demo.views", schema=schema)
    rows = 3000
    path = tmp_path / "views.parquet"
    data = {
        "id": pa.array(range(rows), pa.int64()),
        "s": pa.array([f"v{i}" for i in range(rows)], pa.string_view()),
        "b": pa.array([f"b{i}".encode() for i in range(rows)], pa.binary_view()),
    }
    pq.write_table(pa.table(data), path)
    table.add_files([f"file://{path}"])
    table = catalog.load_table("demo.views")
    expected = pa.table({"id": data["id"], "s": data["s"].cast(pa.string()), "b": data["b"].cast(pa.binary())})
    with running_cache(table.metadata_location, data_nodes=3) as cache:
        served = _served(cache.endpoint, ShardRequest())
    assert served.num_rows == rows
    assert served.cast(expected.schema).equals(expected)
