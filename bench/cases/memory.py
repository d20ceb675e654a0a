"""Memory: each data node's resident set against the Arrow size of the rows it holds.

The interpreter baseline is the resident set of a data node that holds zero rows but has done
everything else (imports, opened the table): node 0 of a 2-node cache over a 1-row table, the
median over several cluster starts (one start's idle node reads a couple of MiB either side of
another's, which at the headline's 56 MiB of Arrow rows per node is 0.05 of the ratio).
``overhead_ratio`` = (resident - baseline) / Arrow bytes, for the worst node of the cluster.
Beside it, a bare interpreter that only imports what a data node imports (``imports_bytes``):
the difference is the node's own fixed cost (its Flight and health servers, threads, the opened
table, allocator arenas), which the baseline counts as the interpreter's and a reader may not.

The target is that a node *stays* within 1.3x, so besides the figure at ready it is taken twice
on the last cluster of a point, after the serve, epoch and resume cases: once the node is idle
again (after its gather memory is handed back, allocator.GATHER_RECLAIM_IDLE_SECONDS), and at its
peak while serving (the kernel's high-water mark, VmHWM, reset at ready through clear_refs).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from bench.procs import CacheProcess
from bench.stats import CaseResult
from bench.tables import BenchTable
from kubeflow_data_cache.allocator import GATHER_RECLAIM_IDLE_SECONDS

# How long after the last read the idle figure is taken: past the gather pool's hand-back.
SETTLE_SECONDS = GATHER_RECLAIM_IDLE_SECONDS + 1.0


def baseline(table: BenchTable, starts: int, progress) -> CaseResult:
    """Two baselines per start: the empty node at ready, and the 1-row node idle again after a
    shuffled read of its row. A node that served and went idle has handed its free heap back
    (allocator.reclaim_gather_memory), start-up garbage included, so the figure after serving
    subtracts the second: against the first it read ~3 MiB low, a ratio 0.05 low at the
    headline size and below 1x (less than the rows themselves) at 200,000 rows."""
    if table.rows != 1:
        raise ValueError("the baseline needs a 1-row table, so that one of two nodes holds no rows")
    from kubeflow_data_cache.client import CacheClient
    from kubeflow_data_cache.protocol import ShardRequest

    result = CaseResult("memory-baseline", "idle-node", 0, 2)
    result.add("imports_bytes", imports_bytes(table.env))
    for _ in range(starts):
        with CacheProcess(table.metadata_location, 2, table.env) as cache:
            nodes = cache.status()["nodes"]
            result.add("resident_bytes", next(n for n in nodes if n["rows"] == 0)["resident_bytes"])
            with CacheClient(cache.endpoint) as client:
                rows = sum(b.num_rows for b in client.read_shard(ShardRequest(shuffle=True), interleave=True))
            if rows != 1:
                raise RuntimeError(f"the baseline's shuffled read gave {rows} rows, expected 1")
            time.sleep(SETTLE_SECONDS)
            served = next(n for n in nodes if n["rows"] == 1)["index"]
            result.add("resident_bytes_after_serve", resident_now(cache.data_node_pids()[served]))
    progress(
        f"memory baseline: an idle data node holds {baseline_bytes(result) / 2**20:.0f} MiB resident, "
        f"{baseline_bytes(result, after_serve=True) / 2**20:.0f} MiB idle after serving"
    )
    return result


# What a data node imports before it serves (runner.py, node.py and the table's reader).
NODE_IMPORTS = "import kubeflow_data_cache.runner, kubeflow_data_cache.node, pyiceberg.table, pyiceberg.io.pyarrow"


def imports_bytes(env: dict[str, str]) -> float:
    """The resident set of a fresh interpreter that has imported what a data node imports."""
    import os
    import subprocess
    import sys

    script = f"{NODE_IMPORTS}\nprint(open('/proc/self/status').read())"
    out = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    line = next(line for line in out.splitlines() if line.startswith("VmRSS:"))
    return float(line.split()[1]) * 1024


def baseline_bytes(result: CaseResult, after_serve: bool = False) -> float:
    """The baseline the ratios subtract: the median over baseline()'s starts, at ready or (for
    the figure idle after serving) idle after a read."""
    return statistics.median(result.raw["resident_bytes_after_serve" if after_serve else "resident_bytes"])


def record(result: CaseResult, status: dict, baseline_bytes: float, cache: CacheProcess) -> None:
    """Per-cluster figures at ready from the head's status (worst node), and each node's peak
    while loading: its resident high-water mark since its start, read before anything resets it
    (the target is a node's memory at any time, and a load peaks above what it keeps)."""
    nodes = [n for n in status["nodes"] if n["rows"] > 0]
    pids = cache.data_node_pids()
    loading = {n["index"]: max(peak_bytes(pids[n["index"]]), n["resident_bytes"]) for n in nodes}
    result.add("resident_bytes_peak_loading", max(loading.values()))
    result.add("overhead_ratio_peak_loading", max((loading[n["index"]] - baseline_bytes) / n["bytes"] for n in nodes))
    result.add("resident_bytes", max(n["resident_bytes"] for n in nodes))
    result.add("arrow_bytes", max(n["bytes"] for n in nodes))
    result.add("baseline_bytes", baseline_bytes)
    result.add("overhead_ratio", max((n["resident_bytes"] - baseline_bytes) / n["bytes"] for n in nodes))
    # The target as one number: resident / (1.3 x Arrow + baseline); <= 1 meets it.
    result.add("target_fraction", max(n["resident_bytes"] / (1.3 * n["bytes"] + baseline_bytes) for n in nodes))


def reset_peak(pid: int) -> None:
    """Start a process's resident high-water mark afresh (Linux: 5 into /proc/PID/clear_refs)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def reset_peaks(cache: CacheProcess) -> None:
    for pid in cache.data_node_pids().values():
        reset_peak(pid)


def peak_bytes(pid: int) -> float:
    """The process's resident high-water mark (VmHWM) since start or the last reset_peak."""
    return _status_kib(pid, "VmHWM:") * 1024


def _status_kib(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field):
            return float(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def resident_now(pid: int) -> float:
    """The process's resident set now (VmRSS)."""
    return _status_kib(pid, "VmRSS:") * 1024


def record_served(result: CaseResult, cache: CacheProcess, baseline: CaseResult, trimmed: bool) -> None:
    """After the serve, epoch and resume cases: the node once idle again, its peak while
    serving (since reset_peaks), and the bytes served per /metrics. The peak subtracts the
    baseline at ready (the node's start-up garbage was resident when its peak was reset). So
    does the idle figure, unless the cluster served shuffled reads (``trimmed``): a node hands
    its free heap back, start-up garbage included, when its last gathering stream has been
    idle a while, and in-order reads gather nothing; then it subtracts the baseline idle after
    a shuffled read.

    Resident sizes are read from each node process itself: the head's status carries what its
    supervision poll last saw (every few seconds), which can predate the hand-back.
    """
    time.sleep(SETTLE_SECONDS)
    status = cache.status()
    pids = cache.data_node_pids()
    nodes = [n for n in status["nodes"] if n["rows"] > 0]
    idle = {n["index"]: resident_now(pids[n["index"]]) for n in nodes}
    # The kernel's counters lag a little (per-thread caches), so a high-water mark read just
    # after a resident figure can come out a few pages below it: the peak is at least the idle one.
    peaks = {k: max(peak_bytes(pids[k]), idle[k]) for k in idle}
    arrow = {n["index"]: n["bytes"] for n in nodes}
    for name, resident, base in (
        ("after_serve", idle, baseline_bytes(baseline, after_serve=trimmed)),
        ("peak_serving", peaks, baseline_bytes(baseline)),
    ):
        result.add(f"resident_bytes_{name}", max(resident.values()))
        result.add(f"baseline_bytes_{name}", base)
        result.add(f"overhead_ratio_{name}", max((resident[k] - base) / arrow[k] for k in resident))
    served = [cache.metric(n["location"], "data_cache_served_bytes_total") for n in status["nodes"]]
    if all(s is not None for s in served):
        result.add("bytes_served_metric", sum(served))


def finish(result: CaseResult, progress) -> CaseResult:
    f = result.as_dict()["figures"]
    after = f.get("overhead_ratio_after_serve", {}).get("median")
    peak = f.get("overhead_ratio_peak_serving", {}).get("median")
    progress(
        f"memory rows={result.rows:,} nodes={result.nodes}: node resident {f['resident_bytes']['median'] / 2**20:.0f} MiB "
        f"for {f['arrow_bytes']['median'] / 2**20:.0f} MiB of Arrow rows (baseline "
        f"{f['baseline_bytes']['median'] / 2**20:.0f} MiB): overhead {f['overhead_ratio']['median']:.2f}x at ready, "
        f"{f['overhead_ratio_peak_loading']['median']:.2f}x at its peak while loading"
        + (f", {after:.2f}x idle after serving, {peak:.2f}x at its peak while serving" if after is not None else "")
    )
    return result
