"""After ready, the head keeps watching its data nodes: a lost node makes it not ready, naming
the node, until a replacement has reloaded the rows."""

from __future__ import annotations

import pyarrow.flight as flight
import pytest

from kubeflow_data_cache import head as head_module
from kubeflow_data_cache.config import build_config
from kubeflow_data_cache.node import DataNode
from kubeflow_data_cache.protocol import ShardRequest
from kubeflow_data_cache.service import HealthServer
from tests.cache.inprocess import FLAGS, get, wait_for


def total_records(head) -> int:
    info = flight.FlightClient(head.location).get_flight_info(flight.FlightDescriptor.for_path("0", "1"))
    return info.total_records


def test_a_lost_data_node_makes_the_head_unready_until_it_is_back(cluster, small_table, monkeypatch):
    monkeypatch.setattr(head_module, "SUPERVISE_POLL_SECONDS", 0.2)
    head, head_health, node, node_health = cluster(small_table.metadata_location)
    wait_for(lambda: get(head_health.port, "/ready")[0] == 200)
    assert total_records(head) == small_table.rows
    lost_at = node.location

    node.stop()
    node_health.stop()
    _, body = wait_for(lambda: (r := get(head_health.port, "/ready"))[0] == 503 and r)
    assert "degraded" in body and f"data node 0 ({lost_at}) unreachable" in body
    assert "data_cache_ready 0.0" in get(head_health.port, "/metrics")[1]
    with pytest.raises(flight.FlightUnavailableError, match=r"data node 0 .* unreachable"):
        total_records(head)

    # The pod comes back (a new process: new port, no rows) and re-registers; the head reloads it.
    replacement = DataNode(build_config("worker", {**FLAGS, "index": 0, "head": head.location}, env={}))
    replacement_health = HealthServer("127.0.0.1", 0, replacement.lifecycle, replacement.metrics, replacement.status)
    replacement_health.start()
    try:
        replacement.start_registering()
        wait_for(lambda: get(head_health.port, "/ready")[0] == 200)
        assert "data_cache_ready 1.0" in get(head_health.port, "/metrics")[1]
        assert total_records(head) == small_table.rows
        endpoint = (
            flight.FlightClient(head.location)
            .get_flight_info(flight.FlightDescriptor.for_command(ShardRequest().to_json()))
            .endpoints[0]
        )
        assert endpoint.locations[0].uri.decode() == replacement.location
    finally:
        replacement.stop()
        replacement_health.stop()
