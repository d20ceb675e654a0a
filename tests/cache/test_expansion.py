"""Measured string/binary expansion: estimates close to what a node holds, for values that do not
compress (random bytes, UUIDs) and for ones that compress very well (a few labels)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import numpy as np
import pyarrow as pa
import pytest

from kubeflow_data_cache.expansion import measure_expansions
from kubeflow_data_cache.plan import VARIABLE_WIDTH_EXPANSION, assign_rows, open_table, plan_table
from kubeflow_data_cache.sample import make_catalog
from kubeflow_data_cache.store import NodeStore

ROWS = 60_000


def _values(kind: str, rows: int) -> pa.Array:
    rng = np.random.default_rng(0)
    if kind == "random bytes":  # JPEGs, hashes: nothing to compress
        return pa.array([os.urandom(int(n)) for n in rng.integers(50, 150, rows)], pa.binary())
    if kind == "uuids":
        return pa.array([str(uuid.UUID(int=int(v))) for v in rng.integers(0, 2**62, rows)])
    return pa.array(rng.choice(["cat", "dog", "bird", "fish"], rows))  # labels: a tiny dictionary


def _table(tmp_path, kind: str, rows: int = ROWS, files: int = 2) -> str:
    data = pa.table({"id": pa.array(range(rows), pa.int64()), "value": _values(kind, rows)})
    catalog = make_catalog(str(tmp_path / "wh"), tmp_path / "c.db")
    catalog.create_namespace("s")
    table = catalog.create_table("s.t", schema=data.schema)
    for part in range(files):
        table.append(data.slice(part * rows // files, rows // files))
    return catalog.load_table("s.t").metadata_location


@pytest.mark.parametrize("kind", ["random bytes", "uuids", "labels"])
def test_string_and_binary_estimates_come_close_to_what_a_node_holds(tmp_path, kind):
    """A fixed factor of 4 over the compressed size put random bytes at 4x their size (a 30 MiB
    table was refused, "use at least 41 data nodes") and labels at a fraction of theirs."""
    location = _table(tmp_path, kind)
    table = open_table(location)
    plan, tasks = plan_table(table, location)
    (assignment,) = assign_rows(plan, 1)
    held = NodeStore.load(table, tasks, plan.schema, list(assignment.pieces), 1, None, plan.expansions).column_bytes
    estimated = sum(f.column_bytes[plan.schema.get_field_index("value")] for f in plan.files)
    assert 0.8 * held["value"] <= estimated <= 1.3 * held["value"], (estimated, held["value"])


def test_an_unreadable_sample_leaves_the_fixed_factor(tmp_path, caplog):
    location = _table(tmp_path, "uuids", rows=2000)
    table = open_table(location)
    plan, tasks = plan_table(table, location)
    first = sorted(tasks)[0]
    os.remove(first.removeprefix("file://"))
    with caplog.at_level("INFO"):
        assert measure_expansions(table, tasks, plan.schema, list(table.schema().fields)) == {}
    assert "could not sample" in caplog.text and "estimating them from the manifests" in caplog.text
    assert VARIABLE_WIDTH_EXPANSION == 4.0  # what applies instead (plan._field_estimate)


@pytest.mark.slow
def test_a_table_of_random_bytes_that_fits_is_loaded_not_refused(tmp_path):
    """The reviewer's case: ~30 MiB of random bytes under a 700Mi limit, estimated at 4x and
    refused with advice of 41 data nodes; it loads, in one."""
    location = _table(tmp_path, "random bytes", rows=300_000, files=1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kubeflow_data_cache", "local", "--metadata-loc", location, "--data-nodes", "1",
         "--port", "0", "--memory-limit", "700Mi", "--startup-timeout", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        first = proc.stdout.readline()
        assert first.startswith("READY grpc://"), proc.stderr.read() if proc.poll() is not None else first
    finally:
        proc.terminate()
        proc.wait(60)
