"""Slices whose variable-width columns start at offset 0, rebased in memory that gets reused.

Arrow IPC sends a string, binary or list column with offsets that start at 0. For a slice that
starts further in, Flight's writer allocates a rebased copy of the offsets from Arrow's default
pool, once per batch sent. On a data node that pool is jemalloc with no decay (allocator.py):
it hands every freed buffer straight back to the OS, so each batch faulted fresh pages in, which
cost 10-15% of an unshuffled DoGet of a table with a string column on the project's test
machine. ``zero_based`` makes the copy itself, in numpy (glibc) memory that the node's malloc
setting keeps for reuse, so the writer sends every buffer as it is. Data buffers stay zero-copy.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

# Types whose offsets buffer (buffers()[1]) indexes into a data buffer (buffers()[2]).
_BINARY_LIKE = {
    pa.string(): np.int32,
    pa.binary(): np.int32,
    pa.large_string(): np.int64,
    pa.large_binary(): np.int64,
}


def has_offsets(typ: pa.DataType | pa.Schema) -> bool:
    """Whether slices of this type (or of any column of this schema) can need rebasing."""
    if isinstance(typ, pa.Schema):
        return any(has_offsets(field.type) for field in typ)
    if typ in _BINARY_LIKE or _is_list(typ):
        return True
    return pa.types.is_struct(typ) and any(has_offsets(typ.field(i).type) for i in range(typ.num_fields))


def zero_based(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The same rows, with every string, binary and list column (also inside lists and structs)
    rebuilt so that its offsets start at 0. Other columns are kept as they are."""
    old = batch.columns
    columns = [rebase(col) for col in old]
    if all(a is b for a, b in zip(columns, old, strict=True)):
        return batch
    return pa.RecordBatch.from_arrays(columns, schema=batch.schema)


def _validity(arr: pa.Array) -> pa.Buffer | bool | None:
    """The slice's own validity bitmap (zero-copy), None without nulls, False if it cannot be cut
    without shifting bits (a slice that does not start on a byte)."""
    if arr.null_count == 0:
        return None
    if arr.offset % 8:
        return False
    return arr.buffers()[0].slice(arr.offset // 8, (len(arr) + 7) // 8)


def _offsets(arr: pa.Array, dtype) -> tuple[pa.Buffer, int, int]:
    """Rebased offsets of a sliced array, and the range ``[start, stop)`` of child values it uses."""
    view = np.frombuffer(arr.buffers()[1], dtype=dtype)[arr.offset : arr.offset + len(arr) + 1]
    start, stop = int(view[0]), int(view[-1])
    return pa.py_buffer(view - view[0]), start, stop


def rebase(arr: pa.Array) -> pa.Array:
    """``arr`` with zero-based offsets where that saves the IPC writer a copy; else ``arr``.

    An array at offset 0 (a stored chunk, or the first slice of one) is returned as it is.
    """
    typ = arr.type
    if arr.offset == 0 or not (typ in _BINARY_LIKE or _is_list(typ) or pa.types.is_struct(typ)):
        return arr
    validity = _validity(arr)
    if validity is False:
        return arr  # the writer shifts the bitmap and rebases; rare enough to leave to it
    if typ in _BINARY_LIKE:
        offsets, start, stop = _offsets(arr, _BINARY_LIKE[typ])
        data = arr.buffers()[2]
        data = data.slice(start, stop - start) if data is not None else None
        return pa.Array.from_buffers(typ, len(arr), [validity, offsets, data], null_count=arr.null_count)
    if _is_list(typ):
        offsets, start, stop = _offsets(arr, np.int64 if pa.types.is_large_list(typ) else np.int32)
        child = rebase(arr.values.slice(start, stop - start))  # .values: the whole child
        return pa.Array.from_buffers(typ, len(arr), [validity, offsets], null_count=arr.null_count, children=[child])
    # A struct: field(i) is the child already cut to this slice.
    children = [rebase(arr.field(i)) for i in range(typ.num_fields)]
    return pa.Array.from_buffers(typ, len(arr), [validity], null_count=arr.null_count, children=children)


def _is_list(typ: pa.DataType) -> bool:
    return pa.types.is_list(typ) or pa.types.is_large_list(typ)
