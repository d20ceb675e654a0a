"""How many decoded Arrow bytes a table's string and binary columns take per byte on disk, measured.

Manifests hold each column's compressed size, not its decoded one, and no fixed factor fits:
random bytes (UUIDs, hashes, JPEGs) decode to about their size on disk, so a factor of 4 refused a
30 MiB table of them ("use at least 41 data nodes"), while dictionary-encoded labels decode to 8x
and more. So the head decodes the first SAMPLE_ROWS rows of those columns from one data file, the
first in path order that holds rows, and sizes every file's column by the ratio it finds. The
ratios go to the data nodes with their load (node.LoadOrder.expansions), so the head's fit check
and the nodes' decode budgets use the same estimates.

Only top-level string and binary columns are measured: their Arrow size is what the sample
shows. Nested columns keep the manifest-based guess (plan._nested_estimate). Where the sample
cannot be read the fixed factor applies, and the load's memory guard still stops a load that
decodes larger than it fits.
"""

from __future__ import annotations

import logging

import pyarrow as pa

log = logging.getLogger(__name__)

# Rows decoded per column: enough to average out short runs, a few MiB at most for long values.
SAMPLE_ROWS = 8192
# Read the sampled pages as they are needed, not the whole row group's column chunks (on S3 a
# row group can be hundreds of MiB).
SAMPLE_BUFFER_BYTES = 1 << 20
# A decoded string column is not smaller than its compressed pages; below this the sample held
# almost nothing (all nulls, say) and says nothing.
MIN_EXPANSION = 1.0


def measured(field: pa.Field) -> bool:
    """Whether ``field``'s expansion is measured: top-level strings and binaries."""
    t = field.type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)


def measure_expansions(table, tasks: dict, schema: pa.Schema, iceberg_fields: list) -> dict[int, float]:
    """Iceberg field id -> decoded Arrow bytes per compressed byte, for the measured columns of
    ``schema`` (with their ``iceberg_fields``); empty where there is nothing to measure or the
    sample cannot be read."""
    wanted = {f.field_id: field.name for field, f in zip(schema, iceberg_fields, strict=True) if measured(field)}
    sample = next((t for _, t in sorted(tasks.items()) if t.file.record_count > 0), None)
    if not wanted or sample is None:
        return {}
    try:
        return _measure(table, sample.file.file_path, wanted)
    except Exception as err:  # a sample is an estimate's input: the fixed factor applies instead
        log.info(
            "could not sample %s for column sizes (%s); estimating them from the manifests", sample.file.file_path, err
        )
        return {}


def _measure(table, path: str, wanted: dict[int, str]) -> dict[int, float]:
    # Imported here: pyarrow.parquet brings in pyarrow.fs, whose S3 client reads SSL_CERT_FILE once,
    # when first imported, and plan.py is imported before plan.trust_aws_ca_bundle sets it.
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
        names = sorted(set(by_id.values()))
        batch = next(parquet.iter_batches(batch_size=SAMPLE_ROWS, row_groups=[0], columns=names, use_threads=False))
    ratios = {}
    for field_id, name in by_id.items():
        chunk = chunks.get(name)
        on_disk = chunk.total_compressed_size * batch.num_rows / group.num_rows if chunk is not None else 0
        if on_disk > 0:
            ratios[field_id] = max(MIN_EXPANSION, batch.column(name).nbytes / on_disk)
    return ratios


def _columns_by_field_id(schema: pa.Schema, wanted: dict[int, str]) -> dict[int, str]:
    """The file's top-level column name of each wanted field id (files may name them otherwise)."""
    found = {}
    for field in schema:
        raw = (field.metadata or {}).get(b"PARQUET:field_id")
        if raw is not None and int(raw) in wanted and measured(field):
            found[int(raw)] = field.name
    return found
