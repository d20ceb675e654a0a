"""Memory: each data node's resident set against the Arrow size of the rows it holds.

The interpreter baseline is the resident set of a data node that holds zero rows but has done
everything else (imports, opened the table): node 0 of a 2-node cache over a 1-row table.
``overhead_ratio`` = (resident - baseline) / Arrow bytes, for the worst node of the cluster.
"""

from __future__ import annotations

from bench.procs import CacheProcess
from bench.stats import CaseResult
from bench.tables import BenchTable


def baseline(table: BenchTable, progress) -> CaseResult:
    if table.rows != 1:
        raise ValueError("the baseline needs a 1-row table, so that one of two nodes holds no rows")
    result = CaseResult("memory-baseline", "idle-node", 0, 2)
    with CacheProcess(table.metadata_location, 2, table.env) as cache:
        empty = [n for n in cache.status()["nodes"] if n["rows"] == 0]
        result.add("resident_bytes", empty[0]["resident_bytes"])
    progress(f"memory baseline: an idle data node holds {result.raw['resident_bytes'][0] / 2**20:.0f} MiB resident")
    return result


def record(result: CaseResult, status: dict, baseline_bytes: float, key: str = "") -> None:
    """Per-cluster figures from the head's status (worst node)."""
    nodes = [n for n in status["nodes"] if n["rows"] > 0]
    result.add(f"resident_bytes{key}", max(n["resident_bytes"] for n in nodes))
    if key:
        return
    result.add("arrow_bytes", max(n["bytes"] for n in nodes))
    result.add("baseline_bytes", baseline_bytes)
    result.add("overhead_ratio", max((n["resident_bytes"] - baseline_bytes) / n["bytes"] for n in nodes))
    # The target as one number: resident / (1.3 x Arrow + baseline); <= 1 meets it.
    result.add("target_fraction", max(n["resident_bytes"] / (1.3 * n["bytes"] + baseline_bytes) for n in nodes))


def record_served(result: CaseResult, cache: CacheProcess, status: dict) -> None:
    """After the serve and epoch cases: resident memory again, and bytes served per /metrics."""
    record(result, status, 0.0, key="_after_serve")
    served = [cache.metric(n["location"], "data_cache_bytes_served_total") for n in status["nodes"]]
    if all(s is not None for s in served):
        result.add("bytes_served_metric", sum(served))


def finish(result: CaseResult, progress) -> CaseResult:
    f = result.as_dict()["figures"]
    after = f.get("resident_bytes_after_serve", {}).get("median")
    progress(
        f"memory rows={result.rows:,} nodes={result.nodes}: node resident {f['resident_bytes']['median'] / 2**20:.0f} MiB "
        f"for {f['arrow_bytes']['median'] / 2**20:.0f} MiB of Arrow rows (baseline "
        f"{f['baseline_bytes']['median'] / 2**20:.0f} MiB): overhead {f['overhead_ratio']['median']:.2f}x"
        + (f", {after / 2**20:.0f} MiB after serving" if after else "")
    )
    return result
