"""How many decoded Arrow bytes a table's string and binary columns take per byte on disk, measured.

Manifests hold each column's compressed size, not its decoded one. The fixed factor the estimate
used alone (plan.VARIABLE_WIDTH_EXPANSION, 4) put random bytes (UUIDs, hashes, JPEGs), which
decode to about their size on disk, at 4x: a 30 MiB table of them was refused ("use at least 41
data nodes"). So the head decodes the first SAMPLE_ROWS rows (at most SAMPLE_MAX_BYTES of them on
disk) of those columns from one data file, the largest, and sizes every file's column by the
ratio it finds; a column whose dictionary page is too large to read is sized by its own
uncompressed and compressed sizes. The ratios go to the data nodes
with their load (node.LoadOrder.expansions), so the head's fit check and the nodes' decode
budgets use the same estimates.

A sampled ratio only lowers the fixed factor, never raises it. One file does not speak for
every file: a sampled file of one repeated label, or of nulls (whose offsets decode to 4 bytes a
row from almost nothing), measured 500-2700x, and an estimate that high refuses a table that
fits, with no way past it; an estimate too low is caught by the load's memory guard, which stops
a load that decodes larger than it fits, with the reason. A sample of under MIN_SAMPLE_BYTES on
disk (page headers and the dictionary weigh too much in it) measures nothing. What raises an
estimate past the fixed factor is the files' footers (footer_floors.py): their uncompressed
sizes are a floor under what a column decodes to, which a file of labels or nulls cannot inflate.

Only top-level string and binary columns are sampled: their Arrow size is what the sample
shows. Nested columns keep the manifest-based guess (plan._nested_estimate), raised by their
leaves' footer floors, as does every column where the sample cannot be read.
"""

from __future__ import annotations

import logging
import time

import pyarrow as pa

from kubeflow_data_cache.constants import MAX_EXPANSION
from kubeflow_data_cache.daemon_call import DaemonCall
from kubeflow_data_cache.footer_floors import footer_expansions, parquet_field_id
from kubeflow_data_cache.offsets import is_string_or_binary

log = logging.getLogger(__name__)

# Rows decoded per column: enough to average out short runs...
SAMPLE_ROWS = 8192
# ... and at most this many bytes of the sampled columns on disk: 8,192 rows of 512 KiB images
# would decode 4 GiB on the head.
SAMPLE_MAX_BYTES = 8 << 20
# A column chunk whose dictionary page is larger than this is not decoded: the page is read whole
# before the first row, and pyarrow's writer (pyiceberg's) grows a dictionary for a whole write
# batch before it falls back (600 distinct 512 KiB images made a 300 MiB page, and sampling it
# took the head to 1.3 GiB). Its ratio comes from the chunk's own sizes instead (below).
SAMPLE_MAX_DICTIONARY_BYTES = 8 << 20
# Nor one whose dictionary may decode past this: the page's compressed size says little of it (31
# zero-padded 16 MiB values made a 16 KiB page of 496 MiB, and the head reached 1.1 GiB). The
# chunk's uncompressed size, dictionary and data pages together, bounds it.
SAMPLE_MAX_DICTIONARY_DECODED_BYTES = 64 << 20
# Rows decoded at a time, until the sample holds SAMPLE_ROWS rows or SAMPLE_MAX_BYTES decoded:
# sized by bytes on disk alone, a dictionary-encoded column of large repeated values decoded its
# whole 8,192 rows (96 KiB each took the head to 1.2 GiB; 512 KiB would have taken 8 GiB).
SAMPLE_STEP_ROWS = 64
# Read the sampled pages as they are needed, not the whole row group's column chunks (on S3 a
# row group can be hundreds of MiB).
SAMPLE_BUFFER_BYTES = 1 << 20
# Compressed bytes the sampled rows of a column must span to say anything (see above).
MIN_SAMPLE_BYTES = 16 << 10
# Columns decoded by one reader: each holds its read buffer, its dictionary page and a page of
# its own (1.6-2.5 MiB a column), so one reader over a table's 1,000 string columns took the head
# to 2.6 GB while planning. In groups of this many, one group at a time.
SAMPLE_COLUMNS_AT_ONCE = 32
# A decoded string column is not smaller than its compressed pages.
MIN_EXPANSION = 1.0
# How long planning waits for the sample: a file whose read stalls must hold the cache's
# formation no longer than this (the data node that reads it later names it, load_progress.py).
SAMPLE_TIMEOUT_SECONDS = 5.0


def measured(field: pa.Field) -> bool:
    """Whether ``field``'s expansion is measured: top-level strings and binaries."""
    return is_string_or_binary(field.type)


def measure_expansions(table, tasks: dict, schema: pa.Schema, iceberg_fields: list, ceiling: float) -> dict[int, float]:
    """Iceberg field id -> decoded Arrow bytes per compressed byte. A top-level string or binary
    column's is its sample's, at most ``ceiling`` (the fixed factor); a column is left out where
    its sample is too small, and all are where the sample cannot be read. Then any string or
    binary leaf, at any depth, whose files' footers say it is larger (footer_floors.py) takes
    their floor instead, past ``ceiling`` too: the only way an entry raises an estimate."""
    wanted = {f.field_id: field.name for field, f in zip(schema, iceberg_fields, strict=True) if measured(field)}
    # The largest file (the first by path among equals): the most rows behind its first pages.
    candidates = [t for t in tasks.values() if t.file.record_count > 0]
    sample = min(candidates, key=lambda t: (-t.file.file_size_in_bytes, t.file.file_path), default=None)
    call, path = None, sample.file.file_path if sample is not None else ""
    if wanted and sample is not None:
        call = DaemonCall(lambda: _measure(table, path, wanted), "sample")
    started = time.monotonic()
    # Read while the sample decodes: planning waits for the slower of the two, not their sum.
    floors = footer_expansions(table, tasks, string_leaf_ids(schema, iceberg_fields))
    ratios = _sampled(call, path, SAMPLE_TIMEOUT_SECONDS - (time.monotonic() - started)) if call else {}
    ratios = {k: min(ceiling, v) for k, v in ratios.items()}
    for field_id, floor in floors.items():
        if floor > ratios.get(field_id, ceiling):
            ratios[field_id] = min(floor, MAX_EXPANSION)
    return ratios


def _sampled(call: DaemonCall, path: str, seconds: float) -> dict[int, float]:
    if not call.wait(seconds):
        log.info(
            "sampling %s for column sizes took over %gs; estimating them from the manifests",
            path,
            SAMPLE_TIMEOUT_SECONDS,
        )
        return {}
    try:
        return call.result()
    except Exception as err:  # a sample is an estimate's input: the fixed factor applies instead
        log.info("could not sample %s for column sizes (%s); estimating them from the manifests", path, err)
        return {}


def string_leaf_ids(schema: pa.Schema, iceberg_fields: list) -> set[int]:
    """The field ids of the string and binary leaves of ``schema``'s columns, at any depth."""
    # Imported here: plan imports this module at its top.
    from kubeflow_data_cache.plan import column_leaves

    return {
        leaf_id
        for field, iceberg_field in zip(schema, iceberg_fields, strict=True)
        for leaf_id, leaf_type in column_leaves(field.type, iceberg_field.field_type, iceberg_field.field_id)[0]
        if is_string_or_binary(leaf_type)
    }


def _measure(table, path: str, wanted: dict[int, str]) -> dict[int, float]:
    try:
        return _measure_file(table, path, wanted)
    finally:
        # What the sample decoded goes back to the system: pyarrow's pool keeps freed pages for
        # reuse, and the head held them for its whole life.
        pa.default_memory_pool().release_unused()


def _measure_file(table, path: str, wanted: dict[int, str]) -> dict[int, float]:
    # Imported here: pyarrow.parquet brings in pyarrow.fs, whose S3 client reads SSL_CERT_FILE once,
    # when first imported, and plan.py is imported before s3_settings.trust_aws_ca_bundle sets it.
    import pyarrow.parquet as pq

    with table.io.new_input(path).open() as raw:
        parquet = pq.ParquetFile(raw, buffer_size=SAMPLE_BUFFER_BYTES, pre_buffer=False)
        by_id = _columns_by_field_id(parquet.schema_arrow, wanted)
        if not by_id or parquet.metadata.num_row_groups == 0:
            return {}
        group = parquet.metadata.row_group(0)
        if group.num_rows == 0:
            return {}
        chunks = {group.column(j).path_in_schema: group.column(j) for j in range(group.num_columns)}
        present = {name for name in by_id.values() if name in chunks}
        by_sizes = {name for name in present if _large_dictionary(chunks[name])}
        names = _worth_sampling(sorted(present - by_sizes), chunks, group.num_rows)
        decoded: dict[str, int] = {}
        sampled_rows: dict[str, int] = {}
        for start in range(0, len(names), SAMPLE_COLUMNS_AT_ONCE):
            part = names[start : start + SAMPLE_COLUMNS_AT_ONCE]
            rows, sizes = _sample_columns(parquet, part, chunks, group.num_rows)
            decoded |= sizes
            sampled_rows |= dict.fromkeys(part, rows)
    ratios = {}
    for field_id, name in by_id.items():
        chunk = chunks.get(name)
        if name in by_sizes:
            # Values that fill a dictionary that large are mostly distinct: they decode to about
            # the dictionary's uncompressed size, and an offset each.
            ratios[field_id] = max(
                MIN_EXPANSION, (chunk.total_uncompressed_size + 4 * group.num_rows) / chunk.total_compressed_size
            )
            continue
        rows = sampled_rows.get(name, 0)
        on_disk = chunk.total_compressed_size * rows / group.num_rows if chunk is not None else 0
        if on_disk >= MIN_SAMPLE_BYTES:
            ratios[field_id] = max(MIN_EXPANSION, decoded[name] / on_disk)
    return ratios


def _sample_rows(names: list[str], chunks: dict, group_rows: int) -> int:
    """Rows to decode of ``names`` together: SAMPLE_ROWS, or fewer where they take more than
    SAMPLE_MAX_BYTES by the larger of their compressed and uncompressed sizes (values that
    compress well decode far past their bytes on disk)."""
    row_bytes = sum(_chunk_bytes(chunks[name]) for name in names) / group_rows
    return max(1, min(SAMPLE_ROWS, group_rows, int(SAMPLE_MAX_BYTES / max(row_bytes, 1e-9))))


def _worth_sampling(names: list[str], chunks: dict, group_rows: int) -> list[str]:
    """The columns whose sampled rows could span MIN_SAMPLE_BYTES on disk, sampled alone (the
    most rows they can get), decided before decoding any: a column that cannot measures nothing,
    and its reader's buffers were the head's memory for nothing."""
    return [
        name
        for name in names
        if chunks[name].total_compressed_size * _sample_rows([name], chunks, group_rows) / group_rows
        >= MIN_SAMPLE_BYTES
    ]


def _sample_columns(parquet, names: list[str], chunks: dict, group_rows: int) -> tuple[int, dict[str, int]]:
    """Rows decoded of ``names`` from the first row group, and each column's decoded bytes."""
    rows = _sample_rows(names, chunks, group_rows)
    # The first row, decoded alone, bounds the rows by bytes decoded before a step of
    # SAMPLE_STEP_ROWS decodes them: one 16 MiB value in every row took 64 at once, 1 GiB.
    first = next(parquet.iter_batches(batch_size=1, row_groups=[0], columns=names, use_threads=False))
    rows = max(1, min(rows, SAMPLE_MAX_BYTES // max(first.nbytes, 1)))
    decoded, sampled_rows = dict.fromkeys(names, 0), 0
    steps = parquet.iter_batches(
        batch_size=min(rows, SAMPLE_STEP_ROWS), row_groups=[0], columns=names, use_threads=False
    )
    for part in steps:
        sampled_rows += part.num_rows
        for name in names:
            decoded[name] += part.column(name).nbytes
        if sampled_rows >= rows or sum(decoded.values()) >= SAMPLE_MAX_BYTES:
            break
    return sampled_rows, decoded


def _chunk_bytes(chunk) -> int:
    return max(chunk.total_compressed_size, chunk.total_uncompressed_size)


def _large_dictionary(chunk) -> bool:
    """Whether ``chunk``'s dictionary page is too large to decode on the head: on disk, or as far
    as the chunk's uncompressed size can tell."""
    page = _dictionary_page_bytes(chunk)
    return page > SAMPLE_MAX_DICTIONARY_BYTES or (
        page > 0 and chunk.total_uncompressed_size > SAMPLE_MAX_DICTIONARY_DECODED_BYTES
    )


def _dictionary_page_bytes(chunk) -> int:
    """The compressed size of a column chunk's dictionary page (0: it has none). Older Parquet
    writers leave the page's offset out of the metadata (parquet-mr's dictionary at offset 0):
    for a chunk whose encodings say it has one, its whole size bounds it."""
    if chunk.has_dictionary_page and chunk.dictionary_page_offset is not None:
        return max(0, chunk.data_page_offset - chunk.dictionary_page_offset)
    if any("DICTIONARY" in encoding for encoding in chunk.encodings or ()):
        return _chunk_bytes(chunk)
    return 0


def _columns_by_field_id(schema: pa.Schema, wanted: dict[int, str]) -> dict[int, str]:
    """The file's top-level column name of each wanted field id (files may name them otherwise)."""
    found = {}
    for field in schema:
        field_id = parquet_field_id(field)
        if field_id in wanted and measured(field):
            found[field_id] = field.name
    return found
