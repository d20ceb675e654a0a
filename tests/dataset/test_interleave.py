"""Interleaving endpoint streams, and resuming that order part-way without the rows before it."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubeflow_data_cache.errors import DataCacheError
from kubeflow_data_cache.interleave import ResumePoint, interleave, resume_point, sequential_point


def stream(first: int, n: int, cut: int):
    """Rows ``first .. first + n - 1`` as batches of ``cut`` rows (how a node happens to cut them)."""
    for lo in range(0, n, cut):
        yield pa.record_batch({"id": pa.array(range(first + lo, first + min(n, lo + cut)), pa.int64())})


def ids(batches) -> list[int]:
    return [i for b in batches for i in b.column("id").to_pylist()]


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 120), min_size=1, max_size=5),
    unit=st.integers(1, 40),
    cut=st.integers(1, 50),
    data=st.data(),
)
def test_resuming_the_interleave_gives_the_rest_of_the_same_order(lengths, unit, cut, data):
    firsts = [1000 * i for i in range(len(lengths))]
    whole = ids(interleave([stream(f, n, cut) for f, n in zip(firsts, lengths, strict=True)], lengths, unit))
    assert sorted(whole) == sorted(f + r for f, n in zip(firsts, lengths, strict=True) for r in range(n))
    # Each stream's rows keep their order: only the streams are interleaved.
    for f in firsts:
        mine = [i for i in whole if f <= i < f + 1000]
        assert mine == sorted(mine)
    start = data.draw(st.integers(0, len(whole)))
    point = resume_point(lengths, unit, start)
    # Each stream gave exactly the rows of it among the first ``start``.
    assert list(point.skips) == [sum(1 for i in whole[:start] if f <= i < f + 1000) for f in firsts]
    rest = interleave(
        [stream(f + k, n - k, cut) for f, n, k in zip(firsts, lengths, point.skips, strict=True)],
        lengths,
        unit,
        point,
    )
    assert ids(rest) == whole[start:]


def _stream_of(row: int) -> int:
    return row // 1000


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 300), min_size=2, max_size=5), unit=st.integers(1, 8))
def test_every_stretch_of_the_read_holds_each_stream_in_proportion(lengths, unit):
    """No stream runs out long before the others: after any prefix, each stream has given its
    share of the rows, within a unit for each stream and one more (a plain rotation gives the
    short streams out first). The spread places units, not rows: a stream's short last unit
    takes a whole unit's place, so streams that each end on one are a little ahead in rows
    (three streams of 26 rows against one of 290, in units of 5: 2.5 units)."""
    firsts = [1000 * i for i in range(len(lengths))]
    whole = ids(interleave([stream(f, n, 7) for f, n in zip(firsts, lengths, strict=True)], lengths, unit))
    total = len(whole)
    given_so_far = [0] * len(lengths)
    for position, row in enumerate(whole, start=1):
        given_so_far[_stream_of(row)] += 1
        for j, n in enumerate(lengths):
            assert abs(given_so_far[j] - n * position / total) <= (len(lengths) + 1) * unit + 1


def test_equal_streams_alternate_unit_by_unit():
    whole = ids(interleave([stream(0, 6, 4), stream(1000, 6, 5)], [6, 6], 2))
    assert whole == [0, 1, 1000, 1001, 2, 3, 1002, 1003, 4, 5, 1004, 1005]


def test_a_short_stream_is_spread_over_the_read_not_given_first():
    # 2 units against 6: the short stream's sit at 3/12 and 9/12 of the read, the long one's at
    # 1/12, 3/12, 5/12, ... (on a tie the lower stream goes first).
    whole = ids(interleave([stream(0, 12, 12), stream(1000, 4, 4)], [12, 4], 2))
    assert [_stream_of(i) for i in whole[::2]] == [0, 0, 1, 0, 0, 0, 1, 0]


def test_streams_of_unknown_length_rotate_and_leave_when_they_end():
    whole = ids(interleave([stream(0, 2, 2), stream(1000, 6, 6)], None, 2))
    assert whole == [0, 1, 1000, 1001, 1002, 1003, 1004, 1005]
    assert ids(interleave([stream(0, 0, 1)], None, 2, ResumePoint((0,)))) == []


@given(lengths=st.lists(st.integers(0, 50), min_size=1, max_size=4), data=st.data())
def test_sequential_point_takes_whole_streams_first(lengths, data):
    start = data.draw(st.integers(0, sum(lengths)))
    point = sequential_point(lengths, start)
    assert list(point.skips) == [min(n, max(0, start - sum(lengths[:i]))) for i, n in enumerate(lengths)]


def test_a_start_past_the_rows_is_refused():
    with pytest.raises(ValueError, match="outside the streams' 5 rows"):
        resume_point([2, 3], 4, 6)


def test_a_stream_that_goes_past_its_length_is_an_error_not_cut_short():
    """Each stream is read to its end, so a stream's own check against its ticket runs (and a
    DoGet completes rather than being cancelled); one with rows left over is an error here."""
    ended = []

    def checked(n: int):
        yield from stream(0, n, 4)
        ended.append(n)

    assert len(ids(interleave([checked(6), checked(3)], [6, 3], 2))) == 9
    assert sorted(ended) == [3, 6]
    with pytest.raises(DataCacheError, match="stream 0 went past the 4 rows its ticket holds"):
        ids(interleave([stream(0, 6, 4), stream(1000, 4, 4)], [4, 4], 2))


@pytest.mark.parametrize("unit", [2, 300], ids=["taken a window at a time", "sliced"])
def test_a_stream_that_ends_before_its_length_is_an_error_not_a_short_read(unit):
    """A node that sends fewer rows than its ticket holds (a stream cut without an error) would
    otherwise leave the epoch short, its rows silently missing."""
    with pytest.raises(DataCacheError, match="stream 1 ended before the 600 rows its ticket holds"):
        ids(interleave([stream(0, 600, 64), stream(1000, 500, 64)], [600, 600], unit))


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 400), min_size=2, max_size=5),
    unit=st.integers(1, 12),
    cut=st.integers(1, 90),
    window=st.integers(1, 64),
    data=st.data(),
)
def test_small_units_taken_a_window_at_a_time_come_in_the_sliced_order(lengths, unit, cut, window, data):
    """Units below SLICED_UNIT_ROWS are gathered by one take per window (interleave._taken), not
    sliced one by one: the same rows in the same order, resumed from any point, in windows of any
    size (a window's edge may fall between two units at the same position)."""
    from kubeflow_data_cache import interleave as module

    firsts = [1000 * i for i in range(len(lengths))]

    def read(path, point):
        cursors = [
            module._Cursor(stream(f + k, n - k, cut)) for f, n, k in zip(firsts, lengths, point.skips, strict=True)
        ]
        return ids(path(cursors, list(lengths), unit, point))

    start = data.draw(st.integers(0, sum(lengths)))
    point = resume_point(lengths, unit, start)
    sliced = read(module._sliced, point)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "TAKEN_WINDOW_ROWS", window * unit)
        assert read(module._taken, point) == sliced
    assert (
        ids(interleave([stream(f, n, cut) for f, n in zip(firsts, lengths, strict=True)], lengths, unit))[start:]
        == sliced
    )


def test_a_taken_window_gives_whole_batches_not_a_slice_per_unit():
    batches = list(interleave([stream(0, 5000, 700), stream(10_000, 3000, 700)], [5000, 3000], 1))
    assert len(batches) < 10 and sum(b.num_rows for b in batches) == 8000
    assert sorted(ids(batches)) == [*range(5000), *range(10_000, 13_000)]
