"""A data node's DoGet streams from the side of what they leave behind: threads, metrics, and
what a client hears when a stream fails on the node."""

from __future__ import annotations

import functools
import threading
import time

import pyarrow.flight as flight
import pytest

from kubeflow_data_cache import node as node_module
from kubeflow_data_cache.client import CacheClient
from kubeflow_data_cache.errors import DataCacheError, NotReadyError
from kubeflow_data_cache.protocol import ShardRequest
from kubeflow_data_cache.store import NodeStore

from .inprocess import cluster, get, wait_for  # noqa: F401 - cluster is a fixture

ROWS = 300_000


@pytest.fixture
def ready(cluster, table_factory):  # noqa: F811 - the fixture imported above
    head, _, node, node_health = cluster(table_factory(ROWS, 3).metadata_location)
    wait_for(lambda: head.lifecycle.state == "ready")
    return head, node, node_health


def _ticket(head, request: ShardRequest) -> tuple[str, flight.Ticket]:
    info = flight.FlightClient(head.location).get_flight_info(flight.FlightDescriptor.for_command(request.to_json()))
    (endpoint,) = info.endpoints
    return endpoint.locations[0].uri.decode(), endpoint.ticket


def _gather_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gather"]


def test_a_gathering_stream_whose_client_left_before_it_began_leaves_no_thread(ready, monkeypatch):
    """A shuffled DoGet whose client gave up (deadline, cancel) while the handler still ran: Flight
    never starts the stream, so nothing may have been started that only the stream stops."""
    head, node, _ = ready
    # Batches small enough to be gathered ahead of the writer (node.gather_ahead).
    location, ticket = _ticket(head, ShardRequest(shuffle=True, batch_size=1000))
    real = node_module.node_rows

    def slow_node_rows(*args, **kwargs):
        time.sleep(0.5)  # the handler outlives the client's deadline
        return real(*args, **kwargs)

    monkeypatch.setattr(node_module, "node_rows", slow_node_rows)
    reader = flight.FlightClient(location)
    for _ in range(3):
        with pytest.raises(flight.FlightTimedOutError):
            reader.do_get(ticket, flight.FlightCallOptions(timeout=0.05)).read_chunk()
    time.sleep(1.5)  # each handler has returned (0.5 s) and its stream was dropped
    assert _gather_threads() == []
    assert node._gathers.open_streams == 0
    # The node still serves the same ticket whole afterwards.
    monkeypatch.setattr(node_module, "node_rows", real)
    assert reader.do_get(ticket).read_all().num_rows == ROWS


def test_served_rows_count_what_was_sent_not_what_the_stream_would_hold(cluster, table_factory, monkeypatch):  # noqa: F811
    """An in-order stream the reader stops after one batch: the node counts the windows Flight's
    writer took, not the whole stream at its start. Fixed-width columns: the stream whose slices
    the writer used to be handed all at once. gRPC's flow control lets the writer run a few MiB
    ahead of a reader (up to ~5 MiB measured on loopback), so the stream is 24 MiB."""
    rows = 1_000_000
    head, _, _, node_health = cluster(table_factory(rows, 2, with_text=False).metadata_location)
    wait_for(lambda: head.lifecycle.state == "ready")
    # Windows of 1 MiB, as if the stream were 16 times larger (constants.SERVE_WINDOW_BYTES).
    monkeypatch.setattr(node_module, "window_rows", functools.partial(node_module.window_rows, max_bytes=1 << 20))
    with CacheClient(head.location, deadline_seconds=30) as client:
        request = ShardRequest(batch_size=1000, columns=("id", "feature_b", "label", "flag"))
        batches = client.read_shard(request, interleave=False)
        assert next(batches).num_rows == 1000
        batches.close()
    time.sleep(1)
    served = float(
        next(
            line.split()[-1]
            for line in get(node_health.port, "/metrics")[1].splitlines()
            if line.startswith("data_cache_served_rows_total ")
        )
    )
    assert 1000 <= served < rows / 2


@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffled"])
def test_a_stream_that_fails_on_the_node_names_the_node_and_is_counted(ready, monkeypatch, shuffle):
    """A failure inside a stream (after its first batches) reaches the reader as the cache's error
    naming the node and the row it failed at, without the node's Python traceback; the node
    counts it and logs the traceback."""
    head, _, node_health = ready
    # In order, one batch a window: a window is sent once the next batch is made.
    monkeypatch.setattr(node_module, "window_rows", functools.partial(node_module.window_rows, max_bytes=1))
    calls = {"n": 0}

    def third_fails() -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise MemoryError("simulated allocation failure")

    # Shuffled, each batch is a gather (NodeStore.take); in order, a slice (NodeStore.slices).
    if shuffle:
        take = NodeStore.take

        def failing_take(self, *args, **kwargs):
            third_fails()
            return take(self, *args, **kwargs)

        monkeypatch.setattr(NodeStore, "take", failing_take)
    else:
        slices = NodeStore.slices

        def failing_slices(self, *args, **kwargs):
            for batch in slices(self, *args, **kwargs):
                third_fails()
                yield batch

        monkeypatch.setattr(NodeStore, "slices", failing_slices)
    got = 0
    with CacheClient(head.location, deadline_seconds=30) as client, pytest.raises(DataCacheError) as caught:
        for batch in client.read_shard(ShardRequest(shuffle=shuffle, batch_size=1000), interleave=False):
            got += batch.num_rows
    message = str(caught.value)
    # Two batches were made; the second is sent with the third when windows are cut (in order).
    assert got == (2000 if shuffle else 1000)
    assert f"data node 0 failed after {got} rows of the stream: MemoryError: simulated allocation failure" in message
    assert "Traceback" not in message
    assert (
        'data_cache_errors_total{action="",code="INTERNAL",method="DoGet"} 1.0' in get(node_health.port, "/metrics")[1]
    )


def test_a_cache_whose_load_failed_is_not_ready_for_its_readers(cluster, tmp_path):  # noqa: F811
    """The failed load's INTERNAL answer carries a marker: readers get NotReadyError with the
    load's error, other internal failures a plain DataCacheError (above)."""
    head, *_ = cluster(str(tmp_path / "missing.metadata.json"))
    wait_for(lambda: head.lifecycle.state == "failed")
    with CacheClient(head.location, deadline_seconds=5) as client, pytest.raises(NotReadyError) as caught:
        client.get_flight_info(ShardRequest())
    assert "the cache failed to load" in str(caught.value) and "does not exist" in str(caught.value)


def test_windows_keep_every_batch_in_order_within_the_row_bound():
    import pyarrow as pa

    batches = [
        pa.record_batch({"x": pa.array(range(i * 100, i * 100 + n), pa.int64())})
        for i, n in enumerate([100, 50, 100, 7, 100])
    ]
    got = list(node_module.windows(iter(batches), max_rows=160))
    assert [t.num_rows for t in got] == [150, 107, 100]
    assert pa.concat_tables(got).column("x").to_pylist() == [v for b in batches for v in b.column(0).to_pylist()]
    # A batch larger than the bound is a window of its own; nothing in, nothing out.
    assert [t.num_rows for t in node_module.windows(iter(batches), max_rows=1)] == [100, 50, 100, 7, 100]
    assert list(node_module.windows(iter([]), max_rows=10)) == []


def test_a_window_holds_at_most_its_batch_count():
    """One-row batches (a client's batch_size=1) made windows of 16 MiB of rows: hundreds of
    thousands of slices, each with its own buffers, several KiB a row and uncounted."""
    import pyarrow as pa

    batches = [pa.record_batch({"x": pa.array([i], pa.int64())}) for i in range(10)]
    got = list(node_module.windows(iter(batches), max_rows=1000, max_batches=4))
    assert [t.num_rows for t in got] == [4, 4, 2]
    assert pa.concat_tables(got).column("x").to_pylist() == list(range(10))


def test_an_in_order_stream_of_one_row_batches_is_windowed_by_batch_count(cluster, small_table, monkeypatch):  # noqa: F811
    """Every row once, in windows of at most SERVE_WINDOW_BATCHES batches, as the node sends them."""
    sizes = []
    real = node_module.windows

    def recording(batches, max_rows, *args, **kwargs):
        for window in real(batches, max_rows, *args, **kwargs):
            sizes.append(len(window.to_batches()))
            yield window

    monkeypatch.setattr(node_module, "windows", recording)
    head, *_ = cluster(small_table.metadata_location)
    wait_for(lambda: head.lifecycle.state == "ready")
    with CacheClient(head.location, deadline_seconds=30) as client:
        batches = list(client.read_shard(ShardRequest(columns=["id"], batch_size=1)))
    assert sorted(v for b in batches for v in b.column(0).to_pylist()) == list(range(small_table.rows))
    assert sizes and max(sizes) == 256  # constants.SERVE_WINDOW_BATCHES: it was all 10,000 in one
    assert sum(sizes) == small_table.rows  # one row per batch, every batch windowed


def test_a_window_holds_about_the_window_bytes_of_average_rows():
    assert node_module.window_rows(8.0, max_bytes=160 * 8) == 160
    assert node_module.window_rows(1e9, max_bytes=16) == 1  # one huge row: still a window
    assert node_module.window_rows(0.0, max_bytes=16) == 16  # rows of no bytes: any bound
