"""How received record batches become training batches: exact sizes, order, and no needless copies."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kubeflow_data_cache.dataset import CONVERT_ROWS, DataCacheDataset, column_to_tensor

# Never contacted: _rebatch only converts what it is given.
ENDPOINT = "grpc://127.0.0.1:9"


def stream(sizes: list[int]) -> list[pa.RecordBatch]:
    out, start = [], 0
    for n in sizes:
        ids = np.arange(start, start + n, dtype=np.int64)
        out.append(pa.record_batch({"id": ids, "x": ids.astype(np.float32)}))
        start += n
    return out


def buffer_range(batch: pa.RecordBatch, column: str) -> tuple[int, int]:
    buf = batch.column(column).buffers()[1]
    return buf.address, buf.address + buf.size


# Transfer batches as a node sends them (CONVERT_ROWS and a bit more, a short one where a node's
# part ends), and the small pieces of a shuffled, interleaved read.
SIZES = st.lists(
    st.one_of(st.integers(0, 3000), st.integers(CONVERT_ROWS, CONVERT_ROWS + 5000)), min_size=0, max_size=6
)


@settings(max_examples=40, deadline=None)
@given(sizes=SIZES, batch_size=st.one_of(st.integers(3, 8), st.integers(100, 5000)), drop_last=st.booleans())
def test_batches_have_exactly_batch_size_rows_in_order(sizes, batch_size, drop_last):
    ds = DataCacheDataset(ENDPOINT, batch_size=batch_size, drop_last=drop_last)
    out = list(ds._rebatch(iter(stream(sizes))))
    total = sum(sizes)
    expected = total // batch_size * batch_size if drop_last else total
    ids = torch.cat([b["id"] for b, _ in out]).numpy() if out else np.empty(0, dtype=np.int64)
    assert np.array_equal(ids, np.arange(expected))
    assert [rows for _, rows in out] == [len(b["id"]) for b, _ in out]
    assert all(rows == batch_size for _, rows in out[:-1])
    if out:
        assert 0 < out[-1][1] <= batch_size
    if out:  # features stay aligned with their ids (one comparison of the whole epoch)
        assert torch.equal(torch.cat([b["x"] for b, _ in out]), torch.from_numpy(ids).to(torch.float32))


def test_small_batches_are_split_off_a_bounded_number_at_a_time(monkeypatch):
    """batch_size=1 made one view per row of a whole run at once: 262,144 a column, ~450 MiB for
    three columns of a 16 MB table."""
    from kubeflow_data_cache.dataset import SPLIT_VIEWS

    real, most = torch.Tensor.split, []

    def counted(self, *args, **kwargs):
        parts = real(self, *args, **kwargs)
        most.append(len(parts))
        return parts

    monkeypatch.setattr(torch.Tensor, "split", counted)
    ds = DataCacheDataset(ENDPOINT, batch_size=1)
    out = list(ds._rebatch(iter(stream([3 * SPLIT_VIEWS + 5]))))
    assert torch.equal(torch.cat([b["id"] for b, _ in out]), torch.arange(3 * SPLIT_VIEWS + 5))
    assert max(most) <= SPLIT_VIEWS


def test_a_transfer_batch_after_a_short_tail_is_not_copied():
    """Where one node's part ends mid-batch, only the rows that complete that batch are copied;
    the next node's whole transfer batch is turned into tensors over its own buffer."""
    tail, big = stream([500, CONVERT_ROWS])
    ds = DataCacheDataset(ENDPOINT, batch_size=1024)
    out = [b for b, _ in ds._rebatch(iter([tail, big]))]
    lo, hi = buffer_range(big, "id")
    shared = [b for b in out if lo <= b["id"].data_ptr() < hi]
    # Only the batch that joins the tail to the first rows of `big` is a copy.
    assert len(out) == 65 and len(shared) == 64


def test_tensors_may_share_a_batch_the_reader_owns_but_not_by_default():
    col = pa.array(np.arange(100, dtype=np.float64)).slice(10, 50)
    lo = col.buffers()[1].address
    shared = column_to_tensor("x", col, copy=False)
    owned = column_to_tensor("x", col)
    assert torch.equal(shared, owned) and torch.equal(owned, torch.arange(10, 60, dtype=torch.float64))
    assert shared.data_ptr() == lo + 10 * 8
    assert owned.data_ptr() != shared.data_ptr()
    owned += 1  # a copy: the Arrow values stay as they were
    assert col.to_pylist()[0] == 10.0


@pytest.mark.parametrize(
    "col",
    [
        pa.array([True, False, True]),  # bit-packed: always converted
        pa.array([1.0, None, 3.0]),  # nulls become NaN: always converted
    ],
)
def test_what_cannot_be_a_view_is_still_converted_without_copy(col):
    tensor = column_to_tensor("c", col, copy=False)
    expected = column_to_tensor("c", col)
    assert torch.equal(tensor, expected) or torch.allclose(tensor, expected, equal_nan=True)


def test_a_list_of_strings_column_is_refused_naming_it():
    col = pa.array([["a", "b"], ["c", "d"]])
    with pytest.raises(TypeError, match=r"column 'tags' holds lists of string, which have no tensor form"):
        column_to_tensor("tags", col)


def test_nulls_inside_lists_are_refused_as_such_and_float_ones_become_nan():
    """A null inside a list that is not null itself: the column's own IS NOT NULL filter keeps the
    row, so the message must not suggest it, nor name the lists' value type as the column's."""
    col = pa.array([[1, 2], [3, None]], type=pa.list_(pa.int32()))
    with pytest.raises(
        ValueError, match=r"column 'emb' \(list<item: int32>\) holds 1 null value\(s\) inside its lists"
    ) as err:
        column_to_tensor("emb", col)
    assert "IS NOT NULL" not in str(err.value)
    floats = column_to_tensor("emb", pa.array([[1.0, None]], type=pa.list_(pa.float32())))
    assert floats.shape == (1, 2) and torch.isnan(floats[0, 1])
