"""Memory: each data node's resident set against the Arrow size of the rows it holds.

The interpreter baseline is the resident set of a data node that holds zero rows but has done
everything else (imports, opened the table): node 0 of a 2-node cache over a 1-row table, the
median over several cluster starts (one start's idle node reads a couple of MiB either side of
another's, which at the headline's 56 MiB of Arrow rows per node is 0.05 of the ratio).
``overhead_ratio`` = (resident - baseline) / Arrow bytes, for the worst node of the cluster.

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
    if table.rows != 1:
        raise ValueError("the baseline needs a 1-row table, so that one of two nodes holds no rows")
    result = CaseResult("memory-baseline", "idle-node", 0, 2)
    for _ in range(starts):
        with CacheProcess(table.metadata_location, 2, table.env) as cache:
            empty = [n for n in cache.status()["nodes"] if n["rows"] == 0]
            result.add("resident_bytes", empty[0]["resident_bytes"])
    progress(f"memory baseline: an idle data node holds {baseline_bytes(result) / 2**20:.0f} MiB resident")
    return result


def baseline_bytes(result: CaseResult) -> float:
    """The baseline the ratios subtract: the median idle node of baseline()'s starts."""
    return statistics.median(result.raw["resident_bytes"])


def record(result: CaseResult, status: dict, baseline_bytes: float) -> None:
    """Per-cluster figures at ready from the head's status (worst node)."""
    nodes = [n for n in status["nodes"] if n["rows"] > 0]
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


def record_served(result: CaseResult, cache: CacheProcess, baseline_bytes: float) -> None:
    """After the serve, epoch and resume cases: the node once idle again, its peak while
    serving (since reset_peaks), and the bytes served per /metrics.

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
    for name, resident in (("after_serve", idle), ("peak_serving", peaks)):
        result.add(f"resident_bytes_{name}", max(resident.values()))
        result.add(f"overhead_ratio_{name}", max((resident[k] - baseline_bytes) / arrow[k] for k in resident))
    served = [cache.metric(n["location"], "data_cache_bytes_served_total") for n in status["nodes"]]
    if all(s is not None for s in served):
        result.add("bytes_served_metric", sum(served))


def finish(result: CaseResult, progress) -> CaseResult:
    f = result.as_dict()["figures"]
    after = f.get("overhead_ratio_after_serve", {}).get("median")
    peak = f.get("overhead_ratio_peak_serving", {}).get("median")
    progress(
        f"memory rows={result.rows:,} nodes={result.nodes}: node resident {f['resident_bytes']['median'] / 2**20:.0f} MiB "
        f"for {f['arrow_bytes']['median'] / 2**20:.0f} MiB of Arrow rows (baseline "
        f"{f['baseline_bytes']['median'] / 2**20:.0f} MiB): overhead {f['overhead_ratio']['median']:.2f}x at ready"
        + (f", {after:.2f}x idle after serving, {peak:.2f}x at its peak while serving" if after is not None else "")
    )
    return result
