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
