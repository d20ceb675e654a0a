"""Shard math: every row exactly once over shards and nodes, shuffled or not, for any sizes."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubeflow_data_cache.client import CacheClient
from kubeflow_data_cache.errors import BadRequestError
from kubeflow_data_cache.protocol import MAX_BLOCK_SIZE, ShardRequest
from kubeflow_data_cache.sharding import (
    ORDER_WINDOW_ROWS,
    EpochOrder,
    deal,
    endpoint_rows,
    node_rows,
    shard_ranges,
    shard_size,
)
from tests.cache.inprocess import get, wait_for


def node_offsets(total: int, nodes: int) -> list[int]:
    return [k * total // nodes for k in range(nodes)] + [total]


def rows_of_shard(
    total: int, nodes: int, req: ShardRequest, window: int = ORDER_WINDOW_ROWS
) -> tuple[list[int], list[int]]:
    """What the data nodes together serve for one shard, and how many rows each served."""
    offs = node_offsets(total, nodes)
    out: list[int] = []
    served = []
    for k in range(nodes):
        parts = node_rows(offs[k], offs[k + 1] - offs[k], total, req, window_rows=window)
        mine = [r + offs[k] for part in parts for r in part]
        served.append(len(mine))
        out.extend(mine)
    return out, served


@settings(max_examples=150, deadline=None)
@given(
    total=st.integers(0, 2500),
    shards=st.integers(1, 12),
    nodes=st.integers(1, 6),
    block=st.integers(1, 300),
    shuffle=st.booleans(),
    seed=st.one_of(st.integers(0, 2**31), st.integers(2**44, 2**64 - 1)),  # microsecond-clock seeds too
    epoch=st.integers(0, 50),
    window=st.integers(1, 700),  # a node computes its order this many positions at a time
)
def test_every_row_exactly_once_over_all_shards(total, shards, nodes, block, shuffle, seed, epoch, window):
    seen: list[int] = []
    offs = node_offsets(total, nodes)
    for s in range(shards):
        req = ShardRequest(shard=s, num_shards=shards, shuffle=shuffle, seed=seed, epoch=epoch, block_size=block)
        rows, served = rows_of_shard(total, nodes, req, window)
        assert len(rows) == shard_size(total, req)
        # The head's per-endpoint counts (in tickets) are exactly what each node streams.
        assert endpoint_rows(offs, total, req) == served
        seen.extend(rows)
    assert sorted(seen) == list(range(total))


@settings(max_examples=100, deadline=None)
@given(total=st.integers(0, 3000), shards=st.integers(1, 16), shuffle=st.booleans())
def test_even_split_sizes(total, shards, shuffle):
    drop = [shard_size(total, ShardRequest(shard=s, num_shards=shards, even="drop")) for s in range(shards)]
    pad = [shard_size(total, ShardRequest(shard=s, num_shards=shards, even="pad")) for s in range(shards)]
    assert set(drop) == {total // shards}
    assert set(pad) == ({-(-total // shards)} if total else {0})
    # pad covers every row at least once; drop never repeats a row.
    pad_rows, drop_rows = [], []
    for s in range(shards):
        pad_rows += rows_of_shard(total, 2, ShardRequest(shard=s, num_shards=shards, even="pad", shuffle=shuffle))[0]
        drop_rows += rows_of_shard(total, 2, ShardRequest(shard=s, num_shards=shards, even="drop", shuffle=shuffle))[0]
    assert set(pad_rows) == set(range(total))
    assert len(drop_rows) == len(set(drop_rows))


def test_plain_shards_are_contiguous_and_near_equal():
    sizes = [shard_size(10, ShardRequest(shard=s, num_shards=4)) for s in range(4)]
    assert sizes == [2, 3, 2, 3]
    assert shard_ranges(10, ShardRequest(shard=1, num_shards=4)) == [(2, 5)]
    # More shards than rows: some shards are empty, never an error.
    assert [shard_size(3, ShardRequest(shard=s, num_shards=5)) for s in range(5)] == [0, 1, 0, 1, 1]
    assert shard_ranges(3, ShardRequest(shard=0, num_shards=5)) == []


def test_shuffle_is_deterministic_and_differs_by_epoch_and_seed():
    def order(seed, epoch):
        return EpochOrder(50_000, ShardRequest(shuffle=True, seed=seed, epoch=epoch)).rows(0, 50_000)

    a = order(7, 0)
    assert np.array_equal(a, order(7, 0))
    assert not np.array_equal(a, order(7, 1))
    assert not np.array_equal(a, order(8, 0))
    assert np.array_equal(np.sort(a), np.arange(50_000))


def test_seed_and_epoch_never_stand_in_for_each_other():
    """Shifted-and-xored fields once made seed 1 / epoch 0 equal seed 0 / epoch 2**18."""

    def order(seed, epoch):
        return EpochOrder(10_000, ShardRequest(shuffle=True, seed=seed, epoch=epoch)).rows(0, 10_000)

    assert not np.array_equal(order(1, 0), order(0, 2**18))
    assert not np.array_equal(order(0, 1), order(1, 0))
    assert not np.array_equal(order(2**63, 0), order(0, 0))


def test_seed_and_epoch_beyond_64_bits_are_refused():
    for field in ("seed", "epoch"):
        with pytest.raises(BadRequestError, match=f"'{field}' should be <= {2**64 - 1}"):
            ShardRequest(**{field: 2**64})
    ShardRequest(seed=2**64 - 1, epoch=2**64 - 1)


def test_shuffle_quality():
    """The permutation must decorrelate position from row id, and mix neighbours apart."""
    total = 200_000
    blocks = total // 1024
    orders = [EpochOrder(total, ShardRequest(shuffle=True, seed=s, block_size=1024)).rows(0, total) for s in range(20)]
    # Position and row id are uncorrelated: for a random order of `blocks` blocks the correlation
    # has a spread of ~1/sqrt(blocks) around 0, so its mean over 20 seeds stays within 3 spreads.
    corr = [np.corrcoef(np.arange(total), rows)[0, 1] for rows in orders]
    assert abs(np.mean(corr)) < 3 / np.sqrt(blocks * 20)
    assert max(abs(c) for c in corr) < 5 / np.sqrt(blocks)
    rows = orders[1]
    # Rows adjacent in the table land far apart: the median distance is a large fraction of the table.
    gaps = np.abs(np.diff(rows))
    assert np.median(gaps) < 1024  # in-block neighbours stay within a block...
    first = rows[::1024]
    assert np.median(np.abs(np.diff(first))) > total // 10  # ...but consecutive blocks are far apart


def _training_batches(total: int, nodes: int, epoch: int, batch: int = 1024) -> list[np.ndarray]:
    """The row ids of each full batch a reader of one shuffled shard gets with the defaults: the
    nodes' streams (node_rows), interleaved as the client does, cut into ``batch`` rows."""
    import pyarrow as pa

    from kubeflow_data_cache.interleave import interleave

    req = ShardRequest(shuffle=True, epoch=epoch)
    offs = node_offsets(total, nodes)
    streams, lengths = [], []
    for k in range(nodes):
        rows = np.concatenate([p + offs[k] for p in node_rows(offs[k], offs[k + 1] - offs[k], total, req)])
        streams.append(iter([pa.record_batch([pa.array(rows)], names=["id"])]))
        lengths.append(len(rows))
    ids = np.concatenate([b.column(0).to_numpy() for b in interleave(streams, lengths, req.block_size)])
    return [ids[i : i + batch] for i in range(0, len(ids) - batch + 1, batch)]


@pytest.mark.parametrize("total", [60_000, 200_000])
def test_a_default_shuffled_batch_mixes_many_blocks_and_not_the_same_rows_every_epoch(total):
    """With block_size equal to batch_size (both 1024 by default) a batch was one block, 1024
    consecutive rows of the table, and the same block made a batch again in later epochs (39 of
    59 batches of a 60K-row table; a median 43-56% of a batch's rows together again). Each node
    now deals its rows out across the blocks of a window (sharding.deal)."""
    epochs = [_training_batches(total, 2, epoch) for epoch in (0, 1)]
    blocks_per_batch = [len(np.unique(b // 1024)) for b in epochs[0]]
    assert np.median(blocks_per_batch) >= 16, blocks_per_batch
    batch_of = np.full(total, -1)
    for i, b in enumerate(epochs[0]):
        batch_of[b] = i
    # For each batch of the next epoch: the largest share of its rows that shared one batch before.
    together = [np.bincount(batch_of[b][batch_of[b] >= 0]).max() / len(b) for b in epochs[1]]
    assert np.median(together) < 0.1 and max(together) < 0.2, sorted(together)[-5:]


def test_shuffled_positions_are_consistent_across_ranges():
    """Any sub-range of positions computes the same rows as the whole order (nodes rely on it)."""
    order = EpochOrder(10_007, ShardRequest(shuffle=True, seed=3, block_size=100))
    whole = order.rows(0, 10_007)
    for lo, hi in [(0, 1), (99, 101), (5000, 10_007), (10_006, 10_007), (1234, 5678)]:
        assert np.array_equal(order.rows(lo, hi), whole[lo:hi])


@settings(max_examples=150, deadline=None)
@given(
    total=st.integers(1, 5000),
    block=st.integers(1, 700),
    shuffle=st.booleans(),
    data=st.data(),
)
def test_a_nodes_rows_are_the_orders_rows_in_its_range(total, block, shuffle, data):
    """rows_in skips whole blocks outside a node's range: it must equal filtering the full order."""
    order = EpochOrder(total, ShardRequest(shuffle=shuffle, seed=5, epoch=1, block_size=block))
    lo = data.draw(st.integers(0, total))
    hi = data.draw(st.integers(lo, total))
    row_lo = data.draw(st.integers(0, total))
    row_hi = data.draw(st.integers(row_lo, total))
    rows = order.rows(lo, hi)
    expected = rows[(rows >= row_lo) & (rows < row_hi)]
    assert np.array_equal(order.rows_in(lo, hi, row_lo, row_hi), expected)


@settings(max_examples=150, deadline=None)
@given(
    total=st.integers(0, 3000),
    cuts=st.lists(st.integers(0, 3000), max_size=5),
    shards=st.integers(1, 10),
    block=st.integers(1, 400),
    shuffle=st.booleans(),
    even=st.sampled_from([None, "drop", "pad"]),
    data=st.data(),
)
def test_endpoint_counts_are_exact_for_uneven_nodes_and_wrapping_shards(
    total, cuts, shards, block, shuffle, even, data
):
    """Nodes of any size (empty ones too), even splits that wrap around: counts match the streams."""
    offs = [0, *sorted(min(c, total) for c in cuts), total]
    req = ShardRequest(
        shard=data.draw(st.integers(0, shards - 1)), num_shards=shards, shuffle=shuffle, block_size=block, even=even
    )
    streamed = [
        sum(len(p) for p in node_rows(offs[k], offs[k + 1] - offs[k], total, req)) for k in range(len(offs) - 1)
    ]
    assert endpoint_rows(offs, total, req) == streamed


@settings(max_examples=200, deadline=None)
@given(
    total=st.integers(1, 3000),
    cut=st.floats(0, 1),
    shards=st.integers(1, 6),
    block=st.integers(1, 400),
    batch=st.integers(1, 64),
    window=st.integers(1, 700),
    shuffle=st.booleans(),
    even=st.sampled_from([None, "drop", "pad"]),
    data=st.data(),
)
def test_a_skipped_stream_is_the_rest_of_the_whole_one(total, cut, shards, block, batch, window, shuffle, even, data):
    """A node told to skip starts where the whole stream would be after that many rows: counted
    across wrapped ranges (pad) and partial blocks, windows smaller or larger than blocks."""
    split = int(total * cut)
    node = data.draw(st.sampled_from([(0, split), (split, total - split)]))
    req = ShardRequest(
        shard=data.draw(st.integers(0, shards - 1)),
        num_shards=shards,
        shuffle=shuffle,
        block_size=block,
        batch_size=batch,
        even=even,
    )
    whole = [int(r) for p in node_rows(*node, total, req, window_rows=window) for r in p]
    skip = data.draw(st.integers(0, len(whole)))
    parts = list(node_rows(*node, total, req, skip, window))
    assert shuffle or all(isinstance(p, range) for p in parts)  # unshuffled stays zero-copy slices
    assert [int(r) for p in parts for r in p] == whole[skip:]


def test_epoch_orders_are_shared_and_large_ones_kept_one_at_a_time(monkeypatch):
    """Every reader of an epoch shares one permutation; of large ones (tiny blocks on a huge
    table) only the latest is kept, and orders too large to build per epoch are refused."""
    import kubeflow_data_cache.sharding as sharding

    req = ShardRequest(shard=1, num_shards=4, shuffle=True, seed=3, epoch=2, block_size=10)
    other_shard = ShardRequest(shard=3, num_shards=4, shuffle=True, seed=3, epoch=2, block_size=10, columns=("id",))
    shared = sharding.epoch_order(1000, req)
    assert sharding.epoch_order(1000, other_shard) is shared
    assert sharding.epoch_order(1000, ShardRequest(shuffle=True, seed=3, epoch=3, block_size=10)) is not shared
    with pytest.raises(ValueError, match="read-only"):
        shared.order[0] = 1  # shared between concurrent requests: nobody may change it
    monkeypatch.setattr(sharding, "ORDER_CACHE_BLOCKS", 99)  # 1000 rows / 10 = 100 blocks: a large one
    large_req = ShardRequest(shuffle=True, seed=4, epoch=2, block_size=10)
    assert not sharding.order_built(1000, large_req)
    large = sharding.epoch_order(1000, large_req)
    assert sharding.order_built(1000, large_req) and sharding.epoch_order(1000, large_req) is large
    del large
    sharding.epoch_order(1000, ShardRequest(shuffle=True, seed=4, epoch=3, block_size=10))
    gc.collect()
    assert not sharding.order_built(1000, large_req)  # one large order kept at a time...
    held = sharding.epoch_order(1000, large_req)
    sharding.epoch_order(1000, ShardRequest(shuffle=True, seed=4, epoch=4, block_size=10))
    # ...but one a stream still holds is shared, not built again beside it.
    assert sharding.order_built(1000, large_req) and sharding.epoch_order(1000, large_req) is held
    monkeypatch.setattr(sharding, "MAX_ORDER_BLOCKS", 99)
    with pytest.raises(BadRequestError, match="cuts this table's 1000 rows into 100 blocks.*use block_size >= 11"):
        sharding.epoch_order(1000, req)
    assert sharding.epoch_order(1000, ShardRequest(block_size=10)).shuffle is False  # in order: no blocks


@pytest.mark.parametrize("kept_by", ["_large_epoch_order", "_epoch_order"])
def test_orders_of_different_epochs_past_a_small_size_are_built_one_at_a_time(monkeypatch, kept_by):
    """Eight jobs starting at once each built their 1.5M-block order at the same time: ~70 MiB of
    peak each, stacked past the node's memory limit; and 40 readers asking the head for 40 seeds'
    orders of 1M blocks (under the size kept one at a time) took it to 1.5 GiB."""
    import threading
    import time

    import kubeflow_data_cache.sharding as sharding

    monkeypatch.setattr(sharding, "ALONE_ORDER_BLOCKS", 99)
    if kept_by == "_large_epoch_order":
        monkeypatch.setattr(sharding, "ORDER_CACHE_BLOCKS", 99)
    building, most = [0], [0]
    lock = threading.Lock()

    def slow_build(*key):
        with lock:
            building[0] += 1
            most[0] = max(most[0], building[0])
        time.sleep(0.05)
        with lock:
            building[0] -= 1
        return sharding._build_order(*key)

    monkeypatch.setattr(sharding, kept_by, slow_build)
    orders = {}

    def build(seed: int) -> None:
        orders[seed] = sharding.epoch_order(1000, ShardRequest(shuffle=True, seed=seed, epoch=9, block_size=10))

    threads = [threading.Thread(target=build, args=(seed,)) for seed in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(orders) == list(range(6)) and most[0] == 1


def test_one_stream_per_epoch_is_counted_for_building_its_order(monkeypatch):
    """Every reader of an epoch that started before its order was built was counted for the
    whole order, though they share one build: the third reader of a 1.5M-block epoch was refused."""
    import kubeflow_data_cache.sharding as sharding

    req = ShardRequest(shuffle=True, seed=11, epoch=4, block_size=10)
    assert sharding.claim_order_build(1000, req)  # the first builds it
    assert not sharding.claim_order_build(1000, req)  # the others share that build
    sharding.release_order_claim(1000, req)  # refused: the next one builds it
    assert sharding.claim_order_build(1000, req)
    held = sharding.epoch_order(1000, req)
    assert not sharding.claim_order_build(1000, req)  # built and held: nothing to count
    del held
    monkeypatch.setattr(sharding, "ORDER_CLAIM_SECONDS", 0.0)  # a claim whose stream never started lapses
    other = ShardRequest(shuffle=True, seed=11, epoch=5, block_size=10)
    assert sharding.claim_order_build(1000, other) and sharding.claim_order_build(1000, other)


def test_an_orders_memory_is_counted_by_the_guard_when_no_stream_holds_it():
    from kubeflow_data_cache.sharding import order_nbytes

    req = ShardRequest(shuffle=True, seed=1, epoch=1, block_size=2)
    # 1.5M blocks held 34 MiB and peaked at 68 MiB while built.
    assert 60 << 20 < order_nbytes(3_000_000, req) < 80 << 20
    assert order_nbytes(3_000_000, ShardRequest(block_size=2)) == 0  # in order: none


def test_the_head_refuses_a_shuffle_of_too_many_blocks_naming_the_block_size(cluster, small_table, monkeypatch):
    """What a client sends cannot make the head order millions of blocks per request."""
    import kubeflow_data_cache.sharding as sharding

    monkeypatch.setattr(sharding, "MAX_ORDER_BLOCKS", 100)
    head, head_health, _, _ = cluster(small_table.metadata_location)
    wait_for(lambda: get(head_health.port, "/ready")[0] == 200)
    with CacheClient(head.location, deadline_seconds=30) as client:
        with pytest.raises(BadRequestError, match=r"10000 rows into 10000 blocks.*use block_size >= 100"):
            client.get_flight_info(ShardRequest(shuffle=True, block_size=1))
        assert client.get_flight_info(ShardRequest(shuffle=True, block_size=100)).total_records == small_table.rows


@pytest.mark.parametrize("block", [1024, MAX_BLOCK_SIZE])
def test_a_shuffled_node_computes_its_order_a_bounded_window_at_a_time(block):
    """A node's order arrays are its stream's memory while it is computed: about ORDER_WINDOW_ROWS
    of its own rows (or two blocks, when they are larger) at a time, whatever the transfer batch.
    A window holds the node's blocks by chance: a little more or less than its share."""
    total = 2_000_000
    req = ShardRequest(shuffle=True, epoch=1, batch_size=1 << 20, block_size=block)
    for node in ((0, total // 2), (total // 2, total // 2)):
        sizes = [len(part) for part in node_rows(*node, total, req)]
        assert sum(sizes) == total // 2
        assert max(sizes) <= 1.5 * max(ORDER_WINDOW_ROWS, 2 * block)


@pytest.mark.parametrize("nodes", [2, 16, 128])
def test_each_node_deals_about_a_window_of_its_own_rows_however_many_nodes(nodes):
    """Counted in positions alone, a window gave each of 128 nodes one block: nothing to deal,
    and a batch was one block again. Windows are sized by the node's share of the rows."""
    total = 16_000_000
    req = ShardRequest(shuffle=True, epoch=2)
    share = total // nodes
    first = next(node_rows(0, share, total, req))
    blocks = len(np.unique(first[: req.block_size] // req.block_size))
    assert len(first) >= ORDER_WINDOW_ROWS // 2 and blocks >= 32, (len(first), blocks)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 5000), block=st.integers(1, 700))
def test_deal_takes_the_first_row_of_every_run_then_the_second_and_so_on(n, block):
    """The definition, spelled out: a run's k-th row comes before any run's (k+1)-th, runs in
    their order (deal writes this into one array; it was built from concatenated pieces)."""
    rows = np.random.default_rng(n).permutation(n).astype(np.int64)
    positions = np.arange(n)
    expected = rows[np.lexsort((positions // block, positions % block))]
    assert np.array_equal(deal(rows, block), expected)


def test_readers_asking_for_one_epoch_at_once_wait_for_one_build(monkeypatch):
    """Every reader of an epoch asks at its start, at once: an lru_cache does not merge those
    misses, and each built the same order in parallel (16 readers took a node past its memory
    limit). Concurrent callers of one key now wait for the first one's build."""
    import threading
    import time

    from kubeflow_data_cache import sharding

    built = []

    class SlowOrder(sharding.EpochOrder):
        def __init__(self, *args, **kwargs):
            built.append(1)
            time.sleep(0.3)  # long enough that every caller arrives during the build
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(sharding, "EpochOrder", SlowOrder)
    req = ShardRequest(shuffle=True, seed=987_654_321, epoch=3)  # a key no other test has built
    results: list = []
    readers = [threading.Thread(target=lambda: results.append(sharding.epoch_order(50_000, req))) for _ in range(8)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(10)
    assert len(results) == 8 and all(order is results[0] for order in results)
    assert built == [1]
    assert not sharding._building  # nothing left pending

    failing = ShardRequest(shuffle=True, seed=987_654_322, epoch=3)

    class BrokenOrder(sharding.EpochOrder):
        def __init__(self, *args, **kwargs):
            raise MemoryError("no room")

    monkeypatch.setattr(sharding, "EpochOrder", BrokenOrder)
    with pytest.raises(MemoryError):  # a failed build reaches its caller, and is not kept
        sharding.epoch_order(50_000, failing)
    assert not sharding._building


def test_the_shuffled_order_is_pinned():
    """The order is part of the protocol: a saved position counts rows in it, and head and nodes
    on different machines compute it apart. Changing it (a salt, the in-block rotation, the
    window) must bump protocol.ORDER_VERSION, which readers resuming compare; then update this."""
    import hashlib

    from kubeflow_data_cache.protocol import ORDER_VERSION

    rows = 5000
    req = ShardRequest(shuffle=True, seed=1, epoch=3, block_size=64)
    streamed = [np.concatenate(list(node_rows(node * rows, rows, 2 * rows, req))) for node in (0, 1)]
    order = np.concatenate(streamed).astype(np.int64)
    assert ORDER_VERSION == 2
    assert order[:6].tolist() == [2322, 2701, 2423, 48, 4577, 3028]
    assert (
        hashlib.sha256(order.tobytes()).hexdigest()
        == "b3619fabedc0f4658c2e173c654ac3bbb6c05c002cbb9a59377c91001926ffde"
    )


def test_each_full_block_gets_its_own_in_block_order():
    """Every block's rows are shuffled within it by an order of its own: one order for all (the
    rotation dropped) puts the same in-block offsets side by side in every block."""
    order = EpochOrder(8192, ShardRequest(shuffle=True, seed=1, block_size=1024))
    blocks = order.rows(0, 8192).reshape(8, 1024)
    assert len({tuple(block % 1024) for block in blocks}) == 8
