"""A data node's `load` action: checked whole before it acts, and never two loads at once."""

from __future__ import annotations

import json
import threading
import time

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from kubeflow_data_cache.config import build_config
from kubeflow_data_cache.errors import BadRequestError
from kubeflow_data_cache.node import DataNode, LoadOrder
from kubeflow_data_cache.store import NodeStore
from tests.cache.inprocess import FLAGS, get, wait_for

GOOD = {
    "generation": "g1",
    "metadata_location": "file:///t/metadata.json",
    "snapshot_id": 7,
    "global_start": 10,
    "global_stop": 30,
    "pieces": [{"path": "a.parquet", "start": 0, "stop": 5}, {"path": "b.parquet", "start": 3, "stop": 18}],
}


def test_a_well_formed_order_parses():
    order = LoadOrder.parse(GOOD)
    assert order.generation == "g1" and order.global_stop - order.global_start == 20
    assert [(p.path, p.start, p.stop) for p in order.pieces] == [("a.parquet", 0, 5), ("b.parquet", 3, 18)]
    with_counts = {**GOOD, "pieces": [{"path": "a.parquet", "start": 0, "stop": 20, "file_rows": 20}]}
    assert LoadOrder.parse(with_counts).pieces[0].file_rows == 20
    # The whole table's rows (what a ticket's row space may hold); absent from older heads' orders.
    assert LoadOrder.parse({**GOOD, "table_rows": 45}).table_rows == 45 and LoadOrder.parse(GOOD).table_rows is None
    # The head's measured string/binary expansions (JSON keys: field ids as text); absent: none.
    assert LoadOrder.parse({**GOOD, "expansions": {"6": 1.25}}).expansions == {6: 1.25}
    assert LoadOrder.parse(GOOD).expansions == {}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"generation": None}, "'generation'"),
        ({"pieces": None}, "'pieces'"),
        ({"pieces": [{"path": "a.parquet", "start": 5, "stop": 1}]}, "0 <= start <= stop"),
        ({"pieces": [{"path": "a.parquet", "start": 0, "stop": "5"}]}, "0 <= start <= stop"),
        ({"pieces": [{"path": "a.parquet", "start": 0, "stop": 5, "file_rows": 4}]}, "'file_rows'"),
        ({"pieces": [{"path": "a.parquet", "start": 0, "stop": 5, "file_rows": "9"}]}, "'file_rows'"),
        ({"global_stop": 5}, "'global_start' <= 'global_stop'"),
        ({"global_stop": 31}, "add up"),
        ({"snapshot_id": "7"}, "'snapshot_id'"),
        ({"metadata_location": ""}, "'metadata_location'"),
        ({"table_rows": 29}, "'table_rows' should be null or an integer >= 'global_stop'"),
        ({"table_rows": "45"}, "'table_rows'"),
        ({"expansions": [1.5]}, "'expansions' should be an object"),
        ({"expansions": {"x": 1.5}}, "'expansions' entry 'x'"),
        ({"expansions": {"6": 0}}, "should be a number > 0"),
        ({"expansions": {"6": float("nan")}}, "should be a number > 0"),
        ({"expansions": {"6": True}}, "should be a number > 0"),
        ({"expansions": {"\u00b2": 1.5}}, "'expansions' entry"),  # a digit to str.isdigit, not to int()
        ({"expansions": {"6": 1e308}}, r"should be a number > 0 and <= 1e\+06"),
    ],
)
def test_a_malformed_order_is_refused_naming_the_field(change, message):
    with pytest.raises(BadRequestError, match=message):
        LoadOrder.parse({**GOOD, **change})


def test_a_malformed_load_leaves_a_serving_node_as_it_was(cluster, small_table):
    head, head_health, node, node_health = cluster(small_table.metadata_location)
    wait_for(lambda: get(head_health.port, "/ready")[0] == 200)
    client = flight.FlightClient(node.location)
    for body in (b'{"generation": "x"}', b"{}"):
        with pytest.raises(pa.ArrowInvalid, match="load: "):
            list(client.do_action(flight.Action("load", body)))
    assert get(node_health.port, "/ready")[0] == 200
    assert node.store is not None and node.store.num_rows == small_table.rows
    status = json.loads(next(iter(client.do_action(flight.Action("status", b"")))).body.to_pybytes())
    assert status["state"] == "ready" and status["generation"] == head.generation


def test_a_stopping_node_takes_no_load(cluster, small_table):
    """While its streams finish after SIGTERM, a node still answers Flight: a load then (a
    restarted head) would read rows the leaving process can never serve."""
    from kubeflow_data_cache.service import STOPPING

    head, _, node, _ = cluster(small_table.metadata_location)
    wait_for(lambda: node.lifecycle.state == "ready")
    (assignment,) = head.assignments
    order = {
        "generation": "after-sigterm",
        "metadata_location": head.plan.metadata_location,
        "snapshot_id": head.plan.snapshot_id,
        "global_start": 0,
        "global_stop": head.plan.rows,
        "table_rows": head.plan.rows,
        "pieces": [p.to_dict() for p in assignment.pieces],
    }
    node.lifecycle.set(STOPPING, "shutting down")
    with pytest.raises(flight.FlightUnavailableError, match="data node 0 is stopping: it takes no load"):
        list(flight.FlightClient(node.location).do_action(flight.Action("load", json.dumps(order).encode())))
    assert node.generation != "after-sigterm"


def test_a_newer_assignment_waits_for_the_load_it_supersedes(cluster, small_table, monkeypatch):
    """A restarted head re-sends the assignment with a new generation while the first load runs:
    the first stops, the second reads only after it, so the node never holds two loads."""
    real_load = NodeStore.load
    spans: list[tuple[float, float]] = []
    lock = threading.Lock()

    def timed_load(*args, **kwargs):
        start = time.monotonic()
        try:
            return real_load(*args, **kwargs)
        finally:
            with lock:
                spans.append((start, time.monotonic()))

    gate = threading.Event()  # holds the first load's reads until the new assignment is in

    def held_load(table, tasks, schema, pieces, threads, progress, expansions=None):
        real_read = progress.read

        def held():
            gate.wait(30)
            real_read()

        progress.read = held
        return timed_load(table, tasks, schema, pieces, threads, progress, expansions)

    monkeypatch.setattr(NodeStore, "load", staticmethod(held_load))
    head, _, node, node_health = cluster(small_table.metadata_location)
    wait_for(lambda: (status := node.status())["state"] == "loading" and status["loading"] is not None)
    first = node.generation
    order = {
        "generation": "restarted-head",
        "metadata_location": head.plan.metadata_location,
        "snapshot_id": head.plan.snapshot_id,
        "global_start": head.assignments[0].global_start,
        "global_stop": head.assignments[0].global_stop,
        "pieces": [p.to_dict() for p in head.assignments[0].pieces],
    }
    head.stop()  # the old head is gone; the new one sends its own generation
    list(flight.FlightClient(node.location).do_action(flight.Action("load", json.dumps(order).encode())))
    gate.set()
    wait_for(lambda: node.generation == "restarted-head" and node.lifecycle.state == "ready")
    assert first != "restarted-head"
    assert node.store.num_rows == small_table.rows
    assert len(spans) == 2
    (_, a_end), (b_start, _) = sorted(spans)
    assert b_start >= a_end, "the second load started before the first one ended"
    metrics = get(node_health.port, "/metrics")[1]
    assert "data_cache_ready 1.0" in metrics


def test_a_loaded_node_keeps_only_its_files_scan_tasks_and_lists_them_again_for_others(cluster, small_table):
    """A scan task carries its file's column statistics (~70 KiB a file at 200 columns): the
    whole table's stayed for the node's life. A later load of other files (a restarted head
    planning other shares) lists the table again instead of failing."""
    head, _, node, _ = cluster(small_table.metadata_location)
    wait_for(lambda: node.lifecycle.state == "ready")
    location = head.plan.metadata_location
    (assignment,) = head.assignments
    files = [p.path for p in assignment.pieces]
    assert len(files) == 3
    assert set(node._tables[location].result()[2]) == set(files)  # all of the table: its one node's

    first = head.plan.files[0]
    order = {
        "generation": "first-file",
        "metadata_location": location,
        "snapshot_id": head.plan.snapshot_id,
        "global_start": 0,
        "global_stop": first.rows,
        "table_rows": head.plan.rows,
        "pieces": [{"path": first.path, "start": 0, "stop": first.rows}],
    }
    head.stop()
    client = flight.FlightClient(node.location)
    list(client.do_action(flight.Action("load", json.dumps(order).encode())))
    wait_for(lambda: node.generation == "first-file" and node.lifecycle.state == "ready")
    # The other files' tasks let go (just after the node says ready, outside its load lock).
    wait_for(lambda: set(node._tables[location].result()[2]) == {first.path}, timeout=10)

    whole = {**order, "generation": "whole", "global_stop": head.plan.rows}
    whole["pieces"] = [p.to_dict() for p in assignment.pieces]
    list(client.do_action(flight.Action("load", json.dumps(whole).encode())))
    wait_for(lambda: node.generation == "whole" and node.lifecycle.state in ("ready", "failed"))
    assert node.lifecycle.state == "ready", node.lifecycle.error
    assert node.store.num_rows == small_table.rows


@pytest.mark.parametrize("when", ["before the load", "while the load waits for it"])
def test_an_early_open_that_failed_is_tried_again_by_the_load(cluster, small_table, when):
    """A node opens METADATA_LOC as it starts, before the head plans: storage may not answer yet
    (DNS, a store still starting, credentials not mounted). That failure was kept for the
    process's life: every load re-raised it, and the node failed though the table was readable."""
    head, _, _, _ = cluster(small_table.metadata_location, with_node=False)
    cfg = build_config(
        "worker", {**FLAGS, "index": 0, "head": head.location, "metadata_loc": small_table.metadata_location}, env={}
    )
    node = DataNode(cfg)
    real_open, calls, loading = node._open, [], threading.Event()

    def open_flaky(location):
        calls.append(location)
        if len(calls) == 1:
            if when == "while the load waits for it":
                assert loading.wait(30)
            raise OSError("the store is not reachable yet")
        return real_open(location)

    node._open = open_flaky
    try:
        node.start_registering()
        if when == "while the load waits for it":
            wait_for(lambda: node.lifecycle.state == "loading")
            loading.set()
        wait_for(lambda: node.lifecycle.state in ("ready", "failed"))
        assert node.lifecycle.state == "ready", node.lifecycle.error
        assert node.store.num_rows == small_table.rows
        assert len(calls) == 2
        # Nothing holds the early open on: it had every file's scan tasks (_keep_tasks).
        assert node._preopened is None
    finally:
        loading.set()
        node.stop()


def test_a_metadata_location_with_an_upper_case_scheme_loads(cluster, small_table):
    """Schemes are case-insensitive: ``FILE://`` (or ``S3://``, as the upstream cache takes it)
    reached pyiceberg as written, which matches them in lower case only."""
    upper = "FILE://" + small_table.metadata_location.removeprefix("file://")
    head, _, node, _ = cluster(upper)
    wait_for(lambda: head.lifecycle.state in ("ready", "failed"))
    assert head.lifecycle.state == "ready", head.lifecycle.error
    assert head.cfg.metadata_loc == small_table.metadata_location
    assert node.store.num_rows == small_table.rows
