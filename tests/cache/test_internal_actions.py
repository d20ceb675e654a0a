"""What only the cache's own processes may ask of each other, and what the tokenless health port
shows: a data node counts a filter only for its head (the cluster key), the head's refusals of a
registration name the caller without flooding its log, and a node's columns stay off /status."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from kubeflow_data_cache import security
from kubeflow_data_cache.config import build_config
from kubeflow_data_cache.head import Head
from kubeflow_data_cache.node import DataNode
from kubeflow_data_cache.protocol import ShardRequest
from kubeflow_data_cache.service import READY, HealthServer
from tests.cache.inprocess import FLAGS, get, wait_for

KEY = "k3y-of-the-cluster-Rw8"
COLUMN_FIGURES = ("column_bytes", "null_counts", "list_lengths", "inner_list_lengths")


@pytest.fixture
def keyed(small_table) -> Iterator[tuple[Head, DataNode, HealthServer]]:
    """A head and a data node sharing DATA_CACHE_CLUSTER_KEY, ready; the node's health server."""
    flags = {**FLAGS, "metadata_loc": small_table.metadata_location}
    env = {"DATA_CACHE_CLUSTER_KEY": KEY}
    head = Head(build_config("head", {**flags, "data_nodes": 1}, env=env))
    node = DataNode(build_config("worker", {**flags, "index": 0, "head": head.location}, env=env))
    health = HealthServer("127.0.0.1", 0, node.lifecycle, node.metrics, node.status).start()
    try:
        head.start()
        node.start_registering()
        wait_for(lambda: head.lifecycle.state == READY or head.lifecycle.error, timeout=60)
        assert head.lifecycle.state == READY, head.lifecycle.error
        yield head, node, health
    finally:
        node.stop()
        head.stop()
        health.stop()


def action(location: str, kind: str, body: dict) -> list[bytes]:
    with flight.connect(location) as client:
        return [r.body.to_pybytes() for r in client.do_action(flight.Action(kind, json.dumps(body).encode()))]


@pytest.mark.parametrize("key", [None, "a-guess"], ids=["no key", "wrong key"])
def test_a_data_node_counts_a_filter_only_for_its_head(keyed, small_table, caplog, key):
    """A reader holds the token, not the key: asking a node to count directly ran its predicate
    there past the head's de-duplication, and pushed readers' filters out of the node's cache."""
    head, node, _ = keyed
    body = {"filter": "id >= 0", **({"cluster_key": key} if key else {})}
    with caplog.at_level(logging.WARNING), pytest.raises(pa.ArrowInvalid, match="count: the cluster key is missing"):
        action(node.location, "count", body)
    assert "refused a count without the cluster key (from ipv4:127.0.0.1:" in caplog.text
    labels = {"method": "DoAction", "action": "count", "code": "INVALID_ARGUMENT"}
    assert node.metrics.registry.get_sample_value("data_cache_errors_total", labels) == 1
    # With the key, as the head sends it: counted.
    assert json.loads(action(node.location, "count", {**body, "cluster_key": KEY})[0])["rows"] == small_table.rows
    # A reader's filter goes through the head, which holds the key: its rows are read as before.
    with flight.connect(head.location) as client:
        request = ShardRequest(filter="id < 100").to_json()
        info = client.get_flight_info(flight.FlightDescriptor.for_command(request))
        assert info.total_records == 100
        rows = sum(
            flight.connect(ep.locations[0].uri.decode()).do_get(ep.ticket).read_all().num_rows for ep in info.endpoints
        )
    assert rows == 100


def test_a_refused_registration_names_its_caller_once_a_spell(keyed, caplog, monkeypatch):
    """Any token holder could send `register` in a loop, each refusal a warning line naming no one."""
    head, node, _ = keyed
    stranger = {"index": 0, "location": "grpc://127.0.0.1:9", "load_threads": 1}
    with caplog.at_level(logging.WARNING, logger="kubeflow_data_cache.head"):
        for _ in range(5):
            with pytest.raises(pa.ArrowInvalid, match="register: the cluster key is missing or wrong"):
                action(head.location, "register", stranger)
    warnings = [r.getMessage() for r in caplog.records if "refused a data node registration" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "(index 0)" in warnings[0] and "(from ipv4:127.0.0.1:" in warnings[0]
    labels = {"method": "DoAction", "action": "register", "code": "INVALID_ARGUMENT"}
    assert head.metrics.registry.get_sample_value("data_cache_errors_total", labels) == 5, "each is counted"
    # Once the interval has passed, the next refusal is warned of, with how many went unsaid.
    monkeypatch.setattr(security, "REFUSAL_WARN_EVERY_SECONDS", 0.0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kubeflow_data_cache.head"), pytest.raises(pa.ArrowInvalid):
        action(head.location, "register", stranger)
    (warning,) = [r.getMessage() for r in caplog.records if "refused a data node registration" in r.getMessage()]
    assert "4 more refused since the last warning" in warning
    assert head.registered[0]["location"] == node.location, "the stranger took no node's place"


def test_refusal_warnings_keep_to_one_a_spell():
    now = [0.0]
    said: list[str] = []

    class Log:
        def warning(self, message, *args):
            said.append(message % args)

    warnings = security.RefusalWarnings(Log(), every=60.0, clock=lambda: now[0])
    for _ in range(3):
        warnings.refused("refused x", "ipv4:10.0.0.7:5000")
    now[0] = 59.0
    warnings.refused("refused x", "ipv4:10.0.0.8:5000")
    assert said == ["refused x (from ipv4:10.0.0.7:5000)"]
    now[0] = 61.0
    warnings.refused("refused x", "ipv4:10.0.0.9:5000")
    assert said[1] == "refused x (from ipv4:10.0.0.9:5000; 3 more refused since the last warning)"
    now[0] = 200.0  # a quiet spell: the next refusal is a new one's first
    warnings.refused("refused x", "ipv4:10.0.0.9:5000")
    assert said[2] == "refused x (from ipv4:10.0.0.9:5000)"
    assert security.caller(None) == security.UNKNOWN_PEER


def test_a_data_nodes_columns_stay_off_its_tokenless_status(keyed, small_table):
    """The health port takes no token: /status said every column's name, size, nulls and list
    lengths. The head, which needs them for its FlightInfo, has them from the `status` action."""
    head, node, health = keyed
    over_http = json.loads(get(health.port, "/status")[1])
    assert over_http["state"] == READY and over_http["rows"] == small_table.rows
    assert not set(COLUMN_FIGURES) & set(over_http), over_http.keys()
    assert "embedding" not in json.dumps(over_http)
    by_action = json.loads(action(node.location, "status", {})[0])
    assert set(COLUMN_FIGURES) <= set(by_action) and "embedding" in by_action["column_bytes"]
    assert {k: v for k, v in by_action.items() if k not in COLUMN_FIGURES and k != "resident_bytes"} == {
        k: v for k, v in over_http.items() if k != "resident_bytes"
    }
    # The head's FlightInfo still sizes the rows from the nodes' column bytes.
    with flight.connect(head.location) as client:
        info = client.get_flight_info(flight.FlightDescriptor.for_path("0", "1"))
    assert info.total_bytes == pytest.approx(sum(by_action["column_bytes"].values()), rel=0.01)
