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
    yield from _served(tmp_path_factory, "ragged", [_rows(0, PER_FILE, 8), _rows(PER_FILE, 2 * PER_FILE, 9)])


def _served(tmp_path_factory, name: str, files: list[pa.Table]) -> Iterator[LocalCache]:
    """A table of ``files`` (one append each), served by a 2-node cache."""
    root = tmp_path_factory.mktemp(name)
    catalog = make_catalog(str(root / "wh"), root / "catalog.db")
    catalog.create_namespace("demo")
    table = catalog.create_table(f"demo.{name}", schema=files[0].schema)
    for rows in files:
        table.append(rows)
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


def _nested(lo: int, hi: int, inner: int) -> pa.Table:
    """Rows of 2 inner lists of ``inner`` ints each, and a list of strings, null every 7th row."""
    n = hi - lo
    values = pa.array(np.arange(n * 2 * inner, dtype=np.int64))
    inner_lists = pa.ListArray.from_arrays(pa.array(np.arange(0, n * 2 * inner + 1, inner, dtype=np.int32)), values)
    outer = pa.ListArray.from_arrays(pa.array(np.arange(0, n * 2 + 1, 2, dtype=np.int32)), inner_lists)
    tags = pa.array([None if i % 7 == 0 else [str(i)] for i in range(lo, hi)], pa.list_(pa.string()))
    return pa.table({"id": np.arange(lo, hi, dtype=np.int64), "grid": outer, "tags": tags})


@pytest.fixture(scope="module")
def nested_cache(tmp_path_factory) -> Iterator[LocalCache]:
    """`grid` holds 2 lists of 2 ints a row in the first file and 2 lists of 1 in the second:
    every row's own list holds 2, only the inner lists change."""
    yield from _served(tmp_path_factory, "nested", [_nested(0, PER_FILE, 2), _nested(PER_FILE, 2 * PER_FILE, 1)])


def test_lists_of_lists_whose_inner_lists_change_are_refused_before_the_first_batch(nested_cache):
    """Only the outer lengths were counted: 100 batches in, one reader failed alone (its DDP
    peers left waiting), saying the column held lists of 1 to 2 values, which every row's did not."""
    dataset = DataCacheDataset(nested_cache.endpoint, batch_size=1024, columns=["id", "grid"])
    with pytest.raises(
        ValueError,
        match=r"column 'grid' holds lists 2 deep \(inside its lists\) of 1 to 2 values.*before the first batch",
    ):
        next(iter(dataset))
    filtered = DataCacheDataset(nested_cache.endpoint, batch_size=1024, columns=["id", "grid"], filter="id >= 0")
    with pytest.raises(ValueError, match=r"lists 2 deep \(inside its lists\) of 1 to 2 values.*the filter's rows"):
        next(iter(filtered))
    # The rows of one shape read as 3-D tensors.
    one_shape = DataCacheDataset(
        nested_cache.endpoint, batch_size=1024, columns=["id", "grid"], filter=f"id < {PER_FILE}"
    )
    shapes = {tuple(b["grid"].shape[1:]) for b in one_shape}
    assert shapes == {(2, 2)}


def test_the_inner_lengths_are_counted_by_the_nodes_and_sent_where_they_differ(nested_cache):
    from kubeflow_data_cache.protocol import info_inner_list_lengths

    with CacheClient(nested_cache.endpoint) as client:
        info = client.get_flight_info(ShardRequest(columns=("id", "grid")))
        assert info_list_lengths(info.app_metadata) == {}  # every row holds 2 lists
        assert info_inner_list_lengths(info.app_metadata) == {"grid": [(1, 2)]}
        one_shape = client.get_flight_info(ShardRequest(columns=("grid",), filter=f"id >= {PER_FILE}"))
        assert info_inner_list_lengths(one_shape.app_metadata) == {}
    batch = _nested(0, 5, 3).to_batches()[0]
    store = NodeStore(batch.schema, [batch.slice(0, 2), batch.slice(2)])
    assert store.inner_list_lengths == {"grid": [[3, 3]]}
    assert store.figures_of(np.array([1, 3]))["inner_list_lengths"] == {"grid": [[3, 3]]}


def test_a_ragged_inner_list_met_in_conversion_is_named_as_such():
    grid = pa.array([[[1, 2], [3, 4]], [[5], [6]]], pa.list_(pa.list_(pa.int64())))
    with pytest.raises(ValueError, match=r"column 'grid' holds lists 2 deep \(inside its lists\) of 1 to 2 values"):
        column_to_tensor("grid", grid)


def test_null_lists_without_a_tensor_form_are_refused_for_their_type_not_their_nulls(nested_cache):
    """The null refusal suggested filter='"tags" IS NOT NULL', which only led to "no tensor form"."""
    dataset = DataCacheDataset(nested_cache.endpoint, batch_size=1024, columns=["id", "tags"])
    with pytest.raises(TypeError, match="column 'tags' holds lists of string, which have no tensor form"):
        next(iter(dataset))
    assert null_refusal("tags", pa.list_(pa.string()), 3) is None


def test_a_column_without_a_tensor_form_is_refused_on_a_rank_whose_shard_is_empty(nested_cache):
    """Refused at the first batch, a rank whose shard held no row (a small or filtered table)
    never refused it, and went on to its next collective while its peers failed."""
    dataset = DataCacheDataset(
        nested_cache.endpoint, batch_size=1024, columns=["id", "tags"], filter="id < 1", rank=1, world_size=2
    )
    with pytest.raises(
        TypeError, match=r"'tags' holds lists of string, which have no .*refused before the first batch"
    ):
        next(iter(dataset))


def test_a_chunked_column_is_converted_as_one():
    """`table.column(name)` in an overridden hook is a ChunkedArray: to_numpy(writable=...) failed."""
    chunked = pa.chunked_array([[1, 2], [3]], pa.int64())
    assert column_to_tensor("x", chunked).tolist() == [1, 2, 3]
