"""Slices whose variable-width columns start at offset 0, rebased in memory that gets reused.

Arrow IPC sends a string, binary or list column with offsets that start at 0. For a slice that
starts further in, Flight's writer allocates a rebased copy of the offsets from Arrow's default
pool, once per batch sent. On a data node that pool is jemalloc with no decay (allocator.py):
it hands every freed buffer straight back to the OS, so each batch faulted fresh pages in, which
cost 10-15% of an unshuffled DoGet of a table with a string column on the project's test
machine. ``rebaser`` makes the copy itself, in numpy (glibc) memory that the node's malloc
setting keeps for reuse, so the writer sends every buffer as it is. Data buffers stay zero-copy.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa


def has_offsets(typ: pa.DataType | pa.Schema) -> bool:
    """Whether slices of this type (or of any column of this schema) can need rebasing."""
    if isinstance(typ, pa.Schema):
        return any(has_offsets(field.type) for field in typ)
    if _offset_width(typ) is not None:  # string, binary or list (their large forms too)
        return True
    return pa.types.is_struct(typ) and any(has_offsets(typ.field(i).type) for i in range(typ.num_fields))


def rebased_nbytes(arr: pa.Array) -> int:
    """The bytes of the offsets a rebase of all of ``arr`` makes (``rebaser``), at any depth: a
    string, binary or list array's own, its list values' within, a struct's fields'."""
    typ = arr.type
    width = _offset_width(typ)
    if width is not None:
        own = (len(arr) + 1) * np.dtype(width).itemsize
        if not (_is_list(typ) and has_offsets(typ.value_type)):
            return own
        offsets = value_offsets(arr)  # the values this array uses: ``values`` is all of its child's
        start, stop = (int(offsets[0]), int(offsets[-1])) if len(offsets) else (0, 0)
        return own + rebased_nbytes(arr.values.slice(start, stop - start))
    if pa.types.is_struct(typ):
        return sum(rebased_nbytes(arr.field(i)) for i in range(typ.num_fields) if has_offsets(typ.field(i).type))
    return 0


def zero_based(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The same rows, with every string, binary and list column (also inside lists and structs)
    rebuilt so that its offsets start at 0. Other columns are kept as they are."""
    return rebaser(batch.schema)(batch)


Rebaser = Callable[[pa.RecordBatch], pa.RecordBatch]


def rebaser(schema: pa.Schema) -> Rebaser:
    """``zero_based`` for batches of ``schema``, with the columns to rebase and how found once.

    An in-order stream calls it once per batch: looking the types up again for every batch
    (``DataType`` hashes by its string form) and rebuilding the batch from all of its columns
    cost about as much as the rebasing itself.
    """
    plan = [(i, field, _fixer(field.type)) for i, field in enumerate(schema) if has_offsets(field.type)]

    def rebased(batch: pa.RecordBatch) -> pa.RecordBatch:
        for i, field, fix in plan:
            column = batch.column(i)
            fixed = fix(column)
            if fixed is not column:
                batch = batch.set_column(i, field, fixed)
        return batch

    return rebased


def _fixer(typ: pa.DataType) -> Callable[[pa.Array], pa.Array]:
    """``rebase`` specialised for one type: the same result, the type's checks done once."""
    width = _offset_width(typ)
    if width is not None and not _is_list(typ):  # string or binary
        return lambda arr: _rebase_binary(arr) if arr.offset else arr
    if width is not None:  # a list: its offsets, then its child's
        child = _fixer(typ.value_type) if has_offsets(typ.value_type) else None
        return lambda arr: _rebase_list(arr, child) if arr.offset else arr
    if pa.types.is_struct(typ):
        fields = [_fixer(typ.field(i).type) if has_offsets(typ.field(i).type) else None for i in range(typ.num_fields)]
        return lambda arr: _rebase_struct(arr, fields) if arr.offset else arr
    return lambda arr: arr


def _validity(arr: pa.Array) -> pa.Buffer | bool | None:
    """The slice's own validity bitmap (zero-copy), None without nulls, False if it cannot be cut
    without shifting bits (a slice that does not start on a byte)."""
    if arr.null_count == 0:
        return None
    if arr.offset % 8:
        return False
    return arr.buffers()[0].slice(arr.offset // 8, (len(arr) + 7) // 8)


def is_string_or_binary(t: pa.DataType) -> bool:
    """Strings and binaries (their large forms too): one offsets buffer over one values buffer."""
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)


def value_offsets(arr: pa.Array) -> np.ndarray:
    """The offsets of a string, binary, list or map array, sliced or not: a view, ``len(arr) + 1``
    long (zeros for a zero-length array with no offsets buffer, which Arrow allows)."""
    dtype = np.int32 if pa.types.is_map(arr.type) else _offset_width(arr.type)
    buffer = arr.buffers()[1]
    if buffer is None or buffer.size == 0:
        return np.zeros(len(arr) + 1, dtype=dtype)
    return np.frombuffer(buffer, dtype=dtype)[arr.offset : arr.offset + len(arr) + 1]


def _offsets(arr: pa.Array) -> tuple[pa.Buffer, int, int]:
    """Rebased offsets of a sliced array, and the range ``[start, stop)`` of child values it uses."""
    view = value_offsets(arr)
    start, stop = int(view[0]), int(view[-1])
    return pa.py_buffer(view - view[0]), start, stop


def rebase(arr: pa.Array) -> pa.Array:
    """``arr`` with zero-based offsets where that saves the IPC writer a copy; else ``arr``.

    An array at offset 0 (a stored chunk, or the first slice of one) is returned as it is.
    """
    return _fixer(arr.type)(arr)


def _rebase_binary(arr: pa.Array) -> pa.Array:
    validity = _validity(arr)
    if validity is False:
        return arr  # the writer shifts the bitmap and rebases; rare enough to leave to it
    offsets, start, stop = _offsets(arr)
    data = arr.buffers()[2]
    data = data.slice(start, stop - start) if data is not None else None
    return pa.Array.from_buffers(arr.type, len(arr), [validity, offsets, data], null_count=arr.null_count)


def _rebase_list(arr: pa.Array, child: Callable[[pa.Array], pa.Array] | None) -> pa.Array:
    validity = _validity(arr)
    if validity is False:
        return arr
    offsets, start, stop = _offsets(arr)
    values = arr.values.slice(start, stop - start)  # .values: the whole child
    if child is not None:
        values = child(values)
    return pa.Array.from_buffers(arr.type, len(arr), [validity, offsets], null_count=arr.null_count, children=[values])


def _rebase_struct(arr: pa.Array, fields: list[Callable[[pa.Array], pa.Array] | None]) -> pa.Array:
    validity = _validity(arr)
    if validity is False:
        return arr
    # field(i) is the child already cut to this slice.
    children = [arr.field(i) if fix is None else fix(arr.field(i)) for i, fix in enumerate(fields)]
    return pa.Array.from_buffers(arr.type, len(arr), [validity], null_count=arr.null_count, children=children)


def _offset_width(typ: pa.DataType):
    """The numpy type of ``typ``'s offsets, None for a type without offsets."""
    if pa.types.is_string(typ) or pa.types.is_binary(typ) or pa.types.is_list(typ):
        return np.int32
    if pa.types.is_large_string(typ) or pa.types.is_large_binary(typ) or pa.types.is_large_list(typ):
        return np.int64
    return None


def _is_list(typ: pa.DataType) -> bool:
    return pa.types.is_list(typ) or pa.types.is_large_list(typ)
