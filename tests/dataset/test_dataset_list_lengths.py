"""List columns whose rows hold lists of different lengths do not stack into one tensor: refused
before the first batch from the head's counts (of the table, or of a filter's matches), and, where
a cache sends none, at the first run whose rows have another shape, never yielded as tensors that
change width half way."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pytest
import torch
from torch.utils.data import DataLoader

from kubeflow_data_cache.client import CacheClient
from kubeflow_data_cache.dataset import DataCacheDataset, _check_row_shapes, column_to_tensor, null_refusal
from kubeflow_data_cache.filtering import matching_rows
from kubeflow_data_cache.protocol import ShardRequest, info_list_lengths
from kubeflow_data_cache.sample import make_catalog
from kubeflow_data_cache.store import NodeStore
from tests.conftest import LocalCache, running_cache

# A file per width, each one data node's rows (a multiple of the batch size): read in order, each
# conversion run holds one width, so nothing inside a run is ragged.
PER_FILE = 102_400


def _rows(lo: int, hi: int, width: int) -> pa.Table:
    ids = np.arange(lo, hi, dtype=np.int64)
    offsets = pa.array(np.arange(0, (hi - lo) * width + 1, width, dtype=np.int32))
    vectors = pa.ListArray.from_arrays(offsets, pa.array(np.repeat(ids.astype(np.float32), width)))
    fixed = pa.ListArray.from_arrays(
        pa.array(np.arange(0, (hi - lo) * 4 + 1, 4, dtype=np.int32)), pa.array(np.ones((hi - lo) * 4, np.float32))
    )
    return pa.table({"id": ids, "emb": vectors, "four": fixed})


@pytest.fixture(scope="module")
def ragged_cache(tmp_path_factory) -> Iterator[LocalCache]:
    """`emb` holds 8 floats a row in the first file and 9 in the second (a model changed);
    `four` holds 4 in every row."""
    root = tmp_path_factory.mktemp("ragged")
    catalog = make_catalog(str(root / "wh"), root / "catalog.db")
    catalog.create_namespace("demo")
    table = catalog.create_table("demo.ragged", schema=_rows(0, 1, 8).schema)
    table.append(_rows(0, PER_FILE, 8))
    table.append(_rows(PER_FILE, 2 * PER_FILE, 9))
    with running_cache(table.metadata_location, data_nodes=2) as cache:
        yield cache


def test_a_ragged_list_column_is_refused_before_the_first_batch(ragged_cache):
    dataset = DataCacheDataset(ragged_cache.endpoint, batch_size=1024, columns=["id", "emb"])
    with pytest.raises(ValueError) as refused:
        next(iter(dataset))  # the first batch alone is all 8 wide
    message = str(refused.value)
    assert "column 'emb' holds lists of 8 to 9 values" in message and "before the first batch" in message, message


@pytest.mark.parametrize("workers", [0, 2])
def test_a_filtered_read_is_refused_before_the_first_batch_with_workers_or_without(ragged_cache, workers):
    """A filter's rows were not counted by the head: a lone reader refused at the change of width,
    100 batches in; two DataLoader workers, each reading rows of one width, yielded tensors of
    both widths in one epoch with no error (a review's run)."""
    dataset = DataCacheDataset(ragged_cache.endpoint, batch_size=1024, columns=["id", "emb"], filter="id >= 0")
    loader = DataLoader(
        dataset,
        batch_size=None,
        num_workers=workers,
        **({"multiprocessing_context": "forkserver", "timeout": 60} if workers else {}),
    )
    with pytest.raises(ValueError, match=r"column 'emb' holds lists of 8 to 9 values.*before the first batch"):
        next(iter(loader))
    # A filter that keeps rows of one width reads them.
    one_width = DataCacheDataset(
        ragged_cache.endpoint, batch_size=1024, columns=["id", "emb"], filter=f"id < {PER_FILE}"
    )
    widths = {batch["emb"].shape[1] for batch in one_width}
    assert widths == {8}


def test_a_reader_refuses_rows_that_change_shape_where_the_cache_sent_no_counts():
    """The check that stands where a cache does not send the lengths (one older than its readers)."""
    shapes: dict[str, tuple[int, ...]] = {}
    _check_row_shapes({"emb": torch.zeros(4, 8), "id": torch.zeros(4)}, shapes)
    _check_row_shapes({"emb": torch.zeros(2, 8)}, shapes)
    with pytest.raises(
        ValueError, match=r"column 'emb' holds lists shaped \[8\] in this reader's earlier rows and \[9\]"
    ):
        _check_row_shapes({"emb": torch.zeros(4, 9)}, shapes)


def test_uniform_list_columns_read_as_2d_tensors(ragged_cache):
    batches = list(DataCacheDataset(ragged_cache.endpoint, batch_size=1024, columns=["id", "four"]))
    assert sum(b["id"].shape[0] for b in batches) == 2 * PER_FILE
    assert {tuple(b["four"].shape[1:]) for b in batches} == {(4,)}


def test_the_head_sends_the_ragged_columns_lengths_in_the_table_or_in_a_filters_matches(ragged_cache):
    with CacheClient(ragged_cache.endpoint) as client:
        info = client.get_flight_info(ShardRequest(columns=("id", "emb", "four")))
        assert info_list_lengths(info.app_metadata) == {"emb": (8, 9)}  # `four` is uniform: not sent
        assert info_list_lengths(client.get_flight_info(ShardRequest(columns=("id", "four"))).app_metadata) == {}
        assert info_list_lengths(client.get_flight_info(ShardRequest(filter="id >= 0")).app_metadata) == {"emb": (8, 9)}
        # Each node's matches are of one width, a different one on each: ragged all the same.
        across = f"id < 10 OR id >= {2 * PER_FILE - 10}"
        assert info_list_lengths(client.get_flight_info(ShardRequest(filter=across)).app_metadata) == {"emb": (8, 9)}
        one_width = ShardRequest(filter=f"id >= {PER_FILE}")
        assert info_list_lengths(client.get_flight_info(one_width).app_metadata) == {}


def test_a_conversion_of_ones_own_may_pad_them(ragged_cache):
    class Padded(DataCacheDataset):
        def from_arrow_rb_to_tensor(self, batch):
            lists = batch["emb"].to_pylist()
            return {"emb": np.array([v + [0.0] * (9 - len(v)) for v in lists], dtype=np.float32)}

    shapes = {b["emb"].shape[1] for b in Padded(ragged_cache.endpoint, batch_size=4096, columns=["emb"])}
    assert shapes == {9}


@pytest.mark.parametrize(
    "metadata",
    [
        b"",
        b"not json",
        b'{"list_lengths": [1, 2]}',
        b'{"list_lengths": {"x": 3}}',
        b'{"list_lengths": {"x": ["a", 2]}}',
    ],
)
def test_a_cache_that_sends_no_lengths_is_read_as_none(metadata):
    assert info_list_lengths(metadata) == {}


def test_lists_without_a_tensor_form_say_so_whatever_their_lengths():
    """Padding lists of strings would not make them a tensor: the message says what would."""
    ragged = pa.array([["a"], ["b", "c"]], pa.list_(pa.string()))
    with pytest.raises(TypeError, match="holds lists of string, which have no tensor form"):
        column_to_tensor("tags", ragged)


def test_the_suggested_null_filter_quotes_a_name_holding_a_double_quote():
    message = null_refusal('we"ird', pa.int64(), 1)
    suggested = message.split("filter='", 1)[1].split("'", 1)[0]
    assert suggested == '"we""ird" IS NOT NULL'
    batch = pa.record_batch({'we"ird': pa.array([1, None], pa.int64())})
    assert matching_rows(NodeStore(batch.schema, [batch]), suggested).tolist() == [0]  # DataFusion reads it
