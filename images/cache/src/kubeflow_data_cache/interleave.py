"""Interleave a shard's endpoint streams, and find where in them a resumed read starts.

A shuffled shard's rows come from several data nodes, each stream in the epoch's permuted
order. The client cuts every stream into units of ``unit`` rows (the block the shuffle permutes)
and spreads each stream's units evenly over the read (``interleave``): unit ``k`` of a stream of
``U`` units sits at fraction ``(k + 1/2) / U``, and units are taken in the order of those
fractions (ties: the lower stream first). Streams of equal length alternate; a stream with a
third of the rows gives a third of every stretch of the read, not all of it at the start. (A
plain rotation would run the shorter streams out first and end the epoch on one node's rows
alone: a filter that matches unevenly across nodes then orders every epoch by node.)

The order depends only on the streams' lengths and the unit, so a reader that already handed
out ``start`` rows can compute how many each stream gave and which unit was part-way
(``resume_point``), ask every node to leave those rows out, and continue the same order
without receiving the rows again.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import pyarrow as pa

from kubeflow_data_cache.errors import DataCacheError

# Stream lengths unknown (a cache whose tickets do not say): every stream is taken to be this
# long, so units simply rotate, and a stream that ends leaves the rotation.
UNKNOWN_LENGTH = 1 << 62


@dataclass(frozen=True)
class ResumePoint:
    """Where ``start`` rows into an interleaved (or sequential) read of the streams stand.

    ``skips[i]``: rows stream ``i`` already gave. ``turn``: the stream whose unit is part-way,
    ``taken``: rows of that unit already given (always below the unit; 0: none is part-way).
    """

    skips: tuple[int, ...]
    turn: int = 0
    taken: int = 0


def sequential_point(lengths: Sequence[int], start: int) -> ResumePoint:
    """Streams read one after the other: the first ones whole, then part of one."""
    skips, left = [], start
    for n in lengths:
        skips.append(min(n, left))
        left -= skips[-1]
    return ResumePoint(tuple(skips))


def _units(lengths: Sequence[int], unit: int) -> list[int]:
    return [-(-n // unit) for n in lengths]


def rotation_order(lengths: Sequence[int], unit: int) -> bool:
    """Whether the spread order is a plain rotation (every stream has as many units), the order
    versions before the spread used for any lengths."""
    return len(set(_units(lengths, unit))) <= 1


def _units_before(units: Sequence[int], stream: int, k: int) -> list[int]:
    """How many units of each stream come before unit ``k`` of ``stream`` in the interleave.

    Unit ``c`` of stream ``j`` comes first when ``(2c + 1) / U_j < (2k + 1) / U_i`` (exact, in
    integers: ``(2c + 1) * U_i < (2k + 1) * U_j``), or on a tie when ``j < i``.
    """
    own = units[stream]
    counts = []
    for j, u in enumerate(units):
        if j == stream:
            counts.append(k)
            continue
        if u == 0:
            counts.append(0)
            continue
        bound = (2 * k + 1) * u
        odd = (bound - 1) // own  # the largest 2c + 1 with (2c + 1) * own < bound, rounded down
        before = min(u, max(0, (odd - 1) // 2 + 1))
        if j < stream and bound % own == 0 and (bound // own) % 2 == 1 and (bound // own - 1) // 2 < u:
            before += 1  # the tie, which the lower stream wins
        counts.append(before)
    return counts


def _rows(counts: Sequence[int], lengths: Sequence[int], unit: int) -> int:
    return sum(min(c * unit, n) for c, n in zip(counts, lengths, strict=True))


def resume_point(lengths: Sequence[int], unit: int, start: int) -> ResumePoint:
    """Where ``interleave(streams, lengths, unit)`` stands after yielding ``start`` rows.

    Arithmetic, not a replay: for each stream, the last of its units to start at or before
    ``start`` is found by bisection (rows before a unit grow with its index); the latest of
    those across streams is the unit part-way through, or just begun.
    """
    if unit < 1:
        raise ValueError(f"unit should be >= 1, got {unit}")
    if not 0 <= start <= sum(lengths):
        raise ValueError(f"start {start} is outside the streams' {sum(lengths)} rows")
    if start == sum(lengths):
        return ResumePoint(tuple(lengths))
    units = _units(lengths, unit)
    best: tuple[int, int, int] | None = None  # (rows before it, stream, unit index)
    for i, u in enumerate(units):
        low, high = 0, u - 1
        if u == 0 or _rows(_units_before(units, i, 0), lengths, unit) > start:
            continue
        while low < high:  # the last unit of stream i that starts at or before ``start``
            mid = (low + high + 1) // 2
            if _rows(_units_before(units, i, mid), lengths, unit) <= start:
                low = mid
            else:
                high = mid - 1
        before = _rows(_units_before(units, i, low), lengths, unit)
        if best is None or before > best[0]:
            best = (before, i, low)
    assert best is not None  # unit 0 of the first stream to go starts at row 0
    before, turn, k = best
    counts = _units_before(units, turn, k)
    skips = [min(c * unit, n) for c, n in zip(counts, lengths, strict=True)]
    taken = start - before
    skips[turn] += taken
    return ResumePoint(tuple(skips), turn, taken)


def interleave(
    streams: Iterable[Iterator[pa.RecordBatch]],
    lengths: Sequence[int] | None,
    unit: int,
    point: ResumePoint | None = None,
) -> Iterator[pa.RecordBatch]:
    """The streams' rows as zero-copy slices, ``unit`` rows at a time in the spread order.

    ``lengths``: each stream's rows (None: unknown, see UNKNOWN_LENGTH). ``point`` continues a
    read from its ``resume_point``: each stream starts after its ``skips`` (the node left them
    out), and the unit part-way gives only its remaining rows.
    """
    cursors = [_Cursor(stream) for stream in streams]
    lengths = list(lengths) if lengths is not None else [UNKNOWN_LENGTH] * len(cursors)
    point = point or ResumePoint((0,) * len(cursors))
    units = _units(lengths, unit)
    scale = math.lcm(*(u for u in units if u)) if any(units) else 1
    # Unit k of stream j sits at (2k + 1) * scale / U_j: integers, so ties compare exactly.
    heap: list[tuple[int, int, int]] = []  # (spread position, stream, unit index)
    for j, skip in enumerate(point.skips):
        k = (skip - point.taken) // unit if j == point.turn and point.taken else -(-skip // unit)
        if k < units[j]:
            heap.append(((2 * k + 1) * (scale // units[j]), j, k))
    heapq.heapify(heap)
    first_part = point.taken
    while heap:
        position, j, k = heap[0]
        need = min(unit, lengths[j] - k * unit) - first_part
        first_part = 0  # the unit part-way, if any, is the first one (it precedes all the rest)
        cursor = cursors[j]
        while need:
            piece = cursor.take(need)
            if piece is None:
                heapq.heappop(heap)  # ended: a stream of unknown length leaves the rotation
                break
            need -= piece.num_rows
            yield piece
        else:
            if k + 1 < units[j]:
                heapq.heapreplace(heap, (position + 2 * (scale // units[j]), j, k + 1))
                continue
            heapq.heappop(heap)
            if lengths[j] != UNKNOWN_LENGTH and cursor.take(1) is not None:
                # Asked to its end, the stream checks itself against its ticket (client.read_endpoint);
                # one that still has rows here is not the stream its length promised.
                raise DataCacheError(f"stream {j} went past the {lengths[j]} rows its ticket holds")


class _Cursor:
    """A stream of record batches read in pieces of at most ``n`` rows."""

    def __init__(self, stream: Iterator[pa.RecordBatch]) -> None:
        self._stream = stream
        self._batch: pa.RecordBatch | None = None
        self._offset = 0

    def take(self, n: int) -> pa.RecordBatch | None:
        while self._batch is None or self._offset >= self._batch.num_rows:
            self._batch = next(self._stream, None)
            self._offset = 0
            if self._batch is None:
                return None
        piece = self._batch.slice(self._offset, n)
        self._offset += piece.num_rows
        return piece
