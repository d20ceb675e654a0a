"""Epoch into tensors: DataCacheDataset against reading the same table directly each epoch.

Every method ends in the same place: dicts of ``batch_size``-row tensors of the numeric
columns, consumed by the same loop. The direct readers load the projected columns and hand the
read rows to DataCacheDataset's own conversion (tensors without a copy, one ``split()`` per
column); shuffled, they first permute the rows with the cache's own block permutation for that
epoch (one Arrow take), a shuffle as strong as the one the cache serves, so the figures compare
how the rows are got, not how much they are shuffled. Methods alternate within each repeat, so machine load
drifts hit all alike, and the order they run in turns by one each repeat, so none is always first.
Each repeat times ``epochs_per_repeat`` whole epochs per method (each its own shuffle order) and
records their mean: one short epoch alone is at the scheduler's mercy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds

from bench.config import epochs_per_repeat
from bench.stats import CaseResult, gb, paired_ratio
from bench.tables import BenchTable
from kubeflow_data_cache.dataset import DataCacheDataset, World
from kubeflow_data_cache.protocol import ShardRequest
from kubeflow_data_cache.sharding import node_rows

CACHE = "cache"
PYICEBERG = "pyiceberg"
PYARROW_DATASET = "pyarrow.dataset"
PYICEBERG_S3 = "pyiceberg-s3"


def tensor_batches(table: pa.Table, converter: DataCacheDataset, shuffle: bool, epoch: int) -> Iterator[Any]:
    """The direct readers' path from a read table to the training loop's batches.

    Shuffled, the rows are permuted as one data node holding every row would stream them for
    (seed 0, ``epoch``): the cache's block permutation, each window's rows dealt out across its
    blocks (sharding.node_rows), with one Arrow take (the cache's reader interleaves its nodes'
    streams on top, which does not make its order any more random); the rows are then converted
    and cut by DataCacheDataset's
    own conversion (``converter`` is never iterated, so it never connects), as the cache's
    reader converts what it receives.
    """
    if shuffle:
        request = ShardRequest(
            shuffle=True, seed=0, epoch=epoch, block_size=converter.shard_request(World()).block_size
        )
        order = np.concatenate(list(node_rows(0, table.num_rows, table.num_rows, request)))
        table = table.take(pa.array(order))
    return (batch for batch, _ in converter._rebatch(iter(table.to_batches())))


def consume(batches) -> tuple[int, int]:
    """The training loop stand-in: touch every batch; rows and tensor bytes seen."""
    rows = nbytes = 0
    for batch in batches:
        first = next(iter(batch.values()))
        rows += first.shape[0]
        nbytes += sum(t.element_size() * t.nelement() for t in batch.values())
    return rows, nbytes


def _methods(endpoint: str, local: BenchTable, s3: BenchTable | None, columns, batch_size: int):
    """name -> f(shuffle, epoch) that yields the epoch's batches.

    As a training loop would, each method sets up once and reads every epoch from there: the
    cache keeps one dataset per shuffle mode (its connection too), the pyiceberg readers keep the
    opened table and plan and read a scan each epoch.
    """
    paths = local.parquet_paths()  # a user of pyarrow.dataset knows the files; listing is not timed
    datasets = {
        shuffle: DataCacheDataset(endpoint, batch_size=batch_size, columns=columns, shuffle=shuffle, seed=0)
        for shuffle in (False, True)
    }
    converter = DataCacheDataset(endpoint, batch_size=batch_size, columns=columns)

    def cache(shuffle: bool, epoch: int):
        dataset = datasets[shuffle]
        dataset.set_epoch(epoch)
        return iter(dataset)

    def iceberg(table: BenchTable) -> Callable:
        opened = table.open()

        def read(shuffle: bool, epoch: int):
            arrow = opened.scan(selected_fields=tuple(columns)).to_arrow()
            return tensor_batches(arrow, converter, shuffle, epoch)

        return read

    def dataset(shuffle: bool, epoch: int):
        arrow = ds.dataset(paths, format="parquet").to_table(columns=list(columns))
        return tensor_batches(arrow, converter, shuffle, epoch)

    methods = {CACHE: cache, PYICEBERG: iceberg(local), PYARROW_DATASET: dataset}
    if s3 is not None:
        methods[PYICEBERG_S3] = iceberg(s3)
    return methods


def _timed_epochs(make: Callable, name: str, shuffled: bool, epochs: range, rows: int) -> tuple[float, int]:
    """The mean seconds of one epoch over ``epochs`` (each its own epoch number, so its own
    shuffle order), read back to back; and one epoch's tensor bytes."""
    start = time.perf_counter()
    for number in epochs:
        got, nbytes = consume(make(shuffled, number))
        if got != rows:
            raise RuntimeError(f"epoch {number} via {name} yielded {got} rows, expected {rows}")
    return (time.perf_counter() - start) / len(epochs), nbytes


def run(
    endpoint: str,
    local: BenchTable,
    s3: BenchTable | None,
    nodes: int,
    repeats: int,
    batch_size: int,
    columns: tuple[str, ...],
    progress,
    repeat_rows: int = 0,
) -> list[CaseResult]:
    rows = local.rows
    methods = _methods(endpoint, local, s3, columns, batch_size)
    names = list(methods)
    epochs = epochs_per_repeat(rows, repeat_rows)
    results: list[CaseResult] = []
    for shuffled in (False, True):
        seconds: dict[str, list[float]] = {name: [] for name in methods}
        case = {
            name: CaseResult("epoch", name, rows, nodes, 1, shuffled, "s3" if name == PYICEBERG_S3 else "file")
            for name in methods
        }
        for repeat in range(repeats):
            turn = repeat % len(names)
            for name in names[turn:] + names[:turn]:
                elapsed, nbytes = _timed_epochs(
                    methods[name], name, shuffled, range(repeat * epochs, (repeat + 1) * epochs), rows
                )
                seconds[name].append(elapsed)
                case[name].add("seconds", elapsed)
                case[name].add("epochs_timed", epochs)
                case[name].add("rows_per_s", rows / elapsed)
                case[name].add("gb_per_s", gb(nbytes / elapsed))
        for name in methods:
            # How many times faster the cache is than this method (1.0 for the cache itself).
            for r in paired_ratio(seconds[name], seconds[CACHE]):
                case[name].add("cache_speedup", r)
            results.append(case[name])
        line = ", ".join(
            f"{name} {case[name].as_dict()['figures']['seconds']['median']:.2f}s"
            + ("" if name == CACHE else f" ({case[name].as_dict()['figures']['cache_speedup']['median']:.1f}x)")
            for name in methods
        )
        progress(f"epoch rows={rows:,} nodes={nodes} {'shuffled' if shuffled else 'in order'}: {line}")
    return results
