"""Nulls the default conversion cannot take are refused before the first batch, not at the
batch that holds one (which could be hours into an epoch, one rank failing while its DDP peers
wait)."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pytest

from kubeflow_data_cache.client import CacheClient
from kubeflow_data_cache.dataset import DataCacheDataset
from kubeflow_data_cache.protocol import ShardRequest, info_null_counts
from kubeflow_data_cache.sample import make_catalog
from tests.conftest import LocalCache, running_cache

ROWS = 4000


@pytest.fixture(scope="module")
def null_cache(tmp_path_factory) -> Iterator[LocalCache]:
    """Two files; `x` (int64) has one null, on the very last row; `f` (float) and `s` (string),
    whose nulls the default conversion takes (NaN, None), have some; `flag` (bool) and `vec` (a
    list) have one each, at the end of a file; `id` has none."""
    root = tmp_path_factory.mktemp("nulls")
    catalog = make_catalog(str(root / "wh"), root / "catalog.db")
    catalog.create_namespace("demo")

    def part(lo: int, hi: int) -> pa.Table:
        ids = list(range(lo, hi))
        return pa.table(
            {
                "id": pa.array(ids, pa.int64()),
                "x": pa.array([None if i == ROWS - 1 else i for i in ids], pa.int64()),
                "f": pa.array([None if i % 7 == 0 else float(i) for i in ids], pa.float64()),
                "s": pa.array([None if i % 5 == 0 else str(i) for i in ids], pa.string()),
                "flag": pa.array([None if i == ROWS // 2 - 1 else i % 2 == 0 for i in ids], pa.bool_()),
                "vec": pa.array([None if i == ROWS - 2 else [float(i)] * 2 for i in ids], pa.list_(pa.float32())),
            }
        )

    table = catalog.create_table("demo.nulls", schema=part(0, 1).schema)
    table.append(part(0, ROWS // 2))
    table.append(part(ROWS // 2, ROWS))
    with running_cache(table.metadata_location, data_nodes=2) as cache:
        yield cache


def _ids(dataset: DataCacheDataset) -> list[int]:
    return [i for batch in dataset for i in batch["id"].tolist()]


def test_an_integer_column_with_a_null_is_refused_before_the_first_batch(null_cache):
    dataset = DataCacheDataset(null_cache.endpoint, batch_size=100)
    with pytest.raises(ValueError) as refused:
        next(iter(dataset))  # the null is on the last row: without the check this batch is fine
    message = str(refused.value)
    assert "column 'x' (int64) has 1 null value(s)" in message, message
    assert "filter='\"x\" IS NOT NULL'" in message and "(the table holds them;" in message, message


@pytest.mark.parametrize(
    ("column", "refusal"),
    [
        ("flag", "column 'flag' (bool) has 1 null value(s)"),
        ("vec", "column 'vec' has 1 null list(s)"),
    ],
)
def test_boolean_and_list_columns_with_a_null_are_refused_before_the_first_batch(null_cache, column, refusal):
    dataset = DataCacheDataset(null_cache.endpoint, batch_size=100, columns=["id", column])
    with pytest.raises(ValueError) as refused:
        next(iter(dataset))  # each null ends its file, past the first batch whichever file comes first
    message = str(refused.value)
    assert refusal in message and "before the first batch" in message, message
    assert f"filter='\"{column}\" IS NOT NULL'" in message


def test_what_the_message_suggests_reads_the_rest(null_cache):
    kept = DataCacheDataset(null_cache.endpoint, batch_size=100, filter='"x" IS NOT NULL', columns=["id", "x"])
    assert sorted(_ids(kept)) == list(range(ROWS - 1))
    # Nulls in float and string columns are taken as they are (NaN, None): no refusal.
    assert sorted(_ids(DataCacheDataset(null_cache.endpoint, batch_size=100, columns=["id", "f", "s"]))) == list(
        range(ROWS)
    )


def _fill(dataset: DataCacheDataset, batch):
    out = DataCacheDataset.from_arrow_rb_to_tensor(dataset, batch.drop_columns(["x"]))
    out["x"] = batch["x"].fill_null(-1).to_numpy()
    return out


@pytest.mark.parametrize("given_as", ["subclass", "function set on the dataset", "method bound to it"])
def test_a_conversion_of_ones_own_gets_the_nulls(null_cache, given_as):
    """However the hook is given: set on the instance, it ran, but the default conversion's
    refusal of nulls still applied, naming as the fix what the user had done."""
    import types

    class Filled(DataCacheDataset):
        def from_arrow_rb_to_tensor(self, batch):
            return _fill(self, batch)

    columns = ["id", "x", "f", "s"]
    if given_as == "subclass":
        dataset = Filled(null_cache.endpoint, batch_size=100, columns=columns)
    else:
        dataset = DataCacheDataset(null_cache.endpoint, batch_size=100, columns=columns)
        if given_as == "function set on the dataset":
            dataset.from_arrow_rb_to_tensor = lambda batch: _fill(dataset, batch)
        else:
            dataset.from_arrow_rb_to_tensor = types.MethodType(_fill, dataset)
    filled = [x for batch in dataset for x in batch["x"].tolist()]
    assert len(filled) == ROWS and filled.count(-1) == 1


def test_the_head_counts_nulls_per_requested_column_in_the_table_or_in_a_filters_matches(null_cache):
    with CacheClient(null_cache.endpoint) as client:
        info = client.get_flight_info(ShardRequest(columns=("id", "x", "f")))
        assert info_null_counts(info.app_metadata) == {"x": 1, "f": len(range(0, ROWS, 7))}
        filtered = client.get_flight_info(ShardRequest(columns=("x", "f"), filter="id >= 14"))
        assert info_null_counts(filtered.app_metadata) == {"x": 1, "f": len(range(14, ROWS, 7))}
        # A filter that leaves them out has none to count.
        kept = client.get_flight_info(ShardRequest(columns=("x", "vec"), filter=f"id < {ROWS - 2}"))
        assert info_null_counts(kept.app_metadata) == {}


def test_a_filter_that_keeps_a_null_is_refused_before_the_first_batch(null_cache):
    """Only the head's count over the filter's matches tells: before, such a read failed at the
    batch that held the null, the last of the epoch here."""
    dataset = DataCacheDataset(null_cache.endpoint, batch_size=100, columns=["id", "x"], filter="id >= 100")
    with pytest.raises(
        ValueError, match=r"column 'x' \(int64\) has 1 null value\(s\).*before the first batch"
    ) as refused:
        next(iter(dataset))
    assert "(the filter's rows hold them;" in str(refused.value)  # not the table's: they were counted in the matches


@pytest.mark.parametrize(
    "metadata",
    [b"", b"not json", b"[1]", b'{"null_counts": "x"}', b'{"null_counts": {"x": "many"}}', b'{"other": 1}'],
)
def test_a_cache_that_sends_no_counts_is_read_as_none(metadata):
    assert info_null_counts(metadata) == {}
