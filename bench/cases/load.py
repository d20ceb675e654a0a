"""Load: the cache's planning-to-ready time against one pyiceberg ``to_arrow()`` of the table.

Three cache figures per cluster start: the head's ``load_seconds`` (its planning, then from
every node registered to every node ready: the wait for nodes to start is left out), the slowest
node's own ``load_seconds`` (its read alone), and the wall time from spawning
`data-cache local` to its READY line (cold interpreters included). Three pyiceberg figures: a
warm ``to_arrow()`` in this process (imports done, allocator and page cache warm), a fresh
interpreter that imports, opens the table, decodes one batch of one file (the warm-up each
data node does before its clock starts) and calls ``to_arrow()``, and that fresh interpreter's
``to_arrow()`` call alone. The head compares with the fresh call (both are the first whole read
in new processes, after the same warm-up) and with the warm one; the spawn-to-READY wall time
with the whole fresh interpreter.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time

from bench.config import CHILD_TIMEOUT_SECONDS
from bench.procs import CacheProcess
from bench.stats import CaseResult, gb, paired_ratio
from bench.tables import BenchTable

# What a user's fresh process runs to get the whole table in memory without the cache.
# It also times the to_arrow() call alone, after the warm-up a data node does before its own
# clock starts (store.warm_reader: one decoded batch of one column of the smallest file, which
# sets up the reader stack), so the two first reads start from the same state. The warm-up's
# own time is left out of the whole interpreter's figure, which stays what a user's process takes.
_COLD_SCRIPT = """
import json, sys, time
from pyiceberg.table import StaticTable
table = StaticTable.from_metadata(sys.argv[1], json.loads(sys.argv[2]))
warm_start = time.perf_counter()
from kubeflow_data_cache.store import warm_reader
tasks = list(table.scan().plan_files())
if tasks:
    warm_reader(table, min(tasks, key=lambda task: task.file.file_size_in_bytes))
start = time.perf_counter()
rows = table.scan().to_arrow().num_rows
print(rows, time.perf_counter() - start, start - warm_start)
"""


def to_arrow_warm(table: BenchTable) -> float:
    start = time.perf_counter()
    arrow = table.open().scan().to_arrow()
    elapsed = time.perf_counter() - start
    if arrow.num_rows != table.rows:
        raise RuntimeError(f"to_arrow() read {arrow.num_rows} rows, expected {table.rows}")
    return elapsed


def to_arrow_cold(table: BenchTable) -> tuple[float, float]:
    """(whole fresh interpreter less the warm-up, its to_arrow() call alone) in seconds.

    Timed to the child's result line, as the cache is timed to its READY line: waiting for the
    child's exit counted its interpreter's teardown too (about 0.09 s of 0.9 s on 2M rows), which
    the cache side never pays before READY."""
    start = time.perf_counter()
    with subprocess.Popen(
        [sys.executable, "-c", _COLD_SCRIPT, table.metadata_location, json.dumps(table.properties)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **table.env},
    ) as child:
        timer = threading.Timer(CHILD_TIMEOUT_SECONDS, child.kill)  # a hung read must not hang the run
        timer.start()
        try:
            line = child.stdout.readline()
            elapsed = time.perf_counter() - start
            _, stderr = child.communicate()
        finally:
            timer.cancel()
    rows, call, warm_up = [*line.split(), "", "", ""][:3]
    if child.returncode != 0 or rows != str(table.rows):
        raise RuntimeError(f"cold to_arrow() failed ({child.returncode}): {stderr[-2000:]}")
    return elapsed - float(warm_up), float(call)


def record_baseline(result: CaseResult, table: BenchTable, cold: bool) -> None:
    """One pyiceberg measurement of each kind, taken next to a cluster start."""
    result.add("to_arrow_seconds", to_arrow_warm(table))
    if cold:
        wall, call = to_arrow_cold(table)
        result.add("to_arrow_cold_seconds", wall)
        result.add("to_arrow_fresh_call_seconds", call)


def record_cluster(result: CaseResult, cache: CacheProcess, status: dict, table: BenchTable) -> None:
    if status["rows"] != table.rows:  # a cache that loaded less would read as a faster load
        raise RuntimeError(f"the cache loaded {status['rows']} rows of a {table.rows}-row table")
    nodes = status.get("nodes", [])
    result.add("head_load_seconds", status["load_seconds"])
    result.add("node_load_seconds", max(float(n.get("load_seconds") or 0) for n in nodes))
    result.add("ready_wall_seconds", cache.ready_wall_seconds)
    result.add("arrow_bytes", status["bytes"])
    result.add("rows_per_s", status["rows"] / status["load_seconds"])
    result.add("gb_per_s", gb(status["bytes"] / status["load_seconds"]))


def finish(result: CaseResult, progress) -> CaseResult:
    """Ratios per pair: each cluster start is paired with the pyiceberg reads taken just before it
    (record_baseline, then the start), so a slow spell of the machine hits both sides of a pair."""
    raw = result.raw
    med = {k: statistics.median(v) for k, v in raw.items()}
    pairs = {
        "ratio_head_to_warm": ("head_load_seconds", "to_arrow_seconds"),
        "ratio_wall_to_cold": ("ready_wall_seconds", "to_arrow_cold_seconds"),
        "ratio_head_to_fresh_call": ("head_load_seconds", "to_arrow_fresh_call_seconds"),
    }
    for name, (cache_side, pyiceberg_side) in pairs.items():
        if pyiceberg_side in raw:
            for ratio in paired_ratio(raw[cache_side], raw[pyiceberg_side]):
                result.add(name, ratio)
    cold = (
        f", cold process {med['to_arrow_cold_seconds']:.2f}s (its call {med['to_arrow_fresh_call_seconds']:.2f}s)"
        if "to_arrow_cold_seconds" in raw
        else ""
    )
    progress(
        f"load rows={result.rows:,} nodes={result.nodes} from {result.source}: head {med['head_load_seconds']:.2f}s "
        f"(node read {med['node_load_seconds']:.2f}s, spawn to READY {med['ready_wall_seconds']:.2f}s); "
        f"pyiceberg to_arrow {med['to_arrow_seconds']:.2f}s{cold}"
    )
    return result
