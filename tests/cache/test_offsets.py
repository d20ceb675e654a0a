"""Rebased slices: the same rows, and nothing left for Flight's IPC writer to copy."""

from __future__ import annotations

import io
import itertools

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
from hypothesis import given, settings
from hypothesis import strategies as st

from kubeflow_data_cache.offsets import has_offsets, rebase, rebaser, zero_based

ROWS = 3000


def table(with_nulls: bool) -> pa.RecordBatch:
    """Every kind of column ``zero_based`` handles, and a fixed-width one it leaves alone."""

    def maybe(i: int, value):
        return None if with_nulls and i % 7 == 3 else value

    return pa.record_batch(
        {
            "id": pa.array(range(ROWS), type=pa.int64()),
            "text": pa.array([maybe(i, f"row-{i}" * (i % 4)) for i in range(ROWS)], type=pa.string()),
            "blob": pa.array([maybe(i, b"b" * (i % 5)) for i in range(ROWS)], type=pa.large_binary()),
            "ints": pa.array([maybe(i, list(range(i % 3))) for i in range(ROWS)], type=pa.list_(pa.int32())),
            "words": pa.array([maybe(i, [f"w{i}"] * (i % 3)) for i in range(ROWS)], type=pa.large_list(pa.string())),
            "pair": pa.array(
                [maybe(i, {"name": f"n{i}", "n": i}) for i in range(ROWS)],
                type=pa.struct([("name", pa.string()), ("n", pa.int64())]),
            ),
        }
    )


def ipc_round_trip(batch: pa.RecordBatch) -> pa.RecordBatch:
    sink = io.BytesIO()
    with ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return ipc.open_stream(sink.getvalue()).read_next_batch()


@settings(max_examples=80, deadline=None)
@given(start=st.integers(0, ROWS), length=st.integers(0, ROWS), with_nulls=st.booleans())
def test_a_rebased_slice_holds_the_same_rows_and_survives_ipc(start, length, with_nulls):
    source = table(with_nulls)
    part = source.slice(start, length)
    rebased = zero_based(part)
    assert rebased.schema == part.schema
    assert rebased.equals(part)
    assert ipc_round_trip(rebased).equals(part)


def test_variable_width_columns_start_at_zero_and_fixed_width_ones_stay_zero_copy():
    part = table(with_nulls=False).slice(1000, 500)
    rebased = zero_based(part)
    for name in ("text", "blob", "ints", "words", "pair"):
        assert rebased.column(name).offset == 0, name
    assert rebased.column("words").values.offset == 0  # nested strings are rebased too
    # The data behind the strings is the stored buffer, not a copy.
    text = part.column("text")
    first = int(np.frombuffer(text.buffers()[1], dtype=np.int32)[text.offset])
    assert rebased.column("text").buffers()[2].address == text.buffers()[2].address + first
    assert rebased.column("id").buffers()[1].address == part.column("id").buffers()[1].address


def test_flights_ipc_writer_allocates_no_rebased_copy_for_a_rebased_slice():
    """The reason for the module: the writer's own allocations for a slice deep in a chunk drop
    to what it needs for a batch that starts at row 0."""
    pool = pa.default_memory_pool()
    source = table(with_nulls=False)

    def writer_allocations(batch: pa.RecordBatch) -> int:
        before = pool.num_allocations()
        ipc.get_record_batch_size(batch)  # serializes it as Flight's writer does
        return pool.num_allocations() - before

    part = source.slice(2000, 500)
    at_start = source.slice(0, 500)
    assert writer_allocations(part) > writer_allocations(at_start)
    assert writer_allocations(zero_based(part)) == writer_allocations(at_start)


def test_what_cannot_be_cut_on_a_byte_is_left_to_the_writer():
    part = table(with_nulls=True).slice(3, 100)  # nulls, and a slice that starts mid-byte
    text = part.column("text")
    assert rebase(text) is text
    assert zero_based(part).equals(part)


def test_a_batch_with_nothing_to_rebase_is_returned_as_it_is():
    source = table(with_nulls=True)
    assert zero_based(source) is source
    numeric = source.select(["id"]).slice(100, 50)
    assert zero_based(numeric) is numeric


def test_only_types_with_offsets_take_the_rebasing_path():
    schema = table(with_nulls=False).schema
    assert [f.name for f in schema if has_offsets(f.type)] == ["text", "blob", "ints", "words", "pair"]
    assert has_offsets(schema)
    numeric = pa.schema([("id", pa.int64()), ("v", pa.list_(pa.float32(), 4)), ("s", pa.struct([("n", pa.int8())]))])
    assert not has_offsets(numeric)


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, ROWS), min_size=1, max_size=6), with_nulls=st.booleans())
def test_one_rebaser_serves_every_slice_of_a_stream(cuts, with_nulls):
    """A stream builds its rebaser once from the schema and calls it on each slice in turn:
    each comes out as rebasing it alone gives, the same rows with its columns at offset 0."""
    source = table(with_nulls)
    rebased = rebaser(source.schema)
    bounds = sorted({0, ROWS, *cuts})
    for lo, hi in itertools.pairwise(bounds):
        part = source.slice(lo, hi - lo)
        got = rebased(part)
        assert got.equals(part) and got.schema == part.schema
        for name in ("text", "blob", "ints", "words", "pair"):
            alone = rebase(part.column(name))
            assert got.column(name).offset == alone.offset, name
        assert ipc_round_trip(got).equals(part)


def test_rebased_nbytes_counts_the_offsets_a_rebase_makes_at_every_depth():
    """What an in-order stream's window holds of its own (the serving memory guard)."""
    from kubeflow_data_cache.offsets import rebased_nbytes

    lists = pa.array([["a", "bc"], [], ["d", "e", "f"]], pa.list_(pa.string()))  # 3 lists, 5 strings
    assert rebased_nbytes(lists) == (3 + 1) * 4 + (5 + 1) * 4
    assert rebased_nbytes(pa.array(["x", None, "yz"], pa.large_string())) == (3 + 1) * 8
    record = pa.array([{"s": "a", "n": 1}, {"s": "bb", "n": 2}], pa.struct([("s", pa.string()), ("n", pa.int64())]))
    assert rebased_nbytes(record) == (2 + 1) * 4
    assert rebased_nbytes(pa.array([1, 2, 3], pa.int64())) == 0
    # As large as what a rebase of a slice makes: its own offsets and its values' within, not
    # its whole child's (a stored batch can be one slice of many over one long list column).
    piece = lists.slice(1, 2)
    rebased = rebaser(pa.schema([("l", lists.type)]))(pa.record_batch([piece], names=["l"])).column(0)
    assert (
        rebased_nbytes(piece)
        == rebased.buffers()[1].size + rebased.values.buffers()[1].size
        == (2 + 1) * 4 + (3 + 1) * 4
    )
