"""Readers that open streams and stop reading: what holds a data node's serving memory (each
shuffled stream's gathered batches, each in-order stream's rebased offsets), for the tests of how
a node gives it back or holds it off."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator

# One connection per stream, and no flow-control window growth: each stream stalls after a
# batch or so, its node still holding what it gathered ahead.
STALLED_STREAM_OPTIONS = [("grpc.use_local_subchannel_pool", 1), ("grpc.http2.bdp_probe", 0)]

_SCRIPT = f"""
import json, sys, time
import pyarrow.flight as flight
head = flight.FlightClient(sys.argv[1])
body = {{"shard": 0, "num_shards": 1, "shuffle": sys.argv[3] == "1", "epoch": 1}}
info = head.get_flight_info(flight.FlightDescriptor.for_command(json.dumps(body).encode()))
held, refused, reason = [], 0, ""
for _ in range(int(sys.argv[2])):
    for ep in info.endpoints:
        client = flight.FlightClient(ep.locations[0].uri.decode(), generic_options={STALLED_STREAM_OPTIONS!r})
        try:
            stream = client.do_get(ep.ticket)
            stream.read_chunk()
            held.append((client, stream))
        except flight.FlightUnavailableError as err:  # a node near its memory limit
            refused, reason = refused + 1, str(err).splitlines()[0]
print(json.dumps({{"held": len(held), "refused": refused, "reason": reason}}), flush=True)
time.sleep(600)
"""


@contextlib.contextmanager
def stalled_readers(endpoint: str, per_endpoint: int, shuffle: bool = True) -> Iterator[tuple[subprocess.Popen, dict]]:
    """A process holding ``per_endpoint`` stalled shuffled (or in-order) streams on each data
    node, and what it got: ``{"held": n, "refused": n, "reason": "<the last refusal>"}``. Killed
    on exit."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, endpoint, str(per_endpoint), "1" if shuffle else "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield holder, json.loads(holder.stdout.readline())
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)
