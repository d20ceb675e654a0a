"""Deadlines a reader keeps against servers that misbehave in ways a real cache cannot be made to
on cue: a node whose reopened stream starts but never sends a batch, an address that accepts
connections and never answers.

The misbehaving node here is a small Flight server speaking the cache's protocol (tickets from
protocol.Ticket), because freezing a real node between its stream's first message and its first
batch cannot be timed from outside.
"""

from __future__ import annotations

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


@pytest.fixture
def stalling_node():
    server = _StallingNode()
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.release.set()
        server.shutdown()
        thread.join(10)


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
