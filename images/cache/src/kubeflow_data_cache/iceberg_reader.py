"""The pyiceberg internals the cache reads through, kept in one place.

pyiceberg's public readers decode each data file whole before yielding anything (0.9-0.12
collect a file's batches into a list, to run the decode in their executor). A data node keeps
a range of a file's rows and the head only needs a file's live row count, so both go one level
down: the per-file batch stream, and the delete-file reader. Where a pyiceberg lacks them, the
public path is used (same results, more memory), with a warning once.

pyiceberg also opens every Parquet file with ``pre_buffer=True``: pyarrow then fetches the
compressed column chunks of the file's row groups ahead of the decode, in a few large requests,
and holds what it fetched beside what it decodes: up to the whole file where the fetches run far
ahead. From an object store that is what makes a read fast (a few
large requests; unbuffered, a 400 MB file took 3-6x as long on moto). From a local path it buys
nothing for large files and holds up to the whole compressed file: a data node reading two
local 200 MB files peaked ~300 MiB higher with it than without, and loaded no faster. Small
files it reads in fewer, larger reads: the benchmarks' 2M-row table (8 files of ~10 MB) loaded
~13% slower without it. So local data files larger than LOCAL_PREBUFFER_MAX_BYTES are read
without it (``task_batches``), through the switches below; they also hand files with large row
groups to parquet_batches.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

log = logging.getLogger(__name__)


def _delete_reader():
    """pyiceberg's delete-file reader where its ArrowScan also has the per-file stream, else
    None (the public path, with a warning)."""
    from pyiceberg.io import pyarrow as pyiceberg_arrow

    read_deletes = getattr(pyiceberg_arrow, "_read_all_delete_files", None)
    if read_deletes is None or not hasattr(pyiceberg_arrow.ArrowScan, "_record_batches_from_scan_tasks_and_deletes"):
        _warn_public_path()
        return None
    return read_deletes


@functools.cache
def _warn_public_path() -> None:
    log.warning(
        "this pyiceberg has no per-file batch stream: each data file is decoded whole before its "
        "rows are kept, so a load can peak above the planned memory; use the pyiceberg of the "
        "image's requirements lock"
    )


def task_deletes(table, task):
    """The positional deletes of one data file, read once for all of its column groups; None
    where this pyiceberg reads them inside its public path."""
    read_deletes = _delete_reader()
    return None if read_deletes is None else read_deletes(table.io, [task])


def is_remote(path: str) -> bool:
    """Whether a data file lives in an object store (s3://, s3a://), not on a local path."""
    return "://" in path and not path.startswith("file:")


# A local file up to this size is read pre-buffered: it holds at most this much beside its decode
# (the plan's read-ahead window, plan.READ_AHEAD_BYTES, is as large), and reads faster so.
LOCAL_PREBUFFER_MAX_BYTES = 64 << 20

# While this thread pulls a batch through ``task_batches``: ``batchwise`` (always) has pyiceberg's
# per-file reads decode batch by batch (parquet_batches), ``unbuffered`` (a large local file) has
# its file formats made without pre-buffering. Both are read where pyiceberg calls the switches.
_reading = threading.local()
_switch_lock = threading.Lock()
_switch_installed: bool | None = None


class _Scanner:
    """pyarrow.dataset's Scanner, as pyiceberg's reader module sees it: a read of a whole
    fragment's columns with no filter, pulled by ``task_batches``, decodes batch by batch where
    its row groups are large (parquet_batches.BatchwiseRead.of says where). Anything else is
    the Scanner's own."""

    def __getattr__(self, name):
        import pyarrow.dataset as ds

        return getattr(ds.Scanner, name)

    @staticmethod
    def from_fragment(fragment, schema=None, filter=None, columns=None, **kwargs):
        import pyarrow.dataset as ds  # not at the top: see _Dataset

        from kubeflow_data_cache.parquet_batches import BatchwiseRead

        if getattr(_reading, "batchwise", False) and filter is None and columns is not None and not kwargs:
            read = BatchwiseRead.of(fragment, schema if schema is not None else fragment.physical_schema, columns)
            if read is not None:
                return read
        return ds.Scanner.from_fragment(fragment, schema=schema, filter=filter, columns=columns, **kwargs)


class _Dataset:
    """pyarrow.dataset with the Scanner above, for pyiceberg's reader module alone. Imported
    where first used, as pyiceberg does: pyarrow.dataset imports pyarrow's S3 client, which
    reads SSL_CERT_FILE once (s3_settings.trust_aws_ca_bundle sets it first)."""

    Scanner = _Scanner()

    def __getattr__(self, name):
        import pyarrow.dataset as ds

        return getattr(ds, name)


def _install_switches() -> bool:
    """Wrap pyiceberg's file-format factory, so that reads marked unbuffered are not
    pre-buffered, and its pyarrow.dataset, so that marked reads decode batch by batch. Returns
    False (reads stay pre-buffered and by row group, with a warning once) where this pyiceberg
    has no such factory or module."""
    global _switch_installed
    with _switch_lock:
        if _switch_installed is None:
            import pyarrow.dataset as ds
            from pyiceberg.io import pyarrow as pyiceberg_arrow

            make_format = getattr(pyiceberg_arrow, "_get_file_format", None)
            _switch_installed = make_format is not None and getattr(pyiceberg_arrow, "ds", None) is ds
            if not _switch_installed:
                log.warning(
                    "this pyiceberg reads every Parquet file pre-buffered and a row group at a time: "
                    "a load holds each row group decoded whole, and each local file's compressed "
                    "bytes while it is read; use the pyiceberg of the image's requirements lock"
                )
            else:

                def file_format(file_format, **kwargs):
                    if getattr(_reading, "unbuffered", False) and "pre_buffer" in kwargs:
                        kwargs["pre_buffer"] = False
                    return make_format(file_format, **kwargs)

                pyiceberg_arrow._get_file_format = file_format
                pyiceberg_arrow.ds = _Dataset()
        return _switch_installed


def reads_prebuffered(path: str, stored_bytes: int) -> bool:
    """Whether ``task_batches`` reads this data file (``stored_bytes`` large) pre-buffered: one in
    an object store, a small local one, or any where this pyiceberg lacks the per-file stream
    (its public path reads in its own threads) or the switches."""
    return (
        is_remote(path)
        or stored_bytes <= LOCAL_PREBUFFER_MAX_BYTES
        or _delete_reader() is None
        or not _install_switches()
    )


def _marked(batches: Iterator[pa.RecordBatch], unbuffered: bool) -> Iterator[pa.RecordBatch]:
    """``batches``, with each one pulled while this thread's reads are marked."""
    try:
        while True:
            _reading.batchwise, _reading.unbuffered = True, unbuffered
            try:
                batch = next(batches)
            except StopIteration:
                return
            finally:
                _reading.batchwise = _reading.unbuffered = False
            yield batch
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()  # a read stopped early closes its file


def task_batches(table, task, field_ids=None, deletes=None) -> Iterator[pa.RecordBatch]:
    """One data file's batches in file order, positional deletes applied, decoded as consumed:
    a large row group batch by batch (parquet_batches), a small one whole by pyarrow's scanner,
    which reads a window ahead. pyiceberg's reader also handles schema evolution by field id and
    partition values that are not in the file. Close the generator to stop early: that closes
    the file.

    ``field_ids`` (top-level Iceberg field ids) reads only those columns: a reader decodes a
    batch's (or a row group's) columns together, so fewer columns at a time is less in decode
    at once.
    ``deletes`` is ``task_deletes``' result, to read the delete files once per data file."""
    from pyiceberg.expressions import AlwaysTrue
    from pyiceberg.io.pyarrow import ArrowScan
    from pyiceberg.schema import Schema

    schema = table.schema()
    if field_ids is not None:
        wanted = set(field_ids)
        schema = Schema(*[f for f in schema.fields if f.field_id in wanted], schema_id=schema.schema_id)
    scan = ArrowScan(table.metadata, table.io, schema, AlwaysTrue())
    if deletes is None:
        deletes = task_deletes(table, task)
    if deletes is None:
        return scan.to_record_batches([task])
    batches = scan._record_batches_from_scan_tasks_and_deletes([task], deletes)
    _install_switches()
    return _marked(batches, unbuffered=not reads_prebuffered(task.file.file_path, task.file.file_size_in_bytes))


def rows_after_deletes(table, task) -> int:
    """A data file's live rows: its record count less the distinct positions its positional
    delete files name, read from the delete files alone (no data file is decoded on the head)."""
    read_deletes = _delete_reader()
    if read_deletes is None:
        return sum(batch.num_rows for batch in task_batches(table, task))
    chunks = read_deletes(table.io, [task]).get(task.file.file_path, [])
    if not chunks:
        return task.file.record_count
    every = np.concatenate([np.asarray(chunk.to_numpy(), dtype=np.int64) for chunk in chunks])
    # Two delete files may name one row; a position past the file's end deletes nothing.
    deleted = np.unique(every[(every >= 0) & (every < task.file.record_count)])
    return task.file.record_count - len(deleted)
