"""The sample Iceberg tables the cases read: one per size, on local files and on moto S3."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.config import S3_BUCKET, files_for
from kubeflow_data_cache.sample import SampleTable, create_sample_table


@dataclass(frozen=True)
class BenchTable:
    """A written table and how to open it: FileIO properties and, for the cache, env."""

    sample: SampleTable
    source: str  # "file" or "s3"
    properties: dict[str, str]
    env: dict[str, str]

    @property
    def metadata_location(self) -> str:
        return self.sample.metadata_location

    @property
    def rows(self) -> int:
        return self.sample.rows

    def open(self):
        """The table as a user would open it without the cache: pyiceberg from its metadata."""
        from pyiceberg.table import StaticTable

        return StaticTable.from_metadata(self.metadata_location, self.properties)

    def parquet_paths(self) -> list[str]:
        """Local paths of the current snapshot's data files (for pyarrow.dataset)."""
        if self.source != "file":
            raise ValueError("parquet_paths is for tables on local files")
        return [task.file.file_path.removeprefix("file://") for task in self.open().scan().plan_files()]


class Tables:
    """Writes each table once per run under ``root`` (a temporary folder)."""

    def __init__(self, root: Path, moto=None) -> None:
        self.root, self.moto = root, moto
        self._made: dict[tuple[str, int], BenchTable] = {}

    def local(self, rows: int) -> BenchTable:
        key = ("file", rows)
        if key not in self._made:
            sample = create_sample_table(str(self.root / f"wh-{rows}"), rows, files_for(rows))
            self._made[key] = BenchTable(sample, "file", {}, {})
        return self._made[key]

    def s3(self, rows: int) -> BenchTable:
        if self.moto is None:
            raise RuntimeError("S3 tables need the moto server")
        key = ("s3", rows)
        if key not in self._made:
            sample = create_sample_table(
                f"s3://{S3_BUCKET}/wh-{rows}",
                rows,
                files_for(rows),
                catalog_db=self.root / f"s3-catalog-{rows}.db",
                properties=self.moto.properties,
            )
            self._made[key] = BenchTable(sample, "s3", self.moto.properties, self.moto.env)
        return self._made[key]
