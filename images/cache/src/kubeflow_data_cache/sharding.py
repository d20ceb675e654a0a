"""Which rows make up shard ``s`` of ``S`` in one epoch: pure numpy, shared by head and nodes.

Rows live in a *virtual* space ``0..M-1`` (the table, or the rows matching a filter). An epoch's
order is a permutation of that space: a permutation of blocks of ``block_size`` rows, then a
permutation of the rows inside each block. Both come from hashing ``(seed, epoch, id)``, so any
node can compute any part of the order without computing the rest. Shards are contiguous runs
of positions in that order. A node streams its rows of a shard window by window, each window's
rows dealt out across its blocks (``deal``), so a batch is not one block; see docs/protocol.md.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import numpy as np

from kubeflow_data_cache.errors import BadRequestError
from kubeflow_data_cache.protocol import ShardRequest

# Shuffled node_rows computes (and deals) the order about this many of the node's own rows at a
# time (order_window; or two blocks, when blocks are larger): for each of 2 nodes, windows of
# 2**17 positions. Each window's arrays and temporaries take ~40 bytes a position while it is
# computed: at 8 transfer batches of 64K rows (an earlier window), a shuffled stream held ~13 MiB
# more on its node, and computed the order no faster. Dealt, a window of 2**17 of a node's rows
# read 5-10% slower than 2**16 (its gathers spread over twice the blocks) and mixed no better.
# Part of the shuffled order (protocol.ORDER_VERSION).
ORDER_WINDOW_ROWS = 1 << 16

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a bijection on uint64 with good avalanche, vectorised."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def _keys(ids: np.ndarray, seed: int, epoch: int, salt: int) -> np.ndarray:
    # Each input is mixed in on its own (mix is a bijection), so no two (seed, epoch) pairs share
    # a base by construction, as shifted-and-xored fields did (seed 1 / epoch 0 and seed 0 /
    # epoch 2**18), and any seed or epoch below 2**64 fits (the protocol bounds them).
    base = np.array([seed], dtype=np.uint64)
    for part in (epoch, salt):
        base = _mix(base) ^ np.uint64(part)
    return _mix(ids.astype(np.uint64) ^ _mix(base))


def shard_ranges(total: int, req: ShardRequest) -> list[tuple[int, int]]:
    """The position ranges (in epoch order) of the shard; at most a few, ascending."""
    shards, s = req.num_shards, req.shard
    if total == 0:
        return []
    if req.even is None:
        lo, hi = s * total // shards, (s + 1) * total // shards
    elif req.even == "drop":
        q = total // shards
        lo, hi = s * q, (s + 1) * q
    else:  # "pad": wrap around to the start of the order
        q = -(-total // shards)
        lo, hi = s * q, (s + 1) * q
    ranges = []
    while lo < hi:
        start = lo % total
        take = min(hi - lo, total - start)
        ranges.append((start, start + take))
        lo += take
    return ranges


def shard_size(total: int, req: ShardRequest) -> int:
    return sum(hi - lo for lo, hi in shard_ranges(total, req))


class EpochOrder:
    """The permutation of ``total`` rows for one (seed, epoch), or the identity."""

    def __init__(self, total: int, req: ShardRequest):
        self.total = total
        self.shuffle = req.shuffle
        self.seed, self.epoch, self.block = req.seed, req.epoch, req.block_size
        if self.shuffle and total:
            nblocks = -(-total // self.block)
            block_ids = np.arange(nblocks, dtype=np.int64)
            self.order = np.argsort(_keys(block_ids, self.seed, self.epoch, 1), kind="stable")
            sizes = np.full(nblocks, self.block, dtype=np.int64)
            sizes[-1] = total - (nblocks - 1) * self.block
            self.sizes = sizes[self.order]
            self.starts = np.concatenate(([0], np.cumsum(self.sizes)))
            self.in_block = np.argsort(_keys(np.arange(self.block, dtype=np.int64), self.seed, self.epoch, 2))
            for shared in (self.order, self.sizes, self.starts, self.in_block):
                shared.setflags(write=False)  # one order serves concurrent requests (epoch_order)

    def _rotation(self, blocks: np.ndarray) -> np.ndarray:
        return (_keys(blocks, self.seed, self.epoch, 4) % np.uint64(self.block)).astype(np.int64)

    def _rotated(self, blocks: np.ndarray) -> np.ndarray:
        """``(in_block + rotation) % block`` for each block: row offsets within the block, 2-D.

        Both terms are below ``block``, so the modulo is "subtract ``block`` where the sum
        reached it", done as an unsigned minimum (a sum below ``block`` wraps to a huge value
        when ``block`` is subtracted). In 32 bits while sums fit, this is ~7x faster than an
        int64 ``%``, which had been a third of a shuffled read's time.
        """
        small = self.block < 1 << 30
        signed, unsigned = (np.int32, np.uint32) if small else (np.int64, np.uint64)
        rows = self.in_block.astype(signed) + self._rotation(blocks).astype(signed)[:, None]
        view = rows.view(unsigned)
        np.minimum(view, view - unsigned(self.block), out=view)
        return rows

    def _blocks(self, lo: int, hi: int) -> tuple[int, int]:
        """Indices (into the permuted block order) of the blocks covering positions [lo, hi)."""
        first = int(np.searchsorted(self.starts, lo, side="right")) - 1
        last = int(np.searchsorted(self.starts, hi - 1, side="right")) - 1
        return first, last

    def rows(self, lo: int, hi: int) -> np.ndarray:
        """Virtual row ids at positions ``[lo, hi)``, in order."""
        if not self.shuffle:
            return np.arange(lo, hi, dtype=np.int64)
        return self.rows_in(lo, hi, 0, self.total)

    def rows_in(self, lo: int, hi: int, row_lo: int, row_hi: int) -> np.ndarray:
        """The virtual rows in ``[row_lo, row_hi)`` among those at positions ``[lo, hi)``, in order.

        A data node asks for its own rows only. Blocks are runs of consecutive rows, so a node's
        rows fill whole blocks but for at most one at each end of its range: blocks outside it
        are skipped before their rows are computed, and each node does 1/N of the work.
        """
        if not self.shuffle:
            first_row, end_row = max(lo, row_lo), min(hi, row_hi)
            return np.arange(first_row, max(first_row, end_row), dtype=np.int64)
        if hi <= lo or row_hi <= row_lo:
            return np.empty(0, dtype=np.int64)
        first, last = self._blocks(lo, hi)
        blocks = self.order[first : last + 1]
        sizes = self.sizes[first : last + 1]
        begin = blocks * self.block
        keep = (begin < row_hi) & (begin + sizes > row_lo)
        if not keep.any():
            return np.empty(0, dtype=np.int64)
        rows = self._block_rows(blocks[keep], sizes[keep])
        # Positions [lo, hi) may start inside the first block and end inside the last one.
        head = lo - int(self.starts[first]) if keep[0] else 0
        tail = int(self.starts[last + 1]) - hi if keep[-1] else 0
        rows = rows[head : len(rows) - tail]
        kept_begin = begin[keep]
        if row_lo <= int(kept_begin.min()) and int((kept_begin + sizes[keep]).max()) <= row_hi:
            # Every block kept lies within the range: nothing to cut. (Tested over all blocks, a
            # window holding another node's blocks filtered every row, ~76 us per 64K rows.)
            return rows
        return rows[(rows >= row_lo) & (rows < row_hi)]

    def _block_rows(self, blocks: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """All rows of ``blocks`` (in that order), each block in its own shuffled order."""
        full = sizes == self.block
        # Full blocks as one 2-D array: one shared in-block permutation, rotated by a per-block
        # amount, so each block's order differs without an argsort per block.
        rows = blocks[full][:, None] * self.block + self._rotated(blocks[full])
        if full.all():
            return rows.reshape(-1)
        # The table's last block is the only short one.
        short = int(np.flatnonzero(~full)[0])
        start = int(blocks[short]) * self.block
        tail = start + np.argsort(_keys(np.arange(int(sizes[short]), dtype=np.int64), self.seed, self.epoch, 3))
        flat = rows.reshape(-1)
        cut = short * self.block  # the full blocks before the short one
        return np.concatenate((flat[:cut], tail, flat[cut:]))

    def row_spans(self, lo: int, hi: int) -> np.ndarray:
        """Ranges ``[start, stop)`` of virtual rows (one per block, shape ``(n, 2)``) that positions
        [lo, hi) may touch: whole blocks when shuffled."""
        if not self.shuffle:
            return np.array([[lo, hi]] if hi > lo else [], dtype=np.int64).reshape(-1, 2)
        if hi <= lo:
            return np.empty((0, 2), dtype=np.int64)
        first, last = self._blocks(lo, hi)
        begin = self.order[first : last + 1] * self.block
        return np.stack((begin, begin + self.sizes[first : last + 1]), axis=1)

    def counts_in(self, lo: int, hi: int, bounds: np.ndarray) -> np.ndarray:
        """How many of the rows at positions ``[lo, hi)`` fall in each ``[bounds[k], bounds[k+1])``.

        Exact, without computing the rows: whole blocks are counted from their row spans, and
        only the two end blocks, which ``[lo, hi)`` may cut, are computed row by row.
        """
        counts = np.zeros(len(bounds) - 1, dtype=np.int64)
        if hi <= lo:
            return counts
        if not self.shuffle:
            return np.clip(np.minimum(hi, bounds[1:]) - np.maximum(lo, bounds[:-1]), 0, None)
        first, last = self._blocks(lo, hi)
        counts += np.diff(_covered_below(self.row_spans(lo, hi), bounds))
        for cut_lo, cut_hi in ((int(self.starts[first]), lo), (hi, int(self.starts[last + 1]))):
            if cut_lo < cut_hi:  # rows of an end block outside [lo, hi)
                counts -= _counts_by_range(self.rows(cut_lo, cut_hi), bounds)
        return counts

    def seek(self, lo: int, hi: int, row_lo: int, row_hi: int, skip: int) -> int:
        """The position in ``[lo, hi)`` of the row in ``[row_lo, row_hi)`` that comes after the
        first ``skip`` of them: where a node's stream that leaves out ``skip`` rows starts
        (``skip`` is below their count). Whole blocks are counted, and one block computed."""
        if not self.shuffle:
            return max(lo, row_lo) + skip
        first, last = self._blocks(lo, hi)
        begin = self.order[first : last + 1] * self.block
        per_block = np.minimum(begin + self.sizes[first : last + 1], row_hi) - np.maximum(begin, row_lo)
        ahead = np.cumsum(np.clip(per_block, 0, None))  # rows in range up to each block's end
        block_start = int(self.starts[first])
        if block_start < lo:  # the first block's positions before lo are not in [lo, hi)
            ahead -= int(_counts_by_range(self.rows(block_start, lo), np.array([row_lo, row_hi]))[0])
        b = int(np.searchsorted(ahead, skip, side="right"))  # the block holding the row
        before = int(ahead[b - 1]) if b else 0
        start, stop = max(lo, int(self.starts[first + b])), min(hi, int(self.starts[first + b + 1]))
        rows = self.rows(start, stop)
        return start + int(np.flatnonzero((rows >= row_lo) & (rows < row_hi))[skip - before])


def _counts_by_range(rows: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """How many of ``rows`` fall in each ``[bounds[k], bounds[k+1])`` (rows outside all: none)."""
    which = np.searchsorted(bounds, rows, side="right") - 1
    which = which[(which >= 0) & (which < len(bounds) - 1)]
    return np.bincount(which, minlength=len(bounds) - 1)


def order_blocks(total: int, req: ShardRequest) -> int:
    """Blocks in the shuffled order of ``total`` rows (0 unshuffled: no order is built)."""
    return -(-total // req.block_size) if req.shuffle else 0


def check_order_size(total: int, req: ShardRequest) -> None:
    """Refuse (BadRequestError) an order of more than MAX_ORDER_BLOCKS blocks, without building it."""
    blocks = order_blocks(total, req)
    if blocks > MAX_ORDER_BLOCKS:
        raise BadRequestError(
            f"block_size {req.block_size} cuts this table's {total} rows into {blocks} blocks; a shuffle of more "
            f"than {MAX_ORDER_BLOCKS} blocks is refused (each costs the cache seconds and hundreds of MiB to "
            f"order): use block_size >= {-(-total // MAX_ORDER_BLOCKS)}"
        )


def order_nbytes(total: int, req: ShardRequest) -> int:
    """Memory building the order takes at its peak (what a stream that needs it may bring on)."""
    blocks = order_blocks(total, req)
    return (blocks + req.block_size) * ORDER_PEAK_BYTES_PER_BLOCK if blocks else 0


def order_built(total: int, req: ShardRequest) -> bool:
    """Whether the order is held already (by a stream, or the cache of recent orders)."""
    return _order_key(total, req) in _live_orders


def claim_order_build(total: int, req: ShardRequest) -> bool:
    """Whether a stream about to start is the one to count the order's memory for: no stream
    holds it, builds it, or has claimed it (the streams of an epoch that start before it is
    built share one build: each counted for it, the third reader of a 1.5M-block epoch was
    refused). A claim lapses after ORDER_CLAIM_SECONDS (its stream never started), or when the
    order is built; release_order_claim gives it up (its stream was refused)."""
    key = _order_key(total, req)
    now = time.monotonic()
    with _building_lock:
        for lapsed in [k for k, until in _claims.items() if until <= now]:
            del _claims[lapsed]
        if key in _live_orders or key in _building or key in _claims:
            return False
        _claims[key] = now + ORDER_CLAIM_SECONDS
        return True


def release_order_claim(total: int, req: ShardRequest) -> None:
    with _building_lock:
        _claims.pop(_order_key(total, req), None)


def _order_key(total: int, req: ShardRequest) -> tuple:
    return (total, req.shuffle, req.seed, req.epoch, req.block_size)


def epoch_order(total: int, req: ShardRequest) -> EpochOrder:
    """The permutation for a request's (seed, epoch, block size), shared by every request of that
    epoch: all readers ask the head for it, and every node stream computes from it (on a 1e9-row
    table, building it takes a tenth of a second). Orders of more than ORDER_CACHE_BLOCKS blocks
    (tiny blocks on a huge table) are kept one at a time, so that what the cache keeps stays
    small next to the rows; orders of more than ALONE_ORDER_BLOCKS blocks are built one at a
    time; more than MAX_ORDER_BLOCKS blocks are refused (BadRequestError). An order some stream still holds is shared, not built again, even
    once the cache has let it go."""
    check_order_size(total, req)
    key = _order_key(total, req)
    held = _live_orders.get(key)
    if held is not None:
        return held
    blocks = order_blocks(total, req)
    keep = _large_epoch_order if blocks > ORDER_CACHE_BLOCKS else _epoch_order
    order = _built_once(keep, key, _one_build if blocks > ALONE_ORDER_BLOCKS else None)
    _live_orders[key] = order
    with _building_lock:
        _claims.pop(key, None)  # built: the streams that follow hold it, and count nothing for it
    return order


def _built_once(
    keep: Callable[..., EpochOrder], key: tuple, one_at_a_time: contextlib.AbstractContextManager | None = None
) -> EpochOrder:
    """``keep(*key)``, with concurrent callers of one key waiting for the first one's build.

    An lru_cache does not merge concurrent misses: every reader of an epoch asks at its start,
    at once, and each built the same order in parallel (16 readers of 2M one-row blocks took a
    node from 196 MiB to 1.2 GiB, past its memory limit, and each request 8 s instead of 0.5 s).
    Builds of different keys run under ``one_at_a_time`` (all but small orders: their peaks,
    ~70 MiB each at 1.5M blocks, stacked past a node's limit when eight jobs began at once, and
    40 readers asking the head for 40 seeds' orders of 1M blocks at once took it to 1.5 GiB).
    """
    with _building_lock:
        pending = _building.get(key)
        first = pending is None
        if first:
            pending = _building[key] = Future()
    if first:
        try:
            with one_at_a_time or contextlib.nullcontext():
                pending.set_result(keep(*key))
        except BaseException as err:
            pending.set_exception(err)
        finally:
            with _building_lock:
                del _building[key]
    return pending.result()


_building: dict[tuple, Future] = {}
_building_lock = threading.Lock()
_one_build = threading.Lock()
# Orders some stream (or the caches below) still holds, by key: a stream holds its order for its
# whole life, and one evicted from the one-entry cache of large orders was built again for the
# next stream of the same epoch while the first still held it.
_live_orders: weakref.WeakValueDictionary[tuple, EpochOrder] = weakref.WeakValueDictionary()
# Orders a stream was admitted to build, until when (claim_order_build).
_claims: dict[tuple, float] = {}
ORDER_CLAIM_SECONDS = 10.0


# A few epochs at once (train and eval datasets, readers a step apart), each at most
# ORDER_CACHE_BLOCKS blocks (24 bytes a block: 24 MiB) plus its in-block order (8 bytes a row
# of a block); one larger order (at most MAX_ORDER_BLOCKS blocks: 48 MiB), built once per epoch
# rather than once per request. Ordering 2**21 blocks takes a few tenths of a second here; 10M
# rows in blocks of 1 took 4.4 s and 480 MiB, so such requests are refused.
ORDER_CACHE_BLOCKS = 1 << 20
MAX_ORDER_BLOCKS = 1 << 21
# Orders of more blocks than this (a peak of 3 MiB) are built one at a time, whatever their key:
# smaller ones take microseconds and cannot add up to much.
ALONE_ORDER_BLOCKS = 1 << 16
# An order holds 24 bytes a block (its block order, sizes and starts) and 8 a row of a block (the
# in-block permutation); building it peaks at about twice that (the hashed keys and argsort's
# output beside them): 1.5M blocks held 34 MiB and peaked at 68 MiB.
ORDER_PEAK_BYTES_PER_BLOCK = 48


def _build_order(total: int, shuffle: bool, seed: int, epoch: int, block_size: int) -> EpochOrder:
    return EpochOrder(total, ShardRequest(shuffle=shuffle, seed=seed, epoch=epoch, block_size=block_size))


_epoch_order = functools.lru_cache(maxsize=4)(_build_order)
_large_epoch_order = functools.lru_cache(maxsize=1)(_build_order)


def endpoint_rows(node_offsets: list[int], total: int, req: ShardRequest) -> list[int]:
    """How many rows of the shard each data node serves. ``node_offsets`` has one entry per node
    plus the end (``total``), so node ``k`` holds virtual rows ``[node_offsets[k], node_offsets[k+1])``.

    Exact, without computing the shard's rows (``EpochOrder.counts_in``). A client uses the
    counts to resume mid-shard (which rows of each endpoint's stream it already has) and to
    check that every stream was whole.
    """
    bounds = np.asarray(node_offsets, dtype=np.int64)
    order = epoch_order(total, req)
    counts = np.zeros(len(node_offsets) - 1, dtype=np.int64)
    for lo, hi in shard_ranges(total, req):
        counts += order.counts_in(lo, hi, bounds)
    return counts.tolist()


def _covered_below(spans: np.ndarray, points: np.ndarray) -> np.ndarray:
    """For each point ``x``, how many rows of the disjoint ``[start, stop)`` spans lie below ``x``."""
    if not len(spans):
        return np.zeros(len(points), dtype=np.int64)
    spans = spans[np.argsort(spans[:, 0])]
    below = np.concatenate(([0], np.cumsum(spans[:, 1] - spans[:, 0])))
    # Spans starting below x count whole, but the last of them may reach past x.
    n = np.searchsorted(spans[:, 0], points, side="left")
    over = np.where(n > 0, np.maximum(spans[np.maximum(n - 1, 0), 1] - points, 0), 0)
    return below[n] - over


def node_rows(
    node_offset: int,
    node_total: int,
    total: int,
    req: ShardRequest,
    skip: int = 0,
    window_rows: int = ORDER_WINDOW_ROWS,
) -> Iterator[np.ndarray | range]:
    """The node's local virtual rows of the shard, in order: ``range`` pieces when unshuffled
    (served as zero-copy slices), index arrays when shuffled; without the first ``skip`` (a
    resumed or reopened stream).

    Shuffled, the order is computed one window of positions at a time as the caller asks for
    it, so a stream's first batch does not wait for the whole shard's permutation (on a 10M-row
    table that alone took longer than sending the node's rows), and its memory stays bounded:
    ``window_rows`` positions (at least two blocks) at a time. Skipped rows are counted, not
    computed, so a stream resumed near its end starts as fast as a fresh one.
    """
    lo_node, hi_node = node_offset, node_offset + node_total
    if not req.shuffle:
        for lo, hi in shard_ranges(total, req):
            a, b = max(lo, lo_node), min(hi, hi_node)
            left_out = min(skip, max(0, b - a))
            skip -= left_out
            if a + left_out < b:
                yield range(a + left_out - node_offset, b - node_offset)
        return
    if node_total <= 0:
        return
    order = epoch_order(total, req)
    window = order_window(node_total, total, req.block_size, window_rows)
    mine_bounds = np.array([lo_node, hi_node], dtype=np.int64)
    for lo, hi in shard_ranges(total, req):
        first = lo - lo % window
        if skip:  # counted, not computed: the window holding the first row still to send
            here = int(order.counts_in(lo, hi, mine_bounds)[0])
            if skip >= here:
                skip -= here
                continue
            at = order.seek(lo, hi, lo_node, hi_node, skip)
            first = at - at % window
            skip -= int(order.counts_in(lo, max(lo, first), mine_bounds)[0])
        # Windows on multiples of ``window`` in the epoch's positions, cut at the shard's ends: the
        # same for a resumed stream (dealing depends on the window) and for any shard count inside.
        for start in range(first, hi, window):
            a, b = max(lo, start), min(hi, start + window)
            mine = deal(order.rows_in(a, b, lo_node, hi_node), req.block_size)[skip:]
            skip = 0
            if len(mine):
                mine -= node_offset  # in place: rows_in and deal return arrays of their own
                yield mine


def order_window(node_total: int, total: int, block: int, window_rows: int = ORDER_WINDOW_ROWS) -> int:
    """Positions a node orders (and deals) at a time: about ``window_rows`` of its own rows.

    A node holds ``node_total`` of the ``total`` rows, so a window of positions holds that share
    of them: counted in positions alone, a window of 2**17 positions gave each of 128 nodes one
    block, and nothing to deal. At least two blocks: a window inside one block would compute that block
    again for each. Part of the shuffled order (protocol.ORDER_VERSION): changing it changes
    which rows a resumed count means.
    """
    return max(-(-window_rows * total // node_total), 2 * block)


def deal(rows: np.ndarray, block: int) -> np.ndarray:
    """A window's rows dealt out across its ``block``-row runs: the first row of every run, then
    the second of every run, and so on.

    The block permutation alone leaves each block's rows together: with ``batch_size`` equal to
    ``block_size`` (the defaults), a training batch was one block, a contiguous range of the
    table, and the same rows made up a batch again in later epochs. Dealt, any ``block`` rows in
    a row hold about ``block / runs`` rows from each of the window's runs (about 2**16 of the
    node's rows: 64 blocks of 1024), and the runs are different blocks every epoch.
    """
    runs = -(-len(rows) // block)
    if runs < 2:
        return rows
    # Transposes, not an index array: the full runs as a (runs, block) matrix read column by
    # column, the short last run's rows joining the first ``last`` columns (a third of the time).
    # Written straight into the one output array: concatenating the pieces held three more
    # arrays the size of the window's rows while a data node gathered.
    whole = (runs - 1) * block
    last = len(rows) - whole
    full = rows[:whole].reshape(runs - 1, block)
    out = np.empty_like(rows)
    head = out[: last * runs].reshape(last, runs)
    head[:, : runs - 1] = full[:, :last].T
    head[:, runs - 1] = rows[whole:]
    out[last * runs :].reshape(block - last, runs - 1)[:] = full[:, last:].T
    return out
