"""A floor under how far string and binary values decode, read from Parquet footers.

A Parquet footer holds each column chunk's compressed and uncompressed size. Uncompressed, a
plain-encoded string or binary is a 4-byte length and the value: what Arrow holds (an offset and
the value). Dictionary and delta encodings are smaller than that, never larger, so a column
decodes to at least its uncompressed bytes. Manifests hold only the compressed size, and the
fixed factor over it (plan.VARIABLE_WIDTH_EXPANSION, 4) or the decoded sample (expansion.py,
which may only lower it) put values that compress far better than 4x far too low: zero-padded
tensors of 4 KiB in a struct, compressed 190x by zstd, were estimated at 2 MiB for 82 MiB held,
so the fit check passed tables many times too large and the load ran into its memory guard, or
past it, one 131,072-row batch at a time.

So the head reads the footers of up to FOOTER_FILES Parquet data files (the largest, and others
drawn by a hash of their paths), at once, for at most FOOTER_TIMEOUT_SECONDS, and takes for each
string or binary leaf (top level, or inside lists, maps and structs) its uncompressed bytes per
compressed byte, the least across the files read: one file that compresses far better than the
rest does not speak for them (the sample's lesson: one file of nulls measured 500x). Every file
read counts, however little of the leaf it holds: leaving out small files (page headers weigh
more there) put 100 small files of random bytes at the 190x of one file of tensors beside them,
17 MiB held estimated at 296 MiB. Where a file of nulls or of short values brings the least to
about 1, the floor raises nothing, and the estimate is what it was without it. The ratios only
ever raise an estimate (expansion.measure_expansions): what a floor cannot see (a dictionary of a
few labels, a file sized above the least) is the sample's and the load guard's to catch.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator

import pyarrow as pa

from kubeflow_data_cache.daemon_call import DaemonCall
from kubeflow_data_cache.offsets import is_string_or_binary

log = logging.getLogger(__name__)

# Footers read per plan, all at once: one read each (_footer), two where a footer is over 64 KiB.
FOOTER_FILES = 16
# How long planning waits for them: a footer whose read stalls leaves its file out.
FOOTER_TIMEOUT_SECONDS = 5.0


def footer_files(tasks: dict) -> list[str]:
    """The Parquet files whose footers are read: the largest, then FOOTER_FILES - 1 others drawn
    by a hash of their paths (every file of a smaller table). Drawn, not taken at a fixed stride
    of the path order: partitions alternating in that order (source=image, source=text, ...) put
    every file of a stride in one kind, and the other kind, never read, was sized by its ratio
    (1 MiB of text estimated at 120 MiB). Drawn at random, a kind holding half the files is
    missed with odds of 2**-15; a kind missed is a few files, sized at most by the others' ratio."""
    from pyiceberg.manifest import FileFormat

    # ORC and Avro files have no Parquet footer: read, each would only log that it could not be.
    paths = sorted(p for p, t in tasks.items() if t.file.record_count > 0 and t.file.file_format == FileFormat.PARQUET)
    if len(paths) <= FOOTER_FILES:
        return paths
    largest = min(paths, key=lambda p: (-tasks[p].file.file_size_in_bytes, p))
    drawn = sorted((p for p in paths if p != largest), key=lambda p: hashlib.sha256(p.encode()).digest())
    return [largest, *drawn[: FOOTER_FILES - 1]]


def footer_expansions(table, tasks: dict, wanted: set[int]) -> dict[int, float]:
    """Iceberg leaf field id (of ``wanted``) -> the least uncompressed/compressed ratio of its
    chunks across the footers read; a leaf no file measured is left out."""
    paths = footer_files(tasks)
    if not wanted or not paths:
        return {}
    sizes = {path: tasks[path].file.file_size_in_bytes for path in paths}
    calls = {path: DaemonCall(lambda p=path: _file_ratios(table, p, sizes[p], wanted), "footer") for path in paths}
    deadline = time.monotonic() + FOOTER_TIMEOUT_SECONDS
    least: dict[int, float] = {}
    for path, call in calls.items():
        if not call.wait(deadline - time.monotonic()):
            log.info("reading the footer of %s took over %gs; sizing columns without it", path, FOOTER_TIMEOUT_SECONDS)
            continue
        try:
            ratios = call.result()
        except Exception as err:  # an estimate's input: the data node that reads the file names a real fault
            log.info("could not read the footer of %s (%s); sizing columns without it", path, err)
            continue
        for field_id, ratio in ratios.items():
            least[field_id] = min(ratio, least.get(field_id, ratio))
    return least


def _file_ratios(table, path: str, size: int, wanted: set[int]) -> dict[int, float]:
    metadata, schema = _footer(table, path, size)
    leaves = list(leaf_fields(schema))
    if len(leaves) != metadata.num_columns:  # a layout this walk does not know: say nothing
        return {}
    measured = [(j, parquet_field_id(leaf)) for j, leaf in enumerate(leaves) if is_string_or_binary(leaf.type)]
    measured = [(j, field_id) for j, field_id in measured if field_id in wanted]
    compressed = dict.fromkeys((field_id for _, field_id in measured), 0)
    uncompressed = dict(compressed)
    for g in range(metadata.num_row_groups):  # each row group's metadata object made once
        group = metadata.row_group(g)
        for j, field_id in measured:
            chunk = group.column(j)
            compressed[field_id] += chunk.total_compressed_size
            uncompressed[field_id] += chunk.total_uncompressed_size
    return {k: uncompressed[k] / c for k, c in compressed.items() if c > 0}


def _footer(table, path: str, size: int):
    """A data file's Parquet metadata and Arrow schema. Where the table reads through pyarrow's
    own filesystems (pyiceberg's PyArrowFileIO), the file is opened with the size its manifest
    gives, so the object store is asked for the footer alone: opened by name, it is asked for
    the file's size first, a second request per file (on moto S3, planning 8 files took ~115 ms
    by name, ~97 ms by size, ~70 ms without footers)."""
    # Imported here, as in expansion.py: pyarrow.parquet brings in pyarrow.fs's S3 client.
    import pyarrow.dataset as ds
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    source = table.io.new_input(path)
    filesystem, inner = getattr(source, "_filesystem", None), getattr(source, "_path", None)
    if isinstance(filesystem, pafs.FileSystem) and isinstance(inner, str) and size > 0:
        fragment = ds.ParquetFileFormat().make_fragment(inner, filesystem, file_size=size)
        return fragment.metadata, fragment.physical_schema
    with source.open() as raw:
        parquet = pq.ParquetFile(raw, pre_buffer=False)
        return parquet.metadata, parquet.schema_arrow


def leaf_fields(schema: pa.Schema) -> Iterator[pa.Field]:
    """The Arrow fields of a Parquet file's leaf columns, in the footer's column order (depth
    first: a struct's children, a list's element, a map's key then value)."""
    for field in schema:
        yield from _leaves(field)


def _leaves(field: pa.Field) -> Iterator[pa.Field]:
    t = field.type
    if pa.types.is_struct(t):
        for j in range(t.num_fields):
            yield from _leaves(t.field(j))
    elif pa.types.is_map(t):
        yield from _leaves(t.key_field)
        yield from _leaves(t.item_field)
    elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        yield from _leaves(t.value_field)
    else:
        yield field


def parquet_field_id(field: pa.Field) -> int | None:
    """The Iceberg field id a Parquet file's writer put on an Arrow field (None: none)."""
    raw = (field.metadata or {}).get(b"PARQUET:field_id")
    return int(raw) if raw is not None else None
