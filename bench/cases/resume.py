"""Resume: reading the rest of a shard from a saved position, with the nodes skipping the rows
already handed out, against receiving them again and dropping them (what a client must do when
tickets carry no row counts: an older cache, or any resume by replay).

Both read the whole table's shard (all columns) from RESUME_FRACTION of the way in, in order
and shuffled, alternating within each repeat.
"""

from __future__ import annotations

import time

from bench.stats import CaseResult, paired_ratio
from kubeflow_data_cache.client import CacheClient, drop_rows
from kubeflow_data_cache.protocol import ShardRequest

# How far into the shard the saved position is.
RESUME_FRACTION = 0.9
NODE_SKIP = "node-skip"
CLIENT_DROP = "client-drop"


def _read(client: CacheClient, request: ShardRequest, start: int, way: str):
    if way == NODE_SKIP:
        return client.read_shard(request, interleave=request.shuffle, start=start)
    return drop_rows(client.read_shard(request, interleave=request.shuffle), start)


def run(endpoint: str, rows: int, nodes: int, repeats: int, progress) -> list[CaseResult]:
    start = int(rows * RESUME_FRACTION)
    results: list[CaseResult] = []
    with CacheClient(endpoint) as client:
        for shuffled in (False, True):
            request = ShardRequest(shuffle=shuffled, epoch=1)
            ways = (NODE_SKIP, CLIENT_DROP)
            seconds: dict[str, list[float]] = {name: [] for name in ways}
            for _ in range(repeats):
                for name in ways:
                    began = time.perf_counter()
                    got = sum(b.num_rows for b in _read(client, request, start, name))
                    elapsed = time.perf_counter() - began
                    if got != rows - start:
                        raise RuntimeError(f"resume via {name} read {got} rows, expected {rows - start}")
                    seconds[name].append(elapsed)
            for name in ways:
                case = CaseResult("resume", name, rows, nodes, 1, shuffled)
                for value in seconds[name]:
                    case.add("seconds", value)
                # How many times faster skipping at the nodes is (1.0 for itself).
                for ratio in paired_ratio(seconds[name], seconds[NODE_SKIP]):
                    case.add("skip_speedup", ratio)
                results.append(case)
            skip, drop = (sorted(seconds[n])[len(seconds[n]) // 2] for n in (NODE_SKIP, CLIENT_DROP))
            progress(
                f"resume rows={rows:,} nodes={nodes} {'shuffled' if shuffled else 'in order'} from "
                f"{RESUME_FRACTION:.0%}: nodes skip {skip:.3f}s, re-sent and dropped {drop:.3f}s"
            )
    return results
