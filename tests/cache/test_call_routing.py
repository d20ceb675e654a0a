"""Calls sent to the wrong role, or before the cache is ready, answer with a status that says so."""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from kubeflow_data_cache.client import CacheClient
from kubeflow_data_cache.errors import NOT_READY_INFO, CacheUnavailableError, answered_not_ready
from kubeflow_data_cache.protocol import ShardRequest
from tests.cache.conftest import read_descriptor
from tests.cache.inprocess import wait_for
from tests.conftest import free_port


def read_path_shard(endpoint: str, index: int, total: int):
    return read_descriptor(endpoint, flight.FlightDescriptor.for_path(str(index), str(total)))


def test_doget_on_the_head_points_at_the_endpoints(small_cache):
    info, _ = read_path_shard(small_cache.endpoint, 0, 1)
    with pytest.raises(pa.ArrowNotImplementedError, match="DoGet goes to a data node"):
        flight.FlightClient(small_cache.endpoint).do_get(info.endpoints[0].ticket).read_all()


def test_head_calls_on_a_data_node_point_at_the_head(small_cache):
    info, _ = read_path_shard(small_cache.endpoint, 0, 1)
    node = flight.FlightClient(info.endpoints[0].locations[0].uri.decode())
    with pytest.raises(pa.ArrowNotImplementedError, match="GetFlightInfo goes to the head"):
        node.get_flight_info(flight.FlightDescriptor.for_path("0", "1"))
    with pytest.raises(pa.ArrowNotImplementedError, match="ListFlights goes to the head"):
        list(node.list_flights())
    with pytest.raises(pa.ArrowNotImplementedError, match="GetSchema goes to the head"):
        node.get_schema(flight.FlightDescriptor.for_path("0", "1"))


def test_list_flights_before_ready_is_unavailable_and_counted(cluster, small_table):
    head, _, _, _ = cluster(small_table.metadata_location, with_node=False)
    with pytest.raises(flight.FlightUnavailableError, match="not ready yet"):
        list(flight.FlightClient(head.location).list_flights())
    errors = head.metrics.errors.labels(method="ListFlights", action="", code="UNAVAILABLE")._value.get()
    assert errors == 1


def test_get_schema_before_ready_says_unavailable_without_the_servers_traceback(cluster, small_table):
    """pyarrow's server passes no Flight error out of GetSchema: the client read "Unknown error"
    followed by the server's traceback (its source paths), while /metrics said UNAVAILABLE."""
    head, _, _, _ = cluster(small_table.metadata_location, with_node=False)
    with pytest.raises(OSError, match=r"^UNAVAILABLE: the cache is not ready yet") as refused:
        flight.FlightClient(head.location).get_schema(flight.FlightDescriptor.for_path("0", "1"))
    assert "Traceback" not in str(refused.value) and ".py" not in str(refused.value)
    errors = head.metrics.errors.labels(method="GetSchema", action="", code="UNAVAILABLE")._value.get()
    assert errors == 1


def test_the_planned_snapshot_is_named_while_the_head_waits_for_its_nodes(cluster, small_table):
    """It said null until the loads were sent, and for good where the memory check then failed."""
    from pyiceberg.table import StaticTable

    head, _, _, _ = cluster(small_table.metadata_location, with_node=False)
    wait_for(lambda: head.plan_seconds > 0, timeout=30)
    assert head.status()["state"] == "waiting"
    snapshot = StaticTable.from_metadata(small_table.metadata_location).current_snapshot()
    assert head.status()["snapshot_id"] == snapshot.snapshot_id


def test_not_ready_is_marked_so_that_clients_need_not_read_the_words(cluster, small_table):
    """The marker, not the message, tells a reader that the cache answered "not ready yet"."""
    head, _, _, _ = cluster(small_table.metadata_location, with_node=False)
    with pytest.raises(flight.FlightUnavailableError) as err:
        flight.FlightClient(head.location).get_flight_info(flight.FlightDescriptor.for_path("0", "1"))
    assert err.value.extra_info == NOT_READY_INFO
    assert answered_not_ready(err.value)
    # Nothing else is taken for it: an unreachable server, or a message that only says the words.
    assert not answered_not_ready(flight.FlightUnavailableError("the cache is not ready yet"))
    with pytest.raises(flight.FlightUnavailableError) as unreachable:
        flight.FlightClient(f"grpc://127.0.0.1:{free_port()}").get_flight_info(
            flight.FlightDescriptor.for_path("0", "1"), options=flight.FlightCallOptions(timeout=5)
        )
    assert not answered_not_ready(unreachable.value)


def test_a_reader_of_a_cache_that_stays_loading_is_told_so(cluster, small_table):
    """Not "could not reach": the address is right, the cache is not ready, and waiting longer helps."""
    head, _, _, _ = cluster(small_table.metadata_location, with_node=False)
    with (
        CacheClient(head.location, deadline_seconds=1) as client,
        pytest.raises(CacheUnavailableError, match=r"was still not ready after 1s .*larger deadline_seconds") as err,
    ):
        next(client.read_shard(ShardRequest()))
    assert "DATA_CACHE_ENDPOINT" not in str(err.value)


def test_stopping_a_head_before_ready_is_not_logged_as_a_failure(cluster, small_table, caplog):
    caplog.set_level(logging.INFO, logger="kubeflow_data_cache")
    head, _, _, _ = cluster(small_table.metadata_location, with_node=False)
    wait_for(lambda: "registered" in head.lifecycle.detail)
    head.stop()
    wait_for(lambda: any("stopped before the cache was ready" in r.getMessage() for r in caplog.records))
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert head.lifecycle.state != "failed"
