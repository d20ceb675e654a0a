"""Interleave a shard's endpoint streams, and find where in them a resumed read starts.

A shuffled shard's rows come from several data nodes; the client takes ``unit`` rows from each
stream in turn (``round_robin``). The order depends only on the streams' lengths and the unit,
so a reader that already handed out ``start`` rows can compute how many each stream gave and
where the turn was (``resume_point``), ask every node to leave those rows out, and continue the
same order without receiving the rows again.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import pyarrow as pa


@dataclass(frozen=True)
class ResumePoint:
    """Where ``start`` rows into an interleaved (or sequential) read of the streams stand.

    ``skips[i]``: rows stream ``i`` already gave. ``turn``: the stream whose turn it is,
    ``taken``: rows it already gave in this turn (always below the unit).
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


def resume_point(lengths: Sequence[int], unit: int, start: int) -> ResumePoint:
    """Where ``round_robin(streams, unit)`` stands after yielding ``start`` rows.

    Arithmetic, not a replay: ``r`` whole turns of every stream give ``sum(min(n, r * unit))``
    rows, so the last whole turn before ``start`` is found by bisection and only that turn is
    walked stream by stream.
    """
    if unit < 1:
        raise ValueError(f"unit should be >= 1, got {unit}")
    if not 0 <= start <= sum(lengths):
        raise ValueError(f"start {start} is outside the streams' {sum(lengths)} rows")

    def given(turns: int) -> int:
        return sum(min(n, turns * unit) for n in lengths)

    low, high = 0, -(-max(lengths, default=0) // unit)  # given(high) is every row
    while low < high:  # the most whole turns with given(turns) <= start
        mid = (low + high + 1) // 2
        low, high = (mid, high) if given(mid) <= start else (low, mid - 1)
    turns = low
    skips = [min(n, turns * unit) for n in lengths]
    left = start - given(turns)
    for i, n in enumerate(lengths):
        this_turn = min(unit, n - skips[i])
        if this_turn <= 0:
            continue  # exhausted before this turn
        if left < this_turn:
            skips[i] += left
            return ResumePoint(tuple(skips), i, left)
        skips[i] += this_turn
        left -= this_turn
    return ResumePoint(tuple(skips))  # every row given (start == sum(lengths))


def round_robin(
    streams: Iterable[Iterator[pa.RecordBatch]], unit: int, turn: int = 0, taken: int = 0
) -> Iterator[pa.RecordBatch]:
    """Take ``unit`` rows from each stream in turn (zero-copy slices) until all are exhausted.

    ``turn`` and ``taken`` continue a read from its ``resume_point``: the first turn goes to
    stream ``turn``, which gives ``unit - taken`` rows; the streams before it had theirs.
    """
    cursors = [_Cursor(stream) for stream in streams]
    first_round = cursors[turn:]
    need_first = unit - taken
    while cursors:
        for cursor in first_round if first_round is not None else list(cursors):
            need = need_first if need_first is not None else unit
            need_first = None
            while need:
                piece = cursor.take(need)
                if piece is None:
                    cursors.remove(cursor)
                    break
                need -= piece.num_rows
                yield piece
        first_round = None


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
