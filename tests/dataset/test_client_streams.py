"""CacheClient.read_shard reads every endpoint's stream in its own readahead thread: the rows
are the same as read one stream at a time, and leaving early ends those threads."""

from __future__ import annotations

import threading
import time

import pyarrow as pa
import pyarrow.flight as flight

from kubeflow_data_cache.client import CacheClient
from kubeflow_data_cache.protocol import ShardRequest


def _stream_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("cache-stream-")]


def _one_stream_at_a_time(endpoint: str, request: ShardRequest) -> list[int]:
    """The shard read the plain way: GetFlightInfo, then each endpoint's DoGet in turn."""
    head = flight.FlightClient(endpoint)
    info = head.get_flight_info(flight.FlightDescriptor.for_command(request.to_json()))
    ids: list[int] = []
    for ep in info.endpoints:
        ids += flight.FlightClient(ep.locations[0].uri.decode()).do_get(ep.ticket).read_all()["id"].to_pylist()
    return ids


def test_streams_of_all_nodes_give_every_row_once(cache_factory):
    cache = cache_factory(20_000, 3, data_nodes=3)
    with CacheClient(cache.endpoint) as client:
        for shuffle in (False, True):
            request = ShardRequest(shuffle=shuffle, columns=("id",))
            plain = _one_stream_at_a_time(cache.endpoint, request)
            assert sorted(plain) == list(range(20_000))
            for interleave in (False, True):
                got = pa.Table.from_batches(list(client.read_shard(request, interleave=interleave)))
                ids = got.column("id").to_pylist()
                # Without interleave, streams read ahead in parallel still come out one after the other.
                assert ids == plain if not interleave else sorted(ids) == sorted(plain)


def test_leaving_early_ends_the_stream_threads(cache_factory):
    cache = cache_factory(20_000, 3, data_nodes=3)
    with CacheClient(cache.endpoint) as client:
        stream = client.read_shard(ShardRequest(shuffle=True, batch_size=100))
        next(stream)
        assert len(_stream_threads()) == 3  # one per data node, all reading ahead
        stream.close()
        deadline = time.monotonic() + 10
        while _stream_threads() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _stream_threads() == []


def test_an_unshuffled_shard_comes_in_table_order_unless_interleave_is_asked(cache_factory):
    """read_shard interleaved every shard by default: a library user reading an unshuffled shard
    got 1024-row blocks alternating between nodes, not the table's order. The default is now
    the request's shuffle."""
    cache = cache_factory(20_000, 3, data_nodes=3)
    with CacheClient(cache.endpoint) as client:
        request = ShardRequest(columns=("id",))
        ids = pa.Table.from_batches(list(client.read_shard(request))).column("id").to_pylist()
        # The cache's order: data files by path, rows in file order; node after node.
        assert ids == _one_stream_at_a_time(cache.endpoint, request) and sorted(ids) == list(range(20_000))
        mixed = pa.Table.from_batches(list(client.read_shard(request, interleave=True))).column("id").to_pylist()
        assert mixed != ids and sorted(mixed) == sorted(ids)
        shuffled = ShardRequest(columns=("id",), shuffle=True)
        default = [b.column("id").to_pylist() for b in client.read_shard(shuffled)]
        assert default == [b.column("id").to_pylist() for b in client.read_shard(shuffled, interleave=True)]


def test_client_settings_a_library_user_gets_wrong_are_refused_or_taken():
    """nan passed the deadline's `<= 0` check and retried a refused endpoint for ever; numpy
    integers (a shard computed with numpy) were refused as "not an integer"."""
    import numpy as np
    import pytest

    for deadline in (float("nan"), float("inf"), 0, -1, True):
        with pytest.raises(ValueError, match="deadline_seconds should be a number of seconds > 0"):
            CacheClient("grpc://127.0.0.1:1", deadline_seconds=deadline)
    request = ShardRequest(shard=np.int64(1), num_shards=np.int32(4), epoch=np.uint64(2), seed=np.int16(3))
    assert (request.shard, request.num_shards, request.epoch, request.seed) == (1, 4, 2, 3)
    assert b'"shard": 1' in request.to_json() and type(request.shard) is int
