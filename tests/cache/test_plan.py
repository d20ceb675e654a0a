"""Planning real Iceberg tables: row splits, memory estimates and refusals."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kubeflow_data_cache.constants import BASELINE_MEMORY_BYTES
from kubeflow_data_cache.errors import ConfigError, MemoryBudgetError, TableLoadError, UnsupportedTableError
from kubeflow_data_cache.memory import (
    LoadMemoryGuard,
    LoadMemoryWatch,
    check_fits,
    load_guard_threshold,
    load_watch_threshold,
    local_load_threads,
    parse_bytes,
    resident_bytes,
)
from kubeflow_data_cache.plan import (
    FilePlan,
    Piece,
    TablePlan,
    _open_error,
    assign_rows,
    estimated_node_memory,
    open_table,
    plan_table,
)
from kubeflow_data_cache.s3_settings import s3_properties_from_env
from kubeflow_data_cache.sample import create_sample_table, make_catalog, sample_batch
from kubeflow_data_cache.store import NodeStore
from tests.cache.conftest import held_and_estimated, pool_peak_in_a_fresh_process, table_in_files
from tests.conftest import json_from_a_fresh_process

# What the trust check looks for; the S3 client itself never reads it in these tests.
PEM_SHAPED = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


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


def test_empty_table(table_factory, caplog):
    table = table_factory(0, 1)
    _, plan, _ = planned(table)
    assert plan.rows == 0 and plan.files == ()
    assert [a.rows for a in assign_rows(plan, 3)] == [0, 0, 0]
    assert plan.schema.names[0] == "id"
    # Served, but said: a table's first metadata file, before its first commit, is an easy
    # METADATA_LOC to give by mistake, and READY with 0 rows said nothing of it.
    assert "has no snapshot, so the cache serves no rows: if it should have some, point METADATA_LOC" in caplog.text


def test_a_snapshot_with_every_row_deleted_is_said_to_hold_none(tmp_path, caplog):
    from pyiceberg.expressions import AlwaysTrue

    from kubeflow_data_cache.sample import make_catalog

    table_in_files(tmp_path, pa.table({"id": pa.array([1, 2, 3], pa.int64())}))
    catalog = make_catalog(str(tmp_path / "wh"), tmp_path / "c.db")
    catalog.load_table("s.t").delete(AlwaysTrue())
    location = catalog.load_table("s.t").metadata_location
    _, plan, _ = planned_location(location)
    assert plan.rows == 0 and plan.snapshot_id is not None
    assert f"the table's current snapshot ({plan.snapshot_id}) holds no rows, so the cache serves none" in caplog.text


def test_loaded_rows_match_the_plan_and_the_estimate_is_close(table_factory):
    table = table_factory(20_000, 3)
    t, plan, tasks = planned(table)
    assignments = assign_rows(plan, 2)
    stores = [NodeStore.load(t, tasks, plan.schema, list(a.pieces), 2) for a in assignments]
    ids = sorted(i for s in stores for b in s.batches for i in b.column("id").to_pylist())
    assert ids == list(range(20_000))
    actual = sum(s.nbytes for s in stores)
    assert 0.7 * actual <= plan.estimated_bytes <= 2.0 * actual


def _nested_table(tmp_path, rows: int, properties: dict[str, str] | None = None):
    """An embedding table: a list<float> of 256 values, a struct and a map per row."""
    rng = np.random.default_rng(0)
    embedding = pa.array(list(rng.random((rows, 256), dtype=np.float32)), pa.list_(pa.float32()))
    meta = pa.array([{"score": float(i), "tag": f"t{i % 7}"} for i in range(rows)])
    attrs = pa.array([[("a", i), ("b", -i)] for i in range(rows)], pa.map_(pa.string(), pa.int64()))
    data = pa.table({"id": pa.array(range(rows), pa.int64()), "embedding": embedding, "meta": meta, "attrs": attrs})
    catalog = make_catalog(str(tmp_path / "wh"), tmp_path / "c.db")
    catalog.create_namespace("s")
    tbl = catalog.create_table("s.nested", schema=data.schema, properties=properties or {})
    tbl.append(data)
    return catalog.load_table("s.nested").metadata_location


@pytest.mark.parametrize("metrics", ["default", "counts", "none"])
def test_nested_columns_are_estimated_from_their_leaves(tmp_path, metrics):
    """Iceberg keeps sizes and counts per leaf (list element, struct child), not per column: the
    estimate of each column must still come close to what the node holds, or the memory check
    passes a table 100x too large for the nodes; also where the table keeps fewer statistics
    (write.metadata.metrics.default: counts only, or none at all)."""
    properties = {} if metrics == "default" else {"write.metadata.metrics.default": metrics}
    location = _nested_table(tmp_path, 3000, properties)
    t = open_table(location)
    plan, tasks = plan_table(t, location)
    (assignment,) = assign_rows(plan, 1)
    store = NodeStore.load(t, tasks, plan.schema, list(assignment.pieces), 1)
    estimated = {name: sum(f.column_bytes[i] for f in plan.files) for i, name in enumerate(plan.schema.names)}
    for name, actual in store.column_bytes.items():
        assert 0.7 * actual <= estimated[name] <= 3.0 * actual, (name, estimated[name], actual)


def shared_evenly(peaks: list[int]):
    """A table whose peak memory divides evenly over any number of data nodes."""
    return lambda n: [-(-sum(peaks) // n)] * n


def test_memory_refusal_names_the_fix():
    need, peak = [3 << 30, 3 << 30], [4 << 30, 4 << 30]
    with pytest.raises(MemoryBudgetError) as err:
        check_fits(need, peak, [(1 << 30) + BASELINE_MEMORY_BYTES] * 2, shared_evenly(peak))
    message = str(err.value)
    assert "use at least 8 data nodes (CLUSTER_SIZE=9)" in message
    assert "4.00 GiB at its peak while loading" in message
    assert "WORKER_MEM" in message
    check_fits(need, peak, [None, None], shared_evenly(peak))  # no budget known: nothing to refuse
    check_fits(need, peak, [(4 << 30) + BASELINE_MEMORY_BYTES] * 2, shared_evenly(peak))


def test_the_advised_node_count_is_one_whose_real_estimate_fits(table_factory):
    """With the plan's own estimate for each node count (read scratch does not shrink with the
    share), the count named is the fewest that fits; following the summed-peaks guess was refused
    again, sometimes naming the count already in use."""
    table = table_factory(200_000, 4)
    plan, _ = plan_table(open_table(table.metadata_location), table.metadata_location)

    def peaks_for(n: int) -> list[int]:
        return [estimated_node_memory(plan, a, 1)[1] for a in assign_rows(plan, n)]

    one_node_peak = peaks_for(1)[0]
    budget = one_node_peak // 2 + BASELINE_MEMORY_BYTES  # half of one node's peak
    loaded = [estimated_node_memory(plan, a, 1)[0] for a in assign_rows(plan, 2)]
    with pytest.raises(MemoryBudgetError) as err:
        check_fits(loaded, peaks_for(2), [budget] * 2, peaks_for=peaks_for)
    advised = int(re.search(r"use at least (\d+) data nodes", str(err.value)).group(1))
    assert max(peaks_for(advised)) <= budget - BASELINE_MEMORY_BYTES
    assert max(peaks_for(advised - 1)) > budget - BASELINE_MEMORY_BYTES
    # A budget below one file's read scratch: no node count is named.
    with pytest.raises(MemoryBudgetError, match="more data nodes alone would not fit it"):
        check_fits(loaded, peaks_for(2), [BASELINE_MEMORY_BYTES + 1024] * 2, peaks_for=peaks_for)
    # A limit that does not even hold the interpreter: that is the reason, not a file's scratch.
    with pytest.raises(MemoryBudgetError, match="no number of data nodes fits a limit at or below the 400") as err:
        check_fits(loaded, peaks_for(2), [100 << 20] * 2, peaks_for=peaks_for)
    assert "read scratch" not in str(err.value)


def test_memory_refusal_under_local_names_its_flags_in_mib():
    """`data-cache local` budgets are small and set by its own flags, not a pod's knobs."""
    with pytest.raises(MemoryBudgetError) as err:
        check_fits([3 << 20], [4 << 20], [(1 << 20) + BASELINE_MEMORY_BYTES], shared_evenly([4 << 20]), local=True)
    message = str(err.value)
    assert "use at least 4 data nodes (--data-nodes 4)" in message
    assert "4.0 MiB at its peak while loading" in message and "can use 1.0 MiB" in message
    assert "(--memory-limit)" in message
    assert "0.00 GiB" not in message and "CLUSTER_SIZE" not in message and "WORKER_MEM" not in message


def test_a_share_that_fits_but_whose_load_peak_does_not_is_refused():
    """Room for the rows but not for the copy of the column being merged: refused up front,
    not OOM-killed half way through the load."""
    with pytest.raises(MemoryBudgetError, match="at its peak while loading"):
        peak = [(3 << 30) + (1 << 29)]
        check_fits([3 << 30], peak, [(3 << 30) + (1 << 28) + BASELINE_MEMORY_BYTES], shared_evenly(peak))


def _row_grouped_table(tmp_path, rows: int, row_group_rows: int) -> str:
    """One data file of sample rows cut into several Parquet row groups (the unit a read decodes)."""
    catalog = make_catalog(str(tmp_path / "wh"), tmp_path / "c.db")
    catalog.create_namespace("s")
    table = catalog.create_table(
        "s.grouped",
        schema=sample_batch(0, 0).schema,
        properties={"write.parquet.row-group-limit": str(row_group_rows)},
    )
    table.append(sample_batch(0, rows))
    return catalog.load_table("s.grouped").metadata_location


@pytest.mark.parametrize("layout", ["3 small files", "1 file of 5 row groups"])
def test_the_load_peak_estimate_covers_a_real_loads_peak_without_overstating_it(table_factory, tmp_path, layout):
    """A fresh process loads the table as a data node would; its Arrow pool's peak (everything the
    load held at once) stays within the estimate the head checks before it sends the load, and
    the estimate is not so far above it that tables which fit are refused."""
    if layout == "3 small files":
        location = table_factory(60_000, 3).metadata_location
    else:
        location = _row_grouped_table(tmp_path, 150_000, 30_000)
    t = open_table(location)
    plan, _ = plan_table(t, location)
    (assignment,) = assign_rows(plan, 1)
    if layout != "3 small files":
        assert plan.files[0].row_groups == 5
    measured = pool_peak_in_a_fresh_process(
        location,
        "(a,) = assign_rows(plan, 1)",
        "store = NodeStore.load(t, tasks, plan.schema, list(a.pieces), 1)",
        "{'rows_bytes': store.nbytes}",
        # As a node on a larger machine decodes: more columns in decode at once hold more (the
        # peak varies with their timing: with this machine's 2 threads it once came out above an
        # estimate that 8 threads often exceeded).
        decode_threads=8,
    )
    loaded, estimate = estimated_node_memory(plan, assignment, load_threads=1)
    assert measured["peak"] > measured["rows_bytes"]  # reading and merging really hold more than the rows
    # The model errs high where row groups are small (about 2x for this one; 1.0-1.3x at the
    # default 1M-row groups), never low; an estimate 3x the peak refused tables that fit.
    assert measured["peak"] <= estimate <= 2.5 * measured["peak"], (measured, estimate)
    assert estimate > loaded


def test_a_node_keeping_a_few_rows_of_a_large_file_decodes_a_window_of_it_not_all(tmp_path):
    """pyiceberg's public reader decodes a whole file before yielding its first batch: a node
    keeping 1% of a file held all of it decoded (128 MiB here, for 1.3 MiB kept), far above the
    peak the head had checked against the node's memory. The node streams the file instead, so
    it holds a read-ahead window, and the head's peak estimate covers that window."""
    catalog = make_catalog(str(tmp_path / "wh"), tmp_path / "c.db")
    catalog.create_namespace("s")
    rows = 8_000_000
    i = np.arange(rows, dtype=np.int64)
    numbers = pa.table({"a": i % 100, "b": (i // 1000).astype(np.float64)})  # compresses to ~0.3 MB
    table = catalog.create_table("s.big", schema=numbers.schema, properties={"write.parquet.row-group-limit": "100000"})
    table.append(numbers)
    location = catalog.load_table("s.big").metadata_location
    plan, _ = plan_table(open_table(location), location)
    first = assign_rows(plan, 100)[0]
    measured = pool_peak_in_a_fresh_process(
        location,
        "(piece,) = assign_rows(plan, 100)[0].pieces",
        "kept = read_piece(t, tasks[piece.path], piece)",
        "{'rows': sum(b.num_rows for b in kept)}",
    )
    decoded_file = rows * 16
    assert measured["rows"] == rows // 100
    assert measured["peak"] < decoded_file / 2, measured  # ~35 MiB of a 128 MiB file here
    assert measured["peak"] <= estimated_node_memory(plan, first, load_threads=1)[1]


def test_a_local_file_is_read_without_holding_its_compressed_row_groups(tmp_path):
    """pyiceberg opens every Parquet file pre-buffered: pyarrow reads the compressed chunks of all
    its row groups up front and keeps them until the file is done. From a local path that bought
    no speed and held the whole file beside what the reader decodes: a node keeping the last 1%
    of a 90 MB file of random floats peaked at ~1.9x the file, ~1.05x without."""
    catalog = make_catalog(str(tmp_path / "wh"), tmp_path / "c.db")
    catalog.create_namespace("s")
    rng = np.random.default_rng(0)
    rows = 1_000_000
    floats = pa.table({f"c{i}": rng.random(rows) for i in range(10)})  # random floats do not compress
    table = catalog.create_table(
        "s.floats", schema=floats.schema, properties={"write.parquet.row-group-limit": "100000"}
    )
    table.append(floats)
    location = catalog.load_table("s.floats").metadata_location
    measured = pool_peak_in_a_fresh_process(
        location,
        "(piece,) = assign_rows(plan, 100)[-1].pieces",
        "kept = read_piece(t, tasks[piece.path], piece)",
        "{'rows': sum(b.num_rows for b in kept), 'stored': tasks[piece.path].file.file_size_in_bytes}",
    )
    assert measured["rows"] == rows // 100
    assert measured["peak"] < 1.5 * measured["stored"], measured


@pytest.mark.parametrize(
    ("text", "value"),
    [
        *(("4Gi", 4 << 30), ("512Mi", 512 << 20), ("2G", 2 * 10**9), ("1024", 1024), ("1e9", 10**9)),
        *(("1.5Gi", 3 << 29), ("1E", 10**18), ("7Ei", 7 << 60)),  # exa, not an exponent
        # A fraction of a byte past the first rounds up, as Kubernetes reads it (1.5 was 1 byte).
        *(("1.5", 2), ("0.1Ki", 103), ("1.0000000001G", 1_000_000_001)),
        ("123456789012345678", 123456789012345678),  # exactly (a float lost the last digits)
        ("1.0000000000000000000000000001", 2),  # past Decimal's default 28 digits
    ],
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lots", "a Kubernetes quantity such as 4Gi"),
        # As Kubernetes reads them: m is a thousandth (500m was taken as 500 MB), and the
        # suffixes are case-sensitive, with no B.
        ("500m", "fraction of a byte (m means a thousandth): write 500Mi or 500M"),
        ("0.5", "less than one byte"),
        ("8Ei", "too large to be a memory size"),
        ("9223372036854775807.5", "too large to be a memory size"),  # rounds up to 2^63
        ("2GB", "case-sensitive, with no B"),
        ("4gi", "case-sensitive"),
        ("1e400", "too large to be a memory size"),
    ],
)
def test_parse_bytes_refuses_what_kubernetes_would_not_read_as_bytes(text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_bytes(text)


def test_missing_metadata_names_the_variable(tmp_path):
    with pytest.raises(TableLoadError, match="METADATA_LOC .* does not exist"):
        open_table(str(tmp_path / "nope.metadata.json"))


def test_a_percent_escaped_local_uri_is_named_with_the_path_as_pyiceberg_reads_it(tmp_path):
    """Path.as_uri() writes "my wh" as "my%20wh"; pyiceberg reads a local URI as it stands, so the
    file it names was called missing with no hint of why."""
    table = create_sample_table(str(tmp_path / "my wh"), 10, 1)
    escaped = Path(table.metadata_location.removeprefix("file://")).as_uri()
    assert "%20" in escaped
    with pytest.raises(TableLoadError, match="pyiceberg does not decode percent-escapes") as err:
        open_table(escaped)
    assert repr(table.metadata_location) in str(err.value)
    assert open_table(table.metadata_location).metadata_location == table.metadata_location


def test_a_directory_is_not_called_missing(tmp_path):
    for location in (str(tmp_path), f"file://{tmp_path}"):
        with pytest.raises(TableLoadError, match="is a directory: METADATA_LOC must be a table's metadata.json file"):
            open_table(location)


# Built by pyiceberg as a table's FileIO only if the table's own properties are handed to it.
CONSTRUCTED_FROM_TABLE_PROPERTIES: list[dict] = []


class RecordingFileIO:
    def __init__(self, properties: dict) -> None:
        CONSTRUCTED_FROM_TABLE_PROPERTIES.append(dict(properties))


def test_the_tables_own_properties_do_not_set_how_its_files_are_read(tmp_path, caplog):
    """pyiceberg overlays a static table's metadata properties on the FileIO's: a metadata.json
    could send the cache's signed reads to another endpoint, or name a class to construct with
    the properties (`subprocess.Popen` ran a command, `logging.warning` logged the secret key)."""
    import json

    table = create_sample_table(str(tmp_path / "wh"), 100, 1)
    metadata = json.loads(Path(table.metadata_location.removeprefix("file://")).read_text())
    metadata["properties"] |= {
        "py-io-impl": f"{__name__}.RecordingFileIO",
        "s3.endpoint": "http://127.0.0.1:9",
        "s3.secret-access-key": "from-the-table",
        "write.format.default": "parquet",  # not a FileIO setting: not named
    }
    forged = Path(table.metadata_location.removeprefix("file://")).with_name("00099-forged.metadata.json")
    forged.write_text(json.dumps(metadata))

    opened = open_table(str(forged), {"s3.endpoint": "http://127.0.0.1:5000"})

    assert CONSTRUCTED_FROM_TABLE_PROPERTIES == []
    assert opened.io.properties == {"s3.endpoint": "http://127.0.0.1:5000"}
    assert opened.scan().to_arrow().num_rows == 100
    (warning,) = [r.getMessage() for r in caplog.records if "the cache ignores" in r.getMessage()]
    assert "set 'py-io-impl, s3.endpoint, s3.secret-access-key', which the cache ignores" in warning
    assert "from-the-table" not in caplog.text and "write.format" not in warning


def test_a_file_that_is_not_a_metadata_json_is_named(tmp_path):
    """pyiceberg takes any other name for a table folder and fails on its version-hint.text."""
    other = tmp_path / "table.json"
    other.write_text("{}")
    for location in (str(other), f"file://{other}"):
        with pytest.raises(
            TableLoadError, match=r"is not a metadata file: METADATA_LOC must name a table's \*\.metadata\.json"
        ):
            open_table(location)


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ('{"a": 1}', "(it has no 'format-version')"),
        ("", "('Invalid JSON: EOF while parsing a value at line 1 column 0')"),
        ("not json", "('Invalid JSON: expected ident at line 1 column 2')"),
        ('{"format-version": 2, "table-uuid": "x"}', "('Field required at location')"),
    ],
)
def test_a_metadata_file_that_is_not_table_metadata_says_so_and_names_the_fix(tmp_path, content, said):
    """Empty, not JSON, or JSON of something else: pyiceberg's message was pydantic's report,
    ending in a link to pydantic's docs, and named no fix."""
    other = tmp_path / "00001-x.metadata.json"
    other.write_text(content)
    with pytest.raises(TableLoadError) as err:
        open_table(str(other))
    message = str(err.value)
    assert message.startswith(f"METADATA_LOC {str(other)!r} is not Iceberg table metadata {said}: point it at ")
    assert "pydantic" not in message and "\n" not in message


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
    # A custom endpoint without a region (MinIO) gets the SDKs' default rather than a lookup of the
    # bucket on public AWS; without an endpoint, pyiceberg still finds the bucket's region.
    assert s3_properties_from_env({"AWS_ENDPOINT_URL": "http://minio:9000"})["s3.region"] == "us-east-1"
    assert "s3.region" not in s3_properties_from_env({})


def test_the_s3_clients_timeouts_and_addressing_reach_its_filesystem():
    """A store slower than 3 s to answer failed every load, with nothing to set; a store that
    takes only virtual-hosted requests (bucket.host) could not be read at all."""
    from pyiceberg.io.pyarrow import PyArrowFileIO

    env = {
        "AWS_ENDPOINT_URL": "http://minio:9000",
        "AWS_TIMEOUT": "30s",
        "AWS_CONNECT_TIMEOUT": "1500ms",
        "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "true",
    }
    props = s3_properties_from_env(env)
    settings = PyArrowFileIO(props).fs_by_scheme("s3", "bucket").__reduce__()[1][0]
    assert (settings["request_timeout"], settings["connect_timeout"]) == (30.0, 1.5)
    assert settings["force_virtual_addressing"] is True
    assert s3_properties_from_env({"AWS_TIMEOUT": "45"})["s3.request-timeout"] == "45.0"  # seconds
    # humantime's spellings, as object_store (whose names these are) reads them: "1min" was refused.
    for spelled, seconds in (("2m", 120.0), ("1min", 60.0), ("1m 30s", 90.0), ("1h", 3600.0), ("250ms", 0.25)):
        assert s3_properties_from_env({"AWS_TIMEOUT": spelled})["s3.request-timeout"] == str(seconds), spelled
    assert s3_properties_from_env({"AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "on"})["s3.force-virtual-addressing"] == "true"
    assert s3_properties_from_env({"AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "false"}) == {
        "s3.force-virtual-addressing": "false"
    }
    unset = PyArrowFileIO(s3_properties_from_env({"AWS_ENDPOINT_URL": "http://minio:9000"}))
    assert unset.fs_by_scheme("s3", "bucket").__reduce__()[1][0]["force_virtual_addressing"] is False


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"AWS_TIMEOUT": "soon"}, "AWS_TIMEOUT='soon' should be a positive duration: seconds (30), or 30s"),
        ({"AWS_TIMEOUT": "30 parsecs"}, "AWS_TIMEOUT='30 parsecs' should be a positive duration"),
        ({"AWS_TIMEOUT": "1m 30"}, "AWS_TIMEOUT='1m 30' should be a positive duration"),  # a bare number only alone
        ({"AWS_TIMEOUT": "0"}, "AWS_TIMEOUT='0' should be a positive duration"),
        ({"AWS_CONNECT_TIMEOUT": "-1s"}, "AWS_CONNECT_TIMEOUT='-1s' should be a positive duration"),
        ({"AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "maybe"}, "AWS_VIRTUAL_HOSTED_STYLE_REQUEST='maybe' should be true"),
    ],
)
def test_s3_client_settings_that_cannot_work_are_refused_naming_them(env, says):
    with pytest.raises(ConfigError) as refused:
        s3_properties_from_env(env)
    assert str(refused.value).startswith(says)


def test_s3_settings_that_cannot_work_are_refused_naming_the_variable():
    """An endpoint without a scheme was taken as https ("SSL connect error ... wrong version
    number"), and half a key pair failed in pyarrow's words; a lone session token, which the AWS
    SDKs skip, broke a profile or IRSA that works everywhere else."""
    with pytest.raises(ConfigError, match=r"AWS_ENDPOINT_URL_S3='minio:9000' has no scheme: write http://minio:9000"):
        s3_properties_from_env({"AWS_ENDPOINT_URL_S3": "minio:9000"})
    with pytest.raises(ConfigError, match="AWS_SECRET_ACCESS_KEY is not set but AWS_ACCESS_KEY_ID is"):
        s3_properties_from_env({"AWS_ACCESS_KEY_ID": "AKIA..."})
    with pytest.raises(ConfigError, match="AWS_ACCESS_KEY_ID is not set but AWS_SECRET_ACCESS_KEY is"):
        s3_properties_from_env({"AWS_SECRET_ACCESS_KEY": "s"})
    assert s3_properties_from_env({"AWS_SESSION_TOKEN": "stray", "AWS_PROFILE": "team"}) == {}
    pair = s3_properties_from_env({"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "s", "AWS_SESSION_TOKEN": "t"})
    assert pair == {"s3.access-key-id": "a", "s3.secret-access-key": "s", "s3.session-token": "t"}
    assert s3_properties_from_env({"AWS_ENDPOINT_URL": "HTTPS://store:443"})["s3.endpoint"] == "https://store:443"


@pytest.mark.parametrize(
    "endpoint", ["http://minioadmin:SuperSecretPw@127.0.0.1:9000", "https://admin@store", " http://a:Pw@minio/ "]
)
def test_an_endpoint_with_a_password_is_refused_without_showing_it(endpoint):
    """The S3 client took the user name for the host, and "cannot reach the object store at
    http://minioadmin:SuperSecretPw@..." reached the unauthenticated /ready and /status."""
    with pytest.raises(ConfigError, match="AWS_ENDPOINT_URL holds a user name or password") as refused:
        s3_properties_from_env({"AWS_ENDPOINT_URL": endpoint})
    assert "Pw" not in str(refused.value) and "admin" not in str(refused.value)
    # An '@' in the path or the query is not a user name.
    for fine in ("http://minio:9000/a@b", "http://minio:9000?x=a@b", "http://minio:9000#a@b"):
        assert s3_properties_from_env({"AWS_ENDPOINT_URL": fine})["s3.endpoint"] == fine


def test_aws_ca_bundle_is_trusted_by_the_s3_client(tmp_path):
    """pyarrow's S3 client reads SSL_CERT_FILE, not AWS_CA_BUNDLE (which a review proved was
    ignored against a TLS store with a private CA, where SSL_CERT_FILE worked)."""
    from kubeflow_data_cache.s3_settings import trust_aws_ca_bundle

    bundle = tmp_path / "ca.pem"
    bundle.write_text(PEM_SHAPED)
    environ = {"AWS_CA_BUNDLE": str(bundle)}
    trust_aws_ca_bundle(environ)
    assert environ["SSL_CERT_FILE"] == str(bundle)
    environ = {"AWS_CA_BUNDLE": str(bundle), "SSL_CERT_FILE": "/etc/ssl/mine.pem"}
    trust_aws_ca_bundle(environ)
    assert environ["SSL_CERT_FILE"] == "/etc/ssl/mine.pem"  # one set by hand wins


def test_a_missing_aws_ca_bundle_is_refused_naming_it(tmp_path):
    """Made SSL_CERT_FILE as it was, it failed every TLS handshake with the store, saying nothing of the file."""
    from kubeflow_data_cache.s3_settings import trust_aws_ca_bundle

    for environ in ({}, {"SSL_CERT_FILE": "/etc/ssl/mine.pem"}):  # also where SSL_CERT_FILE wins
        with pytest.raises(ConfigError, match=r"AWS_CA_BUNDLE='.*/gone.pem' is not a file: give the path"):
            trust_aws_ca_bundle({**environ, "AWS_CA_BUNDLE": str(tmp_path / "gone.pem")})


def test_ca_files_curl_takes_are_taken_and_a_link_to_the_same_file_is_not_warned_of(tmp_path, caplog):
    """OpenSSL's TRUSTED CERTIFICATE blocks (RHEL's ca-bundle.trust.crt) were refused as no PEM;
    an SSL_CERT_FILE that is a link to the bundle itself was warned of as hiding it."""
    from kubeflow_data_cache.s3_settings import trust_aws_ca_bundle

    trusted = tmp_path / "trust.crt"
    trusted.write_text("# RHEL\r\n-----BEGIN TRUSTED CERTIFICATE-----\r\nMIIB\r\n-----END TRUSTED CERTIFICATE-----\r\n")
    environ = {"AWS_CA_BUNDLE": str(trusted)}
    trust_aws_ca_bundle(environ)
    assert environ["SSL_CERT_FILE"] == str(trusted)
    (tmp_path / "link.crt").symlink_to(trusted)
    with caplog.at_level("WARNING", logger="kubeflow_data_cache.s3_settings"):
        trust_aws_ca_bundle({"AWS_CA_BUNDLE": str(trusted), "SSL_CERT_FILE": str(tmp_path / "link.crt")})
        assert caplog.records == []
        trust_aws_ca_bundle({"AWS_CA_BUNDLE": str(trusted), "SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt"})
    assert "is set, so the object store's CA in" in caplog.text


def test_a_store_ca_folder_that_is_not_there_is_refused_naming_it(tmp_path):
    """The mounted volume is an empty folder where the ConfigMap is missing: a folder that does not
    exist is a typo, which was ignored, the store's CA with it."""
    from kubeflow_data_cache.s3_settings import trust_aws_ca_bundle

    with pytest.raises(ConfigError, match=r"DATA_CACHE_S3_CA_DIR='.*/typo' is not a folder: give the folder"):
        trust_aws_ca_bundle({"DATA_CACHE_S3_CA_DIR": str(tmp_path / "typo")})


def test_the_store_ca_mounted_by_the_initializer_is_trusted_where_the_folder_has_one(tmp_path):
    """DATA_CACHE_S3_CA_DIR: the optional ConfigMap volume. Empty (no ConfigMap in the namespace),
    the image's own CAs stay; AWS_CA_BUNDLE, given explicitly, wins over it."""
    from kubeflow_data_cache.s3_settings import trust_aws_ca_bundle

    environ = {"DATA_CACHE_S3_CA_DIR": str(tmp_path)}
    trust_aws_ca_bundle(environ)
    assert "SSL_CERT_FILE" not in environ
    (tmp_path / "ca.crt").write_text(PEM_SHAPED)
    trust_aws_ca_bundle(environ)
    assert environ["SSL_CERT_FILE"] == str(tmp_path / "ca.crt")
    explicit = tmp_path / "other.pem"
    explicit.write_text(PEM_SHAPED)
    environ = {"DATA_CACHE_S3_CA_DIR": str(tmp_path), "AWS_CA_BUNDLE": str(explicit)}
    trust_aws_ca_bundle(environ)
    assert environ["SSL_CERT_FILE"] == str(explicit)


def test_a_bad_request_on_the_metadata_names_the_session_token_and_region():
    # What pyarrow's S3 filesystem raises for a HEAD refused with 400 (an expired session token).
    err = OSError(
        "When getting information for key 'm.json' in bucket 'b': AWS Error UNKNOWN (HTTP status 400) "
        "during HeadObject operation: No response body."
    )
    refusal = _open_error("s3://b/m.json", "s3://b/m.json", err)
    assert refusal is not None and "AWS_SESSION_TOKEN" in str(refusal) and "AWS_REGION" in str(refusal)


# What pyarrow's S3 filesystem raised for each, word for word (a review's runs against fake
# stores and moto); the data files' errors come through the same text.
S3_ERRORS = {
    "wrong region": "When reading information for key 'd.parquet' in bucket 'b': AWS Error UNKNOWN (HTTP status "
    "301) during HeadObject operation: No response body.",
    "silent": "When reading information for key 'd.parquet' in bucket 'b': AWS Error NETWORK_CONNECTION "
    "during HeadObject operation: curlCode: 28, Timeout was reached; Details: Operation too slow.",
    "stalled": "AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 28, Timeout was reached; "
    "Details: Operation too slow. Less than 1 bytes/sec transferred the last 3 seconds",
    "unreachable": "When reading information for key 'd.parquet' in bucket 'b': AWS Error NETWORK_CONNECTION "
    "during HeadObject operation: curlCode: 7, Couldn't connect to server; Details: Failed to connect to "
    "minio port 9000: Connection refused",
    "other name": "When reading information for key 'd.parquet' in bucket 'b': AWS Error NETWORK_CONNECTION during "
    "HeadObject operation: curlCode: 60, SSL peer certificate or SSH remote key was not OK; Details: SSL: no "
    "alternative certificate subject name matches target IPv4 address '127.0.0.1'",
    "bad CA file": "When reading information for key 'd.parquet' in bucket 'b': AWS Error NETWORK_CONNECTION during "
    "HeadObject operation: curlCode: 77, Problem with the SSL CA cert (path? access rights?); Details: error "
    "adding trust anchors from file: /etc/ca.pem",
    # The store's refusals once the S3 client's retries ran out (moto answering 503 and 500).
    "throttled": "Could not open Parquet input source 's3://b/d.parquet': AWS Error SLOW_DOWN during GetObject "
    "operation: Reduce your request rate.",
    "failing": "Could not open Parquet input source 's3://b/d.parquet': AWS Error INTERNAL_FAILURE during GetObject "
    "operation: We encountered an internal error. Please try again.",
    # A 503 page from a load balancer, no S3 body: the SDK names the status alone.
    "unavailable": "Could not open Parquet input source 's3://b/d.parquet': AWS Error SERVICE_UNAVAILABLE during "
    "GetObject operation: ",
}


@pytest.mark.parametrize(
    ("case", "problem", "fix"),
    [
        ("wrong region", "the bucket is in another region than the one requests were sent to", "set AWS_REGION"),
        (
            "unreachable",
            "cannot reach the object store at http://minio:9000 (AWS_ENDPOINT_URL)",
            "check that AWS_ENDPOINT_URL names the store's host and port",
        ),
        # Reached, then nothing: "cannot reach" sent the reader to an address every earlier read used.
        *(
            (
                case,
                "the object store at http://minio:9000 (AWS_ENDPOINT_URL) was reached but stopped answering "
                "(a request timed out)",
                "check the store's health and load, and that AWS_ENDPOINT_URL names the store itself, not another "
                "service; a store that is slow to answer can be given longer with AWS_TIMEOUT (3 s unless set, "
                "e.g. AWS_TIMEOUT=30s)",
            )
            for case in ("silent", "stalled")
        ),
        (
            "other name",
            "the object store's certificate does not name the host it was reached at",
            "reach the store by a name its certificate carries (in AWS_ENDPOINT_URL)",
        ),
        (
            "bad CA file",
            "the CA file for the object store could not be loaded",
            "check that SSL_CERT_FILE (or AWS_CA_BUNDLE) names a readable file of PEM certificates",
        ),
        (
            "throttled",
            "the object store kept refusing requests as too many (503 SlowDown), past the S3 client's retries",
            "restart the cache once the store's load drops",
        ),
        (
            "unavailable",
            "the object store kept refusing requests as too many (503 SlowDown), past the S3 client's retries",
            "restart the cache once the store's load drops",
        ),
        (
            "failing",
            "the object store failed the requests (HTTP 500), past the S3 client's retries",
            "check the store's health and logs, then restart the cache",
        ),
    ],
)
def test_a_data_file_the_store_fails_names_the_setting_to_check(monkeypatch, case, problem, fix):
    """A data file's read named the file and the S3 client's text only: the endpoint and its
    variable, the region, the certificate went unsaid (the metadata read named some of them)."""
    from kubeflow_data_cache.plan import file_read_error

    for name in ("AWS_ENDPOINT_URL_S3", "SSL_CERT_FILE"):
        monkeypatch.delenv(name, raising=False)
    err = OSError(S3_ERRORS[case])
    message = file_read_error("s3://b/d.parquet", err, "http://minio:9000")
    assert message.startswith(f"cannot read data file s3://b/d.parquet: {problem}: {fix}"), message
    assert message.endswith(f"({S3_ERRORS[case]})")  # the client's own words are kept, after the fix
    metadata = str(_open_error("s3://b/m.metadata.json", "s3://b/m.metadata.json", err, "http://minio:9000"))
    assert metadata.startswith(f"{problem}, reading METADATA_LOC 's3://b/m.metadata.json': {fix}"), metadata


@pytest.mark.parametrize(
    "text",
    [
        # MinIO (Go's HTTP server) answers plain HTTP on its TLS port: 400, and a HEAD has no body.
        "When reading information for key 'm.json' in bucket 'b': AWS Error UNKNOWN (HTTP status 400) during "
        "HeadObject operation: No response body.",
        # Other TLS ports reset the connection.
        "When reading information for key 'm.json' in bucket 'b': AWS Error NETWORK_CONNECTION during HeadObject "
        "operation: curlCode: 56, Failure when receiving data from the peer",
    ],
)
def test_a_plain_http_endpoint_refused_as_a_tls_port_would_suggests_https(monkeypatch, text):
    """It was blamed on the session token or the region, or on the host and port alone."""
    from kubeflow_data_cache.s3_settings import store_trouble

    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    trouble = store_trouble(OSError(text), "http://minio:9000")
    assert trouble is not None and "write AWS_ENDPOINT_URL=https://minio:9000" in trouble.fix
    # An https:// endpoint, or AWS itself, has no such advice.
    assert "https://" not in store_trouble(OSError(text), "https://minio:9000").fix
    assert "https://" not in store_trouble(OSError(text), None).fix


def test_the_sdks_own_internal_failure_is_not_called_the_stores():
    """A small ranged read whose error body (a 403's) was larger than the read: the SDK fails
    to take it in and says INTERNAL_FAILURE, whatever the store answered."""
    from kubeflow_data_cache.s3_settings import store_trouble

    text = (
        "When reading from key 'd.parquet' in bucket 'b': AWS Error INTERNAL_FAILURE during GetObject operation: "
        "Failed to flush response stream (eof: 0, bad: 1)"
    )
    assert store_trouble(OSError(text), "http://minio:9000") is None  # its own words, not "HTTP 500"


def test_a_data_file_gone_between_planning_and_its_read_is_named_as_gone():
    """Found by the planning's HEAD, gone by the GET: the S3 client's NO_SUCH_KEY, which came
    through raw, without the "it is gone" of a file found missing at once."""
    from kubeflow_data_cache.plan import file_read_error

    err = OSError(
        "Could not open Parquet input source '<Buffer>': AWS Error NO_SUCH_KEY during GetObject operation: "
        "The specified key does not exist."
    )
    message = file_read_error("s3://b/d.parquet", err, "http://minio:9000")
    assert message.startswith("cannot read data file s3://b/d.parquet: it is gone, though the table's metadata names")
    assert message.endswith("point METADATA_LOC at the current metadata.json")


SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": SECRET}, "the access key in AWS_ACCESS_KEY_ID;"),
        (
            {
                "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE",
                "AWS_SECRET_ACCESS_KEY": SECRET,
                "AWS_SESSION_TOKEN": "FQoGZXIvEXAMPLETOKEN",
            },
            "AWS_ACCESS_KEY_ID with AWS_SESSION_TOKEN",
        ),
        (
            # No such token here: the SDK skipped web identity, and the message says so.
            {"AWS_ROLE_ARN": "arn:aws:iam::1:role/reader", "AWS_WEB_IDENTITY_TOKEN_FILE": "/var/run/token"},
            "web identity (IRSA) for role arn:aws:iam::1:role/reader is set, but its token file "
            "AWS_WEB_IDENTITY_TOKEN_FILE='/var/run/token' does not exist",
        ),
        ({"AWS_PROFILE": "data"}, "AWS_PROFILE='data' is in none of the shared AWS files (/nonexistent/"),
        ({"AWS_CONTAINER_CREDENTIALS_FULL_URI": "http://169.254.170.23/v1/credentials"}, "EKS Pod Identity"),
        ({}, "no AWS credentials are set"),
    ],
)
def test_a_denied_metadata_read_says_which_credentials_signed_it(monkeypatch, env, said):
    """The SDK falls back silently (an IRSA exchange that cannot reach STS sends the request
    unsigned), so a 403 alone cannot tell a missing credential from a missing permission."""
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SESSION_TOKEN",
        "AWS_ROLE_ARN",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_PROFILE",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    ):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    err = OSError("When reading information for key 'm.json' in bucket 'b': AWS Error ACCESS_DENIED during HeadObject")
    refusal = str(_open_error("s3://b/m.json", "s3://b/m.json", err))
    assert "was denied" in refusal and said in refusal
    assert SECRET not in refusal and "FQoGZXIvEXAMPLETOKEN" not in refusal


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


@settings(max_examples=300, deadline=None)
@given(file_rows=st.lists(st.integers(0, 50), max_size=12), nodes=st.integers(1, 40))
def test_property_each_node_gets_its_contiguous_range_cut_into_file_pieces(file_rows, nodes):
    """Empty files, empty tables and more nodes than rows included: each node's pieces are its
    row range, cut at file boundaries, in file order, and the ranges tile the table."""
    files = tuple(FilePlan(f"f{i}", rows, (rows,), False) for i, rows in enumerate(file_rows))
    plan = TablePlan("m.json", 1, pa.schema([("x", pa.int64())]), files)
    assignments = assign_rows(plan, nodes)
    row_of = [(f.path, r) for f in files for r in range(f.rows)]  # global row -> (file, row in file)
    assert [a.node for a in assignments] == list(range(nodes))
    assert [(a.global_start, a.global_stop) for a in assignments] == [(n * len(row_of) // nodes, (n + 1) * len(row_of) // nodes)
                                                  for n in range(nodes)]  # fmt: skip
    for a in assignments:
        rows = [p for p in a.pieces if p.start < p.stop]
        assert [(p.path, r) for p in rows for r in range(p.start, p.stop)] == row_of[a.global_start : a.global_stop]
    # A file planned at no rows is one node's empty piece ending the file (read to its end for
    # rows the plan did not count): the node its position falls in, else the last.
    empty = [(a.node, p.path) for a in assignments for p in a.pieces if p.start == p.stop]
    assert all(p == Piece(p.path, 0, 0, 0) for a in assignments for p in a.pieces if p.start == p.stop)
    starts = dict(zip((f.path for f in files), plan.file_starts, strict=True))
    expected = []
    for f in files:
        if f.rows == 0:
            at = starts[f.path]
            owner = next((a.node for a in assignments if a.global_start <= at < a.global_stop), nodes - 1)
            expected.append((owner, f.path))
    assert sorted(empty) == sorted(expected)


def test_the_load_guard_stops_within_its_margin_and_projects_the_need():
    resident = resident_bytes()
    LoadMemoryGuard(None, 100).check(50)  # no limit known: nothing to guard
    LoadMemoryGuard(resident * 4, 100).check(50)  # far under the limit
    # Within the margin of its limit (here: at it) the load stops, naming this machine's flags.
    with pytest.raises(MemoryBudgetError) as err:
        LoadMemoryGuard(resident, 1000, local=True).check(250)
    message = str(err.value)
    assert "stopped its load before the kernel's OOM kill" in message and "25% of its 1000 rows" in message
    assert "at this rate its rows need about" in message and "(--memory-limit)" in message
    # In a pod the advice names the pod's settings; with no rows decoded yet, no projection.
    with pytest.raises(MemoryBudgetError) as err:
        LoadMemoryGuard(resident, 1000, local=False).check(0)
    assert "WORKER_MEM" in str(err.value) and "CLUSTER_SIZE" in str(err.value)
    assert "at this rate" not in str(err.value)
    # Where no row came, one row group decoded past the limit: more nodes do not shrink it (all
    # the message advised), smaller row groups do.
    assert "before any of its 1000 rows were read. One row group decoded past it" in str(err.value)
    assert "do not shrink a row group), or write the table with smaller row groups" in str(err.value)
    # Rows decoded in column groups, none settled yet: rows came, so not that message.
    with pytest.raises(MemoryBudgetError) as err:
        LoadMemoryGuard(resident, 1000, local=False).check_resident(0, decoded=400)
    assert "One row group decoded past it" not in str(err.value) and "0% of its 1000 rows read" in str(err.value)
    # Rows that decode wider than the limit allows stop the load once a tenth of them are read,
    # long before resident memory gets there; earlier, one wide file does not speak for all.
    roomy = LoadMemoryGuard(resident + (4 << 30), 1000, local=True)
    roomy.check(50, 400 << 20)  # 5% read: too early to extrapolate their 8 MiB a row
    roomy.check(100, 100 << 20)  # 10% read, 1 MiB a row: ~1 GiB in all, which fits
    with pytest.raises(MemoryBudgetError, match="its rows need about"):
        roomy.check(100, 800 << 20)  # 10% read, 8 MiB a row: ~8 GiB in all, past the limit
    # Rows on course to fit, with memory past the margin all the same: what is held beside them
    # (many small files' batches until they are merged) is named, not the rows' decoding.
    beside = LoadMemoryGuard(int(resident * 1.05), 1000, local=True)
    beside.start = resident // 2  # where the load began
    with pytest.raises(MemoryBudgetError) as err:
        beside.check(500, 1 << 20)  # half read, 2 MiB of rows in all
    assert "many small files" in str(err.value) and "decode larger" not in str(err.value), str(err.value)
    # 10% of a small limit is kept back, at most 128 MiB of a large one.
    assert load_guard_threshold(500 << 20) == 450 << 20
    assert load_guard_threshold(16 << 30) == (16 << 30) - (128 << 20)


def test_the_load_guard_projects_by_the_estimate_where_rows_differ_in_size():
    """50 images of 1 MiB read first among 20,000 short rows: 10% of the rows held 50 MiB, and a
    projection per row (500 MiB) stopped a load of ~51 MiB. Scaled by the manifests' estimate of
    what was read, the projection is the estimate itself where it was right, and still stops a
    load whose rows decode 10 times larger than estimated."""
    resident = resident_bytes()
    guard = LoadMemoryGuard(resident + (300 << 20), 20_050, local=True)
    read, estimated, all_rows = 50 << 20, 50 << 20, 51 << 20
    guard.check(2005, read, estimated, all_rows)  # on course: ~51 MiB in all
    with pytest.raises(MemoryBudgetError, match="its rows need about"):
        guard.check(2005, read)  # the per-row projection, where no estimate is known
    with pytest.raises(MemoryBudgetError, match="its rows need about"):
        guard.check(2005, 10 * read, estimated, all_rows)  # 10x the estimate: ~510 MiB
    guard.check(1000, 100 << 20, 2 << 20, all_rows)  # under 10% of the estimate read: too early


def test_the_load_memory_watch_reports_the_resident_check_once_and_stops():
    """Between batches only resident memory is checked (the projection's figures change together
    only at a batch), and a breach is handed on once, while the load runs on to its next batch."""
    resident = resident_bytes()
    LoadMemoryGuard(resident * 4, 100).check_resident(0)  # far under the limit
    LoadMemoryGuard(None, 100).check_resident(0)  # no limit known
    with pytest.raises(MemoryBudgetError) as err:
        LoadMemoryGuard(resident, 1000, local=True).check_resident(250)
    assert "reached" in str(err.value) and "25% of its 1000 rows" in str(err.value)
    assert "at this rate" not in str(err.value)  # no projection between batches
    # Looking every few ms, the watch waits closer to the limit than the per-batch check: at 10%
    # it stopped loads that fit, on a decode's passing peak the per-batch checks fall between.
    assert load_watch_threshold(500 << 20) == int((500 << 20) * 0.96) > load_guard_threshold(500 << 20)
    assert load_watch_threshold(16 << 30) == (16 << 30) - (64 << 20)
    LoadMemoryGuard(int(resident / 0.93), 1000).check_resident(0)  # within 10% of its limit, not 4%
    calls, breaches = [], []
    over = LoadMemoryGuard(resident, 1000, local=True)

    def check() -> None:
        calls.append(1)
        if len(calls) >= 3:  # memory passes the margin on the third look
            over.check_resident(0)

    with LoadMemoryWatch(check, breaches.append, interval=0.005):
        deadline = time.monotonic() + 10
        while not breaches and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # it has stopped looking
    assert len(breaches) == 1 and isinstance(breaches[0], MemoryBudgetError)
    assert len(calls) == 3
    quiet: list = []
    with LoadMemoryWatch(lambda: None, quiet.append, interval=0.005):
        time.sleep(0.05)
    assert quiet == []  # a load under its margin is left alone, and the watch ends with it
    # A breach stops the load at its next batch even where memory came back under the margin
    # (a decode's peak passed): the load had run on to READY holding its rows while failed.
    roomy = LoadMemoryGuard(resident * 4, 1000, local=True)
    roomy.breached = breaches[0]
    with pytest.raises(MemoryBudgetError) as stopped:
        roomy.check(500, 1 << 20)
    assert stopped.value is breaches[0]


def test_a_denied_local_metadata_read_says_nothing_of_aws():
    refusal = str(_open_error("/t/m.metadata.json", "/t/m.metadata.json", PermissionError(13, "Permission denied")))
    assert "was denied" in refusal and "AWS" not in refusal


def test_the_head_and_data_nodes_trust_aws_ca_bundle_from_their_start(monkeypatch, tmp_path):
    from kubeflow_data_cache import cli, runner

    seen = []
    monkeypatch.setattr(runner, "run_node", lambda cfg: seen.append(os.environ.get("SSL_CERT_FILE")) or 0)
    bundle = tmp_path / "ca.pem"
    bundle.write_text(PEM_SHAPED)
    monkeypatch.setenv("AWS_CA_BUNDLE", str(bundle))
    monkeypatch.setenv("SSL_CERT_FILE", "recorded")  # so the one main() sets is undone after the test
    monkeypatch.delenv("SSL_CERT_FILE")
    assert cli.main(["head", "--metadata-loc", str(tmp_path / "v1.metadata.json"), "--data-nodes", "1"]) == 0
    assert seen == [str(bundle)]


def test_the_modules_a_process_starts_with_leave_pyarrows_s3_client_unloaded():
    """pyarrow's S3 client reads SSL_CERT_FILE once, when pyarrow._s3fs is imported (pyarrow.fs
    and pyarrow.parquet import it); trust_aws_ca_bundle sets it after these modules load, so an
    import of either at their top made every store behind a private CA untrusted."""
    modules = "cli, head, node, plan, store, local, runner, expansion, dataset, client"
    code = f"import sys\nfrom kubeflow_data_cache import {modules}\nprint('pyarrow._s3fs' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr


def test_a_column_merged_by_pyarrow_counts_twice_whole_in_the_peak_while_copied_ones_count_a_file():
    """column_concat copies every type an Iceberg table reads as, releasing chunks as it goes (one
    file's column at most exists twice); a type it hands to pyarrow (a dictionary) is held twice
    whole while merged, and the head's model must say so."""
    from kubeflow_data_cache.plan import FilePlan, NodeAssignment, Piece, TablePlan

    def peak(kind: pa.DataType) -> int:
        schema = pa.schema([pa.field("id", pa.int64()), pa.field("c", kind)])
        files = tuple(FilePlan(f"f{i}", 1000, (8_000, 40 << 20), False) for i in range(10))
        plan = TablePlan("file:///t/metadata.json", 1, schema, files)
        pieces = tuple(Piece(f.path, 0, f.rows, f.rows) for f in files)
        loaded, most = estimated_node_memory(plan, NodeAssignment(0, 0, 10_000, pieces), load_threads=1)
        assert loaded == 10 * (8_000 + (40 << 20))
        return most - loaded

    assert peak(pa.dictionary(pa.int32(), pa.string())) >= 400 << 20  # the whole column again
    assert peak(pa.string()) < 200 << 20  # a file's column and the decode scratch, not the column


def _table_with_added_columns(tmp_path, later_rows: int):
    """100,000 rows of ``id``; then columns added (a string, an int, a list of strings, a struct),
    and ``later_rows`` rows written with them."""
    from pyiceberg.types import IntegerType, ListType, NestedField, StringType, StructType

    catalog = make_catalog(str(tmp_path / "wh"), tmp_path / "c.db")
    catalog.create_namespace("s")
    table = catalog.create_table("s.added", schema=pa.schema([("id", pa.int64())]))
    table.append(pa.table({"id": np.arange(100_000, dtype=np.int64)}))
    with table.update_schema() as update:
        update.add_column("text", StringType())
        update.add_column("score", IntegerType())
        update.add_column("tags", ListType(200, StringType(), element_required=False))
        update.add_column("st", StructType(NestedField(300, "a", StringType(), required=False)))
    table = catalog.load_table("s.added")
    if later_rows:
        ids = np.arange(100_000, 100_000 + later_rows, dtype=np.int64)
        later = {
            "id": ids,
            "text": [f"t{i}" for i in ids],
            "score": pa.array(ids % 7, pa.int32()),
            "tags": [["a", "b"]] * later_rows,
            "st": [{"a": "x"}] * later_rows,
        }
        table.append(pa.table(later, schema=table.schema().as_arrow()))
    return catalog.load_table("s.added").metadata_location


def test_columns_added_after_a_file_was_written_are_estimated_as_the_nulls_they_read_there(tmp_path):
    """The older file has no size for them and reads them as nulls. Sized as values without
    statistics (32 bytes a row), 8 such string columns on a 400,000-row table came to 7.5x what a
    node held, and a table that fits was refused."""
    held, estimated = held_and_estimated(_table_with_added_columns(tmp_path, later_rows=2_000))
    for name in ("text", "score", "tags", "st"):
        assert held[name] <= estimated[name] <= 1.3 * held[name], (name, held[name], estimated[name])


def test_a_column_a_file_has_no_size_for_but_held_when_written_is_estimated_as_values(tmp_path):
    """Java's Iceberg records no size for a column in metrics mode none (the default past a
    table's first 100 columns, or switched on later to shrink manifests), stored or not. Files are
    dated by the snapshot that added them: the column was in the table's schema then, so it may
    hold values (an embedding of 3 KB a row), and is not sized as nulls, which would pass a fit
    check the load then fails."""
    import itertools

    from pyiceberg.io.pyarrow import _dataframe_to_data_files

    catalog = make_catalog(str(tmp_path / "wh"), tmp_path / "c.db")
    catalog.create_namespace("s")
    rows = 50_000
    data = pa.table({"id": np.arange(rows, dtype=np.int64), "payload": [f"p{i}" for i in range(rows)]})
    table = catalog.create_table("s.quiet", schema=data.schema)
    table.append(data.slice(0, 10))  # an earlier file, with every size
    table = catalog.load_table("s.quiet")
    payload = table.schema().find_field("payload").field_id
    with table.transaction() as tx, tx.update_snapshot().fast_append() as append:
        for data_file in _dataframe_to_data_files(
            table_metadata=tx.table_metadata,
            df=data,
            io=table.io,
            write_uuid=append.commit_uuid,
            counter=itertools.count(),
        ):
            for stats in ("column_sizes", "value_counts", "null_value_counts", "lower_bounds", "upper_bounds"):
                getattr(data_file, stats).pop(payload, None)  # as a writer in metrics mode none leaves it
            append.append_data_file(data_file)
    location = catalog.load_table("s.quiet").metadata_location
    held, estimated = held_and_estimated(location)
    assert estimated["payload"] >= 32 * rows >= held["payload"], (held, estimated)  # values, not ~4 B of nulls


def test_a_columns_absence_is_read_from_the_files_schema_not_guessed():
    """A column none of whose ids were in the schema a file was written under reads as nulls
    there; with that schema unknown, it is sized as values (which errs high)."""
    from types import SimpleNamespace

    from pyiceberg.types import LongType, NestedField, StringType

    from kubeflow_data_cache.plan import estimate_column_bytes

    schema = pa.schema([("id", pa.int64()), ("city", pa.string())])
    fields = [NestedField(1, "id", LongType(), required=False), NestedField(2, "city", StringType(), required=False)]
    rows = 50_000
    data_file = SimpleNamespace(column_sizes={1: 400_000}, value_counts={1: rows}, record_count=rows)
    _, as_nulls = estimate_column_bytes(data_file, schema, fields, rows, None, frozenset({1}))
    _, unknown = estimate_column_bytes(data_file, schema, fields, rows, None, None)
    _, held_then = estimate_column_bytes(data_file, schema, fields, rows, None, frozenset({1, 2}))
    assert as_nulls < rows * 5  # offsets and validity
    assert unknown >= rows * 32 and held_then >= rows * 32  # no statistics for its values: the generous guess


def _many_small_files(tmp_path, files: int, columns: int, rows_per_file: int) -> str:
    """A table of ``files`` small data files of ``columns`` float columns, committed at once."""
    import itertools

    from pyiceberg.io.pyarrow import _dataframe_to_data_files

    catalog = make_catalog(str(tmp_path / "wh"), tmp_path / "c.db")
    catalog.create_namespace("s")

    def part(lo: int) -> pa.Table:
        ids = np.arange(lo, lo + rows_per_file, dtype=np.int64)
        return pa.table({"id": ids, **{f"c{c}": (ids + c).astype(np.float32) for c in range(columns - 1)}})

    table = catalog.create_table("s.small", schema=part(0).schema)
    with table.transaction() as tx, tx.update_snapshot().fast_append() as append:
        for f in range(files):
            data_files = _dataframe_to_data_files(
                table_metadata=tx.table_metadata, df=part(f * rows_per_file), io=table.io,
                write_uuid=append.commit_uuid, counter=itertools.count(f),
            )  # fmt: skip
            for data_file in data_files:
                append.append_data_file(data_file)
    return catalog.load_table("s.small").metadata_location


def test_a_load_of_many_small_files_is_estimated_with_what_its_batches_hold_and_gives_it_back(tmp_path):
    """Each read batch's arrays hold ~1.25 KB beside their values until the load merges them: 1,000
    files of 200 columns held 239 MiB for 15 MiB of rows, past an estimate that left it out (the
    load guard then stopped the load blaming its strings), and kept 224 MiB once loaded."""
    location = _many_small_files(tmp_path, files=300, columns=40, rows_per_file=10)
    t = open_table(location)
    plan, _ = plan_table(t, location)
    (assignment,) = assign_rows(plan, 1)
    loaded, estimate = estimated_node_memory(plan, assignment, load_threads=1)
    script = (
        "import gc, json, os, sys, psutil\n"
        "from kubeflow_data_cache.allocator import configure_data_node\n"
        "configure_data_node(os.environ)  # the data node's allocator settings\n"
        "from kubeflow_data_cache import store as st\n"
        "from kubeflow_data_cache.plan import assign_rows, open_table, plan_table\n"
        "t = open_table(sys.argv[1]); plan, tasks = plan_table(t, sys.argv[1]); (a,) = assign_rows(plan, 1)\n"
        "me = psutil.Process(); gc.collect(); start = me.memory_info().rss; seen = {}\n"
        "merge = st.compact\n"
        "def compact(*args, **kwargs):\n"
        "    seen['before_merge'] = me.memory_info().rss - start\n"
        "    return merge(*args, **kwargs)\n"
        "st.compact = compact\n"
        "store = st.NodeStore.load(t, tasks, plan.schema, list(a.pieces), 1)\n"
        "gc.collect(); seen['after'] = me.memory_info().rss - start; seen['rows'] = store.nbytes\n"
        "print(json.dumps(seen))\n"
    )
    seen = json_from_a_fresh_process(script, location)
    assert seen["before_merge"] > 4 * seen["rows"], seen  # what the batches hold beside their values
    # Handed back once merged. Kept, it stayed: 20.6 of 21.1 MB here. Handed back, 5-7 MB stayed
    # when this was written, and 9.8-10.7 MB of ~21 MB now (the reader's own set-up, the same at
    # 818f016), which a half-way bound failed once in a fresh-clone CI run (0.502): three quarters
    # tells the two apart.
    assert seen["after"] < 0.75 * seen["before_merge"], seen
    # What the load held beyond what stays (the rows, and the reader's own set-up, which the
    # baseline allowance covers) is within what the estimate adds to the rows.
    assert seen["before_merge"] - seen["after"] <= estimate - loaded, (seen, loaded, estimate)


def planned_location(location: str):
    t = open_table(location)
    return t, *plan_table(t, location)


def _images_and_short_rows(tmp_path) -> str:
    """A file of 100 images of 1 MiB (in row groups of 10, the unit a read decodes) and a file of
    20,000 short rows: whichever order the scan lists them in, an even split of the rows puts
    every image on one node. (Four image files had listed on both sides of the short one in some
    runs, and the even split was already balanced.)"""
    catalog = make_catalog(str(tmp_path / "wh"), tmp_path / "c.db")
    catalog.create_namespace("s")
    schema = pa.schema([("id", pa.int64()), ("image", pa.binary())])
    table = catalog.create_table("s.images", schema=schema, properties={"write.parquet.row-group-limit": "10"})
    rng = np.random.default_rng(0)
    images = [rng.bytes(1 << 20) for _ in range(100)]  # as incompressible as photos
    table.append(pa.table({"id": np.arange(100), "image": images}, schema=schema))
    table.append(pa.table({"id": np.arange(100, 20_100), "image": [b"x" * 8] * 20_000}, schema=schema))
    return catalog.load_table("s.images").metadata_location


def test_rows_of_very_different_sizes_are_split_by_their_bytes(tmp_path):
    location = _images_and_short_rows(tmp_path)
    _, plan, _ = planned_location(location)
    assignments = assign_rows(plan, 2)
    assert assignments[0].global_start == 0 and assignments[0].global_stop == assignments[1].global_start
    assert assignments[1].global_stop == plan.rows == 20_100
    loaded = [estimated_node_memory(plan, a, 1)[0] for a in assignments]
    assert max(loaded) < 0.6 * sum(loaded), loaded  # an even split held ~100% on one node
    # Rows of one size keep their even split (test_more_nodes_than_files_splits_rows).


def test_a_table_of_skewed_rows_that_fits_split_by_bytes_loads_every_row(tmp_path, monkeypatch):
    """Refused before, advising 1,501 nodes for a table that fits 2 (the review's case, scaled down)."""
    from kubeflow_data_cache.client import CacheClient
    from kubeflow_data_cache.protocol import ShardRequest
    from tests.conftest import running_cache

    location = _images_and_short_rows(tmp_path)
    _, plan, _ = planned_location(location)
    threads = local_load_threads(2)  # what each of `local`'s 2 nodes reads with here
    by_bytes = max(estimated_node_memory(plan, a, threads)[1] for a in assign_rows(plan, 2))
    plan_module = sys.modules[assign_rows.__module__]
    monkeypatch.setattr(plan_module, "BYTE_SPLIT_GAIN", 1.0)  # never by bytes: the even split
    evenly = max(estimated_node_memory(plan, a, threads)[1] for a in assign_rows(plan, 2))
    monkeypatch.undo()
    assert evenly > by_bytes + (16 << 20)  # room for a limit between the two
    # Fits split by bytes, not split evenly; as high as that allows: the load's real peak runs
    # past the estimate's (pyarrow decodes the image file's row groups ahead at once, where the
    # estimate counts a 64 MiB window), and at the two estimates' midpoint a node reached 570 MiB
    # of 632, close to where the load's memory watch stops it.
    limit = BASELINE_MEMORY_BYTES + evenly - (1 << 20)
    args = ("--memory-limit", str(limit))
    with running_cache(location, data_nodes=2, args=args) as cache, CacheClient(cache.endpoint) as client:
        ids = np.concatenate([b.column("id").to_numpy() for b in client.read_shard(ShardRequest())])
    assert np.array_equal(np.sort(ids), np.arange(20_100))
