"""Near its memory limit, a data node holds back new shuffled and filtered streams (UNAVAILABLE,
which readers retry) instead of letting their batches bring on the kernel's OOM kill."""

from __future__ import annotations

import gc
import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from kubeflow_data_cache.client import CacheClient
from kubeflow_data_cache.constants import GATHER_AHEAD_BYTES, READAHEAD_BATCHES
from kubeflow_data_cache.errors import CacheUnavailableError, NodeBusyError
from kubeflow_data_cache.memory import (
    GATHER_STREAM_BATCHES,
    GATHER_STREAM_RAMP_SECONDS,
    ServeMemoryGuard,
    load_guard_threshold,
)
from kubeflow_data_cache.node import gather_ahead
from kubeflow_data_cache.protocol import ShardRequest
from tests.cache.inprocess import cluster, get, wait_for  # noqa: F401 - cluster is a fixture
from tests.cache.stalled_readers import STALLED_STREAM_OPTIONS, stalled_readers

MiB = 1 << 20
LIMIT = 1 << 30  # its last margin: 10% of it, 102.4 MiB


def test_the_guard_admits_what_fits_and_reclaims_before_it_refuses(caplog):
    resident, reclaims = [900 * MiB], []
    guard = ServeMemoryGuard(LIMIT, lambda: reclaims.append(1), resident=lambda: resident[0], local=False)
    assert abs(load_guard_threshold(LIMIT) - 921.6 * MiB) < 1
    guard.admit(MiB, open_streams=0, node=3)  # 900 MiB + 10 batches of 1 MiB: under 921.6 MiB
    assert reclaims == [] and guard.refused == 0

    resident[0] = 915 * MiB  # 925 MiB with the stream's batches: into the margin
    caplog.set_level(logging.INFO, logger="kubeflow_data_cache.memory")
    for _ in range(2):
        with pytest.raises(NodeBusyError) as refused:
            guard.admit(MiB, open_streams=5, node=3)
    message = str(refused.value)
    assert "data node 3 is too near its memory limit" in message
    assert "915.0 MiB resident of 1.00 GiB, with 5 such stream(s) open" in message
    assert f"up to ~{GATHER_STREAM_BATCHES}.0 MiB" in message and "retry shortly" in message
    assert "WORKER_MEM / --memory-limit" in message and "CLUSTER_SIZE" in message
    assert reclaims == [1, 1], "each refusal is tried with a reclaim first"
    assert guard.refused == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, "one warning per spell of refusals, not one per retry"

    def frees_enough():  # the freed pages of finished streams go back: room again
        reclaims.append(1)
        resident[0] = 800 * MiB

    guard._reclaim = frees_enough
    guard.admit(MiB, open_streams=5, node=3)
    assert guard.refused == 2
    assert any("starting streams again" in r.getMessage() for r in caplog.records)

    # Alone (no stream open or just started), a stream goes whatever the memory: waiting for
    # others to finish would free nothing.
    alone = ServeMemoryGuard(LIMIT, lambda: None, resident=lambda: LIMIT, local=False)
    alone.admit(MiB, open_streams=0, node=3)
    with pytest.raises(NodeBusyError):  # that one is now starting
        alone.admit(MiB, open_streams=0, node=3)

    unlimited = ServeMemoryGuard(None, lambda: reclaims.append(1), resident=lambda: 1 << 60)
    unlimited.admit(1 << 40, open_streams=1000, node=0)  # no limit known: nothing to guard


def test_an_in_order_stream_counts_only_the_offsets_it_rebases():
    guard = ServeMemoryGuard(LIMIT, lambda: None, resident=lambda: 900 * MiB, local=False)
    assert guard.admit_in_order(0, open_streams=5, node=0) is None  # fixed-width columns: nothing held
    unlimited = ServeMemoryGuard(None, lambda: None, resident=lambda: 900 * MiB, local=False)
    assert unlimited.admit_in_order(MiB, open_streams=5, node=0) is None
    admitted = guard.admit_in_order(2 * MiB, open_streams=5, node=0)  # 902 MiB: under 921.6 MiB
    assert admitted is not None and admitted[1] == 2 * MiB
    with pytest.raises(
        NodeBusyError, match=r"another in-order stream: .* with 5 stream\(s\) open, each holding up to ~20.0 MiB"
    ):
        guard.admit_in_order(20 * MiB, open_streams=5, node=0)
    guard.release(admitted)


def test_streams_opened_together_count_at_full_size_until_they_show():
    """Readers open their streams together at an epoch's start, before any batch is gathered: the
    guard must not let them all in on one reading of resident memory."""
    now = [0.0]
    guard = ServeMemoryGuard(LIMIT, lambda: None, resident=lambda: 500 * MiB, local=False, clock=lambda: now[0])
    admitted = 0
    with pytest.raises(NodeBusyError, match=r"with 42 such stream\(s\) open.*\(42 just started\)"):
        for _ in range(100):
            guard.admit(MiB, open_streams=admitted, node=0)
            admitted += 1
    assert admitted == 42  # (921.6 - 500) MiB of room, 10 MiB a stream
    now[0] += GATHER_STREAM_RAMP_SECONDS + 0.1  # by now their batches show in resident memory
    guard.admit(MiB, open_streams=admitted, node=0)


def test_a_short_stream_counts_at_its_own_size_and_leaves_the_ramp_when_it_ends():
    """Each stream counted at ten full batches, for the 2 s ramp even after it ended: a node
    with 12 readers' short streams refused them at a third of its limit, and epoch starts took
    9x as long. A stream now counts at most twice its own bytes, and only while it lasts."""
    now = [0.0]
    guard = ServeMemoryGuard(LIMIT, lambda: None, resident=lambda: 500 * MiB, local=False, clock=lambda: now[0])
    short = []
    for _ in range(200):  # 4 MiB batches asked for, but 100 KiB of rows each: 200 KiB counted
        short.append(guard.admit(4 * MiB, open_streams=len(short), node=0, stream_bytes=100 * 1024))
    full = []
    with pytest.raises(NodeBusyError):  # full-size streams still count at ten batches
        for _ in range(20):
            full.append(guard.admit(4 * MiB, open_streams=len(short) + len(full), node=0, stream_bytes=1 << 30))
    assert 0 < len(full) < 10  # (921.6 - 500) MiB of room, less the short streams' 39 MiB
    for admitted in short:
        guard.release(admitted)  # they ended within the ramp
    assert guard._ramping() == len(full) * 40 * MiB
    guard.release(None)  # an unlimited guard's (or an unknown) admission: nothing to release


def test_the_order_a_stream_will_build_counts_toward_its_admission():
    """Eight jobs' shuffles of 1-2 row blocks took a 600 MiB node to 954 MiB: each stream's epoch
    order (tens of MiB) was built before admission, and never counted."""
    guard = ServeMemoryGuard(LIMIT, lambda: None, resident=lambda: 800 * MiB, local=False)
    # (921.6 - 800) MiB of room: 10 MiB of batches and 120 of order.
    with pytest.raises(
        NodeBusyError, match=r"each holding up to ~10.0 MiB.*build its epoch's shuffle order, ~120.0 MiB"
    ):
        guard.admit(MiB, open_streams=1, node=0, order_bytes=120 * MiB)
    guard.admit(MiB, open_streams=1, node=0)  # its order held by another stream already: no cost


def test_a_data_node_builds_a_streams_order_only_once_admitted_and_counts_it(cluster, small_table, monkeypatch):  # noqa: F811
    from kubeflow_data_cache import sharding

    head, _head_health, node, _node_health = cluster(small_table.metadata_location, memory_limit="8Gi")
    wait_for(lambda: head.lifecycle.state == "ready")
    asked = []
    real_admit = node._serve_guard.admit

    def admit(*args, **kwargs):
        req = ShardRequest(shuffle=True, seed=0, epoch=1, block_size=1)  # the ticket's order (_shuffled_endpoint)
        asked.append((kwargs.get("order_bytes", 0), sharding.order_built(small_table.rows, req)))
        return real_admit(*args, **kwargs)

    monkeypatch.setattr(node._serve_guard, "admit", admit)
    body = {"shard": 0, "num_shards": 1, "shuffle": True, "epoch": 1, "block_size": 1}
    info = flight.FlightClient(head.location).get_flight_info(
        flight.FlightDescriptor.for_command(json.dumps(body).encode())
    )
    (endpoint,) = info.endpoints
    # The head built the order for the FlightInfo (in this process): let it go, as a node's would be.
    sharding._epoch_order.cache_clear()
    sharding._large_epoch_order.cache_clear()
    gc.collect()
    reader = flight.FlightClient(endpoint.locations[0])
    assert reader.do_get(endpoint.ticket).read_all().num_rows == small_table.rows
    req = ShardRequest(shuffle=True, seed=0, epoch=1, block_size=1)
    assert asked == [(sharding.order_nbytes(small_table.rows, req), False)], "counted, and not built before"
    held = sharding.epoch_order(small_table.rows, req)  # a stream holds it: the next one costs nothing
    assert reader.do_get(endpoint.ticket).read_all().num_rows == small_table.rows
    assert asked[1] == (0, True)
    del held


def test_local_refusals_name_the_local_flags():
    guard = ServeMemoryGuard(LIMIT, lambda: None, resident=lambda: LIMIT, local=True)
    with pytest.raises(NodeBusyError, match="more memory \\(--memory-limit\\), use more of them \\(--data-nodes\\)"):
        guard.admit(MiB, open_streams=1, node=0)


def _shuffled_endpoint(head, batch_size: int = 65536) -> flight.FlightEndpoint:
    body = json.dumps({"shard": 0, "num_shards": 1, "shuffle": True, "epoch": 1, "batch_size": batch_size})
    info = flight.FlightClient(head.location).get_flight_info(flight.FlightDescriptor.for_command(body.encode()))
    (endpoint,) = info.endpoints
    return endpoint


def _stalled_stream(endpoint: flight.FlightEndpoint):
    """A shuffled stream opened and left unread: its node keeps gathering it (small batches, and
    no flow-control window growth, so it cannot all be sent at once)."""
    client = flight.FlightClient(endpoint.locations[0].uri.decode(), generic_options=STALLED_STREAM_OPTIONS)
    reader = client.do_get(endpoint.ticket)
    reader.read_chunk()
    return client, reader


def test_a_node_at_its_limit_refuses_gathering_streams_and_readers_wait(cluster, small_table, monkeypatch):  # noqa: F811
    import kubeflow_data_cache.memory as memory

    head, _head_health, node, node_health = cluster(small_table.metadata_location, memory_limit="8Gi")
    wait_for(lambda: head.lifecycle.state == "ready")
    at_limit = node.cfg.memory_limit
    held = _stalled_stream(_shuffled_endpoint(head, batch_size=16))  # admitted: memory was low
    wait_for(lambda: node._gathers.open_streams == 1)
    monkeypatch.setattr(memory, "resident_bytes", lambda: at_limit)

    endpoint = _shuffled_endpoint(head)
    with pytest.raises(flight.FlightUnavailableError, match="data node 0 is too near its memory limit"):
        flight.FlightClient(endpoint.locations[0]).do_get(endpoint.ticket).read_all()
    # In-order reads of fixed-width columns send zero-copy slices of the rows: never held back.
    with CacheClient(head.location) as client:
        numeric = ShardRequest(columns=("id", "feature_a"))
        assert sum(b.num_rows for b in client.read_shard(numeric, interleave=False)) == small_table.rows
    # With strings or lists, a stream holds its window's rebased offsets (200 stalled ones took
    # nodes 220 MiB past their limit): those are held back too.
    info = CacheClient(head.location).get_flight_info(ShardRequest())
    with pytest.raises(flight.FlightUnavailableError, match="too near its memory limit to start another in-order"):
        flight.FlightClient(info.endpoints[0].locations[0]).do_get(info.endpoints[0].ticket).read_all()
    metrics = get(node_health.port, "/metrics")[1]
    assert "data_cache_streams_refused_total 2.0" in metrics
    assert 'data_cache_errors_total{action="",code="UNAVAILABLE",method="DoGet"} 2.0' in metrics
    assert json.loads(get(node_health.port, "/status")[1])["refused_streams"] == 2

    # A reader retries: once streams elsewhere free their memory, its shuffled read is whole.
    calls = []

    def frees_up_later() -> int:
        calls.append(1)
        return at_limit if len(calls) <= 6 else 0  # each refusal reads memory twice (before and after a reclaim)

    monkeypatch.setattr(memory, "resident_bytes", frees_up_later)
    with CacheClient(head.location, deadline_seconds=30) as client:
        ids = np.concatenate(
            [b.column("id").to_numpy() for b in client.read_shard(ShardRequest(shuffle=True, epoch=2))]
        )
    assert len(calls) > 6, "the reader was refused first"
    assert np.array_equal(np.sort(ids), np.arange(small_table.rows))

    # Memory that never frees up: the reader gives up after its deadline, naming the node and why.
    monkeypatch.setattr(memory, "resident_bytes", lambda: at_limit)
    unavailable = r"data node .* stayed unavailable .*too near its memory limit"
    with (
        CacheClient(head.location, deadline_seconds=2) as client,
        pytest.raises(CacheUnavailableError, match=unavailable),
    ):
        list(client.read_shard(ShardRequest(shuffle=True, epoch=3)))
    held[1].cancel()
    held[0].close()


@pytest.mark.slow
def test_a_burst_of_stalled_readers_is_held_back_under_the_memory_limit(table_factory):
    """Real memory, real processes: 40 shuffled all-column readers that stop reading. Without a
    limit they took this node from ~150 to ~840 MiB here; with 600 MiB it admits what fits, refuses
    the rest, and stays under its limit, then serves whole reads once they are gone."""
    import psutil

    from kubeflow_data_cache.dataset import DataCacheDataset
    from tests.conftest import LocalCache

    limit = 600 << 20
    cache = LocalCache(table_factory(300_000, 3).metadata_location, 1, args=("--memory-limit", "600Mi"))
    try:
        cache.wait_ready()
        node = next(p for p in psutil.Process(cache.proc.pid).children() if "worker" in p.cmdline())
        with stalled_readers(cache.endpoint, 40) as (_holder, burst):
            assert burst["held"] >= 1 and burst["refused"] >= 1, burst
            assert "data node 0 is too near its memory limit" in burst["reason"]
            assert node.memory_info().rss < limit, "the held streams took the node past its limit"
        dataset = DataCacheDataset(cache.endpoint, batch_size=4096, columns=["id"], shuffle=True, deadline_seconds=60)
        ids = np.concatenate([batch["id"].numpy() for batch in dataset])
        assert np.array_equal(np.sort(ids), np.arange(300_000))
    finally:
        cache.stop()


@pytest.mark.slow
def test_stalled_in_order_readers_of_strings_and_lists_are_held_back_under_the_memory_limit(table_factory):
    """Real memory, real processes: each in-order stream of a table with strings and lists holds
    its window's rebased offsets (~2 MiB here) while its reader does not read. 300 such readers
    took this node from ~160 to ~740 MiB, none refused; now the node admits what fits."""
    import psutil

    from tests.conftest import LocalCache

    limit = 600 << 20
    cache = LocalCache(table_factory(300_000, 3).metadata_location, 1, args=("--memory-limit", "600Mi"))
    try:
        cache.wait_ready()
        node = next(p for p in psutil.Process(cache.proc.pid).children() if "worker" in p.cmdline())
        with stalled_readers(cache.endpoint, 300, shuffle=False) as (_holder, burst):
            assert burst["held"] >= 1 and burst["refused"] >= 1, burst
            assert "too near its memory limit to start another in-order stream" in burst["reason"]
            assert node.memory_info().rss < limit, "the held streams took the node past its limit"
    finally:
        cache.stop()


def test_gathering_streams_gather_ahead_within_a_byte_budget():
    """Each batch a stream gathers ahead is resident on its node: as many as GATHER_AHEAD_BYTES
    holds (at most READAHEAD_BATCHES), none where one batch alone is larger."""
    assert gather_ahead(64 << 10) == READAHEAD_BATCHES
    assert gather_ahead(1 << 20) == GATHER_AHEAD_BYTES // (1 << 20)  # 3 numeric columns, 64K rows
    assert gather_ahead(GATHER_AHEAD_BYTES) == 1
    assert gather_ahead(GATHER_AHEAD_BYTES + 1) == 0  # gathered when Flight asks for it
    assert gather_ahead(0) == READAHEAD_BATCHES


def _images_among_short_rows(tmp_path) -> str:
    """200 rows of 64 KiB images among 20,000 of 8 bytes: an average row of ~650 bytes."""
    from kubeflow_data_cache.sample import make_catalog

    catalog = make_catalog(str(tmp_path / "wh"), tmp_path / "catalog.db")
    catalog.create_namespace("s")
    values = [b"x" * 8] * 20_000 + [bytes([i]) * (64 << 10) for i in range(200)]
    data = pa.table({"id": pa.array(np.arange(len(values), dtype=np.int64)), "image": pa.array(values, pa.binary())})
    table = catalog.create_table("s.images", schema=data.schema)
    table.append(data)
    return catalog.load_table("s.images").metadata_location


def test_a_filtered_stream_of_the_largest_rows_is_counted_at_what_it_holds(cluster, tmp_path, monkeypatch):  # noqa: F811
    """The guard counted a gathering stream at its rows times the table's average row: a filter
    keeping only the images was counted at 2 x 200 x ~650 bytes (~250 KiB) for 12.5 MiB of rows,
    so a burst of such readers went past the node's limit unchecked."""
    head, _head_health, node, _node_health = cluster(_images_among_short_rows(tmp_path), memory_limit="8Gi")
    wait_for(lambda: head.lifecycle.state == "ready")
    counted = []
    real_admit = node._serve_guard.admit

    def admit(batch_bytes, open_streams, index, stream_bytes=None, order_bytes=0):
        counted.append((batch_bytes, stream_bytes))
        return real_admit(batch_bytes, open_streams, index, stream_bytes, order_bytes)

    monkeypatch.setattr(node._serve_guard, "admit", admit)
    with CacheClient(head.location) as client:
        batches = list(client.read_shard(ShardRequest(filter="id >= 20000", batch_size=65536)))
    assert sum(b.num_rows for b in batches) == 200
    ((batch_bytes, stream_bytes),) = counted
    assert stream_bytes >= sum(b.nbytes for b in batches)
    assert batch_bytes >= max(b.nbytes for b in batches)
    assert stream_bytes < 2 * sum(b.nbytes for b in batches)  # not counted far above it either


def test_a_shuffled_stream_without_a_filter_counts_its_average_rows_and_one_largest():
    """Counted at the worst case, one long document in a text table made every shuffled stream
    count 4 MiB a batch (5x its rows, and no read-ahead); rows taken as they come are about the
    average, with at most a few of the largest. A filter may keep only the largest: worst case."""
    from kubeflow_data_cache.constants import SERVED_BATCH_MAX_BYTES
    from kubeflow_data_cache.store import NodeStore

    rows = 100_000
    text = pa.array(["x" * 100] * (rows - 1) + ["y" * (1 << 20)])
    batch = pa.record_batch({"id": pa.array(np.arange(rows)), "text": text})
    store = NodeStore(batch.schema, [batch])
    average_batch = 1024 * store.row_bytes(None)
    shuffled = store.served_bytes_bound(1024, None, batch_rows=1024)
    assert average_batch + (1 << 20) - 1 <= shuffled <= average_batch + (1 << 20) + 64
    filtered = store.served_bytes_bound(1024, None, batch_rows=1024, filtered=True)
    assert filtered >= SERVED_BATCH_MAX_BYTES  # 1024 rows as large as the largest, cut at the cap
    # A stream of a few rows, filtered, counts all the variable values they could hold.
    assert store.served_bytes_bound(3, None, filtered=True) >= 3 * (1 << 20) * 0.99 - 3 * 200
