"""Plan a table: which rows exist, how big they are in memory, and which data node holds which.

The head plans once; each data node re-plans the same snapshot to rebuild its scan tasks
(tasks are not serialisable), then reads only the files its assignment names.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
from collections import Counter
from dataclasses import dataclass, replace
from dataclasses import field as dataclass_field
from functools import cached_property
from typing import Any
from urllib.parse import unquote

import pyarrow as pa

from kubeflow_data_cache.column_concat import copies
from kubeflow_data_cache.constants import (
    BATCH_TARGET_BYTES,
    BATCHWISE_MIN_GROUP_BYTES,
    BATCHWISE_MIN_GROUP_ROWS,
    INTERNAL_COLUMN_PREFIX,
    MAX_BATCH_ROWS,
    READ_GROUP_MIN_BYTES,
    READ_GROUP_MIN_REMOTE_BYTES,
    READ_SCRATCH_SHARE,
    RESIZE_FACTOR,
    STORE_CHUNK_VARIABLE_BYTES,
)
from kubeflow_data_cache.errors import TableLoadError, UnsupportedTableError, shown
from kubeflow_data_cache.expansion import measure_expansions
from kubeflow_data_cache.iceberg_reader import is_remote, reads_prebuffered, rows_after_deletes
from kubeflow_data_cache.row_bytes import varies
from kubeflow_data_cache.s3_settings import endpoint_variable, store_trouble

log = logging.getLogger(__name__)

# Decoded Arrow bytes per on-disk byte for variable-width columns (strings, lists): Parquet
# pages are dictionary/RLE encoded and compressed, so decoded data is several times larger.
VARIABLE_WIDTH_EXPANSION = 4.0
# The same for fixed-width values when only their on-disk size is known (no value counts):
# floats barely compress, small integers do; a floor, not an estimate.
FIXED_WIDTH_EXPANSION = 2.0
# Arrow arrays carry offsets and validity bitmaps on top of the values.
ARROW_OVERHEAD = 1.1
# What a reader holds beyond the rows it has yielded: the compressed chunks and page buffers of
# the row groups it decodes, and pyarrow's scanner decodes ahead (up to 16 batches). Measured on
# sample tables, per byte of Arrow data in decode: 1.2-1.5x for small files read whole, 0.7x of
# a 5-row-group file, 1.7-2.0x one row group of 0.7-1M rows; small files read whole reached
# 2.9x once under a loaded CI machine (the reader decodes ahead on its own threads). The model:
# READ_SCRATCH_FACTOR x the smaller of the file and the larger of a row group and
# READ_AHEAD_BYTES (a piece of a file is read through its start and a window ahead, whatever
# its size).
READ_SCRATCH_FACTOR = 2.25
READ_AHEAD_BYTES = 64 << 20
# pyiceberg's read buffer per column (its buffer_size): what a file read without pre-buffering
# holds of each column chunk at once.
READ_BUFFER_BYTES = 8 << 20
# Plus, per reader, what its decode threads hold whatever the file's size (page and decompression
# buffers of the columns decoded at once; more at once on more cores): a 1.2 MB file read with 8
# decode threads took 2.7x its bytes, 0.3 MB past the factor, where one thread took 1.2x.
READ_FIXED_BYTES = 1 << 20
# What a load holds per Arrow array of a read batch beside its values, until it merges them: the
# array's C++ objects and its small buffers' rounding. 1,000 files of 20 rows x 200 columns, 200,000
# arrays, held 239 MiB for 15 MiB of rows (1.25 KB an array; 1.3 KB for 12,000 of 40 columns); a
# load guard stopped such a table, whose estimate had left that out, blaming its strings.
LOAD_ARRAY_OVERHEAD_BYTES = 1536
# Rows per batch pyarrow's scanner yields (its default batch size): a row group of more is cut.
SCAN_BATCH_ROWS = MAX_BATCH_ROWS


@dataclass(frozen=True)
class FilePlan:
    """One data file of the snapshot, with its exact row count after deletes."""

    path: str
    rows: int
    column_bytes: tuple[int, ...]  # estimated Arrow bytes of each column, in schema order
    has_deletes: bool
    row_groups: int = 1  # Parquet row groups (the manifest's split offsets): the unit a read decodes
    # Read batch by batch (parquet_batches), rows of one size: what its reader holds at once
    # (batchwise_window); 0: counted as pyarrow's scanner reads it.
    batchwise_window: int = 0

    @property
    def estimated_bytes(self) -> int:
        return sum(self.column_bytes)


def _leaf_field_ids(table) -> frozenset[int]:
    """The field ids of the table schema's primitive fields: those a manifest has sizes for."""
    schema = table.schema()
    return frozenset(i for i in schema.field_ids if schema.find_field(i).field_type.is_primitive)


def _reads_batchwise(data_file, leaves: frozenset[int]) -> bool:
    """Whether a data node surely reads this file batch by batch (parquet_batches), judged from its
    manifest entry: row groups past that reader's thresholds on average (rows; or stored bytes,
    which the compressed file size is a floor of). Where that cannot be told (no split offsets,
    or a column the file has no size for: it may predate the column, and then the scanner reads
    it), the file is taken as the scanner reads it, which errs high."""
    from pyiceberg.manifest import FileFormat

    groups = len(data_file.split_offsets or ())
    if data_file.file_format != FileFormat.PARQUET or not groups or not leaves <= set(data_file.column_sizes or {}):
        return False
    return (
        data_file.record_count / groups > BATCHWISE_MIN_GROUP_ROWS
        or data_file.file_size_in_bytes / groups > BATCHWISE_MIN_GROUP_BYTES
    )


def batchwise_window(data_file, leaves: frozenset[int], whole: int, rows_one_size: bool) -> int:
    """For a file read batch by batch, what its reader holds at once beside what it has yielded,
    in Arrow bytes before READ_SCRATCH_FACTOR: one batch (of the file's ``whole`` estimated
    bytes), and its row group's compressed chunks, all of them pre-buffered, else each column's
    read buffer's worth (16 columns of random floats: 128 MiB). 0 where the file is counted as
    the scanner reads it: read by the scanner, or with rows of many sizes (``rows_one_size``
    False), whose batches are sized by a row group's average row: 2,000 rows of 256 KiB after
    290,000 short ones decoded as one 500 MiB batch, which only a row group's worth covers."""
    if not rows_one_size or not _reads_batchwise(data_file, leaves):
        return 0
    size = data_file.file_size_in_bytes
    compressed = size // len(data_file.split_offsets)
    if not reads_prebuffered(data_file.file_path, size):
        compressed = min(compressed, len(leaves) * READ_BUFFER_BYTES)
    return min(whole, BATCH_TARGET_BYTES) + compressed


def decode_window(f: FilePlan) -> int:
    """The most of a file's estimated Arrow bytes one reader has in decode at once: read batch by
    batch, its batchwise_window; else a row group, decoded whole, or the scanner's read-ahead
    window where that is more (a piece is read through its file's start and a window ahead,
    whatever its size), never more than the file."""
    if f.batchwise_window:
        return f.batchwise_window
    return min(f.estimated_bytes, max(f.estimated_bytes // max(1, f.row_groups), READ_AHEAD_BYTES))


def merge_chunk_bytes(f: FilePlan, rows: int) -> int:
    """The most of one column that merging ``rows`` of ``f`` holds twice: the largest column's share
    of one read batch, as column_concat frees each source chunk once copied. The scanner's batches
    are slices of a row group decoded whole, whose buffers go only with the last slice: a row
    group's share there. Counted as the whole file's largest column, a node holding a 64th of a
    file was charged all of it, so no count of nodes fitted a table that 8 nodes held easily."""
    if f.batchwise_window:
        unit_rows, cap = MAX_BATCH_ROWS, RESIZE_FACTOR * BATCH_TARGET_BYTES
    else:
        unit_rows, cap = -(-f.rows // max(1, f.row_groups)), None
    largest = max(f.column_bytes, default=0)
    chunk = largest * min(rows, unit_rows) // max(1, f.rows)
    return chunk if cap is None else min(chunk, cap)


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of one file (row numbers after deletes). ``file_rows`` is the
    file's row count after deletes as planned from its manifest: the node that reads the file's
    tail checks that the file ends there (None: not checked)."""

    path: str
    start: int
    stop: int
    file_rows: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "start": self.start, "stop": self.stop, "file_rows": self.file_rows}


@dataclass(frozen=True)
class NodeAssignment:
    """What one data node loads: global rows ``[global_start, global_stop)``."""

    node: int
    global_start: int
    global_stop: int
    pieces: tuple[Piece, ...]

    @property
    def rows(self) -> int:
        return self.global_stop - self.global_start


@dataclass(frozen=True)
class TablePlan:
    metadata_location: str
    snapshot_id: int | None
    schema: pa.Schema
    files: tuple[FilePlan, ...]
    # Measured decoded bytes per on-disk byte of string/binary columns, by Iceberg field id
    # (expansion.py); sent to the data nodes with their load, so their budgets agree.
    expansions: dict[int, float] = dataclass_field(default_factory=dict)

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.files)

    @property
    def estimated_bytes(self) -> int:
        return sum(f.estimated_bytes for f in self.files)

    # Looked up once per node and piece, and per trial node count when a refusal's advice
    # searches for one that fits (up to memory.MAX_ADVISED_NODES): built once, not per call.
    @cached_property
    def files_by_path(self) -> dict[str, FilePlan]:
        return {f.path: f for f in self.files}

    @cached_property
    def file_starts(self) -> list[int]:
        """Each file's first row in the table's row space, in file order."""
        return [0, *itertools.accumulate(f.rows for f in self.files)][:-1]


def open_table(metadata_location: str, properties: dict[str, str] | None = None):
    """Open the table a ``metadata.json`` describes, with errors that say what to fix."""
    from pyiceberg.table import StaticTable

    location = metadata_location
    if "://" not in location:
        location = os.path.abspath(location)
    if not location.endswith(".metadata.json") and os.path.isfile(location.removeprefix("file://")):
        raise _not_a_metadata_file(metadata_location)
    try:
        if not location.endswith(".metadata.json"):  # a table folder: its version hint names the file
            location = StaticTable._metadata_location_from_version_hint(location, properties or {})
        return _static_table(location, properties or {})
    except Exception as err:  # pyiceberg/pyarrow raise many types for unreadable or malformed metadata
        known = _open_error(metadata_location, location, err, (properties or {}).get("s3.endpoint"))
        if known is not None:
            raise known from None
        raise TableLoadError(f"cannot read table metadata at {metadata_location!r}: {err}") from err


# Table properties pyiceberg would hand its FileIO: how and where to read, with what credentials.
_FILE_IO_PROPERTY_PREFIXES = ("s3.", "gcs.", "adls.", "hdfs.", "oss.", "client.", "py-io-impl")


def _static_table(location: str, properties: dict[str, str]):
    """``StaticTable.from_metadata``, but reading the table's files with ``properties`` alone.

    pyiceberg builds a static table's FileIO from the caller's properties overlaid with the
    table's own, from its metadata.json: whoever could write that file could point the cache's
    reads, signed with its credentials, at another endpoint (``s3.endpoint``), swap its
    credentials, or name any installed class to run as the FileIO (``py-io-impl``;
    ``subprocess.Popen`` ran a command made of the table's properties, ``logging.warning``
    logged the secret key). The cache's settings come from its environment (s3_settings.py)."""
    from pyiceberg.catalog.noop import NoopCatalog
    from pyiceberg.io import load_file_io
    from pyiceberg.serializers import FromInputFile
    from pyiceberg.table import StaticTable

    io = load_file_io(properties=properties, location=location)
    metadata = FromInputFile.table_metadata(io.new_input(location))
    ignored = sorted(key for key in metadata.properties if key.startswith(_FILE_IO_PROPERTY_PREFIXES))
    if ignored:
        log.warning(
            "the table's properties set %s, which the cache ignores: it reads the table's files with the "
            "settings of its environment (AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID, ...)",
            shown(", ".join(ignored)),
        )
    return StaticTable(
        identifier=("static-table", location),
        metadata_location=location,
        metadata=metadata,
        io=io,
        catalog=NoopCatalog("static-table"),
    )


def _not_a_metadata_file(metadata_location: str) -> TableLoadError:
    # pyiceberg reads a name not ending in .metadata.json as a table folder and looks for its
    # metadata/version-hint.text, which a file or a mistyped object key then fails on obscurely.
    return TableLoadError(
        f"METADATA_LOC {metadata_location!r} is not a metadata file: METADATA_LOC must name a table's "
        "*.metadata.json (for example .../warehouse/db/table/metadata/00003-....metadata.json)"
    )


def _open_error(
    metadata_location: str, location: str, err: Exception, endpoint: str | None = None
) -> TableLoadError | None:
    """The fix for a metadata location that is missing, a folder, not a metadata file, denied, or
    on a store that cannot be reached; None for other errors."""
    is_dir = os.path.isdir(location.removeprefix("file://"))
    if not location.endswith(".metadata.json") and "version-hint" in str(err) and not is_dir:
        return _not_a_metadata_file(metadata_location)
    if isinstance(err, FileNotFoundError):
        if is_dir:
            return TableLoadError(
                f"METADATA_LOC {metadata_location!r} is a directory: METADATA_LOC must be a table's "
                "metadata.json file (for example .../warehouse/db/table/metadata/00003-....metadata.json)"
            )
        unescaped = unquote(location)
        if location.startswith("file:") and unescaped != location and os.path.isfile(unescaped.removeprefix("file://")):
            # Path.as_uri() writes a space as %20; pyiceberg reads a local URI as it stands.
            return TableLoadError(
                f"METADATA_LOC {metadata_location!r} does not exist as written: pyiceberg does not decode "
                f"percent-escapes in a local path; write it unescaped, {unescaped!r}"
            )
        if is_remote(location):
            # A store answers a missing bucket as it answers a missing key (a HEAD's 404 has no
            # body), and so does an endpoint that is no S3 store at all: name both.
            bucket = location.split("://", 1)[1].split("/", 1)[0]
            variable = endpoint_variable()
            store = f"the object store at {endpoint} ({variable})" if endpoint else "AWS S3"
            return TableLoadError(
                f"METADATA_LOC {metadata_location!r} does not exist on {store}: point it at the table's current "
                f"metadata.json, and check that the bucket {bucket!r} is on that store"
                + (f" and that {variable} names the store itself" if endpoint else "")
            )
        return TableLoadError(
            f"METADATA_LOC {metadata_location!r} does not exist: point it at the table's current "
            "metadata.json (for example s3://bucket/warehouse/db/table/metadata/00003-....metadata.json)"
        )
    not_metadata = _not_table_metadata(err)
    if not_metadata is not None:
        other_service = ""
        if endpoint and is_remote(location) and "Invalid JSON" in not_metadata:
            # Not JSON at all from a store: perhaps no store, but a service that answers every
            # path with a page (MinIO's web console on :9001 beside its S3 API on :9000).
            variable = endpoint_variable()
            other_service = (
                f"; or, if it does, check that {variable} ({endpoint}) names the store's S3 API, not another "
                "service at that host (a web console answers every path with a page)"
            )
        return TableLoadError(
            f"METADATA_LOC {metadata_location!r} is not Iceberg table metadata ({not_metadata}): point it at the "
            "table's current metadata.json, as its catalog reports it (for example "
            ".../warehouse/db/table/metadata/00003-....metadata.json)" + other_service
        )
    if not is_remote(location):
        if isinstance(err, PermissionError):
            return TableLoadError(f"access to METADATA_LOC {metadata_location!r} was denied ({err})")
        return None
    trouble = store_trouble(err, endpoint)
    if trouble is None:
        return None
    return TableLoadError(f"{trouble.problem}, reading METADATA_LOC {metadata_location!r}: {trouble.fix} ({err})")


def _not_table_metadata(err: Exception) -> str | None:
    """What pyiceberg's schema check found wrong with a file that is not table metadata (empty,
    not JSON, or JSON of something else), in one line; None for other errors. Its own message
    is a pydantic report ending in a link to pydantic's docs, which names no fix."""
    from pydantic import ValidationError

    found: BaseException | None = err
    while found is not None and not isinstance(found, ValidationError):
        found = found.__cause__  # pyiceberg raises its own ValidationError from pydantic's
    if found is None:
        return None
    problems = found.errors()
    if not problems:
        return "it does not match the table metadata format"
    first = problems[0]
    loc = [str(part) for part in first.get("loc", ())]
    if loc and loc[0].isdigit():  # the format version the file was checked as: not a field
        loc = loc[1:]
    where = ".".join(loc)
    if first.get("type") == "union_tag_not_found":  # the field that says which format version it is
        return "it has no 'format-version'"
    reason = str(first.get("msg", ""))
    return shown(f"{reason} at {where}" if where else reason)


def _field_estimate(field: pa.Field, rows: int, disk_bytes: int | None) -> int:
    try:
        width = field.type.bit_width
    except ValueError:  # variable width: strings, binaries, lists, structs
        width = None
    if width is not None and width > 0:
        return (rows * width + 7) // 8 + rows // 8
    if pa.types.is_fixed_size_list(field.type):
        inner = _field_estimate(pa.field("item", field.type.value_type), rows * field.type.list_size, None)
        if inner:
            return inner
    if disk_bytes:
        return int(disk_bytes * VARIABLE_WIDTH_EXPANSION) + rows * 4
    return rows * 32  # no statistics: a generous guess per value


def column_leaves(arrow_type: pa.DataType, iceberg_type, field_id: int) -> tuple[list[tuple[int, pa.DataType]], int]:
    """The primitive leaves under a column, as (Iceberg field id, Arrow type), and how many
    list or map levels lie above them (each adds an offsets buffer)."""
    from pyiceberg.types import ListType, MapType, StructType

    if isinstance(iceberg_type, ListType):
        leaves, levels = column_leaves(arrow_type.value_type, iceberg_type.element_type, iceberg_type.element_id)
        return leaves, levels + 1
    if isinstance(iceberg_type, MapType):
        keys, key_levels = column_leaves(arrow_type.key_type, iceberg_type.key_type, iceberg_type.key_id)
        values, value_levels = column_leaves(arrow_type.item_type, iceberg_type.value_type, iceberg_type.value_id)
        return keys + values, key_levels + value_levels + 1
    if isinstance(iceberg_type, StructType):
        found: list[tuple[int, pa.DataType]] = []
        levels = 0
        for arrow_child, child in zip(arrow_type, iceberg_type.fields, strict=True):
            leaves, child_levels = column_leaves(arrow_child.type, child.field_type, child.field_id)
            found += leaves
            levels += child_levels
        return found, levels
    return [(field_id, arrow_type)], 0


def _nested_estimate(
    field: pa.Field, iceberg_field, rows: int, data_file, scale: float, expansions: dict[int, float]
) -> int:
    """Lists, maps and structs: Iceberg keeps statistics per leaf field (a list's element, a
    struct's children), never for the column itself, so the leaves are sized and summed. A
    leaf's entry in ``expansions`` (a footer's floor, expansion.py) raises its estimate only."""
    sizes = data_file.column_sizes or {}
    counts = data_file.value_counts or {}
    leaves, levels = column_leaves(field.type, iceberg_field.field_type, iceberg_field.field_id)
    total = rows // 8 + levels * rows * 4  # the column's validity, and offsets (a lower bound inside lists)
    for leaf_id, leaf_type in leaves:
        # A leaf's value count (a list's elements in all rows) sizes a fixed-width leaf exactly,
        # however well it compressed; strings and binaries go by their on-disk size.
        count = counts.get(leaf_id)
        disk = int(sizes[leaf_id] * scale) if sizes.get(leaf_id) else None
        floor = int(disk * expansions[leaf_id]) if disk and leaf_id in expansions else 0
        if count is not None:
            total += max(floor, _field_estimate(pa.field("leaf", leaf_type), int(count * scale), disk))
        elif disk:
            # No value count (metrics mode none): a list holds an unknown number of values per
            # row, so the decoded size of its on-disk bytes is the floor.
            fixed = pa.types.is_primitive(leaf_type)
            expansion = FIXED_WIDTH_EXPANSION if fixed else VARIABLE_WIDTH_EXPANSION
            guess = _field_estimate(pa.field("leaf", leaf_type), rows, disk)
            total += max(guess, int(disk * expansion), floor)
        else:
            total += rows * 32  # no statistics at all: the generous guess per row
    return total


def _added_after(field: pa.Field, iceberg_field, written_fields: frozenset[int] | None) -> bool:
    """Whether ``field`` was added to the table after a data file was written, so that it reads
    as nulls there: the schema current when the file was added (``written_fields``, its field
    ids; None: not known) had none of its ids."""
    if written_fields is None:
        return False
    ids = [iceberg_field.field_id]
    if pa.types.is_nested(field.type):
        ids += [
            leaf_id for leaf_id, _ in column_leaves(field.type, iceberg_field.field_type, iceberg_field.field_id)[0]
        ]
    return not any(i in written_fields for i in ids)


def _null_column_bytes(t: pa.DataType, rows: int) -> int:
    """The Arrow bytes of ``rows`` nulls of type ``t``: validity, and values or offsets (lists,
    maps, strings and binaries of nulls hold no values; a struct's fields are as long as it is)."""
    validity = (rows + 7) // 8
    if pa.types.is_struct(t):
        return validity + sum(_null_column_bytes(child.type, rows) for child in t)
    if pa.types.is_fixed_size_list(t):
        return validity + _null_column_bytes(t.value_type, rows * t.list_size)
    try:
        width = t.bit_width
    except ValueError:  # variable width
        width = None
    if width:
        return validity + (rows * width + 7) // 8
    large = pa.types.is_large_string(t) or pa.types.is_large_binary(t) or pa.types.is_large_list(t)
    return validity + (8 if large else 4) * (rows + 1)


def written_fields(table, tasks: dict) -> dict[str, frozenset[int]]:
    """Data file path -> the field ids of the table's schema when the snapshot that added the file
    was committed (a file holds no column added after that), for the files that have no size for
    some column of the current schema; files whose snapshot is gone, or records no schema, are
    left out. By snapshot, not by which columns a file has sizes for: Java's Iceberg records no
    size for a column in metrics mode none (the default past a table's first 100 columns), stored
    or not, nor after the mode is switched to none."""
    from pyiceberg.manifest import ManifestContent

    leaves = _leaf_field_ids(table)  # what has sizes
    unsized = {path for path, task in tasks.items() if not leaves <= set(task.file.column_sizes or {})}
    snapshot = table.current_snapshot()
    if not unsized or snapshot is None:
        return {}
    fields = {schema_id: frozenset(s.field_ids) for schema_id, s in table.schemas().items()}
    # Each snapshot's schema, looked up once (snapshot_by_id scans the snapshot list).
    by_snapshot = {s.snapshot_id: fields[s.schema_id] for s in table.snapshots() if s.schema_id in fields}
    found: dict[str, frozenset[int]] = {}
    for manifest in snapshot.manifests(table.io):
        if manifest.content != ManifestContent.DATA:
            continue
        for entry in manifest.fetch_manifest_entry(table.io):
            path = entry.data_file.file_path
            if path in unsized and entry.snapshot_id in by_snapshot:
                found[path] = by_snapshot[entry.snapshot_id]
    return found


def estimate_column_bytes(
    data_file,
    schema: pa.Schema,
    iceberg_fields: list,
    rows: int,
    expansions: dict[int, float] | None = None,
    written: frozenset[int] | None = None,
) -> tuple[int, ...]:
    """Arrow bytes of each column of a file's rows, from manifest statistics (no data is read).

    ``rows`` may be fewer than the file holds (positional deletes); per-file statistics are scaled.
    ``expansions``: measured decoded bytes per on-disk byte by field id (expansion.py): for a
    top-level string or binary column, in place of VARIABLE_WIDTH_EXPANSION; for a leaf inside a
    nested column, a floor under its estimate.
    ``written``: the file's written_fields, for telling the columns added after it was written
    (None: a column the file has no size for is sized as values without statistics).
    """
    expansions = expansions or {}
    sizes = data_file.column_sizes or {}
    scale = rows / data_file.record_count if data_file.record_count else 1.0
    estimates = []
    for field, iceberg_field in zip(schema, iceberg_fields, strict=True):
        if _added_after(field, iceberg_field, written):
            # It reads as nulls in this file. Sized as values with no statistics (32 bytes a row),
            # 8 string columns added to a 400,000-row table were estimated 7.5x what a node held,
            # and a table that fits was refused.
            estimate = _null_column_bytes(field.type, rows)
        elif pa.types.is_nested(field.type):
            estimate = _nested_estimate(field, iceberg_field, rows, data_file, scale, expansions)
        else:
            disk = sizes.get(iceberg_field.field_id)
            measured = expansions.get(iceberg_field.field_id)
            if disk and measured is not None:  # offsets and validity are in the measured bytes
                estimate = int(disk * scale * measured)
            else:
                estimate = _field_estimate(field, rows, int(disk * scale) if disk else None)
        estimates.append(int(estimate * ARROW_OVERHEAD))
    return tuple(estimates)


def _refuse_equality_deletes(table, snapshot) -> None:
    """Refuse equality deletes that may apply to a live row; pyiceberg's planner fails on them
    with a bare ValueError.

    An equality delete applies only to data files with a lower data sequence number (the Iceberg
    spec), so one no newer than the oldest live data file deletes nothing: what a rewrite of the
    data files leaves behind (Spark's rewrite_data_files keeps such deletes in the snapshot unless
    told to remove them). Those are not refused here; pyiceberg's planner skips the ones older than
    every data file and refuses the rest (scan_tasks says how to remove them)."""
    from pyiceberg.manifest import DataFileContent, ManifestContent

    manifests = snapshot.manifests(table.io)
    data = [m.min_sequence_number or 0 for m in manifests if m.content == ManifestContent.DATA]
    oldest_data = min(data, default=0)
    for manifest in manifests:
        if manifest.content != ManifestContent.DELETES:
            continue
        for entry in manifest.fetch_manifest_entry(table.io):
            if entry.data_file.content != DataFileContent.EQUALITY_DELETES:
                continue
            if entry.sequence_number is not None and entry.sequence_number <= oldest_data:
                continue  # older than every live data file: it deletes nothing
            raise UnsupportedTableError(
                f"the table has equality deletes (delete file {entry.data_file.file_path}), which the cache "
                "cannot apply exactly; compact the table (rewrite data files) and point METADATA_LOC at the "
                "new metadata"
            )


def _reader_type(t: pa.DataType) -> pa.DataType:
    """32-bit offsets where schema_to_pyarrow says large: what pyiceberg's reader yields for
    most files (it keeps a file's own Arrow types, and Parquet decodes to 32-bit offsets unless
    the file's stored Arrow schema says large), so most batches load without a cast. Batches of
    files stored with large types (pyiceberg's writer does this for some binary, list and map
    columns) are cast at load, which rewrites their offsets only."""
    if pa.types.is_large_string(t):
        return pa.string()
    if pa.types.is_large_binary(t):
        return pa.binary()
    if pa.types.is_large_list(t) or pa.types.is_list(t):
        return pa.list_(t.value_field.with_type(_reader_type(t.value_type)))
    if pa.types.is_fixed_size_list(t):
        return pa.list_(t.value_field.with_type(_reader_type(t.value_type)), t.list_size)
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_reader_type(f.type)) for f in t])
    if pa.types.is_map(t):
        return pa.map_(_reader_type(t.key_type), t.item_field.with_type(_reader_type(t.item_type)))
    return t


def arrow_schema(table) -> pa.Schema:
    """The table's Arrow schema as the reader yields it, refusing column names the cache reserves."""
    from pyiceberg.io.pyarrow import schema_to_pyarrow

    iceberg = schema_to_pyarrow(table.schema(), include_field_ids=False)
    schema = pa.schema([f.with_type(_reader_type(f.type)) for f in iceberg], metadata=iceberg.metadata)
    clashing = [name for name in schema.names if name.startswith(INTERNAL_COLUMN_PREFIX)]
    if clashing:
        raise UnsupportedTableError(
            f"column(s) {clashing} start with {INTERNAL_COLUMN_PREFIX!r}, which the cache reserves for its "
            "own bookkeeping: rename them in the table (ALTER TABLE ... RENAME COLUMN)"
        )
    return schema


def scan_tasks(table, metadata_location: str) -> dict[str, Any]:
    """The current snapshot's scan tasks by data file path, in path order (no data is read)."""
    snapshot = table.current_snapshot()
    if snapshot is None:
        return {}
    try:
        _refuse_equality_deletes(table, snapshot)
        planned = sorted(table.scan().plan_files(), key=lambda t: t.file.file_path)
    except UnsupportedTableError:
        raise
    except Exception as err:
        if isinstance(err, ValueError) and "equality deletes" in str(err):
            # Only equality deletes that apply to nothing got here (above), in a delete manifest that
            # pyiceberg still reads: one as new as the oldest data file (Spark's rewrite_data_files
            # keeps its starting sequence number by default) or rewritten after the data was.
            raise UnsupportedTableError(
                "the table's equality delete files delete no live row (none is newer than the oldest data file), "
                "but pyiceberg, which plans the cache's scan, still reads them and refuses to plan the snapshot: "
                "remove them (Spark: rewrite_data_files with the option remove-dangling-deletes=true) and point "
                "METADATA_LOC at the new metadata"
            ) from err
        if isinstance(err, FileNotFoundError):
            # A manifest list or manifest the metadata names is gone: its snapshot expired and
            # its files were removed, or METADATA_LOC is an old metadata.json.
            raise TableLoadError(
                f"cannot plan a scan of {metadata_location!r}: a manifest it names is gone ({err}): a "
                "snapshot expiry or orphan-file cleanup may have removed it, or METADATA_LOC names an older "
                "metadata.json than the table's current one: point METADATA_LOC at the current metadata.json"
            ) from err
        # The manifest list and manifests are read from the store the metadata and data files are:
        # its troubles (throttling, denied access, a stall) are named as for those.
        trouble = store_trouble(err, table.io.properties.get("s3.endpoint")) if is_remote(metadata_location) else None
        if trouble is not None:
            raise TableLoadError(
                f"cannot plan a scan of {metadata_location!r}: reading its manifests, {trouble.problem}: "
                f"{trouble.fix} ({err})"
            ) from err
        raise TableLoadError(f"cannot plan a scan of {metadata_location!r}: {err}") from err
    listed = Counter(task.file.file_path for task in planned)
    if twice := sorted(path for path, n in listed.items() if n > 1):
        # Added again with duplicate checks off (add_files(..., check_duplicate_files=False)):
        # readers read such a file once per entry, and the cache, keyed by path, served it once.
        raise UnsupportedTableError(
            f"data file {twice[0]} is listed {listed[twice[0]]} times in the snapshot"
            + (f" ({len(twice)} such files)" if len(twice) > 1 else "")
            + ", so readers read its rows that many times; the cache holds each file once and "
            "refuses rather than serve other rows: remove the extra entries (rewrite the table's "
            "data files) and point METADATA_LOC at the new metadata"
        )
    for task in planned:
        if any(d.content.name == "EQUALITY_DELETES" for d in task.delete_files or set()):
            raise UnsupportedTableError(
                f"data file {task.file.file_path} has equality deletes, which the cache cannot apply "
                "exactly; compact the table (rewrite data files) and point METADATA_LOC at the new metadata"
            )
    return {task.file.file_path: task for task in planned}


def file_read_error(path: str, err: Exception, endpoint: str | None, described: str | None = None) -> str:
    """Why a table's file (``described``, by default "data file <path>") could not be read, and
    what to fix where that is known."""
    described = described or f"data file {path}"
    trouble = store_trouble(err, endpoint) if is_remote(path) else None
    if trouble is not None:
        return f"cannot read {described}: {trouble.problem}: {trouble.fix} ({err})"
    # A file found at planning (HEAD) but gone by its GET is the S3 client's NO_SUCH_KEY, no
    # FileNotFoundError: the same cause.
    if isinstance(err, FileNotFoundError) or "NO_SUCH_KEY" in str(err):
        # The metadata was read moments ago and names it: the file went after the table was
        # written (an expired snapshot's files, an orphan-file cleanup), or METADATA_LOC is old.
        return (
            f"cannot read {described}: it is gone, though the table's metadata names it ({err}): a "
            "snapshot expiry or orphan-file cleanup may have removed it, or METADATA_LOC names an older "
            "metadata.json than the table's current one: point METADATA_LOC at the current metadata.json"
        )
    return f"cannot read {described}: {err}"


def _rows_after_deletes(table, task) -> int:
    """``rows_after_deletes``, a failure named as the delete files' (it was a bare
    FileNotFoundError, without the fix a missing data file's message gives)."""
    try:
        return rows_after_deletes(table, task)
    except Exception as err:
        deletes = sorted(d.file_path for d in task.delete_files)
        described = f"the positional delete file(s) {', '.join(deletes)} of data file {task.file.file_path}"
        raise TableLoadError(
            file_read_error(deletes[0], err, table.io.properties.get("s3.endpoint"), described)
        ) from err


def plan_table(table, metadata_location: str) -> tuple[TablePlan, dict[str, Any]]:
    """Plan the current snapshot: exact rows per file (after positional deletes) and their
    estimated Arrow size. Returns the plan and the scan tasks by file path."""
    schema = arrow_schema(table)
    iceberg_fields = list(table.schema().fields)
    tasks = scan_tasks(table, metadata_location)
    expansions = measure_expansions(table, tasks, schema, iceberg_fields, ceiling=VARIABLE_WIDTH_EXPANSION)
    written = written_fields(table, tasks)
    # Only where every row is one size is a batch of a known row count a known size.
    leaves, rows_one_size = _leaf_field_ids(table), not any(varies(field.type) for field in schema)
    files: list[FilePlan] = []
    for path, task in tasks.items():
        deletes = task.delete_files or set()
        rows = _rows_after_deletes(table, task) if deletes else task.file.record_count
        columns = estimate_column_bytes(task.file, schema, iceberg_fields, rows, expansions, written.get(path))
        files.append(
            FilePlan(
                path,
                rows,
                columns,
                bool(deletes),
                max(1, len(task.file.split_offsets or ())),
                batchwise_window(task.file, leaves, sum(columns), rows_one_size),
            )
        )
    snapshot = table.current_snapshot()
    plan = TablePlan(metadata_location, snapshot.snapshot_id if snapshot else None, schema, tuple(files), expansions)
    log.info("planned %d file(s), %d row(s), about %d MiB in memory", len(files), plan.rows, plan.estimated_bytes >> 20)
    if snapshot is None:
        # Served as an empty table, as it is; but a table's first metadata file (00000-...,
        # written before its first commit) is an easy METADATA_LOC to give by mistake.
        log.warning(
            "the table at %s has no snapshot, so the cache serves no rows: if it should have some, point "
            "METADATA_LOC at its current metadata.json (the one its catalog reports, the latest written)",
            metadata_location,
        )
    elif not plan.rows:
        log.warning("the table's current snapshot (%d) holds no rows, so the cache serves none", snapshot.snapshot_id)
    return plan, tasks


# assign_rows splits the rows by their estimated bytes instead of their count where that makes
# the fullest node at least this much smaller: never for rows of one size (the common case, where
# an even split is what readers and operators expect), always where a file of large rows would
# otherwise land on one node.
BYTE_SPLIT_GAIN = 0.10


def assign_rows(plan: TablePlan, data_nodes: int) -> list[NodeAssignment]:
    """Split the table's rows (not its files) into ``data_nodes`` contiguous ranges: of near-equal
    row counts, or of near-equal estimated bytes where rows differ in size across files.

    An even split of 1M short rows and 1,000 images of 1 MiB put every image on the last node:
    a table that fits 2 nodes by its bytes was refused, advising 1,501 nodes. Split by bytes
    (rows of a file taken as alike), each node holds about half."""
    total = plan.rows
    even = [node * total // data_nodes for node in range(data_nodes + 1)]
    bounds = even
    cumulative = _cumulative_bytes(plan)
    by_bytes = _byte_bounds(plan, data_nodes, cumulative)
    if by_bytes is not None and _fullest(plan, by_bytes, cumulative) < (1 - BYTE_SPLIT_GAIN) * _fullest(
        plan, even, cumulative
    ):
        bounds = by_bytes
    starts = plan.file_starts
    assignments = []
    for node in range(data_nodes):
        lo, hi = bounds[node], bounds[node + 1]
        pieces = []
        # From the last file starting at or before lo (each node visits only its own files).
        for i in range(max(0, bisect.bisect_right(starts, lo) - 1), len(plan.files)):
            f, file_start = plan.files[i], starts[i]
            if file_start >= hi:
                break
            a, b = max(lo, file_start), min(hi, file_start + f.rows)
            if a < b:
                pieces.append(Piece(f.path, a - file_start, b - file_start, f.rows))
        assignments.append(NodeAssignment(node, lo, hi, tuple(pieces)))
    return _with_empty_files(plan, assignments)


def _cumulative_bytes(plan: TablePlan) -> list[int]:
    """Estimated bytes of the files before each file, and of all of them (len(files) + 1)."""
    out = [0]
    for f in plan.files:
        out.append(out[-1] + f.estimated_bytes)
    return out


def _bytes_before(plan: TablePlan, row: int, cumulative: list[int]) -> float:
    """Estimated bytes of the table's rows before global row ``row`` (a file's rows taken as alike)."""
    i = max(0, bisect.bisect_right(plan.file_starts, row) - 1)
    while i < len(plan.files) and plan.files[i].rows == 0:
        i += 1
    if i >= len(plan.files):
        return float(cumulative[-1])
    f = plan.files[i]
    return cumulative[i] + f.estimated_bytes * (row - plan.file_starts[i]) / f.rows


def _fullest(plan: TablePlan, bounds: list[int], cumulative: list[int]) -> float:
    """The estimated bytes of the fullest of the ranges between ``bounds``."""
    before = [_bytes_before(plan, row, cumulative) for row in bounds]
    return max(b - a for a, b in itertools.pairwise(before))


def _byte_bounds(plan: TablePlan, data_nodes: int, cumulative: list[int]) -> list[int] | None:
    """Global row bounds of ``data_nodes`` ranges of near-equal estimated bytes; None where the
    files have no size estimate to split by."""
    if cumulative[-1] <= 0 or plan.rows == 0:
        return None
    bounds = [0]
    i = 0
    for node in range(1, data_nodes):
        target = cumulative[-1] * node / data_nodes
        while i < len(plan.files) - 1 and cumulative[i + 1] <= target:
            i += 1
        f = plan.files[i]
        within = 0 if f.estimated_bytes <= 0 else round(f.rows * (target - cumulative[i]) / f.estimated_bytes)
        bounds.append(max(bounds[-1], min(plan.rows, plan.file_starts[i] + max(0, min(f.rows, within)))))
    bounds.append(plan.rows)
    return bounds


def _with_empty_files(plan: TablePlan, assignments: list[NodeAssignment]) -> list[NodeAssignment]:
    """Give each file planned at no rows (every row deleted, or none counted) to one node as an
    empty piece that ends the file: the node reads it to its end, as it reads every file's tail,
    and fails the load on a row the plan did not count. Unread, such a file's uncounted rows
    (a wrong record_count, a file rewritten after its commit) were left out without a word. The
    node whose rows the file sits among takes it, else the last."""
    empty = [(start, f) for f, start in zip(plan.files, plan.file_starts, strict=True) if f.rows == 0]
    if not empty or not assignments:
        return assignments
    extra: dict[int, list[Piece]] = {}
    for start, f in empty:
        owner = next((a.node for a in assignments if a.global_start <= start < a.global_stop), assignments[-1].node)
        extra.setdefault(owner, []).append(Piece(f.path, 0, 0, 0))
    return [replace(a, pieces=(*a.pieces, *extra.get(a.node, ()))) for a in assignments]


def _node_column_bytes(plan: TablePlan, assignment: NodeAssignment) -> list[int]:
    by_path = plan.files_by_path
    columns = [0] * len(plan.schema)
    for piece in assignment.pieces:
        f = by_path[piece.path]
        for i, nbytes in enumerate(f.column_bytes):
            columns[i] += nbytes * (piece.stop - piece.start) // max(f.rows, 1)
    return columns


def estimated_node_memory(plan: TablePlan, assignment: NodeAssignment, load_threads: int = 1) -> tuple[int, int]:
    """The node's rows in memory once loaded, and the most it holds while loading. Two moments
    can make the peak, one after the other (store.NodeStore.load):

    - reading: each of ``load_threads`` readers (at most one per piece) decodes one piece, a
      row group or a read-ahead window at a time (a batch and its row group's compressed chunks
      for a file read batch by batch: decode_window), holding compressed chunks and page buffers
      beside the rows it yields (READ_SCRATCH_FACTOR, READ_AHEAD_BYTES), and its decode threads'
      buffers (READ_FIXED_BYTES). The load's DecodeBudget keeps what is in decode
      at once within READ_SCRATCH_SHARE of the node's rows, plus one column group per reader
      of at least READ_GROUP_MIN_BYTES (a row group's worth, where that is less) once that
      share is spent: whichever of the two models is smaller bounds it;
    - the read batches' arrays each hold a little beside their values until the merge
      (LOAD_ARRAY_OVERHEAD_BYTES): a load of many small files holds far more than its rows;
    - merging the read batches copies a column at a time into its merged buffers, releasing each
      source chunk once copied (column_concat): one read batch's column exists twice, a row
      group's or a batch's share of the largest column of the rows kept (merge_chunk_bytes); a
      type column_concat does not copy (a dictionary, say) is merged by pyarrow and exists twice
      whole (capped at 1 GiB where chunks are split).
    """
    columns = _node_column_bytes(plan, assignment)
    by_path = plan.files_by_path
    in_decode = []  # per piece: the most of its file in decode at once
    largest_chunk = largest_group = 0
    for p in assignment.pieces:
        # The reader decodes its file from the start and a window ahead of the rows it hands
        # out, however few of them the piece keeps: the file's size bounds it, not the piece's.
        f = by_path[p.path]
        in_decode.append(decode_window(f))
        largest_chunk = max(largest_chunk, merge_chunk_bytes(f, p.stop - p.start))
        # A column is never split: one larger than the group limit is a group of its own.
        least = READ_GROUP_MIN_REMOTE_BYTES if is_remote(p.path) else READ_GROUP_MIN_BYTES
        largest_group = max(largest_group, min(in_decode[-1], max(least, *f.column_bytes, 0)))
    merged_whole = [
        min(nbytes, STORE_CHUNK_VARIABLE_BYTES)
        for field, nbytes in zip(plan.schema, columns, strict=True)
        if not copies(field.type)
    ]
    in_decode.sort(reverse=True)
    readers = max(1, min(load_threads, len(in_decode)))  # a piece is one reader's
    loaded = sum(columns)
    whole_files = sum(in_decode[:readers])
    budgeted = READ_SCRATCH_SHARE * loaded + readers * largest_group
    reading = int(READ_SCRATCH_FACTOR * min(whole_files, budgeted)) + readers * READ_FIXED_BYTES
    held = LOAD_ARRAY_OVERHEAD_BYTES * _read_arrays(plan, assignment)
    return loaded, loaded + held + max(largest_chunk, *merged_whole, reading)


def _read_arrays(plan: TablePlan, assignment: NodeAssignment) -> int:
    """How many Arrow arrays the read batches of ``assignment`` hold until they are merged: a
    batch per row group kept from, or per SCAN_BATCH_ROWS rows where that is more, of every
    column (and of every child of a nested one)."""
    per_batch = sum(_arrays_in(field.type) for field in plan.schema)
    by_path = plan.files_by_path
    batches = 0
    for p in assignment.pieces:
        f, rows = by_path[p.path], p.stop - p.start
        groups = -(-f.row_groups * rows // max(1, f.rows))
        batches += max(1, -(-rows // SCAN_BATCH_ROWS), groups)
    return batches * per_batch


def _arrays_in(t: pa.DataType) -> int:
    """Arrow arrays in one column of type ``t``: itself and its children's."""
    return 1 + sum(_arrays_in(t.field(i).type) for i in range(t.num_fields))
