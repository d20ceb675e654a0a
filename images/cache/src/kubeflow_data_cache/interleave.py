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
from fractions import Fraction

import numpy as np
import pyarrow as pa

from kubeflow_data_cache.errors import DataCacheError

# Stream lengths unknown (a cache whose tickets do not say): every stream is taken to be this
# long, so units simply rotate, and a stream that ends leaves the rotation.
UNKNOWN_LENGTH = 1 << 62
# Units below this many rows are taken a window at a time (``_taken``: one ``take`` over the
# window's rows), not sliced one by one: a slice and its share of the concat after cost ~3.6 us
# a unit, so 1-row blocks spent seconds of Python per million rows (16-row blocks: 0.45 s for
# 2M rows, against ~0.03 s taken). From 256 rows the slices cost about what a take copies.
SLICED_UNIT_ROWS = 256
# Rows of one taken window (about): what one take copies at once; fewer where rows are wide, so
# a window holds about TAKEN_WINDOW_BYTES (rows of 4 KiB in 16-row blocks made 257 MiB windows,
# and rows over 32 KiB a window past the 2 GiB a take's 32-bit offsets hold: every read failed).
TAKEN_WINDOW_ROWS = 1 << 16
TAKEN_WINDOW_BYTES = 8 << 20
# Units per stream past which the windows' float sort keys could tie where the exact order does
# not ((2k + 1) / U, correctly rounded, stays exact below 2^25 units): such reads are sliced.
TAKEN_MAX_UNITS = 1 << 25


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
    known = lengths is not None
    lengths = list(lengths) if lengths is not None else [UNKNOWN_LENGTH] * len(cursors)
    point = point or ResumePoint((0,) * len(cursors))
    units = _units(lengths, unit)
    if known and unit < SLICED_UNIT_ROWS and max(units, default=0) < TAKEN_MAX_UNITS:
        yield from _taken(cursors, lengths, unit, point)
        return
    yield from _sliced(cursors, lengths, unit, point)


def _first_units(lengths: Sequence[int], unit: int, point: ResumePoint) -> list[int]:
    """Each stream's first unit still to give: the one part-way for ``point.turn``."""
    return [
        (skip - point.taken) // unit if j == point.turn and point.taken else -(-skip // unit)
        for j, skip in enumerate(point.skips)
    ]


def _sliced(cursors: list[_Cursor], lengths: list[int], unit: int, point: ResumePoint) -> Iterator[pa.RecordBatch]:
    """The interleave one unit at a time, each a zero-copy slice (any unit, any lengths)."""
    units = _units(lengths, unit)
    scale = math.lcm(*(u for u in units if u)) if any(units) else 1
    # Unit k of stream j sits at (2k + 1) * scale / U_j: integers, so ties compare exactly.
    heap: list[tuple[int, int, int]] = []  # (spread position, stream, unit index)
    for j, k in enumerate(_first_units(lengths, unit, point)):
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
                if lengths[j] != UNKNOWN_LENGTH:  # as the windows' reads say (_taken)
                    raise DataCacheError(f"stream {j} ended before the {lengths[j]} rows its ticket holds")
                heapq.heappop(heap)  # ended: a stream of unknown length leaves the rotation
                break
            need -= piece.num_rows
            yield piece
        else:
            if k + 1 < units[j]:
                heapq.heapreplace(heap, (position + 2 * (scale // units[j]), j, k + 1))
                continue
            heapq.heappop(heap)
            if lengths[j] != UNKNOWN_LENGTH:
                _check_ended(cursor, j, lengths[j])


def _check_ended(cursor: _Cursor, stream: int, length: int) -> None:
    # Asked to its end, the stream checks itself against its ticket (client.read_endpoint);
    # one that still has rows here is not the stream its length promised.
    if cursor.take(1) is not None:
        raise DataCacheError(f"stream {stream} went past the {length} rows its ticket holds")


def _units_below(bound: Fraction, units: int) -> int:
    """How many units ``k`` of a stream of ``units`` sit below ``bound``: (2k + 1) / units < bound."""
    return max(0, min(units, math.ceil((bound * units - 1) / 2)))


def _taken(cursors: list[_Cursor], lengths: list[int], unit: int, point: ResumePoint) -> Iterator[pa.RecordBatch]:
    """The same order as ``_sliced``, a window of about TAKEN_WINDOW_ROWS rows at a time: the
    units of every stream whose spread position falls in the window (exact, in fractions), put
    in order by numpy and gathered by one ``take`` over the window's rows of each stream."""
    units = _units(lengths, unit)
    first = _first_units(lengths, unit, point)
    done = [k >= u for k, u in zip(first, units, strict=True)]  # given whole before: not read
    total_units = sum(units)
    bound = Fraction(0)
    while not all(done):
        # Unit k of stream j sits at (2k + 1) / U_j, in (0, 2): each window takes the next stretch
        # of that range, as wide as TAKEN_WINDOW_BYTES of the widest rows at hand allow. The
        # order does not depend on where windows end.
        widest = max((cursors[j].row_bytes() for j in range(len(units)) if not done[j]), default=0.0)
        window_rows = TAKEN_WINDOW_ROWS if widest <= 0 else int(min(TAKEN_WINDOW_ROWS, TAKEN_WINDOW_BYTES // widest))
        bound += Fraction(2 * max(1, window_rows // unit), max(1, total_units))
        keys, streams, firsts, sizes, pieces = [], [], [], [], []
        offset = 0  # the window's rows read so far, stream after stream
        for j, u in enumerate(units):
            if done[j]:
                continue
            hi = _units_below(bound, u) if bound < 2 else u
            if hi <= first[j]:
                continue
            k = np.arange(first[j], hi, dtype=np.int64)
            first[j] = hi
            # Rows of each unit in stream j, from the first the node sends (after its skip): one
            # stretch of the stream, read now and placed at ``offset`` among the window's rows.
            start = np.maximum(k * unit, point.skips[j]) - point.skips[j]
            size = np.minimum((k + 1) * unit, lengths[j]) - point.skips[j] - start
            stretch = int(start[-1] + size[-1] - start[0])
            got = cursors[j].take_rows(stretch)
            if sum(b.num_rows for b in got) != stretch:
                raise DataCacheError(f"stream {j} ended before the {lengths[j]} rows its ticket holds")
            pieces += got
            keys.append((2 * k + 1) / u)
            streams.append(np.full(len(k), j, dtype=np.int64))
            firsts.append(start - start[0] + offset)
            sizes.append(size)
            offset += stretch
            if hi >= u:
                done[j] = True
                _check_ended(cursors[j], j, lengths[j])
        if not keys:
            continue
        key, stream, first_row, size = (np.concatenate(a) for a in (keys, streams, firsts, sizes))
        order = np.lexsort((stream, key))  # by position; a tie goes to the lower stream
        first_row, size = first_row[order], size[order]
        ends = np.cumsum(size)
        rows = np.arange(int(ends[-1]), dtype=np.int64) + np.repeat(first_row - (ends - size), size)
        window = pa.Table.from_batches(pieces).take(pa.array(rows))
        yield from window.combine_chunks().to_batches()


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

    def row_bytes(self) -> float:
        """The average bytes of a row of the batch at hand (the next one read, where none is;
        nothing is taken), or 0 at the stream's end."""
        while self._batch is None or self._offset >= self._batch.num_rows:
            self._batch = next(self._stream, None)
            self._offset = 0
            if self._batch is None:
                return 0.0
        return self._batch.nbytes / self._batch.num_rows

    def take_rows(self, n: int) -> list[pa.RecordBatch]:
        """The next ``n`` rows (fewer where the stream ends), as slices of its batches."""
        pieces = []
        while n > 0 and (piece := self.take(n)) is not None:
            pieces.append(piece)
            n -= piece.num_rows
        return pieces
