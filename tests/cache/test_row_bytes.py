"""row_bytes: each row's variable bytes from offsets alone, checked against the values themselves."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from kubeflow_data_cache import row_bytes


def expected(value, t: pa.DataType) -> int:
    """The variable bytes of one Python value of type ``t``, counted the slow way."""
    if value is None:
        return 0
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return len(value.encode())
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return len(value)
    if pa.types.is_map(t):
        entry = pa.struct([pa.field("key", t.key_type), pa.field("value", t.item_type)])
        return sum(_fixed(entry) + expected({"key": k, "value": v}, entry) for k, v in value)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return sum(_fixed(t.value_type) + expected(v, t.value_type) for v in value)
    if pa.types.is_fixed_size_list(t):
        return sum(expected(v, t.value_type) for v in value)
    if pa.types.is_struct(t):
        return sum(expected(value[t.field(i).name], t.field(i).type) for i in range(t.num_fields))
    return 0


def _fixed(t: pa.DataType) -> int:
    """Bytes every value holds whatever its size (what a list counts per value beside its variable
    part): its width, a string's, binary's or list's offset, a boolean's bit as a byte."""
    if pa.types.is_struct(t):
        return sum(_fixed(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_fixed_size_list(t):
        return t.list_size * _fixed(t.value_type)
    if pa.types.is_large_string(t) or pa.types.is_large_binary(t) or pa.types.is_large_list(t):
        return 8
    if pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_list(t) or pa.types.is_map(t):
        return 4
    if pa.types.is_boolean(t):
        return 1
    try:
        bits = t.bit_width
    except ValueError:
        return 0
    return bits // 8 if bits % 8 == 0 else 0


CASES = {
    "string": (pa.string(), ["a", "", None, "héllo", "x" * 300]),
    "large_binary": (pa.large_binary(), [b"", b"abc", None, b"z" * 77, b"q"]),
    "list<int32>": (pa.list_(pa.int32()), [[1, 2], [], None, list(range(50)), [7]]),
    "large_list<float64>": (pa.large_list(pa.float64()), [[1.0], [], [2.0] * 9, None, [3.0, 4.0]]),
    "list<string>": (pa.list_(pa.string()), [["a", "bb"], [], None, ["x" * 100, None, "yy"], ["z"]]),
    "list<list<string>>": (pa.list_(pa.list_(pa.string())), [[["a"], ["bb", "c"]], [[]], None, [["x" * 40]], []]),
    "struct<binary,string>": (
        pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
        [
            {"bytes": b"xyz", "path": "p"},
            None,
            {"bytes": b"", "path": "long/path"},
            {"bytes": b"q" * 99, "path": ""},
            {"bytes": None, "path": "a"},
        ],
    ),
    "list<struct<int64,string>>": (
        pa.list_(pa.struct([("n", pa.int64()), ("s", pa.string())])),
        [[{"n": 1, "s": "ab"}], [], None, [{"n": 2, "s": "c" * 30}, {"n": 3, "s": ""}], [{"n": 4, "s": None}]],
    ),
    "map<string,int32>": (
        pa.map_(pa.string(), pa.int32()),
        [[("a", 1)], [], None, [("bb", 2), ("ccc", 3)], [("d", 4)]],
    ),
    "fixed_size_list<string,2>": (
        pa.list_(pa.string(), 2),
        [["a", "bb"], ["", "c" * 20], None, ["x", "y"], ["zz", "z"]],
    ),
    "list<bool>": (pa.list_(pa.bool_()), [[True, False], [], None, [True] * 40, [False]]),
    "list<large_string>": (pa.list_(pa.large_string()), [["a"], [], None, ["bb", "c" * 9], [None]]),
    "struct<list<float32>>": (
        pa.struct([("v", pa.list_(pa.float32()))]),
        [{"v": [1.0]}, {"v": []}, None, {"v": [2.0] * 8}, {"v": None}],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("sliced", [False, True])
def test_each_rows_bytes_match_its_values(name, sliced):
    t, values = CASES[name]
    arr = pa.array(values * 3, type=t)
    if sliced:  # a chunk's slice, and children that are not at offset 0
        arr = arr.slice(2, 11)
    want = np.array([expected(v, t) for v in arr.to_pylist()], dtype=np.int64)
    terms = row_bytes.terms(arr)
    assert row_bytes.varies(t)
    rows = np.arange(len(arr), dtype=np.int64)
    assert np.array_equal(row_bytes.rows_bytes(terms, rows), want)
    shuffled = np.random.default_rng(1).permutation(rows)
    assert np.array_equal(row_bytes.rows_bytes(terms, shuffled), want[shuffled])
    assert np.array_equal(row_bytes.prefix_bytes(terms, 3, 9), np.concatenate(([0], np.cumsum(want[3:9]))))
    assert row_bytes.span_bytes(terms, 1, len(arr)) == want[1:].sum()
    assert row_bytes.largest_row_bytes(terms, len(arr), step=4) == want.max()


@pytest.mark.parametrize(
    "t",
    [pa.int64(), pa.float32(), pa.bool_(), pa.struct([("a", pa.int32()), ("b", pa.float64())]), pa.list_(pa.int8(), 4)],
)
def test_types_whose_rows_are_one_size_have_no_terms(t):
    assert not row_bytes.varies(t)
    arr = pa.array([None] * 3, type=t)
    assert row_bytes.terms(arr) == []
    assert row_bytes.largest_row_bytes([], 3) == 0


def test_a_list_whose_empty_child_has_no_offsets_buffer_counts_nothing():
    """Legal Arrow, though Parquet and IPC give the empty child an offsets buffer: one without any."""
    child = pa.Array.from_buffers(pa.string(), 0, [None, pa.py_buffer(b""), pa.py_buffer(b"")])
    lists = pa.ListArray.from_arrays(pa.array([0, 0, 0], pa.int32()), child)
    terms = row_bytes.terms(lists)
    assert row_bytes.rows_bytes(terms, np.arange(2)).tolist() == [0, 0]
    assert row_bytes.largest_row_bytes(terms, 2) == 0


@pytest.mark.parametrize(
    "arr",
    [
        pa.array([["a"] * 50] * 1000, pa.list_(pa.string())),
        pa.array([[[1]] * 50] * 1000, pa.list_(pa.list_(pa.int8()))),
        pa.array([[("k", "v")] * 50] * 1000, pa.map_(pa.string(), pa.string())),
    ],
    ids=["list<string>", "list<list<int8>>", "map<string,string>"],
)
def test_short_nested_values_count_their_offsets(arr):
    """Rows of many short nested values hold mostly offsets: counted as their values alone, a
    list of 50 one-character strings was 50 of its 254 bytes, and a batch cut at the byte cap
    held 5 times it."""
    counted = int(row_bytes.rows_bytes(row_bytes.terms(arr), np.arange(len(arr))).sum())
    assert 0.9 * arr.nbytes <= counted <= arr.nbytes
