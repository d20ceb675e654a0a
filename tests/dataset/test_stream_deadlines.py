"""Deadlines a reader keeps against servers that misbehave in ways a real cache cannot be made to
on cue: a node whose reopened stream starts but never sends a batch, an address that accepts
connections and never answers; and a node that reloads under a long stream more often than a
reader may ask for a fresh ticket in a row.

The misbehaving node here is a small Flight server speaking the cache's protocol (tickets from
protocol.Ticket), because freezing a real node between its stream's first message and its first
batch cannot be timed from outside.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from kubeflow_data_cache import client as client_module
from kubeflow_data_cache.client import CacheClient
from kubeflow_data_cache.errors import CacheUnavailableError
from kubeflow_data_cache.protocol import ShardRequest, Ticket

ROWS = 4096
SCHEMA = pa.schema([("id", pa.int64())])


class _StallingNode(flight.FlightServerBase):
    """Head and data node in one: its first stream sends two batches and then nothing; every
    stream after that sends its schema (so the reader's do_get returns) and then nothing."""

    def __init__(self) -> None:
        super().__init__("grpc://127.0.0.1:0")
        self.location = f"grpc://127.0.0.1:{self.port}"
        # The same server under another name as its data node, so the reader tells the two apart.
        self.node_location = f"grpc://localhost:{self.port}"
        self.release = threading.Event()  # set at teardown: the blocked streams end
        self.streams = 0

    def get_flight_info(self, context, descriptor):
        request = ShardRequest.from_json(descriptor.command)
        ticket = Ticket("g1", 0, 0, ROWS, ROWS, request, rows=ROWS)
        endpoint = flight.FlightEndpoint(ticket.to_json(), [self.node_location])
        return flight.FlightInfo(SCHEMA, descriptor, [endpoint], ROWS, ROWS * 8)

    def do_get(self, context, ticket):
        self.streams += 1
        first = self.streams == 1

        def batches() -> Iterator[pa.RecordBatch]:
            if first:
                for start in (0, 512):
                    yield pa.record_batch([pa.array(range(start, start + 512), pa.int64())], schema=SCHEMA)
            self.release.wait(60)

        return flight.GeneratorStream(SCHEMA, batches())


@contextlib.contextmanager
def _serving(server: flight.FlightServerBase, before_shutdown=lambda: None) -> Iterator[None]:
    """``server`` serving in a thread of its own until the block ends."""
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        before_shutdown()
        server.shutdown()
        thread.join(10)


@pytest.fixture
def stalling_node():
    server = _StallingNode()
    with _serving(server, before_shutdown=server.release.set):  # the blocked streams end first
        yield server


def test_a_reopened_stream_that_never_sends_a_batch_is_given_up_on_at_the_deadline(stalling_node, monkeypatch):
    """After a stall, the retried stream opens but its first batch never comes: that wait is cut
    to what is left of the deadline, not a whole stall limit more (here 8 s: 16 s in all, not 10)."""
    monkeypatch.setattr(client_module, "STREAM_STALL_SECONDS", 8.0)
    deadline = 10.0
    client = CacheClient(stalling_node.location, deadline_seconds=deadline)
    got = 0
    started = time.monotonic()
    try:
        with pytest.raises(CacheUnavailableError, match=rf"data node {stalling_node.node_location} stayed unavailable"):
            for batch in client.read_shard(ShardRequest(), interleave=False):
                got += batch.num_rows
    finally:
        client.close()
    waited = time.monotonic() - started
    assert got == 1024, "the rows before the stall are handed out once"
    assert stalling_node.streams >= 2, "the stream was reopened after the stall"
    # The stall watcher ticks every second at this limit, and the last wait is at least
    # MIN_STALL_WAIT_SECONDS: 1.5 s late at most, and room for a loaded machine (the old code
    # gave up 6 s late).
    assert waited < deadline + 4, f"gave up {waited - deadline:.1f}s after the deadline"


def test_an_address_that_accepts_and_never_answers_is_named_as_the_setting_to_check():
    """A timeout alone does not prove the address right (a wrong one that swallows packets
    times out too): a head that never answered gets the endpoint hint, not 'stopped answering'."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)  # the kernel completes the handshake; nothing ever reads or answers
        endpoint = f"grpc://127.0.0.1:{listener.getsockname()[1]}"
        with CacheClient(endpoint, deadline_seconds=2) as client, pytest.raises(CacheUnavailableError) as err:
            client.status()
    message = str(err.value)
    assert f"could not reach the data cache at {endpoint}" in message
    assert "set DATA_CACHE_ENDPOINT" in message and "stopped answering" not in message


def test_an_http_server_at_the_endpoint_fails_at_once_saying_it_is_not_grpc():
    """The cache's Service carries its health port beside Flight's: a reader pointed at it
    retried to its deadline (120 s by default) and was told only that HTTP/2 did not parse."""
    import http.server

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"grpc://127.0.0.1:{server.server_address[1]}"
        started = time.monotonic()
        with CacheClient(endpoint, deadline_seconds=60) as client, pytest.raises(CacheUnavailableError) as err:
            client.status()
        assert time.monotonic() - started < 20  # the TLS probe's 2 s, not the deadline
    finally:
        server.shutdown()
        server.server_close()
    message = str(err.value)
    assert f"something answers at {endpoint}, but not gRPC" in message
    assert "a cache's health port (8080; Flight is on 50051)" in message and "set DATA_CACHE_ENDPOINT" in message


def test_a_job_cache_service_that_cannot_be_reached_points_at_the_initializer():
    """The endpoint DataCacheDataset makes from TRAIN_JOB_NAME: "set DATA_CACHE_ENDPOINT" sent the
    user to a variable they never set, where the Service is missing or the job uses another runtime."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    # A name no resolver knows (a .invalid domain): unreachable at once, as a missing Service is.
    endpoint = f"grpc://job-a.invalid-cache-service:{port}"
    with CacheClient(endpoint, deadline_seconds=1) as client, pytest.raises(CacheUnavailableError) as err:
        client.status()
    message = str(err.value)
    assert "the Service job-a.invalid-cache-service is the one the cache initializer makes" in message
    assert "torch-distributed-with-cache runtime" in message


class _ReloadingNode(flight.FlightServerBase):
    """Head and data node in one, whose node reloads ``reloads`` times in the middle of a stream:
    each time the stream breaks after ``RELOAD_EVERY`` rows, tickets of the old load are refused
    as stale from then on, and the head's next lookup fails once (it has not seen the reload yet),
    so the reader reopens with its old ticket, is refused, and must ask the head again."""

    RELOAD_EVERY = 1024

    def __init__(self, reloads: int) -> None:
        super().__init__("grpc://127.0.0.1:0")
        self.location = f"grpc://127.0.0.1:{self.port}"
        self.rows = self.RELOAD_EVERY * (reloads + 1)
        self.reloads_left = reloads
        self.load = 1
        self.lookups_to_fail = 0
        self.stale_refusals = 0

    def get_flight_info(self, context, descriptor):
        if self.lookups_to_fail:
            self.lookups_to_fail -= 1
            raise flight.FlightUnavailableError("the head is busy")
        request = ShardRequest.from_json(descriptor.command)
        ticket = Ticket(f"load-{self.load}", 0, 0, self.rows, self.rows, request, rows=self.rows)
        endpoint = flight.FlightEndpoint(ticket.to_json(), [self.location])
        return flight.FlightInfo(SCHEMA, descriptor, [endpoint], self.rows, self.rows * 8)

    def do_get(self, context, ticket):
        t = Ticket.from_json(ticket.ticket)
        if t.generation != f"load-{self.load}":
            self.stale_refusals += 1
            raise pa.ArrowInvalid(f"stale ticket: issued for data node 0 {t.generation}, this is load-{self.load}")

        def batches() -> Iterator[pa.RecordBatch]:
            sent = 0
            for start in range(t.skip, self.rows, 256):
                if sent == self.RELOAD_EVERY and self.reloads_left:
                    self.reloads_left -= 1
                    self.load += 1
                    self.lookups_to_fail = 1
                    raise flight.FlightUnavailableError("the data node restarted")
                stop = min(start + 256, self.rows)
                yield pa.record_batch([pa.array(range(start, stop), pa.int64())], schema=SCHEMA)
                sent += stop - start

        return flight.GeneratorStream(SCHEMA, batches())


def test_a_long_stream_outlives_more_node_reloads_than_the_replan_limit():
    """The stale-ticket replans a stream may make count from its last progress: a stream that
    moves on between reloads is renewed each time, however many reloads it lives through."""
    reloads = client_module.MAX_REPLANS + 2
    server = _ReloadingNode(reloads)
    with _serving(server), CacheClient(server.location, deadline_seconds=30) as client:
        ids = [b.column("id").to_pylist() for b in client.read_shard(ShardRequest(), interleave=False)]
    assert [i for batch in ids for i in batch] == list(range(server.rows)), "every row once, in order"
    assert server.reloads_left == 0 and server.stale_refusals == reloads, "each reload was met with a stale ticket"
