"""Write the e2e Iceberg table to S3 and print its metadata location (runs in the cache image).

Settings come from the environment: the standard ``AWS_*`` variables for the store, and
``WAREHOUSE`` (``s3://bucket/prefix``), ``TABLE_SCHEMA``, ``TABLE_NAME``, ``TABLE_ROWS``,
``TABLE_FILES``, ``CATALOG_DB`` (a sqlite file on local disk). The last stdout line is
``METADATA_LOC=<uri>``; the kind suite reads it from the Job's log.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from urllib.parse import urlparse

REQUIRED = (
    "AWS_ENDPOINT_URL",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_REGION",
    "WAREHOUSE",
    "TABLE_SCHEMA",
    "TABLE_NAME",
    "TABLE_ROWS",
    "TABLE_FILES",
    "CATALOG_DB",
)


def main() -> int:
    missing = [name for name in REQUIRED if not os.environ.get(name)]
    if missing:
        print(f"table_writer: missing settings: {', '.join(missing)}", file=sys.stderr)
        return 2
    env = os.environ
    warehouse = env["WAREHOUSE"]
    parsed = urlparse(warehouse)
    if parsed.scheme != "s3" or not parsed.netloc:
        print(f"table_writer: WAREHOUSE should be s3://bucket/prefix, got {warehouse!r}", file=sys.stderr)
        return 2

    import pyarrow.fs

    from kubeflow_data_cache.sample import create_sample_table

    endpoint = env["AWS_ENDPOINT_URL"]
    s3 = pyarrow.fs.S3FileSystem(
        access_key=env["AWS_ACCESS_KEY_ID"],
        secret_key=env["AWS_SECRET_ACCESS_KEY"],
        region=env["AWS_REGION"],
        endpoint_override=endpoint,
        allow_bucket_creation=True,
    )
    if s3.get_file_info(parsed.netloc).type == pyarrow.fs.FileType.NotFound:
        s3.create_dir(parsed.netloc)
    properties = {
        "s3.endpoint": endpoint,
        "s3.access-key-id": env["AWS_ACCESS_KEY_ID"],
        "s3.secret-access-key": env["AWS_SECRET_ACCESS_KEY"],
        "s3.region": env["AWS_REGION"],
    }
    table = create_sample_table(
        warehouse,
        rows=int(env["TABLE_ROWS"]),
        files=int(env["TABLE_FILES"]),
        schema_name=env["TABLE_SCHEMA"],
        table_name=env["TABLE_NAME"],
        catalog_db=Path(env["CATALOG_DB"]),
        properties=properties,
        with_text=False,
    )
    print(f"wrote {table.rows} rows in {table.files} files", file=sys.stderr)
    print(f"METADATA_LOC={table.metadata_location}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
