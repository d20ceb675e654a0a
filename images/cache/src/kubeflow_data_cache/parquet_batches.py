"""A Parquet file read batch by batch, so that a read holds one batch's decode, not a row group's.

pyarrow's dataset scanner, which pyiceberg reads through, decodes each row group's columns
whole and only then cuts them into batches: a 4M-row row group of three columns held ~360 MiB
decoded to yield 131,072 rows at a time, and a load's memory guard, which runs between batches,
could stop a read only once a whole row group was in memory. pyarrow's file reader decodes
instead the rows a batch asks for, page by page (~54 MiB for the same file, at the same speed).

Batches aim at about BATCH_TARGET_BYTES decoded. A row group's statistics are a floor, not a
measure (one large value repeated in a dictionary page decodes once per row), so each row group
starts with a one-row batch and grows GROWTH times a batch, at most to what the larger of its
stored bytes per row and the largest row seen in it allow; a batch that decodes past twice its
target shrinks the next. A reader's batch size is fixed, so each size is a new reader, which
skips the rows already yielded (decoding them again: 4,161 rows per row group for the ramp,
and all those before a resize). The small first readers read unbuffered; the one at the full
size is pre-buffered where asked (an object store's few large requests), and fetches that row
group's chunks alone, where one reader over the file would fetch ahead and hold every row
group's compressed chunks. Where the rows seen stop the ramp early (rows of hundreds of KiB),
the rest of the row group is read unbuffered.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from kubeflow_data_cache.constants import (
    BATCH_TARGET_BYTES,
    BATCHWISE_MIN_GROUP_BYTES,
    BATCHWISE_MIN_GROUP_ROWS,
    MAX_BATCH_ROWS,
    RESIZE_FACTOR,
)

# Each batch of a row group is at most this many times the one before (a new reader each time):
# 1, 64, 4,096 rows, then the full size. Growing 8 times a batch took twice as many readers, each
# a request per column from an object store: a load from moto ~30% slower.
GROWTH = 64
# A batch that decodes past RESIZE_FACTOR times its target has the next one sized down, at most
# MAX_RESIZES times per row group (each new reader decodes the rows it skips again).
MAX_RESIZES = 3
# The small first readers' reads, unbuffered: from an object store, a request each.
PROBE_BUFFER_BYTES = 1 << 20


def _leaves(t: pa.DataType) -> int:
    """How many Parquet leaf columns an Arrow type is stored as."""
    if isinstance(t, pa.ExtensionType):
        return _leaves(t.storage_type)
    if pa.types.is_struct(t):
        return sum(_leaves(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_map(t):
        return _leaves(t.key_type) + _leaves(t.item_type)
    if isinstance(t, pa.ListType | pa.LargeListType | pa.FixedSizeListType | pa.ListViewType | pa.LargeListViewType):
        return _leaves(t.value_type)
    return 1


def leaf_indices(schema: pa.Schema, columns: list[str]) -> list[int] | None:
    """The Parquet leaf columns that store the top-level ``columns`` of a file whose Arrow
    schema is ``schema``, in file order; None where a name is missing or not unique."""
    names = schema.names
    if any(names.count(name) != 1 for name in columns):
        return None
    wanted = set(columns)
    indices, leaf = [], 0
    for field in schema:
        count = _leaves(field.type)
        if field.name in wanted:
            indices.extend(range(leaf, leaf + count))
        leaf += count
    return indices


def _stored_bytes(group: pq.RowGroupMetaData, indices: list[int]) -> int:
    """The uncompressed bytes the leaf columns ``indices`` take in this row group."""
    return sum(group.column(i).total_uncompressed_size for i in indices)


def _large(group: pq.RowGroupMetaData, indices: list[int]) -> bool:
    """Whether the scanner would decode this row group to more than a couple of batches at once."""
    return group.num_rows > BATCHWISE_MIN_GROUP_ROWS or _stored_bytes(group, indices) > BATCHWISE_MIN_GROUP_BYTES


def _batch_rows(row_bytes: float) -> int:
    return max(1, min(MAX_BATCH_ROWS, int(BATCH_TARGET_BYTES / max(row_bytes, 1.0))))


def decoded_bytes(batch: pa.RecordBatch) -> int:
    """``batch``'s Arrow bytes, a dictionary column's dictionary left out: the batches of a row
    group share it (a file stored with dictionary types yields one in every batch), so counted
    per batch it made every row look as large as the dictionary."""
    return sum(
        column.indices.nbytes if pa.types.is_dictionary(column.type) else column.nbytes for column in batch.columns
    )


class BatchwiseRead:
    """One Parquet fragment's ``columns``, batch by batch (``to_batches()``), in the schema the
    dataset scanner gives them: the file's Arrow fields, in the order of ``columns``."""

    def __init__(
        self, file: pq.ParquetFile, probe: pq.ParquetFile, schema: pa.Schema, columns: list[str], indices: list[int]
    ):
        self._file, self._probe, self._columns, self._indices = file, probe, columns, indices
        self._schema = pa.schema([schema.field(name) for name in columns], metadata=schema.metadata)

    @classmethod
    def of(cls, fragment, schema: pa.Schema, columns: list[str]) -> BatchwiseRead | None:
        """The read, or None where it could not give what the scanner would (then use that):
        not Parquet, no column of the file (rows alone, for columns the file predates), or a file
        whose columns or schema do not map one to one."""
        if not columns or not isinstance(fragment, ds.ParquetFileFragment):
            return None
        metadata = fragment.metadata
        indices = leaf_indices(schema, columns)
        if indices is None or sum(_leaves(field.type) for field in schema) != metadata.num_columns:
            return None
        if not any(_large(metadata.row_group(i), indices) for i in range(metadata.num_row_groups)):
            return None
        fmt = fragment.format
        options, read = fmt.default_fragment_scan_options, fmt.read_options
        source = fragment.open()

        def reader(pre_buffer: bool, buffer_size: int) -> pq.ParquetFile:
            # Read as the scanner reads: its types for binaries, lists and INT96 timestamps, and
            # no Arrow extension types (a Parquet UUID is fixed_size_binary(16) to it).
            return pq.ParquetFile(
                source,
                metadata=metadata,
                pre_buffer=pre_buffer,
                buffer_size=buffer_size,
                read_dictionary=list(read.dictionary_columns) or None,
                binary_type=read.binary_type,
                list_type=read.list_type,
                coerce_int96_timestamp_unit=read.coerce_int96_timestamp_unit,
                arrow_extensions_enabled=False,
            )

        try:
            file = reader(options.pre_buffer, options.buffer_size)
        except TypeError:  # a pyarrow whose file reader lacks one of these options: the scanner reads it
            return None
        read_schema = file.schema_arrow
        if any(not read_schema.field(name).equals(schema.field(name)) for name in columns):
            return None
        probe = reader(False, min(options.buffer_size or PROBE_BUFFER_BYTES, PROBE_BUFFER_BYTES))
        return cls(file, probe, schema, columns, indices)

    def to_batches(self) -> Iterator[pa.RecordBatch]:
        meta = self._file.metadata
        for group in range(meta.num_row_groups):
            group_meta = meta.row_group(group)
            if group_meta.num_rows:
                stored = _stored_bytes(group_meta, self._indices) / group_meta.num_rows
                yield from self._row_group(group, group_meta.num_rows, stored)

    def _row_group(self, group: int, rows: int, stored: float) -> Iterator[pa.RecordBatch]:
        """``stored``: the row group's uncompressed bytes per row, a floor under the rows seen:
        rows that grow part-way through a group (5,000 of 100 B, then 6 KB ones) made a batch
        sized from the first ones decode to 721 MiB. Values repeated in a dictionary page store
        smaller than that: there the rows seen size the batches."""
        done, resizes = 0, 0
        size, row_bytes = 1, stored  # then the most bytes a row of this row group decoded to, if more
        while done < rows:
            full = size >= _batch_rows(row_bytes)  # no growth ahead: the pre-buffered reader
            file = self._file if full else self._probe
            reader = file.reader.iter_batches(size, [group], self._indices, True)
            skip, resized = done, False
            for batch in reader:
                if skip:
                    if batch.num_rows <= skip:
                        skip -= batch.num_rows
                        continue
                    batch, skip = batch.slice(skip), 0
                done += batch.num_rows
                yield self._named(batch)
                if done >= rows:
                    break
                nbytes = decoded_bytes(batch)
                row_bytes = max(row_bytes, nbytes / batch.num_rows)
                wanted = _batch_rows(row_bytes)
                if wanted > size and not full:
                    size, resized = min(wanted, size * GROWTH), True
                elif nbytes > RESIZE_FACTOR * BATCH_TARGET_BYTES and wanted < size and resizes < MAX_RESIZES:
                    size, resized, resizes = wanted, True, resizes + 1
                if resized:
                    break
            if not resized:
                return

    def _named(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """``batch`` (the file's columns in file order) as the scanner gives it."""
        batch = batch.select(self._columns) if batch.schema.names != self._columns else batch
        return pa.RecordBatch.from_arrays(batch.columns, schema=self._schema)
