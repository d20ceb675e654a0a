"""Row-level deletes: the cache serves exactly the live rows of a table, or refuses it clearly.

pyiceberg 0.12 cannot write merge-on-read deletes (``table.delete`` warns and falls back to
copy-on-write), so the positional and equality delete files here are written by hand: a Parquet
file with the spec's reserved field ids, committed as a delete manifest by a small snapshot
producer built on pyiceberg's own fast-append (``pyiceberg.table.update.snapshot`` internals).
"""

from __future__ import annotations

import uuid
import warnings
from pathlib import Path
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.flight as flight
import pyarrow.parquet as pq
import pytest
from pyiceberg.manifest import (
    DataFile,
    DataFileContent,
    FileFormat,
    ManifestContent,
    ManifestEntry,
    ManifestEntryStatus,
    ManifestWriterV2,
)
from pyiceberg.table import StaticTable, Table
from pyiceberg.table.snapshots import Operation
from pyiceberg.table.update.snapshot import _FastAppendFiles
from pyiceberg.typedef import Record

from kubeflow_data_cache.errors import TableLoadError, UnsupportedTableError
from kubeflow_data_cache.plan import open_table, plan_table
from kubeflow_data_cache.sample import create_sample_table, make_catalog, sample_batch
from tests.cache.conftest import read_path_shards
from tests.conftest import LocalCache, running_cache

ROWS, FILES = 3000, 3
# Reserved field ids of a positional delete file (Iceberg spec, "Position Delete Files").
FILE_PATH_FIELD_ID, POS_FIELD_ID = 2147483546, 2147483545
POSITION_DELETE_SCHEMA = pa.schema(
    [
        pa.field("file_path", pa.string(), nullable=False, metadata={"PARQUET:field_id": str(FILE_PATH_FIELD_ID)}),
        pa.field("pos", pa.int64(), nullable=False, metadata={"PARQUET:field_id": str(POS_FIELD_ID)}),
    ]
)
ID_FIELD_ID = 1  # the sample table's `id` column


class _DeleteManifestWriter(ManifestWriterV2):
    """pyiceberg only writes data manifests; a delete manifest differs in its content marker."""

    def content(self) -> ManifestContent:
        return ManifestContent.DELETES

    @property
    def _meta(self) -> dict[str, str]:
        return {**super()._meta, "content": "deletes"}


class _AddDeleteFiles(_FastAppendFiles):
    """A snapshot that keeps every existing manifest and adds one manifest of delete files."""

    def __init__(self, delete_files: list[DataFile], **kwargs):
        super().__init__(**kwargs)
        self._delete_files = delete_files

    def _process_manifests(self, manifests):
        # Sequence number None: inherited, the commit's.
        return [*manifests, _manifest_of(self, _DeleteManifestWriter, self._delete_files, None)]


def _manifest_of(producer: _FastAppendFiles, writer_class, files: list[DataFile], sequence_number: int | None):
    """One manifest of ``producer``'s snapshot adding ``files`` at ``sequence_number``."""
    metadata = producer._transaction.table_metadata
    writer = writer_class(
        metadata.spec(), metadata.schema(), producer.new_manifest_output(), producer._snapshot_id, producer._compression
    )
    with writer:
        for data_file in files:
            writer.add(
                ManifestEntry.from_args(
                    status=ManifestEntryStatus.ADDED,
                    snapshot_id=producer._snapshot_id,
                    sequence_number=sequence_number,
                    file_sequence_number=None,
                    data_file=data_file,
                )
            )
    return writer.to_manifest_file()


def _commit_delete_files(table: Table, delete_files: list[DataFile]) -> Table:
    with table.transaction() as tx:
        _AddDeleteFiles(delete_files, operation=Operation.DELETE, transaction=tx, io=table.io).commit()
    return table.refresh()


def _write_parquet(table: Table, rows: pa.Table, kind: str) -> tuple[str, int]:
    location = f"{table.location()}/data/{kind}-{uuid.uuid4()}.parquet"
    local = Path(urlparse(location).path)
    pq.write_table(rows, local)
    return location, local.stat().st_size


def add_position_deletes(table: Table, deletes: dict[str, list[int]], scoped_to_file: bool) -> Table:
    """One positional delete file deleting ``deletes[data_file_path]`` positions. ``scoped_to_file``
    sets the file_path bounds (as writers do for a single data file), so readers attach it to that
    file only; without bounds it is a partition-wide delete file that every data file must consult."""
    paths = [path for path, positions in sorted(deletes.items()) for _ in positions]
    positions = [pos for _, ps in sorted(deletes.items()) for pos in sorted(ps)]
    rows = pa.table({"file_path": paths, "pos": positions}, schema=POSITION_DELETE_SCHEMA)
    location, size = _write_parquet(table, rows, "pos-deletes")
    bounds = {}
    if scoped_to_file:
        assert len(deletes) == 1
        bounds = {FILE_PATH_FIELD_ID: paths[0].encode()}
    delete_file = DataFile.from_args(
        content=DataFileContent.POSITION_DELETES,
        file_path=location,
        file_format=FileFormat.PARQUET,
        partition=Record(),
        record_count=rows.num_rows,
        file_size_in_bytes=size,
        lower_bounds=bounds,
        upper_bounds=dict(bounds),
        spec_id=table.metadata.default_spec_id,
        equality_ids=None,
        key_metadata=None,
        sort_order_id=None,
    )
    return _commit_delete_files(table, [delete_file])


def add_equality_deletes(table: Table, ids: list[int]) -> Table:
    field = pa.field("id", pa.int64(), nullable=False, metadata={"PARQUET:field_id": str(ID_FIELD_ID)})
    rows = pa.table({"id": ids}, schema=pa.schema([field]))
    location, size = _write_parquet(table, rows, "eq-deletes")
    delete_file = DataFile.from_args(
        content=DataFileContent.EQUALITY_DELETES,
        file_path=location,
        file_format=FileFormat.PARQUET,
        partition=Record(),
        record_count=rows.num_rows,
        file_size_in_bytes=size,
        spec_id=table.metadata.default_spec_id,
        equality_ids=[ID_FIELD_ID],
        key_metadata=None,
        sort_order_id=None,
    )
    return _commit_delete_files(table, [delete_file])


@pytest.fixture()
def writable_table(tmp_path) -> Table:
    """A fresh sample table (ROWS rows in FILES data files) opened through its catalog."""
    warehouse, catalog_db = tmp_path / "wh", tmp_path / "catalog.db"
    sample = create_sample_table(str(warehouse), ROWS, FILES, catalog_db=catalog_db, with_text=False)
    return make_catalog(str(warehouse), catalog_db).load_table(f"{sample.schema_name}.{sample.table_name}")


def data_files(table: Table) -> list[str]:
    """The table's data files in the cache's row order (sorted by path)."""
    return sorted(task.file.file_path for task in table.scan().plan_files())


def pyiceberg_ids(metadata_location: str) -> list[int]:
    return StaticTable.from_metadata(metadata_location).scan().to_arrow().column("id").to_pylist()


def ids_in_file(path: str) -> list[int]:
    return pq.read_table(urlparse(path).path, columns=["id"]).column("id").to_pylist()


def served_ids(metadata_location: str, data_nodes: int) -> tuple[list[int], int]:
    """The ids a fresh cache serves in global order (one unshuffled shard), and its status rows."""
    with running_cache(metadata_location, data_nodes=data_nodes) as cache:
        ids = read_path_shards(cache.endpoint, total=1).column("id").to_pylist()
        info = flight.FlightClient(cache.endpoint).get_flight_info(flight.FlightDescriptor.for_path("0", "1"))
    return ids, info.total_records


@pytest.mark.slow
def test_delete_falls_back_to_copy_on_write_and_cache_serves_the_rest(writable_table):
    with writable_table.transaction() as tx:
        tx.set_properties({"write.delete.mode": "merge-on-read"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "Merge on read is not yet supported, falling back ..."
        writable_table.delete("id >= 500 and id < 1700")  # spans two of the three data files
    table = writable_table.refresh()
    # pyiceberg rewrote the data files: no delete file is left for a reader to apply.
    assert all(not task.delete_files for task in table.scan().plan_files())
    ids, total = served_ids(table.metadata_location, data_nodes=1)
    assert sorted(ids) == sorted(pyiceberg_ids(table.metadata_location))
    assert sorted(ids) == [*range(500), *range(1700, ROWS)]
    assert total == len(ids) == ROWS - 1200


@pytest.mark.slow
def test_positional_deletes_are_applied_across_the_node_split(writable_table):
    first, middle, last = data_files(writable_table)
    # With 2 nodes the split falls inside the middle file (about row 1500 of 3000); deleting rows
    # on both sides of it makes each node count the other's deletes right.
    middle_positions = [0, 1, 400, 499, 500, 501, 777, len(ids_in_file(middle)) - 1]
    table = add_position_deletes(writable_table, {middle: middle_positions}, scoped_to_file=True)
    # A second, partition-wide delete file covering two files: every data file consults it.
    table = add_position_deletes(table, {first: [3, 4, 5], last: [10]}, scoped_to_file=False)
    tasks = {t.file.file_path: t for t in table.scan().plan_files()}
    assert len(tasks[middle].delete_files) == 2 and len(tasks[first].delete_files) == 1

    deleted = {first: {3, 4, 5}, middle: set(middle_positions), last: {10}}
    expected = [i for path in (first, middle, last) for p, i in enumerate(ids_in_file(path)) if p not in deleted[path]]
    assert sorted(expected) == sorted(pyiceberg_ids(table.metadata_location)), "the hand-made deletes took effect"

    ids, total = served_ids(table.metadata_location, data_nodes=2)
    assert ids == expected, "live rows, in file-path order, each once"
    assert total == ROWS - 12


def test_the_head_counts_live_rows_from_the_delete_files_alone(writable_table):
    """Planning counted a file's live rows by decoding every column of it on the head (a 3M-row
    file with one delete: 300 MiB of head memory, 1.6 s of the planning deadline). It now reads
    the delete files only: the count is right with a row named by two delete files, and stays
    right when the data file itself cannot be read."""
    first, middle, _ = data_files(writable_table)
    table = add_position_deletes(writable_table, {middle: [0, 5, 6]}, scoped_to_file=True)
    table = add_position_deletes(table, {middle: [6, 7], first: [1]}, scoped_to_file=False)  # row 6 twice
    live = len(pyiceberg_ids(table.metadata_location))
    assert live == ROWS - 5
    expected = {first: len(ids_in_file(first)) - 1, middle: len(ids_in_file(middle)) - 4}
    Path(urlparse(middle).path).write_bytes(b"not parquet")  # a head that reads it fails here
    plan, _ = plan_table(open_table(table.metadata_location), table.metadata_location)
    rows = {f.path: f.rows for f in plan.files}
    assert {path: rows[path] for path in expected} == expected
    assert plan.rows == live


def test_a_missing_positional_delete_file_is_named_with_the_fix(writable_table):
    """Read while planning, outside the handling a data file's read has: a bare
    FileNotFoundError, without the advice a missing data file gets."""
    _, middle, _ = data_files(writable_table)
    table = add_position_deletes(writable_table, {middle: [0, 5]}, scoped_to_file=True)
    (delete_file,) = [p for p in Path(urlparse(table.location()).path, "data").iterdir() if "pos-deletes" in p.name]
    delete_file.unlink()
    with pytest.raises(TableLoadError) as failed:
        plan_table(open_table(table.metadata_location), table.metadata_location)
    message = str(failed.value)
    assert message.startswith(f"cannot read the positional delete file(s) {table.location()}/data/{delete_file.name}")
    assert f"of data file {middle}: it is gone, though the table's metadata names it" in message
    assert "point METADATA_LOC at the current metadata.json" in message


def test_a_delete_position_past_its_files_end_deletes_nothing(writable_table):
    """A position at or past the file's row count names no row: counted as deleted, the head
    planned one row fewer than the file holds and the node's load failed on a valid table."""
    _, middle, _ = data_files(writable_table)
    table = add_position_deletes(writable_table, {middle: [0, 10**6]}, scoped_to_file=True)
    plan, _ = plan_table(open_table(table.metadata_location), table.metadata_location)
    assert plan.rows == ROWS - 1 == len(pyiceberg_ids(table.metadata_location))


def test_an_equality_delete_newer_than_some_data_files_is_refused_as_one_that_applies(writable_table):
    """Older than the files appended after it, newer than those before: it deletes rows of the
    older ones, so the refusal says the table has equality deletes, not that they delete nothing."""
    table = add_equality_deletes(writable_table, [7, 8, 9])
    table.append(sample_batch(ROWS, ROWS + 100, with_text=False))
    table = table.refresh()
    with pytest.raises(UnsupportedTableError) as refused:
        plan_table(open_table(table.metadata_location), table.metadata_location)
    message = str(refused.value)
    assert message.startswith("the table has equality deletes (delete file ") and "cannot apply exactly" in message
    assert "delete no live row" not in message


def test_equality_deletes_older_than_every_data_file_are_ignored(writable_table):
    """After the data files are rewritten (the refusal's own advice), an equality delete applies
    to no row (Iceberg: only to data files with a lower sequence number). Spark's rewrite keeps
    it in the snapshot by default, and the cache refused the table for it."""
    import pyarrow.compute as pc

    before = writable_table.scan().to_arrow()
    table = add_equality_deletes(writable_table, [7, 8, 9])
    table.overwrite(before.filter(pc.invert(pc.is_in(before["id"], pa.array([7, 8, 9])))))
    table = table.refresh()
    plan, tasks = plan_table(open_table(table.metadata_location), table.metadata_location)
    assert plan.rows == ROWS - 3 == table.scan().to_arrow().num_rows
    assert not any(task.delete_files for task in tasks.values())


class _RewriteAtSequence(_FastAppendFiles):
    """A rewrite of every data file committed at a given data sequence number, keeping the delete
    manifests: what Spark's rewrite_data_files commits by default (its starting snapshot's number)."""

    def __init__(self, files: list[DataFile], sequence_number: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self._files, self._sequence_number = files, sequence_number

    def _existing_manifests(self):
        snapshot = self._transaction.table_metadata.current_snapshot()
        return [m for m in snapshot.manifests(self._io) if m.content == ManifestContent.DELETES]

    def _process_manifests(self, manifests):
        return [_manifest_of(self, ManifestWriterV2, self._files, self._sequence_number), *manifests]


def test_equality_deletes_as_old_as_the_data_are_refused_naming_how_to_remove_them(writable_table):
    """They delete nothing (a delete applies to older data only), but pyiceberg's planner reads
    their manifest and refuses: the reason must not claim the data is newer, and must name the fix."""
    import pyarrow.compute as pc
    from pyiceberg.io.pyarrow import _dataframe_to_data_files

    before = writable_table.scan().to_arrow()
    table = add_equality_deletes(writable_table, [7, 8, 9])
    kept = before.filter(pc.invert(pc.is_in(before["id"], pa.array([7, 8, 9]))))
    files = list(_dataframe_to_data_files(table.metadata, kept, table.io, write_uuid=uuid.uuid4()))
    with table.transaction() as tx:
        at = table.current_snapshot().sequence_number
        _RewriteAtSequence(files, at, operation=Operation.OVERWRITE, transaction=tx, io=table.io).commit()
    table = table.refresh()
    with pytest.raises(UnsupportedTableError) as refused:
        plan_table(open_table(table.metadata_location), table.metadata_location)
    assert "delete no live row (none is newer than the oldest data file)" in str(refused.value)
    assert "remove-dangling-deletes=true" in str(refused.value)


@pytest.mark.slow
def test_equality_deletes_are_refused_with_a_clear_reason(writable_table):
    table = add_equality_deletes(writable_table, [7, 8, 9])
    cache = LocalCache(table.metadata_location, data_nodes=1, args=("--startup-timeout", "60"))
    cache.wait_failure(timeout=90)
    assert cache.proc.returncode != 0
    assert "the table has equality deletes (delete file file://" in cache.stderr
    assert "which the cache cannot apply exactly" in cache.stderr
    assert "compact the table" in cache.stderr


@pytest.mark.slow
def test_a_file_with_every_row_deleted_is_read_to_its_end_and_serves_none(writable_table):
    """Planned at no rows, the file is one node's empty piece: read, it gives nothing."""
    first, _, _ = data_files(writable_table)
    table = add_position_deletes(writable_table, {first: list(range(len(ids_in_file(first))))}, scoped_to_file=True)
    ids, total = served_ids(table.metadata_location, data_nodes=2)
    assert sorted(ids) == sorted(pyiceberg_ids(table.metadata_location))
    assert total == len(ids) == ROWS - len(ids_in_file(first))


@pytest.mark.slow
def test_a_position_delete_older_than_a_data_file_it_names_leaves_that_file_whole(writable_table):
    """The spec: a position delete applies to data files of a sequence number at or below its own.
    A file dropped and added back at the same path after a delete that names it keeps every row.
    The cache applies each task's own delete files, as pyiceberg's planner assigns them (and as
    Spark and Java read it); pyiceberg 0.12's to_arrow() applies every task's deletes by path, and
    returned 10 rows fewer here. Pinned so that nobody "fixes" the cache to match it."""
    first, middle, _ = data_files(writable_table)
    table = add_position_deletes(
        writable_table, {first: list(range(10)), middle: list(range(10))}, scoped_to_file=False
    )
    middle_ids = ids_in_file(middle)
    table.delete(f"id >= {min(middle_ids)} and id <= {max(middle_ids)}")  # drops the middle file whole
    table = table.refresh()
    assert middle not in data_files(table)
    table.add_files([middle])  # back, at a newer sequence number than the delete file
    table = table.refresh()
    tasks = {task.file.file_path: task for task in table.scan().plan_files()}
    assert len(tasks[first].delete_files) == 1 and tasks[middle].delete_files == set()

    ids, total = served_ids(table.metadata_location, data_nodes=2)
    expected = {
        *ids_in_file(first)[10:],
        *middle_ids,
        *(i for path in tasks if path not in (first, middle) for i in ids_in_file(path)),
    }
    assert sorted(ids) == sorted(expected)
    assert total == ROWS - 10


@pytest.mark.slow
def test_a_file_planned_at_no_rows_that_holds_more_fails_the_load(writable_table):
    """A file whose counted rows are all deleted, but which holds more than its manifest counts
    (rewritten after its commit): readers read the extra rows. Never opened, since no row of it
    was planned, the cache left them out without a word; it reads it to its end now."""
    first, middle, _ = data_files(writable_table)
    counted = len(ids_in_file(first))
    table = add_position_deletes(writable_table, {first: list(range(counted))}, scoped_to_file=True)
    local = Path(urlparse(first).path)
    grown = pa.concat_tables([pq.read_table(local), pq.read_table(urlparse(middle).path)])
    pq.write_table(grown, local)
    assert len(pyiceberg_ids(table.metadata_location)) == ROWS  # the rows past the count are read

    cache = LocalCache(table.metadata_location, 2)
    message = cache.wait_failure(timeout=120)
    assert f"data file {first} has at least " in message and "live row(s), but the table's metadata counts 0" in message


def test_a_data_file_listed_twice_in_the_snapshot_is_refused_naming_it(writable_table):
    """add_files(..., check_duplicate_files=False) of a file already in the table: readers read its
    rows twice; the cache, keyed by path, served them once."""
    first, _, _ = data_files(writable_table)
    writable_table.add_files([first], check_duplicate_files=False)
    table = writable_table.refresh()
    assert len(pyiceberg_ids(table.metadata_location)) == ROWS + len(ids_in_file(first))
    with pytest.raises(UnsupportedTableError, match=f"data file {first} is listed 2 times in the snapshot"):
        plan_table(open_table(table.metadata_location), table.metadata_location)
