"""Resumed and reopened streams: a data node leaves out the rows a client already has.

Tickets say how many rows each endpoint's stream holds; a client that handed out ``k`` rows
asks the node to skip them instead of receiving them again, and a stream that ends short of
its ticket is an error, never a smaller shard.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from kubeflow_data_cache.client import CacheClient
from kubeflow_data_cache.errors import BadRequestError, DataCacheError
from kubeflow_data_cache.protocol import (
    ORDER_VERSION,
    PROTOCOL_VERSION,
    SKIP_VERSION,
    ShardRequest,
    Ticket,
    ticket_order,
    ticket_rows,
    with_skip,
)
from tests.cache.inprocess import get, wait_for
from tests.conftest import TEST_CLUSTER_KEY


def served(port: int) -> float:
    metrics = get(port, "/metrics")[1]
    return float(re.search(r"^data_cache_served_rows_total (\S+)$", metrics, re.M).group(1))


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
    rest = node.do_get(flight.Ticket(with_skip(only.ticket.ticket, 1234))).read_all().column("id").to_pylist()
    assert rest == whole[1234:]
    assert served(node_port) - before == len(whole) - 1234  # the skipped rows were not sent


def test_a_skip_past_the_stream_is_refused(one_node):
    endpoint, _ = one_node
    info = flight.FlightClient(endpoint).get_flight_info(flight.FlightDescriptor.for_path("0", "2"))
    body = with_skip(info.endpoints[0].ticket.ticket, 999999)
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


def test_one_stream_is_read_in_the_nodes_batches_not_cut_into_blocks(one_node, small_table):
    """With one endpoint there is nothing to interleave: a shuffled read of 1-row blocks comes
    in the node's batches (it came as one slice per row), in the same order, resumed alike."""
    endpoint, _ = one_node
    request = ShardRequest(shuffle=True, epoch=1, columns=("id",), batch_size=1000, block_size=1)
    with CacheClient(endpoint) as client:
        batches = list(client.read_shard(request))
        assert len(batches) == small_table.rows // 1000
        in_order = ids(client.read_shard(request, interleave=False))
        assert ids(batches) == in_order and sorted(in_order) == list(range(small_table.rows))
        assert ids(client.read_shard(request, start=4321)) == in_order[4321:]


def test_a_stream_short_of_its_ticket_is_an_error(one_node, monkeypatch):
    from kubeflow_data_cache import node as node_module

    endpoint, _ = one_node
    # A node refuses a ticket whose rows are not its stream's where it can count them cheaply
    # (test_a_ticket_whose_rows_were_changed_...): a shuffled epoch whose order it has not built
    # it cannot. Made so here (this process's head built it), these tickets reach the client's
    # own check, as a stream that really lost rows on the way would.
    monkeypatch.setattr(node_module, "order_built", lambda total, req: False)
    with CacheClient(endpoint) as client:
        request = ShardRequest(columns=("id",), shuffle=True, epoch=11)
        (only,) = client.get_flight_info(request).endpoints
        t = Ticket.from_json(only.ticket.ticket)
        # As if the node had lost rows on the way: the ticket promises more than arrives.
        promised = replace(t, rows=t.rows + 5)
        forged = flight.FlightEndpoint(promised.to_json(), only.locations)
        got = []
        with pytest.raises(DataCacheError, match=r"stream ended at row 10000 of the 10005 its ticket holds"):
            for batch in client.read_endpoint(request, forged):
                got.append(batch)
        assert sum(b.num_rows for b in got) == 10_000
        # And one that sends more than its ticket holds fails at the batch that goes past it.
        request = ShardRequest(columns=("id",), shuffle=True, epoch=12)
        (only,) = client.get_flight_info(request).endpoints
        fewer = replace(Ticket.from_json(only.ticket.ticket), rows=t.rows - 5)
        got = []
        with pytest.raises(DataCacheError, match=r"stream went past row 9995, where its ticket ends"):
            for batch in client.read_endpoint(request, flight.FlightEndpoint(fewer.to_json(), only.locations)):
                got.append(batch)
        assert sum(b.num_rows for b in got) < 9995


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


class Spy:
    """A data node connection that records the tickets sent and breaks the first stream once,
    after ``break_after`` batches, as a dropped connection would."""

    def __init__(self, client: flight.FlightClient, break_after: int) -> None:
        self._client, self.break_after, self.tickets = client, break_after, []

    def close(self) -> None:
        self._client.close()

    def do_get(self, ticket, options=None):
        self.tickets.append(json.loads(ticket.ticket))
        reader = self._client.do_get(ticket, options)
        if len(self.tickets) > 1:
            return reader
        spy = self

        class Breaking:
            read = 0

            def read_chunk(self):
                if self.read == spy.break_after:
                    raise flight.FlightUnavailableError("connection reset (injected)")
                self.read += 1
                return reader.read_chunk()

            def cancel(self):
                reader.cancel()

        return Breaking()


def test_a_broken_stream_is_reopened_after_the_rows_received(one_node, monkeypatch):
    endpoint, _ = one_node
    request = ShardRequest(shuffle=True, epoch=1, columns=("id",), batch_size=1000)
    with CacheClient(endpoint) as client:
        whole = ids(client.read_shard(request))
        real = client._acquire
        spies: dict[str, Spy] = {}

        def spied(location):
            connection = real(location)
            if location != endpoint:
                if location not in spies:
                    spies[location] = Spy(connection.client, break_after=3)
                connection.client = spies[location]
            return connection

        monkeypatch.setattr(client, "_acquire", spied)
        assert ids(client.read_shard(request)) == whole
    (spy,) = spies.values()
    # The reopened stream asked the node to leave out the 3000 rows already received.
    assert [(t["v"], t.get("skip")) for t in spy.tickets] == [(1, 0), (2, 3000)]
    assert spy.tickets[1]["rows"] == 10_000


def test_skip_tickets_keep_the_heads_fields_and_old_nodes_refuse_them():
    request = ShardRequest(columns=("id",))
    head_ticket = json.loads(Ticket("g", 0, 0, 10, 10, request, rows=10).to_json())
    head_ticket["future"] = "a field a newer head adds"
    raw = json.dumps(head_ticket).encode()
    assert with_skip(raw, 0) == raw  # nothing to skip: the head's bytes as they are
    skipping = json.loads(with_skip(raw, 4))
    assert skipping == {**head_ticket, "v": SKIP_VERSION, "skip": 4}
    assert Ticket.from_json(with_skip(raw, 4)).skip == 4
    # A node from before skipping accepts version 1 only: it refuses, it does not ignore the skip.
    assert SKIP_VERSION != PROTOCOL_VERSION
    with pytest.raises(BadRequestError, match="a ticket with a skip should be version 2"):
        Ticket.from_json(json.dumps({**head_ticket, "skip": 4}).encode())
    assert ticket_rows(raw) == 10
    assert ticket_rows(b"not json") is None
    assert ticket_rows(json.dumps({**head_ticket, "rows": "10"}).encode()) is None


def test_shuffled_tickets_say_the_order_their_node_streams(small_cache):
    """A resumed position means rows only in the order it was counted in: heads say theirs on
    every shuffled ticket; a ticket that says nothing is from before the dealt order (1)."""
    with CacheClient(small_cache.endpoint) as client:
        shuffled = client.get_flight_info(ShardRequest(shuffle=True)).endpoints
        in_order = client.get_flight_info(ShardRequest()).endpoints
    assert {Ticket.from_json(e.ticket.ticket).order for e in shuffled} == {ORDER_VERSION}
    assert {ticket_order(e.ticket.ticket) for e in shuffled} == {ORDER_VERSION} and ORDER_VERSION == 2
    assert {Ticket.from_json(e.ticket.ticket).order for e in in_order} == {None}
    legacy = Ticket("g", 0, 0, 10, 10, ShardRequest(shuffle=True), rows=10).to_json()
    assert "order" not in json.loads(legacy) and ticket_order(legacy) == 1
    assert ticket_order(b"not json") == 1


def test_a_stream_reopened_on_a_cache_that_orders_otherwise_is_refused(small_cache):
    """A stream broken mid-read is reopened after the rows received, from the head's fresh ticket.
    If the cache came back in another version whose nodes order shuffled streams otherwise, the
    same count means other rows: refused, not continued."""
    request = ShardRequest(shuffle=True, epoch=4)
    with CacheClient(small_cache.endpoint) as client:
        endpoint = client.get_flight_info(request).endpoints[0]
        was = replace(Ticket.from_json(endpoint.ticket.ticket), order=None)  # a ticket from before the versions
        old = flight.FlightEndpoint(was.to_json(), endpoint.locations)
        location = endpoint.locations[0].uri.decode()
        with pytest.raises(BadRequestError, match=f"shuffled order {ORDER_VERSION}, not 1"):
            client._fresh_endpoint(request, old, location)
        assert client._fresh_endpoint(request, endpoint, location).ticket == endpoint.ticket


@pytest.mark.parametrize(
    "change",
    [{"offset": 1}, {"node_rows": 1}, {"total": 1}, {"rows": 1}],
    ids=["offset", "node_rows", "total", "rows"],
)
def test_a_stream_reopened_on_a_node_that_reloaded_other_rows_is_refused(small_cache, change):
    """Resuming a broken stream by row count is right only if the node holds the same rows: a
    fresh ticket that places them otherwise (the table changed under a restarted cache) is an
    error, not a continuation among other rows."""
    request = ShardRequest(shuffle=True, epoch=4)
    with CacheClient(small_cache.endpoint) as client:
        endpoint = client.get_flight_info(request).endpoints[0]
        now = Ticket.from_json(endpoint.ticket.ticket)
        (field,) = change
        was = replace(now, **{field: getattr(now, field) + change[field]})
        old = flight.FlightEndpoint(was.to_json(), endpoint.locations)
        location = endpoint.locations[0].uri.decode()
        with pytest.raises(BadRequestError, match=f"data node {now.node} .* reloaded with other rows") as err:
            client._fresh_endpoint(request, old, location)
        # Not only "start the epoch again": a resume from the last state keeps what was read.
        assert "resume from the last state_dict()" in str(err.value)


@pytest.mark.parametrize(
    "request_",
    [
        ShardRequest(shard=2, num_shards=3, shuffle=True, epoch=3, even="pad", block_size=256, batch_size=300),
        ShardRequest(shard=0, num_shards=2, shuffle=True, filter="id % 3 = 0", block_size=100, batch_size=128),
        ShardRequest(shard=1, num_shards=3, filter="id % 2 = 1", even="drop", batch_size=500),
    ],
    ids=["padded-shuffled", "filtered-shuffled", "filtered-in-order"],
)
def test_resuming_across_two_nodes_gives_the_rest(small_cache, request_):
    """Two data node processes: the round-robin (or node-by-node) order resumes where it stood."""
    request = replace(request_, columns=("id",))
    with CacheClient(small_cache.endpoint) as client:
        whole = ids(client.read_shard(request, interleave=request.shuffle))
        assert len(client.get_flight_info(request).endpoints) == 2
        for start in (1, 257, len(whole) // 2, len(whole) - 1, len(whole)):
            assert ids(client.read_shard(request, interleave=request.shuffle, start=start)) == whole[start:]


@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffled"])
@pytest.mark.parametrize(("more_rows", "skip_past"), [(10, 5), (-1, None)], ids=["skip-past-the-end", "rows-lowered"])
def test_a_ticket_whose_rows_were_changed_is_refused_not_served_short_or_long(
    small_cache, shuffle, more_rows, skip_past
):
    """The node took the ticket's own `rows` for the stream's: raised, with a skip past the real
    end, it sent an empty stream without a word; lowered, it sent every row all the same."""
    request = ShardRequest(shuffle=shuffle, epoch=7)
    with CacheClient(small_cache.endpoint) as client:
        endpoint = client.get_flight_info(request).endpoints[0]
    node = flight.FlightClient(endpoint.locations[0].uri.decode())
    whole = node.do_get(endpoint.ticket).read_all()  # a shuffled stream's first read builds its order
    ticket = Ticket.from_json(endpoint.ticket.ticket)
    assert whole.num_rows == ticket.rows
    skip = ticket.rows + skip_past if skip_past is not None else 0
    changed = replace(ticket, rows=ticket.rows + more_rows, skip=skip)
    with pytest.raises(pa.ArrowInvalid, match=f"this stream holds {ticket.rows}: tickets come from the head"):
        node.do_get(flight.Ticket(changed.to_json(TEST_CLUSTER_KEY))).read_all()
    assert node.do_get(endpoint.ticket).read_all().num_rows == ticket.rows  # the head's ticket still serves
    node.close()
