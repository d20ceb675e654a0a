"""Calls sent to the wrong role, or before the cache is ready, answer with a status that says so."""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from tests.cache.conftest import read_descriptor
from tests.cache.inprocess import wait_for


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
    errors = head.metrics.errors.labels(method="ListFlights", code="UNAVAILABLE")._value.get()
    assert errors == 1


def test_stopping_a_head_before_ready_is_not_logged_as_a_failure(cluster, small_table, caplog):
    caplog.set_level(logging.INFO, logger="kubeflow_data_cache")
    head, _, _, _ = cluster(small_table.metadata_location, with_node=False)
    wait_for(lambda: "registered" in head.lifecycle.detail)
    head.stop()
    wait_for(lambda: any("stopped before the cache was ready" in r.getMessage() for r in caplog.records))
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert head.lifecycle.state != "failed"
