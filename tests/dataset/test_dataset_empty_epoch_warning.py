"""An epoch in which ``even`` or ``drop_last`` leaves no reader a batch, or a filter that
matches no row, is warned about.

More shards than matching rows under ``even="drop"``, or shards shorter than ``batch_size`` with
``drop_last=True``: every rank's loop ran zero steps each epoch, and nothing said so.
"""

from __future__ import annotations

import warnings

import pytest

from kubeflow_data_cache.dataset import DataCacheDataset, EmptyEpochWarning


@pytest.fixture(scope="module")
def cache(small_cache):
    return small_cache  # 10,000 rows, ids 0..9999


def _read(**kwargs) -> tuple[int, list[str]]:
    """Rows this reader yields in one epoch, and the EmptyEpochWarnings said."""
    ds = DataCacheDataset(columns=["id"], **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = sum(len(batch["id"]) for batch in ds)
    said = [w for w in caught if issubclass(w.category, EmptyEpochWarning)]
    assert all(w.filename == __file__ for w in said), [w.filename for w in said]  # the loop, not the package
    return rows, [str(w.message) for w in said]


def test_more_shards_than_rows_under_even_drop_warns_naming_the_fixes(cache):
    rows, said = _read(endpoint=cache.endpoint, filter="id < 3", even="drop", rank=1, world_size=4)
    assert rows == 0
    assert len(said) == 1, said
    assert "the filter's matching rows (3) split into 4 shards" in said[0]
    assert 'even="pad"' in said[0] and "fewer ranks or DataLoader workers" in said[0]


def test_shards_shorter_than_a_batch_with_drop_last_warn(cache):
    rows, said = _read(endpoint=cache.endpoint, filter="id < 100", batch_size=64, drop_last=True, world_size=2, rank=0)
    assert rows == 0
    assert len(said) == 1, said
    assert "leave 50 rows in each, fewer than batch_size=64 with drop_last=True" in said[0]
    assert "a smaller batch_size" in said[0]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"filter": "id < 3", "world_size": 4, "rank": 3},  # no even: shard 3 is empty, the others are not
        {"filter": "id < 100", "even": "pad", "world_size": 128, "rank": 5},  # padded: one row each
        {"filter": "id < 128", "batch_size": 64, "drop_last": True, "world_size": 2, "rank": 1},  # a batch each
    ],
    ids=["uneven", "pad", "a-batch-each"],
)
def test_no_warning_where_some_reader_yields(cache, kwargs):
    _, said = _read(endpoint=cache.endpoint, **kwargs)
    assert said == []


@pytest.mark.parametrize("even", [None, "drop", "pad"])
def test_a_filter_that_matches_no_row_warns_whatever_even(cache, even):
    """A typo in a filter's value trained zero steps each epoch without a word: the head left its
    matching rows out of the FlightInfo when they were 0."""
    rows, said = _read(endpoint=cache.endpoint, filter="id < 0", even=even, world_size=4, rank=0)
    assert rows == 0
    assert said == ["DataCacheDataset yields no batch on any reader this epoch: the filter 'id < 0' matches no row "
                    "in the cached table"]  # fmt: skip


def test_said_once_per_dataset(cache):
    ds = DataCacheDataset(cache.endpoint, columns=["id"], filter="id < 3", even="drop", rank=0, world_size=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(3):
            ds.set_epoch(epoch)
            assert list(ds) == []
    assert sum(issubclass(w.category, EmptyEpochWarning) for w in caught) == 1
