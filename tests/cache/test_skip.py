"""Resumed and reopened streams: a data node leaves out the rows a client already has.

Tickets say how many rows each endpoint's stream holds; a client that handed out ``k`` rows
asks the node to skip them instead of receiving them again, and a stream that ends short of
its ticket is an error, never a smaller shard.
"""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from kubeflow_data_cache.client import CacheClient
from kubeflow_data_cache.errors import DataCacheError
from kubeflow_data_cache.protocol import ShardRequest, Ticket
from tests.cache.inprocess import get, wait_for


def served(port: int) -> float:
    metrics = get(port, "/metrics")[1]
    return float(re.search(r"^data_cache_rows_served_total (\S+)$", metrics, re.M).group(1))


def ids(batches) -> list[int]:
    return [int(i) for b in batches for i in b.column("id").to_numpy()]


@pytest.fixture
def one_node(cluster, small_table):
    head, _head_health, _node, node_health = cluster(small_table.metadata_location)
    wait_for(lambda: head.lifecycle.state == "ready")
    return head.location, node_health.port


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_node_serves_a_ticket_from_its_skip(one_node, small_table, shuffle):
    endpoint, node_port = one_node
    request = ShardRequest(shard=1, num_shards=3, shuffle=shuffle, epoch=4, columns=("id",), batch_size=300)
    client = flight.FlightClient(endpoint)
    info = client.get_flight_info(flight.FlightDescriptor.for_command(request.to_json()))
    (only,) = info.endpoints
    ticket = Ticket.from_json(only.ticket.ticket)
    assert ticket.rows == info.total_records == 3333
    node = flight.FlightClient(only.locations[0].uri.decode())
    whole = node.do_get(only.ticket).read_all().column("id").to_pylist()
    before = served(node_port)
    rest = node.do_get(flight.Ticket(ticket.skipping(1234).to_json())).read_all().column("id").to_pylist()
    assert rest == whole[1234:]
    assert served(node_port) - before == len(whole) - 1234  # the skipped rows were not sent


def test_a_skip_past_the_stream_is_refused(one_node):
    endpoint, _ = one_node
    info = flight.FlightClient(endpoint).get_flight_info(flight.FlightDescriptor.for_path("0", "2"))
    body = info.endpoints[0].ticket.ticket.replace(b'"skip": 0', b'"skip": 999999')
    node = flight.FlightClient(info.endpoints[0].locations[0].uri.decode())
    with pytest.raises(pa.ArrowInvalid, match=r"'skip' \(999999\) is past the stream's 5000 rows"):
        node.do_get(flight.Ticket(body)).read_all()


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_resumed_read_gets_the_rest_and_the_node_sends_only_that(one_node, small_table, shuffle):
    endpoint, node_port = one_node
    request = ShardRequest(shuffle=shuffle, epoch=2, columns=("id",), batch_size=512)
    with CacheClient(endpoint) as client:
        whole = ids(client.read_shard(request, interleave=shuffle))
        before = served(node_port)
        rest = ids(client.read_shard(request, interleave=shuffle, start=6001))
        assert rest == whole[6001:]
        assert served(node_port) - before == small_table.rows - 6001
        with pytest.raises(DataCacheError, match="cannot resume 10001 rows into a shard of 10000 rows"):
            list(client.read_shard(request, start=small_table.rows + 1))


def test_a_stream_short_of_its_ticket_is_an_error(one_node):
    endpoint, _ = one_node
    request = ShardRequest(columns=("id",))
    with CacheClient(endpoint) as client:
        (only,) = client.get_flight_info(request).endpoints
        ticket = Ticket.from_json(only.ticket.ticket)
        # As if the node had lost rows on the way: the ticket promises more than arrives.
        promised = Ticket(
            ticket.generation,
            ticket.node,
            ticket.offset,
            ticket.node_rows,
            ticket.total,
            ticket.request,
            rows=ticket.rows + 5,
        )
        forged = flight.FlightEndpoint(promised.to_json(), only.locations)
        got = []
        with pytest.raises(DataCacheError, match=r"sent 10000 rows of a stream whose ticket holds 10005"):
            for batch in client.read_endpoint(request, forged):
                got.append(batch)
        assert sum(b.num_rows for b in got) == 10_000


def test_tickets_without_counts_are_read_whole_and_skipped_here(one_node):
    """An older cache's tickets carry no row counts: a resumed read drops the rows as they arrive."""
    endpoint, _ = one_node
    request = ShardRequest(shuffle=True, columns=("id",), batch_size=700)
    with CacheClient(endpoint) as client:
        whole = ids(client.read_shard(request))
        (only,) = client.get_flight_info(request).endpoints
        t = Ticket.from_json(only.ticket.ticket)
        old = flight.FlightEndpoint(
            Ticket(t.generation, t.node, t.offset, t.node_rows, t.total, t.request).to_json(), only.locations
        )
        assert b'"rows"' not in old.ticket.ticket
        assert ids(client.read_endpoint(request, old, start=4321)) == whole[4321:]
    assert np.unique(whole).size == 10_000
