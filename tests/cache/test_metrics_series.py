"""The series /metrics carries from a process's start, and the ones that follow its state: what
Prometheus needs to alert on the first error, a load that stalls, or a node near its limit."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.flight as flight
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kubeflow_data_cache import load_progress
from kubeflow_data_cache.config import build_config
from kubeflow_data_cache.head import Head
from kubeflow_data_cache.node import DataNode
from kubeflow_data_cache.protocol import ShardRequest
from kubeflow_data_cache.sample import create_sample_table
from kubeflow_data_cache.service import DEGRADED, LOADING, READY, STOPPING, HealthServer
from tests.cache.inprocess import FLAGS, get, wait_for
from tests.cache.stalled_readers import STALLED_STREAM_OPTIONS
from tests.cache.test_stalled_reads import a_data_file, stalled_file

# Every state /ready goes by: each is a series of data_cache_state, always.
STATES = ("waiting", "loading", "ready", "degraded", "failed", "stopping")


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """A health port's /metrics: each sample's value by (name, its labels)."""
    code, text = get(port, "/metrics")
    assert code == 200
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def series(samples: dict, name: str) -> dict[frozenset, float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def test_each_served_call_has_its_request_and_error_series_at_zero_from_the_start(cluster, small_table):
    """A series that first appears at 1 is no increase to Prometheus: the first error after a
    start never fired an increase() or rate() alert."""
    head, head_health, _node, node_health = cluster(small_table.metadata_location)
    on_head, on_node = scrape(head_health.port), scrape(node_health.port)  # before any reader's call
    for code in ("INVALID_ARGUMENT", "UNAVAILABLE", "INTERNAL", "CANCELLED"):
        for method in ("GetFlightInfo", "GetSchema", "ListFlights"):
            assert value(on_head, "data_cache_errors_total", method=method, action="", code=code) == 0, (method, code)
        assert value(on_node, "data_cache_errors_total", method="DoGet", action="", code=code) == 0, code
        assert value(on_node, "data_cache_errors_total", method="DoAction", action="count", code=code) == 0, code
        assert value(on_node, "data_cache_errors_total", method="DoAction", action="load", code=code) == 0, code
        assert value(on_head, "data_cache_errors_total", method="DoAction", action="register", code=code) == 0, code
    for samples in (on_head, on_node):
        assert value(samples, "data_cache_errors_total", method="DoAction", action="other", code="UNIMPLEMENTED") == 0
    assert value(on_head, "data_cache_requests_total", method="GetFlightInfo", action="") == 0
    assert value(on_node, "data_cache_requests_total", method="DoGet", action="") == 0
    # The handlers' time too: rate() over its _count and _bucket missed the first call as well.
    for samples, method in ((on_head, "GetFlightInfo"), (on_node, "DoGet")):
        assert value(samples, "data_cache_request_seconds_count", method=method, action="") == 0, method
        assert value(samples, "data_cache_request_seconds_bucket", method=method, action="", le="+Inf") == 0, method
    # Only the calls each role serves, and no token refusals where no token is set: bounded.
    assert value(on_head, "data_cache_requests_total", method="DoGet", action="") is None
    assert value(on_node, "data_cache_requests_total", method="GetFlightInfo", action="") is None
    assert value(on_node, "data_cache_requests_total", method="DoAction", action="register") is None
    assert value(on_head, "data_cache_requests_total", method="DoAction", action="load") is None
    assert not [
        labels for labels in series(on_head, "data_cache_errors_total") if ("code", "UNAUTHENTICATED") in labels
    ]
    assert len(series(on_head, "data_cache_errors_total")) < 40 and len(series(on_node, "data_cache_errors_total")) < 40

    # The first error is then an increase from 0, on the series that was there.
    wait_for(lambda: head.lifecycle.state == READY)
    client = flight.FlightClient(head.location)
    with pytest.raises(pa.ArrowInvalid, match="out of range"):
        client.get_flight_info(flight.FlightDescriptor.for_path("5", "1"))
    on_head = scrape(head_health.port)
    assert value(on_head, "data_cache_errors_total", method="GetFlightInfo", action="", code="INVALID_ARGUMENT") == 1
    client.close()


def test_the_slowest_calls_have_buckets_below_inf(cluster, small_table):
    """A head waits up to 25 s for a new filter's counts, a node counts for up to 120 s: in a 10 s
    top bucket, every such call was only "+Inf"."""
    head, head_health, _node, node_health = cluster(small_table.metadata_location)
    wait_for(lambda: head.lifecycle.state == READY)
    with flight.connect(head.location) as client:
        client.get_flight_info(flight.FlightDescriptor.for_command(ShardRequest(filter="id < 10").to_json()))
    on_head, on_node = scrape(head_health.port), scrape(node_health.port)
    for le in ("10.0", "30.0", "60.0", "120.0", "+Inf"):
        assert value(on_head, "data_cache_request_seconds_bucket", method="GetFlightInfo", action="", le=le) == 1, le
        assert value(on_node, "data_cache_request_seconds_bucket", method="DoAction", action="count", le=le) == 1, le


def test_a_token_s_refusals_have_their_series_from_the_start(small_table):
    head = Head(
        build_config(
            "head",
            {**FLAGS, "metadata_loc": small_table.metadata_location, "data_nodes": 1, "token": "t0ken-of-the-cache"},
            env={},
        )
    )
    try:
        sample = head.metrics.registry.get_sample_value
        for method in ("GetFlightInfo", "GetSchema", "ListFlights", "ListActions", "DoAction"):
            assert sample("data_cache_errors_total", {"method": method, "action": "", "code": "UNAUTHENTICATED"}) == 0
            assert sample("data_cache_requests_total", {"method": method, "action": ""}) == 0
        assert sample("data_cache_errors_total", {"method": "DoGet", "action": "", "code": "UNAUTHENTICATED"}) is None
    finally:
        head.stop()


def test_the_state_gauge_and_the_heads_data_nodes_follow_ready_and_status(cluster, small_table):
    """failed, waiting, loading, degraded and stopping all read as data_cache_ready 0: the state
    says which, one series per state, always."""
    head, head_health, _, _ = cluster(small_table.metadata_location, with_node=False)

    def states(port: int) -> dict[str, float]:
        return {dict(labels)["state"]: v for labels, v in series(scrape(port), "data_cache_state").items()}

    def nodes(port: int) -> dict[str, float]:
        return {dict(labels)["state"]: v for labels, v in series(scrape(port), "data_cache_data_nodes").items()}

    assert states(head_health.port) == {state: float(state == "waiting") for state in STATES}
    assert nodes(head_health.port) == {
        "unregistered": 1,
        "unreachable": 0,
        "waiting": 0,
        "loading": 0,
        "ready": 0,
        "failed": 0,
        "stopping": 0,
    }
    node = DataNode(build_config("worker", {**FLAGS, "index": 0, "head": head.location}, env={}))
    node_health = HealthServer("127.0.0.1", 0, node.lifecycle, node.metrics, node.status).start()
    try:
        node.start_registering()
        wait_for(lambda: head.lifecycle.state == READY and states(head_health.port)["ready"] == 1)
        assert states(head_health.port) == {state: float(state == READY) for state in STATES}
        assert states(node_health.port) == {state: float(state == READY) for state in STATES}
        assert nodes(head_health.port)["ready"] == 1 and sum(nodes(head_health.port).values()) == 1
        head.lifecycle.set(DEGRADED, "data node 0 unreachable")
        node.lifecycle.set(STOPPING, "shutting down")
        assert states(head_health.port)["degraded"] == 1 and sum(states(head_health.port).values()) == 1
        assert states(node_health.port)["stopping"] == 1 and sum(states(node_health.port).values()) == 1
        # The head's count is its last look at the node: its supervision's next poll sees it stopping.
        head._poll_nodes()
        assert nodes(head_health.port)["stopping"] == 1 and nodes(head_health.port)["ready"] == 0
    finally:
        node.stop()
        node_health.stop()


def test_a_load_under_way_shows_what_it_read_and_how_long_its_oldest_read_waits(cluster, tmp_path, monkeypatch):
    """While loading, data_cache_loaded_rows reads 0 (nothing is held yet) though /ready says
    "loading: 2000 rows, ... read": the load's own gauges say it, on the node and on the head."""
    monkeypatch.setattr(load_progress, "SLOW_READ_SECONDS", 0.3)
    table = create_sample_table(str(tmp_path / "wh"), 3000, 3)
    with stalled_file(a_data_file(table.metadata_location)):
        head, head_health, _, node_health = cluster(table.metadata_location)
        # Two of the three files read (1000 rows each), the third stalled well past a second.
        loading = wait_for(
            lambda: (
                (s := json.loads(get(node_health.port, "/status")[1]).get("loading"))
                and s["rows"] == 2000
                and (s["oldest_read"] or {}).get("seconds", 0) >= 1.0
                and s
            ),
            timeout=30,
        )
        on_node = scrape(node_health.port)
        assert value(on_node, "data_cache_state", state=LOADING) == 1
        assert value(on_node, "data_cache_loaded_rows") == 0
        assert value(on_node, "data_cache_load_read_rows") == 2000
        assert value(on_node, "data_cache_load_read_bytes") == loading["bytes"] > 0
        assert value(on_node, "data_cache_load_oldest_read_seconds") >= 1.0
        # The head: the sums over its nodes' last polls, and the longest wait among them.
        wait_for(lambda: value(scrape(head_health.port), "data_cache_load_read_rows") == 2000, timeout=30)
        on_head = scrape(head_health.port)
        assert value(on_head, "data_cache_load_read_bytes") == loading["bytes"]
        assert value(on_head, "data_cache_load_oldest_read_seconds") >= 1.0
        assert value(on_head, "data_cache_data_nodes", state=LOADING) == 1
    # Let the read through: the load fails, and nothing is under way any more.
    wait_for(lambda: head.lifecycle.state == "failed", timeout=30)
    on_node = scrape(node_health.port)
    assert value(on_node, "data_cache_state", state="failed") == 1
    assert (
        value(on_node, "data_cache_load_read_rows") == 0 and value(on_node, "data_cache_load_oldest_read_seconds") == 0
    )


def _stalled(endpoint: flight.FlightEndpoint):
    """A stream opened and left unread: its node holds it open (no flow-control window growth)."""
    client = flight.FlightClient(endpoint.locations[0].uri.decode(), generic_options=STALLED_STREAM_OPTIONS)
    reader = client.do_get(endpoint.ticket)
    reader.read_chunk()
    return client, reader


def test_a_node_shows_the_memory_limit_it_enforces_and_its_open_streams_by_kind(cluster, small_table):
    head, head_health, node, node_health = cluster(small_table.metadata_location, memory_limit="8Gi")
    wait_for(lambda: head.lifecycle.state == READY)
    on_node = scrape(node_health.port)
    assert value(on_node, "data_cache_memory_limit_bytes") == 8 << 30
    assert value(on_node, "data_cache_open_streams", kind="gathering") == 0
    assert value(on_node, "data_cache_open_streams", kind="in_order") == 0
    # The head enforces no memory limit and serves no stream: neither series.
    on_head = scrape(head_health.port)
    assert not series(on_head, "data_cache_memory_limit_bytes") and not series(on_head, "data_cache_open_streams")

    def endpoint(body: dict) -> flight.FlightEndpoint:
        info = flight.FlightClient(head.location).get_flight_info(
            flight.FlightDescriptor.for_command(json.dumps({"shard": 0, "num_shards": 1, **body}).encode())
        )
        return info.endpoints[0]

    held = [_stalled(endpoint({"shuffle": True, "epoch": 1, "batch_size": 16}))]
    wait_for(lambda: node._gathers.open_streams == 1)
    held.append(_stalled(endpoint({"batch_size": 16})))
    wait_for(lambda: node._gathers.all_open_streams == 2)
    on_node = scrape(node_health.port)
    assert value(on_node, "data_cache_open_streams", kind="gathering") == 1
    assert value(on_node, "data_cache_open_streams", kind="in_order") == 1
    for client, reader in held:
        reader.cancel()
        client.close()
    wait_for(lambda: node._gathers.all_open_streams == 0)
    on_node = scrape(node_health.port)
    assert value(on_node, "data_cache_open_streams", kind="gathering") == 0
    assert value(on_node, "data_cache_open_streams", kind="in_order") == 0


def test_a_node_without_a_memory_limit_has_no_limit_series(monkeypatch):
    """No limit: no series (a 0 would make resident / limit an infinite ratio); its streams are
    still counted."""
    import kubeflow_data_cache.config as config

    monkeypatch.setattr(config, "container_memory_limit", lambda: None)
    node = DataNode(build_config("worker", {**FLAGS, "index": 0, "head": "grpc://127.0.0.1:9"}, env={}))
    try:
        assert node.cfg.memory_limit is None
        assert node.metrics.registry.get_sample_value("data_cache_memory_limit_bytes") is None
        assert node.metrics.registry.get_sample_value("data_cache_open_streams", {"kind": "gathering"}) == 0
    finally:
        node.stop()
