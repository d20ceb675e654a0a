"""Wide tables: what the head and the data nodes do per column is done once per call, not once
per column per column. ``pa.Schema.names`` builds a new list on each access, and asking it inside a
loop over the columns made GetFlightInfo and DoGet quadratic in them: 2.5 s a call at 4,000
columns with nulls, and 40 readers of such a table all timed out."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from kubeflow_data_cache.client import CacheClient
from kubeflow_data_cache.head import Head, summed_figures
from kubeflow_data_cache.protocol import ShardRequest
from kubeflow_data_cache.sample import make_catalog
from kubeflow_data_cache.store import NodeStore
from tests.conftest import running_cache

COLUMNS = 1000


class CountingSchema:
    """A schema that counts reads of its ``names``."""

    def __init__(self, schema: pa.Schema):
        self._schema = schema
        self.names_read = 0

    @property
    def names(self) -> list[str]:
        self.names_read += 1
        return self._schema.names

    def __getattr__(self, name):
        return getattr(self._schema, name)


def _wide(rows: int) -> pa.Table:
    ids = np.arange(rows, dtype=np.int64)
    columns = {"id": pa.array(ids)}
    for c in range(COLUMNS - 1):
        columns[f"c{c:04d}"] = pa.array((ids + c).astype(np.float32), mask=ids % 7 == c % 7)
    return pa.table(columns)


def test_a_projection_reads_the_schemas_names_once_not_per_column():
    batch = _wide(3).combine_chunks().to_batches()[0]
    store = NodeStore(batch.schema, [batch])
    store.schema = counting = CountingSchema(batch.schema)
    projected = store.project(tuple(batch.schema.names))
    assert projected.names == batch.schema.names
    assert counting.names_read <= 2


def test_the_heads_per_column_figures_read_the_schemas_names_once_not_per_column():
    schema = _wide(0).schema
    head = Head.__new__(Head)
    head.plan = SimpleNamespace(schema=CountingSchema(schema))
    assert head._projected_schema(tuple(schema.names)).names == schema.names
    nulls = {name: 1 for name in schema.names}
    lengths = {name: [1, 2] for name in schema.names}
    head.node_status = {0: {"null_counts": nulls, "list_lengths": lengths}, 1: {"null_counts": nulls}}
    summed = summed_figures(head.node_status.values())
    assert summed["null_counts"] == {name: 2 for name in schema.names}
    assert summed["list_lengths"] == lengths
    assert head.plan.schema.names_read <= 2


@pytest.fixture(scope="module")
def wide_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("wide")
    catalog = make_catalog(str(root / "wh"), root / "catalog.db")
    catalog.create_namespace("demo")
    table = catalog.create_table("demo.wide", schema=_wide(0).schema)
    table.append(_wide(700))
    with running_cache(table.metadata_location, data_nodes=2) as cache:
        yield cache


def test_a_wide_table_with_nulls_in_every_column_is_read_whole(wide_cache):
    with CacheClient(wide_cache.endpoint) as client:
        info = client.get_flight_info(ShardRequest())
        assert len(info.schema) == COLUMNS and info.total_records == 700
        read = pa.Table.from_batches(list(client.read_shard(ShardRequest())))
    assert read.num_rows == 700 and read.column_names == _wide(0).column_names
    assert read.equals(_wide(700).cast(read.schema))
