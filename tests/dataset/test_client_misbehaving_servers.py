"""CacheClient against tiny Flight servers that misbehave on cue: a node that freezes once, a head
that refuses or stops answering while a node is being retried. Real gRPC on loopback; the
servers speak the cache's ticket protocol (protocol.Ticket) and nothing else."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from kubeflow_data_cache.client import CacheClient
from kubeflow_data_cache.errors import CacheUnavailableError, DataCacheError
from kubeflow_data_cache.protocol import ShardRequest, Ticket

SCHEMA = pa.schema([("id", pa.int64())])
NODE_ROWS = 4096
BATCH_ROWS = 256


class TwoNodeCache(flight.FlightServerBase):
    """A head and two data nodes in one server: node 1 is reached as localhost, so the client
    opens a connection of its own to it. ``node1(server, ticket)`` may replace node 1's DoGet;
    ``head(server)`` may raise instead of answering GetFlightInfo."""

    def __init__(self, node1: Callable | None = None, head: Callable | None = None) -> None:
        super().__init__("grpc://127.0.0.1:0")
        self.location = f"grpc://127.0.0.1:{self.port}"
        self.node_locations = [self.location, f"grpc://localhost:{self.port}"]
        self.node1, self.head = node1, head
        self.node1_calls = 0
        self.first_failure: float | None = None

    def get_flight_info(self, context, descriptor):
        if self.head is not None:
            self.head(self)
        request = ShardRequest.from_json(descriptor.command)
        endpoints = [
            flight.FlightEndpoint(
                Ticket("gen-1", n, n * NODE_ROWS, NODE_ROWS, 2 * NODE_ROWS, request, rows=NODE_ROWS).to_json(),
                [self.node_locations[n]],
            )
            for n in (0, 1)
        ]
        return flight.FlightInfo(SCHEMA, descriptor, endpoints, 2 * NODE_ROWS, 2 * NODE_ROWS * 8)

    def do_get(self, context, ticket):
        t = Ticket.from_json(ticket.ticket)
        if t.node == 1:
            self.node1_calls += 1
            if self.node1 is not None:
                return self.node1(self, t)
        return flight.GeneratorStream(SCHEMA, rows_of(t))


def rows_of(t: Ticket, pause: Callable[[int], None] = lambda at: None) -> Iterator[pa.RecordBatch]:
    for start in range(t.skip, t.rows, BATCH_ROWS):
        stop = min(start + BATCH_ROWS, t.rows)
        yield pa.record_batch([pa.array(range(t.offset + start, t.offset + stop), pa.int64())], schema=SCHEMA)
        pause(start)


@contextlib.contextmanager
def serving(server: TwoNodeCache) -> Iterator[TwoNodeCache]:
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        thread.join(10)


def restarting(server, t):
    """Node 1's DoGet while it restarts: unavailable, every time."""
    raise flight.FlightUnavailableError("data node 1 restarting")


def refusing_once_node1_failed(error: Exception) -> Callable:
    """A head that answers until node 1 has been tried, then raises ``error``."""

    def head(server):
        if server.node1_calls:
            raise error

    return head


def read_fails_at_once(server: TwoNodeCache, error: type[Exception]) -> None:
    """Read the whole shard from ``server`` with a 30 s deadline: it must fail with ``error``
    within 10 s, a refusal that no retry mends, not waited out to the deadline."""
    started = time.monotonic()
    with (
        serving(server),
        CacheClient(server.location, deadline_seconds=30) as client,
        pytest.raises(error),
    ):
        for _ in client.read_shard(ShardRequest(), interleave=False):
            pass
    assert time.monotonic() - started < 10


def test_a_node_that_freezes_once_is_retried_within_a_short_deadline():
    """A stall used to be given up on at min(deadline, 60 s), which at a deadline under a minute
    was the whole deadline: the stream was never reopened, though the docs say it is retried."""
    release = threading.Event()

    def freezes_once(server, t):
        first = server.node1_calls == 1
        return flight.GeneratorStream(SCHEMA, rows_of(t, lambda at: release.wait(60) if first and at >= 512 else None))

    with (
        serving(TwoNodeCache(node1=freezes_once)) as server,
        CacheClient(server.location, deadline_seconds=6) as client,
    ):
        try:
            ids = [i for b in client.read_shard(ShardRequest(), interleave=False) for i in b.column("id").to_pylist()]
        finally:
            release.set()
    assert sorted(ids) == list(range(2 * NODE_ROWS))  # reopened after the rows it had: none twice
    assert server.node1_calls == 2


def test_a_head_that_refuses_the_lookup_while_a_node_is_retried_is_named_not_a_raw_arrow_error():
    server = TwoNodeCache(node1=restarting, head=refusing_once_node1_failed(pa.ArrowInvalid("unknown column 'x'")))
    with (
        serving(server),
        CacheClient(server.location, deadline_seconds=5) as client,
        pytest.raises(DataCacheError) as refused,
    ):
        for _ in client.read_shard(ShardRequest(), interleave=False):
            pass
    message = str(refused.value)
    assert "unknown column 'x'" in message and server.location in message
    assert "Traceback" not in message


def test_a_stale_ticket_while_retrying_keeps_to_the_deadline_already_running():
    """Node 1 fails for 2 s, then says its ticket is stale while the head has gone down too (the
    whole cache restarting): the lookup for a new ticket gets what is left of the deadline, not
    a deadline of its own (which had the read give up at nearly twice the deadline)."""
    deadline = 5.0

    def restarting_then_stale(server, t):
        server.first_failure = server.first_failure or time.monotonic()
        if time.monotonic() - server.first_failure < 2:
            raise flight.FlightUnavailableError("data node 1 restarting")
        raise pa.ArrowInvalid("stale ticket: issued for data node 1 load gen-1, this is load gen-2")

    def down_after_the_node_failed(server):
        if server.first_failure is not None and time.monotonic() - server.first_failure > 2:
            raise flight.FlightUnavailableError("head restarting")

    server = TwoNodeCache(node1=restarting_then_stale, head=down_after_the_node_failed)
    with serving(server), CacheClient(server.location, deadline_seconds=deadline) as client:
        with pytest.raises(CacheUnavailableError):
            for _ in client.read_shard(ShardRequest(), interleave=False):
                pass
        gave_up_after = time.monotonic() - server.first_failure
    assert gave_up_after < deadline + 2.5, gave_up_after


def test_a_stream_retrying_a_node_stops_when_its_read_is_closed():
    """Node 1 never answers; the caller takes one batch (node 0's) and stops. Node 1's stream
    thread went on retrying for the rest of its deadline, reconnecting the closed client."""

    with serving(TwoNodeCache(node1=restarting)) as server:
        client = CacheClient(server.location, deadline_seconds=30)
        batches = client.read_shard(ShardRequest(), interleave=False)
        next(batches)
        time.sleep(1)  # node 1's thread is retrying by now
        assert server.node1_calls >= 1
        batches.close()
        client.close()
        time.sleep(0.5)  # a try already under way may still end
        calls = server.node1_calls
        time.sleep(4)  # several backoff periods
        assert server.node1_calls == calls
        assert [t for t in threading.enumerate() if t.name.startswith("cache-stream") and t.is_alive()] == []
        assert client._clients == {}  # nothing reconnected the closed client


def test_a_head_that_refuses_the_token_while_a_node_is_retried_fails_at_once():
    """A token rotated under a read: the head's refusal is final, not retried to the deadline as
    though the head were down."""
    from kubeflow_data_cache.errors import CacheAuthError

    refusal = flight.FlightUnauthenticatedError("missing or wrong bearer token")
    read_fails_at_once(TwoNodeCache(node1=restarting, head=refusing_once_node1_failed(refusal)), CacheAuthError)


def test_a_short_stall_limit_is_named_in_tenths_not_as_zero_seconds():
    from kubeflow_data_cache.client import _secs

    assert (_secs(0.5), _secs(2.25), _secs(10), _secs(60.4)) == ("0.5s", "2.2s", "10s", "60s")


def test_a_head_that_refuses_the_token_when_a_stale_ticket_is_renewed_fails_at_once():
    """The same rule on the stale-ticket path: node 1 fails once, then says its ticket is stale,
    and by then the head refuses the token. Final at once, as on the unavailable path."""
    from kubeflow_data_cache.errors import CacheAuthError

    def unavailable_then_stale(server, t):
        if server.node1_calls == 1:
            raise flight.FlightUnavailableError("data node 1 restarting")
        server.first_failure = time.monotonic()  # the head refuses from now on
        raise pa.ArrowInvalid("stale ticket: issued for data node 1 load gen-1, this is load gen-2")

    def refuses_once_stale(server):
        if server.first_failure is not None:
            raise flight.FlightUnauthenticatedError("missing or wrong bearer token")

    server = TwoNodeCache(node1=unavailable_then_stale, head=refuses_once_stale)
    read_fails_at_once(server, CacheAuthError)
    assert server.node1_calls == 2
