"""One DoGet client process for the serve case: `python -m bench.serve_client ENDPOINT`.

Prints ``ready`` once imported and connected, then for each ``go`` line on stdin reads the
whole table (shard 0 of 1, all columns) with CacheClient and prints one JSON line: rows,
Arrow bytes received, and wall-clock start and end (time.time, comparable across processes).
Imports and connection set-up stay outside the timing; a real trainer pays them once.
"""

from __future__ import annotations

import json
import sys
import time

from kubeflow_data_cache.client import CacheClient
from kubeflow_data_cache.protocol import ShardRequest


def read_all(client: CacheClient) -> dict[str, float]:
    rows = nbytes = 0
    start = time.time()
    for batch in client.read_shard(ShardRequest(), interleave=False):
        rows += batch.num_rows
        nbytes += batch.nbytes
    return {"rows": rows, "bytes": nbytes, "start": start, "end": time.time()}


def main(argv: list[str]) -> int:
    with CacheClient(argv[0], deadline_seconds=60) as client:
        client.status()  # connect to the head before the clock starts
        print("ready", flush=True)
        for line in sys.stdin:
            if line.strip() != "go":
                break
            print(json.dumps(read_all(client)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
