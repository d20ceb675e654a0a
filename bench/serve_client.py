"""One DoGet client process for the serve case: `python -m bench.serve_client ENDPOINT [--bare]`.

With ``--bare`` it reads a `bench.bare_flight` server with a plain pyarrow FlightClient instead.

Prints ``ready`` once imported and connected, then for each ``go N`` line on stdin reads the
whole table (shard 0 of 1, all columns) N times in a row with CacheClient and prints one JSON
line: rows and Arrow bytes of one pass (the same for every pass, or it fails), N, and the
wall-clock start and end of all N (time.time, comparable across processes). Imports and
connection set-up stay outside the timing; a real trainer pays them once.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator

import pyarrow as pa
import pyarrow.flight as flight

from kubeflow_data_cache.allocator import tune_glibc_malloc
from kubeflow_data_cache.client import CacheClient
from kubeflow_data_cache.protocol import ShardRequest


def timed(read: Callable[[], Iterator[pa.RecordBatch]], passes: int) -> dict[str, float]:
    counts = []
    start = time.time()
    for _ in range(passes):
        rows = nbytes = 0
        for batch in read():
            rows += batch.num_rows
            nbytes += batch.nbytes
        counts.append((rows, nbytes))
    end = time.time()
    if len(set(counts)) != 1:
        raise RuntimeError(f"passes over the same table differ: {counts}")
    return {"rows": counts[0][0], "bytes": counts[0][1], "passes": passes, "start": start, "end": end}


def serve_requests(read: Callable[[], Iterator[pa.RecordBatch]]) -> None:
    """One timed series of reads per ``go N`` line on stdin, until anything else or EOF."""
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if len(words) != 2 or words[0] != "go":
            break
        print(json.dumps(timed(read, int(words[1]))), flush=True)


def main(argv: list[str]) -> int:
    if "--bare" in argv:
        tune_glibc_malloc()  # the same client-side setting CacheClient makes: compare servers
        bare = flight.FlightClient(argv[0])
        bare.wait_for_available(timeout=30)
        serve_requests(lambda: (chunk.data for chunk in bare.do_get(flight.Ticket(b"table"))))
        return 0
    with CacheClient(argv[0], deadline_seconds=60) as client:
        client.status()  # connect to the head before the clock starts
        serve_requests(lambda: client.read_shard(ShardRequest(), interleave=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
