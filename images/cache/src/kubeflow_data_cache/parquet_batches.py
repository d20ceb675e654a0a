"""A Parquet file read batch by batch, so that a read holds one batch's decode, not a row group's.

pyarrow's dataset scanner, which pyiceberg reads through, decodes each row group's columns
whole and only then cuts them into batches: a 4M-row row group of three columns held ~360 MiB
decoded to yield 131,072 rows at a time, and a load's memory guard, which runs between batches,
could stop a read only once a whole row group was in memory. pyarrow's file reader decodes
instead the rows a batch asks for, page by page (~54 MiB for the same file, at the same speed).

Each row group gets a reader of its own, with batches sized to about BATCH_TARGET_BYTES decoded,
from the bytes per row seen so far: a row group's statistics (its uncompressed encoded size) say
little where values repeat (a dictionary page of one large value decodes once per row). So the
first row group starts with a one-row probe, and a reader whose batches come out more than twice
its target is replaced by a smaller one, which skips the rows already yielded (decoding them
again, a few batches at most). Pre-buffering, where asked (an object store's few large
requests), then fetches one row group's chunks at a time, where one reader over the file would
fetch ahead and hold every row group's compressed chunks.
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
)

# A reader is replaced when its batches decode past this many times its target, at most
# MAX_RESIZES times per row group (each replacement decodes the rows it skips again).
RESIZE_FACTOR = 2
MAX_RESIZES = 3


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


def _large(group: pq.RowGroupMetaData, indices: list[int]) -> bool:
    """Whether the scanner would decode this row group to more than a couple of batches at once."""
    stored = sum(group.column(i).total_uncompressed_size for i in indices)
    return group.num_rows > BATCHWISE_MIN_GROUP_ROWS or stored > BATCHWISE_MIN_GROUP_BYTES


def _batch_rows(row_bytes: float) -> int:
    return max(1, min(MAX_BATCH_ROWS, int(BATCH_TARGET_BYTES / max(row_bytes, 1.0))))


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
        options, source = fragment.format.default_fragment_scan_options, fragment.open()
        file = pq.ParquetFile(source, metadata=metadata, pre_buffer=options.pre_buffer, buffer_size=options.buffer_size)
        if not file.schema_arrow.equals(schema):
            return None
        # The one-row probe reads its pages alone: pre-buffered, it fetched the row group's
        # chunks once for itself and again for the reader after it (held side by side).
        probe = pq.ParquetFile(source, metadata=metadata, pre_buffer=False, buffer_size=options.buffer_size)
        return cls(file, probe, schema, columns, indices)

    def to_batches(self) -> Iterator[pa.RecordBatch]:
        meta = self._file.metadata
        decoded, encoded = 0.0, 0.0  # over the batches yielded: their Arrow bytes, their encoded estimate
        probe = True
        for group in range(meta.num_row_groups):
            rows = meta.row_group(group).num_rows
            if rows == 0:
                continue
            column_meta = meta.row_group(group)
            stored = sum(column_meta.column(i).total_uncompressed_size for i in self._indices) / rows
            # Bytes per row as this file's rows so far decoded against their encoded size.
            row_bytes = stored * (decoded / encoded if encoded else 1.0)
            for batch in self._row_group(group, rows, row_bytes, probe):
                decoded += batch.nbytes
                encoded += stored * batch.num_rows
                yield batch
            probe = False

    def _row_group(self, group: int, rows: int, row_bytes: float, probe: bool) -> Iterator[pa.RecordBatch]:
        done, resizes = 0, 0
        size = 1 if probe else _batch_rows(row_bytes)
        while done < rows:
            file = self._probe if probe and size == 1 else self._file
            reader = file.reader.iter_batches(size, [group], self._indices, True)
            skip, resize = done, False
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
                seen = batch.nbytes / batch.num_rows
                wanted = _batch_rows(seen)
                if size == 1 and probe and wanted > 1:
                    resize, probe = True, False  # the probe has said what a row holds
                elif batch.nbytes > RESIZE_FACTOR * BATCH_TARGET_BYTES and wanted < size and resizes < MAX_RESIZES:
                    resize = True
                    resizes += 1
                if resize:
                    size = wanted
                    break
            if not resize:
                return

    def _named(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """``batch`` (the file's columns in file order) as the scanner gives it."""
        batch = batch.select(self._columns) if batch.schema.names != self._columns else batch
        return pa.RecordBatch.from_arrays(batch.columns, schema=self._schema)
