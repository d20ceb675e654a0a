"""Planning real Iceberg tables: row splits, memory estimates and refusals."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kubeflow_data_cache.constants import BASELINE_MEMORY_BYTES
from kubeflow_data_cache.errors import ConfigError, MemoryBudgetError, TableLoadError, UnsupportedTableError
from kubeflow_data_cache.memory import check_fits, parse_bytes
from kubeflow_data_cache.plan import assign_rows, open_table, plan_table, s3_properties_from_env
from kubeflow_data_cache.sample import create_sample_table, make_catalog
from kubeflow_data_cache.store import NodeStore


def planned(table):
    t = open_table(table.metadata_location)
    return t, *plan_table(t, table.metadata_location)


def test_more_nodes_than_files_splits_rows(table_factory):
    table = table_factory(1000, 2)
    _, plan, _ = planned(table)
    assignments = assign_rows(plan, 5)
    assert [a.rows for a in assignments] == [200] * 5
    assert sum(p.stop - p.start for a in assignments for p in a.pieces) == 1000
    # One file is cut across several nodes.
    assert len({p.path for a in assignments for p in a.pieces}) == 2


def test_more_nodes_than_rows_gives_empty_nodes(table_factory):
    table = table_factory(3, 1)
    _, plan, _ = planned(table)
    assignments = assign_rows(plan, 5)
    assert sorted(a.rows for a in assignments) == [0, 0, 1, 1, 1]
    assert all(not a.pieces for a in assignments if a.rows == 0)


def test_empty_table(table_factory):
    table = table_factory(0, 1)
    _, plan, _ = planned(table)
    assert plan.rows == 0 and plan.files == ()
    assert [a.rows for a in assign_rows(plan, 3)] == [0, 0, 0]
    assert plan.schema.names[0] == "id"


def test_loaded_rows_match_the_plan_and_the_estimate_is_close(table_factory):
    table = table_factory(20_000, 3)
    t, plan, tasks = planned(table)
    assignments = assign_rows(plan, 2)
    stores = [NodeStore.load(t, tasks, plan.schema, list(a.pieces), 2) for a in assignments]
    ids = sorted(i for s in stores for b in s.batches for i in b.column("id").to_pylist())
    assert ids == list(range(20_000))
    actual = sum(s.nbytes for s in stores)
    assert 0.7 * actual <= plan.estimated_bytes <= 2.0 * actual


def test_memory_refusal_names_the_fix():
    need = [3 << 30, 3 << 30]
    with pytest.raises(MemoryBudgetError) as err:
        check_fits(need, [(1 << 30) + BASELINE_MEMORY_BYTES] * 2)
    message = str(err.value)
    assert "use at least 6 data nodes (CLUSTER_SIZE=7)" in message
    assert "WORKER_MEM" in message
    check_fits(need, [None, None])  # no budget known: nothing to refuse
    check_fits(need, [(4 << 30) + BASELINE_MEMORY_BYTES] * 2)


@pytest.mark.parametrize(("text", "value"), [("4Gi", 4 << 30), ("512Mi", 512 << 20), ("2G", 2 * 10**9), ("1024", 1024)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_parse_bytes_rejects_garbage():
    with pytest.raises(ConfigError, match="MEMORY_LIMIT.*4Gi"):
        parse_bytes("lots")


def test_missing_metadata_names_the_variable(tmp_path):
    with pytest.raises(TableLoadError, match="METADATA_LOC .* does not exist"):
        open_table(str(tmp_path / "nope.metadata.json"))


def test_internal_column_names_are_refused(tmp_path):
    catalog = make_catalog(str(tmp_path / "wh"), tmp_path / "c.db")
    catalog.create_namespace("s")
    data = pa.table({"id": pa.array([1, 2], pa.int64()), "__dc_row": pa.array([1, 2], pa.int64())})
    tbl = catalog.create_table("s.t", schema=data.schema)
    tbl.append(data)
    t = open_table(catalog.load_table("s.t").metadata_location)
    with pytest.raises(UnsupportedTableError, match="__dc_row.*rename"):
        plan_table(t, "x")


def test_s3_properties_from_standard_env():
    props = s3_properties_from_env(
        {"AWS_ENDPOINT_URL": "http://a", "AWS_ENDPOINT_URL_S3": "http://b", "AWS_DEFAULT_REGION": "eu-west-1"}
    )
    assert props == {"s3.endpoint": "http://b", "s3.region": "eu-west-1"}
    assert "s3.access-key-id" not in props  # left to the AWS chain (IRSA, profiles) unless set


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(0, 400), files=st.integers(1, 6), nodes=st.integers(1, 7))
def test_property_real_tables_every_row_loaded_once(tmp_path_factory, rows, files, nodes):
    """Random row, file and node counts on real tables: the nodes' loads partition the table."""
    warehouse = tmp_path_factory.mktemp("prop")
    table = create_sample_table(str(warehouse), rows, files, with_text=False)
    t, plan, tasks = planned(table)
    loaded = []
    for a in assign_rows(plan, nodes):
        store = NodeStore.load(t, tasks, plan.schema, list(a.pieces), 2)
        assert store.num_rows == a.rows
        loaded += [i for b in store.batches for i in b.column("id").to_pylist()]
    assert sorted(loaded) == list(range(rows))
