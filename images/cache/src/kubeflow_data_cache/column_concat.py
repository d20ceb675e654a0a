"""One column from many chunks, without holding two copies of it.

``pa.concat_arrays`` allocates the merged column, copies every chunk into it and only then can
the chunks go: for a moment the column exists twice. A data node merges its load's batches a
column at a time (store.compact), so its peak while loading was its rows plus its largest
column (a 4-float embedding column is a third of the sample table). Here the merged buffers
are allocated first (pages the copy has not reached are not resident yet) and each chunk is
released as soon as it is copied: the extra memory is one chunk, not one column.

Types whose layout this copies: fixed-width values (numbers, temporals, decimals,
fixed-size binaries, booleans), strings and binaries (32- and 64-bit offsets), lists, large
lists, fixed-size lists, maps and structs of those: every type an Iceberg table reads as.
Anything else (dictionaries, unions, view types) goes through ``pa.concat_arrays``, as before.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def concat_releasing(chunks: list[pa.Array], memory_pool: pa.MemoryPool | None = None) -> pa.Array:
    """``chunks`` (one type, at least one) as one array with offset 0. Empties ``chunks`` as it
    copies, so the caller must hold no other reference for the memory to go early."""
    if not chunks:
        raise ValueError("concat_releasing needs at least one chunk")
    pool = memory_pool or pa.default_memory_pool()
    kind = chunks[0].type
    # Empty chunks add nothing, and one built without buffers has none to read from.
    chunks[:] = [chunk for chunk in chunks if len(chunk)] or chunks[:1]
    if not copies(kind) or not len(chunks[0]):
        merged = pa.concat_arrays(chunks, memory_pool=pool)
        chunks.clear()
        return merged
    return _concat(chunks, kind, pool)


def _fixed_bytes(kind: pa.DataType) -> int | None:
    """Bytes per value of a fixed-width layout with whole-byte values, else None."""
    if pa.types.is_dictionary(kind) or pa.types.is_boolean(kind):
        return None
    try:
        width = kind.bit_width
    except ValueError:
        return None
    return width // 8 if width and width % 8 == 0 else None


def copies(kind: pa.DataType) -> bool:
    """Whether ``concat_releasing`` copies this type itself (else: pa.concat_arrays, which holds
    the column twice; the head's memory model counts that)."""
    if pa.types.is_boolean(kind) or _fixed_bytes(kind) is not None:
        return True
    if _offsets_type(kind) is not None:
        return True
    if pa.types.is_map(kind):
        return copies(kind.key_type) and copies(kind.item_type)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return copies(kind.value_type)
    if pa.types.is_struct(kind):
        return all(copies(kind.field(i).type) for i in range(kind.num_fields))
    return False


def _offsets_type(kind: pa.DataType) -> type | None:
    """The offset width of a string or binary layout, else None."""
    if pa.types.is_string(kind) or pa.types.is_binary(kind):
        return np.int32
    if pa.types.is_large_string(kind) or pa.types.is_large_binary(kind):
        return np.int64
    return None


def _concat(chunks: list[pa.Array], kind: pa.DataType, pool: pa.MemoryPool) -> pa.Array:
    lengths = [len(c) for c in chunks]
    rows = sum(lengths)
    validity = _validity(chunks, rows, pool)
    nulls = sum(c.null_count for c in chunks)
    if pa.types.is_boolean(kind):
        data = _allocate_bits(rows, pool)
        pos = 0
        for i in range(len(chunks)):
            chunk = chunks[i]
            _write_bits(data, pos, _bits(chunk.buffers()[1], chunk.offset, len(chunk)))
            pos += len(chunk)
            chunks[i] = chunk = None
        chunks.clear()
        return pa.Array.from_buffers(kind, rows, [validity, data], null_count=nulls)
    width = _fixed_bytes(kind)
    if width is not None:
        data = pa.allocate_buffer(rows * width, memory_pool=pool)
        out = np.frombuffer(data, dtype=np.uint8)
        pos = 0
        for i in range(len(chunks)):
            chunk = chunks[i]
            src = np.frombuffer(chunk.buffers()[1], dtype=np.uint8)
            n = len(chunk) * width
            out[pos : pos + n] = src[chunk.offset * width : chunk.offset * width + n]
            pos += n
            chunks[i] = chunk = src = None  # the chunk's buffers go now, not with the column
        chunks.clear()
        return pa.Array.from_buffers(kind, rows, [validity, data], null_count=nulls)
    offset_type = _offsets_type(kind)
    if offset_type is not None:
        return _concat_binary(chunks, kind, rows, validity, nulls, offset_type, pool)
    if pa.types.is_fixed_size_list(kind):
        size = kind.list_size
        children = []
        for i in range(len(chunks)):
            chunk = chunks[i]
            children.append(chunk.values.slice(chunk.offset * size, len(chunk) * size))
            chunks[i] = chunk = None
        chunks.clear()
        child = concat_releasing(children, pool)
        return pa.Array.from_buffers(kind, rows, [validity], null_count=nulls, children=[child])
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_map(kind):
        return _concat_list(chunks, kind, rows, validity, nulls, pool)
    # A struct: each field's chunks, sliced to their parent's rows by StructArray.field.
    fields = [[chunk.field(f) for chunk in chunks] for f in range(kind.num_fields)]
    chunks.clear()
    children = [concat_releasing(field_chunks, pool) for field_chunks in fields]
    return pa.Array.from_buffers(kind, rows, [validity], null_count=nulls, children=children)


def _concat_binary(chunks, kind, rows, validity, nulls, offset_type, pool) -> pa.Array:
    offsets_buffer, spans = _merged_offsets(chunks, offset_type, rows, pool, f"bytes of {kind} values")
    data_buffer = pa.allocate_buffer(sum(stop - start for start, stop in spans), memory_pool=pool)
    out_data = np.frombuffer(data_buffer, dtype=np.uint8)
    base = 0
    for i in range(len(chunks)):
        start, stop = spans[i]
        if stop > start:
            out_data[base : base + stop - start] = np.frombuffer(chunks[i].buffers()[2], dtype=np.uint8)[start:stop]
        base += stop - start
        chunks[i] = None
    chunks.clear()
    return pa.Array.from_buffers(kind, rows, [validity, offsets_buffer, data_buffer], null_count=nulls)


def _concat_list(chunks, kind, rows, validity, nulls, pool) -> pa.Array:
    """Lists, large lists and maps (a list of key-value structs, with the same offsets)."""
    offset_type = np.int64 if pa.types.is_large_list(kind) else np.int32
    offsets_buffer, spans = _merged_offsets(chunks, offset_type, rows, pool, "list values")
    children = []
    for i in range(len(chunks)):
        start, stop = spans[i]
        # The values this chunk's rows span (``values`` is the whole child, not the slice).
        children.append(chunks[i].values.slice(start, stop - start))
        chunks[i] = None
    chunks.clear()
    child = concat_releasing(children, pool)
    return pa.Array.from_buffers(kind, rows, [validity, offsets_buffer], null_count=nulls, children=[child])


def _merged_offsets(chunks, offset_type, rows: int, pool, what: str) -> tuple[pa.Buffer, list[tuple[int, int]]]:
    """The merged offsets of variable-width chunks (strings, lists), each chunk's rebased to
    where its values land, and each chunk's (first, end) value position in its own buffers.
    Refused before any chunk is dropped where 32-bit offsets would overflow."""
    own = [np.frombuffer(c.buffers()[1], dtype=offset_type)[c.offset : c.offset + len(c) + 1] for c in chunks]
    spans = [(int(offsets[0]), int(offsets[-1])) for offsets in own]
    total = sum(stop - start for start, stop in spans)
    if offset_type is np.int32 and total > np.iinfo(np.int32).max:
        raise ValueError(f"{total} {what} overflow 32-bit offsets; merge fewer chunks")
    buffer = pa.allocate_buffer((rows + 1) * np.dtype(offset_type).itemsize, memory_pool=pool)
    out = np.frombuffer(buffer, dtype=offset_type)
    out[0] = 0
    pos, base = 0, 0
    for offsets, (start, stop) in zip(own, spans, strict=True):
        out[pos + 1 : pos + len(offsets)] = offsets[1:] - start + base
        pos += len(offsets) - 1
        base += stop - start
    return buffer, spans


def _validity(chunks: list[pa.Array], rows: int, pool: pa.MemoryPool) -> pa.Buffer | None:
    """The merged validity bitmap, or None when no chunk has a null."""
    if not any(c.null_count for c in chunks):
        return None
    bitmap = _allocate_bits(rows, pool)
    pos = 0
    for chunk in chunks:
        n = len(chunk)
        bits = _bits(chunk.buffers()[0], chunk.offset, n) if chunk.null_count else np.ones(n, dtype=bool)
        _write_bits(bitmap, pos, bits)
        pos += n
    return bitmap


def _allocate_bits(rows: int, pool: pa.MemoryPool) -> pa.Buffer:
    buffer = pa.allocate_buffer((rows + 7) // 8, memory_pool=pool)
    np.frombuffer(buffer, dtype=np.uint8)[:] = 0
    return buffer


def _bits(buffer: pa.Buffer, offset: int, n: int) -> np.ndarray:
    """Bits ``[offset, offset + n)`` of an Arrow bitmap (least significant bit first)."""
    raw = np.frombuffer(buffer, dtype=np.uint8)[offset // 8 : (offset + n + 7) // 8 + 1]
    return np.unpackbits(raw, bitorder="little")[offset % 8 : offset % 8 + n].astype(bool)


def _write_bits(bitmap: pa.Buffer, pos: int, bits: np.ndarray) -> None:
    """Set bits ``[pos, pos + len(bits))`` of a bitmap whose bits from ``pos`` on are still 0."""
    out = np.frombuffer(bitmap, dtype=np.uint8)
    first, shift = divmod(pos, 8)
    if shift:  # the bits already written in the byte this chunk starts in
        bits = np.concatenate([np.unpackbits(out[first : first + 1], bitorder="little")[:shift].astype(bool), bits])
    packed = np.packbits(bits, bitorder="little")
    out[first : first + len(packed)] = packed
