"""Build real sample Iceberg tables: for the demo, the tests and the benchmarks.

A pyiceberg SQL catalog on sqlite with a file warehouse (or an S3 warehouse, given the
``s3.*`` properties), one append per data file so the table has exactly ``files`` files.
Rows are deterministic functions of ``id`` so readers can check what they got.
"""

from __future__ import annotations

import contextlib
import itertools
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from kubeflow_data_cache.errors import ConfigError

EMBEDDING_DIM = 4


@dataclass(frozen=True)
class SampleTable:
    metadata_location: str
    schema_name: str
    table_name: str
    rows: int
    files: int


def sample_batch(start: int, stop: int, with_text: bool = True) -> pa.Table:
    """Rows ``start..stop-1``: every column is a pure function of ``id``."""
    ids = np.arange(start, stop, dtype=np.int64)
    columns: dict[str, Any] = {
        "id": pa.array(ids),
        "feature_a": pa.array((ids % 1000).astype(np.float32) / 1000.0),
        "feature_b": pa.array(np.sin(ids.astype(np.float64))),
        "label": pa.array((ids % 10).astype(np.int32)),
        "flag": pa.array(ids % 2 == 0),
    }
    if with_text:
        columns["text"] = pa.array([f"row-{i}" for i in ids.tolist()], type=pa.string())
        emb = np.repeat(ids.astype(np.float32)[:, None], EMBEDDING_DIM, axis=1) + np.arange(EMBEDDING_DIM)
        columns["embedding"] = pa.FixedSizeListArray.from_arrays(
            pa.array(emb.reshape(-1), type=pa.float32()), EMBEDDING_DIM
        )
    return pa.table(columns)


# Characters pyiceberg's file IO and sqlite's URI read as URI syntax in a local path: a table
# written under them was split across two folders, its data in a literal "my%20wh".
URI_SYNTAX_CHARS = "#?%"


def make_catalog(warehouse: str, catalog_db: Path, properties: dict[str, str] | None = None):
    """A SQL catalog on sqlite; ``warehouse`` is a folder or an ``s3://bucket/prefix``."""
    from pyiceberg.catalog.sql import SqlCatalog

    for path, what in ((warehouse, "warehouse folder"), (str(catalog_db), "catalog database")):
        if "://" not in path and any(char in URI_SYNTAX_CHARS for char in path):
            raise ConfigError(
                f"the {what} {path!r} holds one of {' '.join(URI_SYNTAX_CHARS)}, which pyiceberg and sqlite read "
                "as URI syntax: choose a folder without them"
            )
    if "://" not in warehouse:
        Path(warehouse).mkdir(parents=True, exist_ok=True)
        # Not Path.as_uri(): pyiceberg reads its percent-escapes (a space's "%20") as they stand.
        warehouse = "file://" + str(Path(warehouse).resolve())
    catalog_db.parent.mkdir(parents=True, exist_ok=True)
    return SqlCatalog(
        "sample",
        uri=f"sqlite:///{catalog_db}",
        warehouse=warehouse,
        **(properties or {}),
    )


def create_sample_table(
    warehouse: str,
    rows: int,
    files: int,
    schema_name: str = "demo",
    table_name: str = "events",
    catalog_db: Path | None = None,
    properties: dict[str, str] | None = None,
    with_text: bool = True,
) -> SampleTable:
    """Create (or replace) ``schema_name.table_name`` with ``rows`` rows in ``files`` data files.

    Rows are spread as evenly as possible; ``files`` larger than ``rows`` is capped, and
    ``rows == 0`` gives an empty table (a schema and no snapshot data).
    """
    if rows < 0 or files < 1:
        raise ValueError(f"rows must be >= 0 and files >= 1, got rows={rows}, files={files}")
    if not warehouse.strip():
        # Path("") is the current folder: the table and its catalog went into it, unasked.
        raise ConfigError("the warehouse is empty: give a folder (or s3://bucket/prefix) to write the table under")
    with contextlib.ExitStack() as scratch:
        if catalog_db is None and "://" in warehouse:
            # For an s3:// warehouse the metadata location is all the cache needs: the catalog
            # that made it is thrown away rather than left in the folder the command ran from.
            catalog_db = (
                Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix="data-cache-sample-catalog-")))
                / "catalog.db"
            )
        catalog = make_catalog(warehouse, catalog_db or Path(warehouse) / "catalog.db", properties)
        catalog.create_namespace_if_not_exists(schema_name)
        identifier = f"{schema_name}.{table_name}"
        if catalog.table_exists(identifier):
            catalog.drop_table(identifier)
        table = catalog.create_table(identifier, schema=sample_batch(0, 0, with_text).schema)
        files = max(1, min(files, rows)) if rows else 1
        bounds = np.linspace(0, rows, files + 1).astype(np.int64)
        for lo, hi in itertools.pairwise(bounds):
            if hi > lo:
                table.append(sample_batch(int(lo), int(hi), with_text))
        table = catalog.load_table(identifier)
    return SampleTable(table.metadata_location, schema_name, table_name, rows, files if rows else 0)
