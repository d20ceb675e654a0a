"""Sharding over ranks x DataLoader workers against real caches: every row once, equal batches.

Readers are simulated in-process (``_iter_world`` with an explicit World) so one cache per table
size serves every combination; test_dataset_loader.py covers real DataLoader workers.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubeflow_data_cache.dataset import DataCacheDataset, World

# Every simulated reader of an epoch runs in this one process, so the second one to read an
# epoch looks like a repeat of it to the dataset (its warning is tested in
# test_dataset_repeat_warning.py): not a repeat here.
pytestmark = pytest.mark.filterwarnings("ignore::kubeflow_data_cache.dataset.RepeatedEpochWarning")

# (rows, files, data nodes): more nodes than rows (node 0 holds none) and than files; several
# files per node.
TABLES = [(2, 1, 3), (2503, 3, 2)]


def read_all(ds: DataCacheDataset, ranks: int, workers: int) -> dict[tuple[int, int], list[np.ndarray]]:
    """Every reader's batches of the current epoch, as id arrays, keyed by (rank, worker)."""
    out = {}
    for rank in range(ranks):
        for worker in range(workers):
            batches = ds._iter_world(World(rank, ranks, worker, workers))
            out[rank, worker] = [b["id"].numpy() for b in batches]
    return out


def expected_shard_rows(rows: int, shards: int, shard: int, even: str | None) -> int:
    if even == "drop":
        return rows // shards
    if even == "pad":
        return math.ceil(rows / shards)
    return (shard + 1) * rows // shards - shard * rows // shards


@settings(max_examples=40, deadline=None)
@given(
    table=st.sampled_from(TABLES),
    ranks=st.integers(1, 3),
    workers=st.integers(1, 3),
    batch_size=st.integers(1, 700),
    shuffle=st.booleans(),
    even=st.sampled_from([None, "drop", "pad"]),
    drop_last=st.booleans(),
    epoch=st.integers(0, 3),
)
def test_rows_once_and_equal_batches(cache_factory, table, ranks, workers, batch_size, shuffle, even, drop_last, epoch):
    rows, files, nodes = table
    cache = cache_factory(rows, files, nodes)
    ds = DataCacheDataset(
        cache.endpoint, batch_size=batch_size, columns=["id"], shuffle=shuffle, seed=7, even=even, drop_last=drop_last
    )
    ds.set_epoch(epoch)
    got = read_all(ds, ranks, workers)
    shards = ranks * workers

    for (rank, worker), batches in got.items():
        shard_rows = expected_shard_rows(rows, shards, rank * workers + worker, ds.even)
        want = shard_rows // batch_size * batch_size if drop_last else shard_rows
        assert sum(len(b) for b in batches) == want
        # Exactly batch_size rows in every batch but the shard's last, which is never empty.
        assert all(len(b) == batch_size for b in batches[:-1])
        assert not batches or 0 < len(batches[-1]) <= batch_size
        if drop_last:
            assert all(len(b) == batch_size for b in batches)

    ids = np.concatenate([b for batches in got.values() for b in batches] or [np.empty(0, np.int64)])
    counts = np.bincount(ids, minlength=rows)
    if ds.even is None:
        assert (counts == 1).all(), "every row exactly once"
    elif ds.even == "drop":
        assert counts.max(initial=0) <= 1, "no row twice"
    elif not drop_last:
        assert (counts >= 1).all() and counts.sum() == shards * math.ceil(rows / shards)

    per_rank = [sum(len(got[r, w]) for w in range(workers)) for r in range(ranks)]
    if ds.even is not None:
        assert len(set(per_rank)) == 1, f"batches per rank differ: {per_rank}"
    # What batches_per_epoch tells a training loop in advance is what each rank then reads.
    assert [ds._rank_batches(r, ranks, workers) for r in range(ranks)] == per_rank


def test_batches_per_epoch_reads_the_rank_from_the_environment(cache_factory, monkeypatch):
    cache = cache_factory(2503, 3, 2)
    ds = DataCacheDataset(cache.endpoint, batch_size=100, columns=["id"])
    assert ds.batches_per_epoch() == 26  # one reader: ceil(2503 / 100)
    assert ds.batches_per_epoch(num_workers=2) == 26  # 1252 + 1251 rows: 13 + 13 batches
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert ds.batches_per_epoch(num_workers=2) == 14  # shards 2, 3 of 4: 626 + 626 rows, 7 + 7
    dropped = DataCacheDataset(cache.endpoint, batch_size=100, columns=["id"], drop_last=True)
    assert dropped.batches_per_epoch(num_workers=2) == 12  # 625 + 625 rows (even="drop"), 6 + 6
    with pytest.raises(ValueError, match="num_workers"):
        ds.batches_per_epoch(num_workers=-1)


def epoch_order(ds: DataCacheDataset, epoch: int, ranks: int = 2) -> list[int]:
    ds.set_epoch(epoch)
    got = read_all(ds, ranks, 1)
    return [int(i) for key in sorted(got) for b in got[key] for i in b]


def test_shuffle_is_deterministic_per_seed_and_epoch(cache_factory):
    cache = cache_factory(2503, 3, 2)

    def dataset(seed: int, shuffle: bool = True) -> DataCacheDataset:
        return DataCacheDataset(cache.endpoint, batch_size=100, columns=["id"], shuffle=shuffle, seed=seed)

    first = epoch_order(dataset(1), 0)
    assert first == epoch_order(dataset(1), 0), "same seed and epoch, same order"
    assert first != epoch_order(dataset(1), 1), "another epoch, another order"
    assert first != epoch_order(dataset(2), 0), "another seed, another order"
    assert sorted(first) == list(range(2503))
    unshuffled = epoch_order(dataset(1, shuffle=False), 0)
    assert unshuffled == epoch_order(dataset(1, shuffle=False), 5), "no shuffle: the epoch does not matter"
    # Unshuffled, shard 0 of 2 is exactly data node 0's rows; shuffled, it mixes both nodes' rows.
    node0 = set(unshuffled[: 2503 // 2])
    shuffled_shard0 = first[: 2503 // 2]
    assert node0 & set(shuffled_shard0) and set(shuffled_shard0) - node0


def test_empty_shards_yield_nothing(cache_factory):
    cache = cache_factory(2, 1, 3)
    ds = DataCacheDataset(cache.endpoint, batch_size=4, columns=["id"])
    got = read_all(ds, 4, 1)
    assert [sum(len(b) for b in got[r, 0]) for r in range(4)] == [0, 1, 0, 1]
