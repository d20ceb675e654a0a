"""Run one grid: write the tables, start the clusters, run every case, collect the results."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.cases import epoch, load, memory, resume, serve
from bench.config import BenchConfig
from bench.procs import CacheProcess, MotoServer
from bench.stats import CaseResult, Progress, machine_facts
from bench.tables import BenchTable, Tables


def _cluster_cases(
    cfg: BenchConfig,
    tables: Tables,
    table: BenchTable,
    nodes: int,
    mem: CaseResult,
    baseline: CaseResult,
    progress: Progress,
) -> tuple[list[CaseResult], dict, CacheProcess]:
    """Serve, epoch, resume and post-serve memory on one running cluster (the last start of its point)."""
    results: list[CaseResult] = []
    with CacheProcess(table.metadata_location, nodes, table.env) as cache:
        status = cache.status()
        memory.record(mem, status, memory.baseline_bytes(baseline), cache)
        memory.reset_peaks(cache)
        for clients in cfg.clients:
            results.append(serve.run(cache, table.rows, nodes, clients, cfg.repeats, cfg.serve_repeat_bytes, progress))
        shuffled = table.rows in cfg.epoch_sizes and nodes == cfg.epoch_nodes  # the epoch and resume cases
        if shuffled:
            s3 = tables.s3(table.rows) if table.rows in cfg.s3_sizes else None
            results += epoch.run(
                cache.endpoint,
                table,
                s3,
                nodes,
                cfg.repeats,
                cfg.batch_size,
                cfg.columns,
                progress,
                cfg.epoch_repeat_rows,
            )
            results += resume.run(cache.endpoint, table.rows, nodes, cfg.repeats, progress)
        memory.record_served(mem, cache, baseline, trimmed=shuffled)
    return results, status, cache


def _size(cfg: BenchConfig, tables: Tables, rows: int, baseline: CaseResult, progress: Progress) -> list[CaseResult]:
    """Every case at one table size; cluster starts and to_arrow() calls alternate."""
    table = tables.local(rows)
    loads = {n: CaseResult("load", "cache", rows, n) for n in cfg.nodes}
    mems = {n: CaseResult("memory", "data-node", rows, n) for n in cfg.nodes}
    results: list[CaseResult] = []
    for repeat in range(cfg.load_repeats):
        last = repeat == cfg.load_repeats - 1
        for nodes in cfg.nodes:
            load.record_baseline(loads[nodes], table, cfg.cold_process)
            if last:
                cases, status, cache = _cluster_cases(cfg, tables, table, nodes, mems[nodes], baseline, progress)
                results += cases
            else:
                with CacheProcess(table.metadata_location, nodes) as cache:
                    status = cache.status()
                    memory.record(mems[nodes], status, memory.baseline_bytes(baseline), cache)
            load.record_cluster(loads[nodes], cache, status, table)
    results += [load.finish(loads[n], progress) for n in cfg.nodes]
    results += [memory.finish(mems[n], progress) for n in cfg.nodes]
    if rows in cfg.s3_sizes and cfg.s3_load:
        results.append(_s3_load(cfg, tables.s3(rows), progress))
    return results


def _s3_load(cfg: BenchConfig, table: BenchTable, progress: Progress) -> CaseResult:
    result = CaseResult("load", "cache", table.rows, cfg.epoch_nodes, source="s3")
    for _ in range(cfg.load_repeats):
        load.record_baseline(result, table, cfg.cold_process)
        with CacheProcess(table.metadata_location, cfg.epoch_nodes, table.env) as cache:
            load.record_cluster(result, cache, cache.status(), table)
    return load.finish(result, progress)


def run(cfg: BenchConfig, progress: Progress | None = None) -> dict[str, Any]:
    progress = progress or Progress()
    started = time.time()
    facts = machine_facts()
    progress(f"{cfg.name} run on {facts['cpus']} CPUs, load average {facts['load_average_start'][0]:.1f}")
    results: list[CaseResult] = []
    with contextlib.ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="data-cache-bench-")))
        moto = stack.enter_context(MotoServer()) if cfg.s3_sizes else None
        tables = Tables(root, moto)
        base = memory.baseline(tables.local(1), cfg.load_repeats, progress)
        results.append(base)
        for rows in cfg.sizes:
            progress(f"writing the {rows:,}-row sample table{' (also to moto S3)' if rows in cfg.s3_sizes else ''}")
            tables.local(rows)
            results += _size(cfg, tables, rows, base, progress)
    facts["load_average_end"] = list(os.getloadavg())
    return {
        "version": 1,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_seconds": round(time.time() - started, 1),
        "config": cfg.as_dict(),
        "machine": facts,
        "cases": [r.as_dict() for r in results],
    }
