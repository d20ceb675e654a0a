"""The benchmark grids: quick (default, a few minutes), full (the growth grid), smoke (tests)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

# The headline epoch comparison: single process, batch 1024, three numeric columns.
BATCH_SIZE = 1024
EPOCH_COLUMNS = ("feature_a", "feature_b", "label")
# Parquet files per table: one per ROWS_PER_FILE rows, so larger tables read in parallel.
ROWS_PER_FILE = 250_000
MAX_FILES = 16
# Deadlines: every wait in the suite has one.
READY_TIMEOUT_SECONDS = 600.0
CHILD_TIMEOUT_SECONDS = 600.0
MOTO_START_SECONDS = 60.0
S3_BUCKET = "bench"
S3_CREDENTIALS = {"key": "testing", "secret": "testing", "region": "us-east-1"}


@dataclass(frozen=True)
class BenchConfig:
    """One grid. ``headline_rows`` and ``epoch_nodes`` pick the figures compared with targets."""

    name: str
    sizes: tuple[int, ...]  # table rows: serve, load and memory run at each
    nodes: tuple[int, ...]  # data nodes per cluster
    clients: tuple[int, ...]  # concurrent DoGet clients (separate processes)
    epoch_sizes: tuple[int, ...]  # sizes where the epoch comparison runs
    s3_sizes: tuple[int, ...]  # sizes also written to moto S3 (epoch and load from S3)
    epoch_nodes: int  # data nodes of the cluster the epoch comparison reads from
    headline_rows: int
    repeats: int  # serve and epoch repeats (cheap: the cluster is up)
    load_repeats: int  # cluster starts per (size, nodes): each is one load measurement
    # Serve: each timed repeat reads the whole table enough times to move this much per client.
    # One 2M-row read lasts ~50 ms here, short enough for scheduler noise to swing it by half.
    serve_repeat_bytes: int = 256 << 20
    # Epoch: each timed repeat reads this many rows per method, in whole epochs (5 of 2M rows),
    # and its figure is the mean epoch. One 2M-row epoch from the cache lasts ~40 ms here: timed
    # alone, the in-order speedup swung from 1.35x to 2.00x between repeats of one run.
    epoch_repeat_rows: int = 10_000_000
    cold_process: bool = True  # also time pyiceberg to_arrow() in a fresh interpreter
    s3_load: bool = True  # also start a cache over the S3 table (one more cluster start per repeat)
    batch_size: int = BATCH_SIZE
    columns: tuple[str, ...] = EPOCH_COLUMNS

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


QUICK = BenchConfig(
    name="quick",
    sizes=(200_000, 2_000_000),
    nodes=(1, 2),
    clients=(1, 2),
    epoch_sizes=(200_000, 2_000_000),
    s3_sizes=(2_000_000,),
    epoch_nodes=2,
    headline_rows=2_000_000,
    repeats=5,  # this 2-vCPU machine swings tens of percent between repeats; medians of 5 hold better
    load_repeats=5,  # a cluster start and a fresh to_arrow() each swing by a third here: medians of 5
)

FULL = BenchConfig(
    name="full",
    sizes=(100_000, 1_000_000, 2_000_000, 10_000_000),
    nodes=(1, 2, 4),
    clients=(1, 2, 4),
    epoch_sizes=(100_000, 1_000_000, 2_000_000, 10_000_000),
    s3_sizes=(1_000_000, 2_000_000, 10_000_000),
    epoch_nodes=2,
    headline_rows=2_000_000,
    repeats=3,
    load_repeats=3,
)

# Every case on a tiny table, once: the machinery, not the figures (tests/bench).
SMOKE = replace(
    QUICK,
    name="smoke",
    sizes=(3_000,),
    nodes=(1,),
    clients=(1,),
    epoch_sizes=(3_000,),
    s3_sizes=(3_000,),
    epoch_nodes=1,
    headline_rows=3_000,
    repeats=1,
    load_repeats=1,
    serve_repeat_bytes=0,  # one pass: the smoke grid checks the machinery, not the rate
    epoch_repeat_rows=0,  # one epoch per repeat, likewise
    cold_process=True,  # one fresh interpreter: the fresh-call figure is part of the machinery
    s3_load=True,  # one cluster start on moto: the S3 load's headline is part of the machinery
)

CONFIGS = {c.name: c for c in (QUICK, FULL, SMOKE)}


def epochs_per_repeat(rows: int, repeat_rows: int) -> int:
    """Whole epochs of ``rows`` that read at least ``repeat_rows`` rows (at least one)."""
    return max(1, -(-repeat_rows // max(1, rows)))


def files_for(rows: int) -> int:
    return max(1, min(MAX_FILES, rows // ROWS_PER_FILE))
