"""Interleaving endpoint streams, and resuming that order part-way without the rows before it."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubeflow_data_cache.interleave import resume_point, round_robin, sequential_point


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
def test_resuming_the_round_robin_gives_the_rest_of_the_same_order(lengths, unit, cut, data):
    firsts = [1000 * i for i in range(len(lengths))]
    whole = ids(round_robin([stream(f, n, cut) for f, n in zip(firsts, lengths, strict=True)], unit))
    assert sorted(whole) == sorted(f + r for f, n in zip(firsts, lengths, strict=True) for r in range(n))
    start = data.draw(st.integers(0, len(whole)))
    point = resume_point(lengths, unit, start)
    # Each stream gave exactly the rows of it among the first ``start``.
    assert list(point.skips) == [sum(1 for i in whole[:start] if f <= i < f + 1000) for f in firsts]
    rest = round_robin(
        [stream(f + k, n - k, cut) for f, n, k in zip(firsts, lengths, point.skips, strict=True)],
        unit,
        point.turn,
        point.taken,
    )
    assert ids(rest) == whole[start:]


@given(lengths=st.lists(st.integers(0, 50), min_size=1, max_size=4), data=st.data())
def test_sequential_point_takes_whole_streams_first(lengths, data):
    start = data.draw(st.integers(0, sum(lengths)))
    point = sequential_point(lengths, start)
    assert list(point.skips) == [min(n, max(0, start - sum(lengths[:i]))) for i, n in enumerate(lengths)]


def test_a_start_past_the_rows_is_refused():
    with pytest.raises(ValueError, match="outside the streams' 5 rows"):
        resume_point([2, 3], 4, 6)
