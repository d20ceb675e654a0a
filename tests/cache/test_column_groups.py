"""Reading a data file's columns in groups (store.column_groups) gives exactly what one read of
every column gives, on the table shapes where pyiceberg's reader does the most: an evolved
schema, partition values not in the files, positional deletes; and the load's decode budget
reads early files whole and late ones in groups."""

from __future__ import annotations

import contextlib

import pyarrow as pa
import pytest

import kubeflow_data_cache.store as store_module
from kubeflow_data_cache.decode_budget import DecodeBudget
from kubeflow_data_cache.load_progress import LoadProgress
from kubeflow_data_cache.plan import Piece, arrow_schema, assign_rows, open_table, plan_table
from kubeflow_data_cache.sample import create_sample_table
from kubeflow_data_cache.store import NodeStore, column_groups, decode_budget, read_piece
from tests.cache.test_deletes import add_position_deletes, data_files, writable_table  # noqa: F401 (a fixture)
from tests.cache.test_table_shapes import _evolved_table, _partitioned_table, catalog  # noqa: F401 (a fixture)

MiB = 1 << 20


def _pieces(task) -> list[Piece]:
    rows = task.file.record_count
    return [Piece(task.file.file_path, 0, rows, rows), Piece(task.file.file_path, rows // 3, rows // 2, rows)]


def _assert_groups_read_the_same(table, deleted: int = 0) -> None:
    schema = arrow_schema(table)
    checked = 0
    for task in table.scan().plan_files():
        assert len(column_groups(table, task, schema, 1)) == len(schema)  # one column per group
        live = task.file.record_count - deleted if task.delete_files else task.file.record_count
        for piece in _pieces(task):
            if piece.file_rows != live:
                piece = Piece(piece.path, piece.start, min(piece.stop, live), live)
            counted: list[tuple[int, int]] = []
            settled: list[tuple[int, int]] = []
            grouped = read_piece(
                table,
                task,
                piece,
                lambda rows, nbytes, c=counted: c.append((rows, nbytes)),
                schema,
                1,
                lambda rows, nbytes, c=settled: c.append((rows, nbytes)),
            )
            # The memory guard projects from settled counts: a grouped read's come once, whole,
            # when every group is in, with the bytes actually read (not the estimated shares).
            assert settled == [(piece.stop - piece.start, sum(n for _, n in counted))]
            whole_settled: list[tuple[int, int]] = []
            whole_counted: list[tuple[int, int]] = []
            whole = read_piece(
                table,
                task,
                piece,
                lambda rows, nbytes, c=whole_counted: c.append((rows, nbytes)),
                schema,
                on_settled=lambda rows, nbytes, c=whole_settled: c.append((rows, nbytes)),
            )
            assert whole_settled == whole_counted  # whole rows settle batch by batch
            got = pa.Table.from_batches(grouped, schema=schema)
            assert got.equals(pa.Table.from_batches(whole, schema=schema))
            assert got.num_rows == piece.stop - piece.start
            # The memory guard's count: every kept row once over all the groups, rows growing
            # with bytes (a group's rows count by its share): not all of them at the first group,
            # which would make the guard's bytes-per-row projection far too low.
            assert sum(rows for rows, _ in counted) == piece.stop - piece.start
            total_bytes, rows_so_far, bytes_so_far = sum(n for _, n in counted), 0, 0
            for rows, nbytes in counted:
                rows_so_far, bytes_so_far = rows_so_far + rows, bytes_so_far + nbytes
                if rows_so_far == piece.stop - piece.start:
                    break
            assert bytes_so_far >= 0.6 * total_bytes, counted
            checked += 1
    assert checked >= 4


def test_an_evolved_schema_reads_the_same_in_column_groups(catalog):  # noqa: F811
    _assert_groups_read_the_same(_evolved_table(catalog))


def test_partition_values_not_in_the_files_read_the_same_in_column_groups(catalog):  # noqa: F811
    _assert_groups_read_the_same(_partitioned_table(catalog))


def test_positional_deletes_apply_to_every_column_group(writable_table):  # noqa: F811
    first = data_files(writable_table)[0]
    table = add_position_deletes(writable_table, {first: [0, 5, 6, 400, 999]}, scoped_to_file=True)
    _assert_groups_read_the_same(table, deleted=5)


def test_columns_are_grouped_in_schema_order_up_to_the_limit(tmp_path):
    sample = create_sample_table(str(tmp_path / "wh"), 40_000, 1)
    table = open_table(sample.metadata_location)
    schema = arrow_schema(table)
    (task,) = table.scan().plan_files()
    assert column_groups(table, task, schema, None) == [(None, 1.0)]
    assert column_groups(table, task, schema, 1 << 40) == [(None, 1.0)]  # the file fits: one read
    groups = column_groups(table, task, schema, 400_000)
    ids = [field_id for field_ids, _ in groups for field_id in field_ids]
    assert ids == [f.field_id for f in table.schema().fields]  # every column once, in order
    assert 1 < len(groups) < len(schema)  # small columns share a group, the limit splits the rest
    assert sum(share for _, share in groups) == pytest.approx(1.0)


def test_the_budget_reads_early_files_whole_and_late_ones_in_groups():
    """Two load threads over four 14 MiB files (15 MiB each read whole): the first two read
    whole; the third starts beside the second, with 42 MiB of rows started, and gets the rest
    of the budget; the fourth, beside the third, only the smallest group."""
    budget = DecodeBudget(kept=[14 * MiB] * 4, unit=[15 * MiB] * 4, minimum=[1 * MiB] * 4, share=0.15)
    assert budget.budget == int(1.15 * 56 * MiB)
    reads = [budget.reading(i) for i in range(4)]
    first, second = reads[0].__enter__(), reads[1].__enter__()
    assert first >= 15 * MiB and second >= 15 * MiB  # little kept yet: both read whole
    reads[0].__exit__(None, None, None)
    third = reads[2].__enter__()
    assert third == budget.budget - 42 * MiB - 15 * MiB  # what the second's scratch leaves
    assert third < 15 * MiB  # so the third file is read in column groups
    reads[1].__exit__(None, None, None)
    assert reads[3].__enter__() == 1 * MiB  # nothing left beside the third: the smallest group
    reads[3].__exit__(None, None, None)
    reads[2].__exit__(None, None, None)
    with budget.reading(0) as again:  # every read ended: only the rows started count
        assert again == max(1 * MiB, budget.budget - 70 * MiB)


def test_a_load_with_a_tight_budget_holds_the_same_rows(tmp_path, monkeypatch):
    """End to end through NodeStore.load: late reads in one-column groups (a budget of nothing
    beyond the rows, groups of any size), the rows and the progress counts as a whole read's."""
    sample = create_sample_table(str(tmp_path / "wh"), 40_000, 4)
    table = open_table(sample.metadata_location)
    plan, tasks = plan_table(table, sample.metadata_location)
    (assignment,) = assign_rows(plan, 1)
    pieces = list(assignment.pieces)
    default = NodeStore.load(table, tasks, plan.schema, pieces, 2)
    monkeypatch.setattr(store_module, "READ_GROUP_MIN_BYTES", 1)
    monkeypatch.setattr(DecodeBudget.__init__, "__defaults__", (0.0,))
    seen: list[tuple[int, int]] = []
    real = DecodeBudget.reading

    @contextlib.contextmanager
    def reading(self, index):
        with real(self, index) as limit:
            seen.append((index, limit))
            yield limit

    monkeypatch.setattr(DecodeBudget, "reading", reading)
    progress = LoadProgress()
    tight = NodeStore.load(table, tasks, plan.schema, pieces, 1, progress)
    assert sorted(index for index, _ in seen) == list(range(len(pieces)))
    assert seen[-1][1] == 1  # the last read had nothing left: one column at a time
    assert pa.Table.from_batches(tight.batches).equals(pa.Table.from_batches(default.batches))
    assert progress.rows == progress.settled_rows == sample.rows
    assert progress.bytes == progress.settled_bytes


def test_reads_from_an_object_store_group_no_smaller_than_its_larger_minimum(tmp_path):
    """Each group reopens its file: a few requests on an object store, so groups there are at
    least READ_GROUP_MIN_REMOTE_BYTES, where local files go down to READ_GROUP_MIN_BYTES."""
    from kubeflow_data_cache.constants import READ_GROUP_MIN_BYTES, READ_GROUP_MIN_REMOTE_BYTES

    sample = create_sample_table(str(tmp_path / "wh"), 40_000, 2)
    table = open_table(sample.metadata_location)
    plan, tasks = plan_table(table, sample.metadata_location)
    pieces = list(assign_rows(plan, 1)[0].pieces)
    # The budget reads only the manifests' statistics of each piece's file: the same file named
    # as an object store's shows which minimum each location gets.
    remote_tasks = {"s3://bucket/" + p.path.split("/")[-1]: tasks[p.path] for p in pieces}
    remote = [Piece("s3://bucket/" + p.path.split("/")[-1], p.start, p.stop, p.file_rows) for p in pieces]
    for given, expected in ((pieces, READ_GROUP_MIN_BYTES), (remote, READ_GROUP_MIN_REMOTE_BYTES)):
        budget = decode_budget(table, tasks if given is pieces else remote_tasks, plan.schema, given)
        with budget.reading(0), budget.reading(1) as last:  # nothing left for the last: its minimum
            assert last == expected
