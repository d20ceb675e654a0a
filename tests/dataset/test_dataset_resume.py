"""Resume mid-epoch from a saved state: no row repeated, none skipped."""

from __future__ import annotations

import json
import multiprocessing
import pickle
import subprocess
import sys
import textwrap
import warnings
from copy import deepcopy

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from kubeflow_data_cache.client import CacheClient
from kubeflow_data_cache.dataset import DataCacheDataset, RepeatedEpochWarning, World
from kubeflow_data_cache.shared_epoch import SharedInt, SharedInts

ROWS = 10_000  # small_table (tests/conftest.py)


@pytest.fixture(scope="module")
def cache(small_cache):
    return small_cache


def make(cache, **kwargs) -> DataCacheDataset:
    return DataCacheDataset(cache.endpoint, batch_size=100, columns=["id"], shuffle=True, seed=5, **kwargs)


def ids_of(batches) -> list[int]:
    return [int(i) for b in batches for i in b["id"]]


# Batches of 100 handed out before the save: inside the first 1024-row turn of the first node's
# stream, past the first round of both nodes' turns, and deep into the shard.
@pytest.mark.parametrize("taken", [4, 13, 37])
def test_resume_continues_the_same_order(cache, taken):
    world = World(1, 2, 0, 1)
    reference = make(cache)
    reference.set_epoch(2)
    full = ids_of(reference._iter_world(world))

    first = make(cache)
    first.set_epoch(2)
    it = first._iter_world(world)
    head = ids_of(next(it) for _ in range(taken))
    state = first.state_dict()
    assert (state["epoch"], state["shard"], state["num_shards"], state["rows"]) == (2, 1, 2, 100 * taken)

    resumed = make(cache)
    resumed.load_state_dict(state)
    assert resumed.epoch == 2
    rest = ids_of(resumed._iter_world(world))
    assert head + rest == full
    # The saved position is used once: the next pass over the epoch starts from the beginning.
    assert ids_of(resumed._iter_world(world)) == full


def test_the_state_is_the_position_of_the_iterator_that_last_handed_out_a_batch(cache):
    """A second iterator made beside a reading one (a shape probe) took the saved position at
    once: a checkpoint then said 0 rows, and resuming from it repeated what had been read."""
    world = World(0, 1, 0, 1)
    ds = make(cache)
    reading = ds._iter_world(world)
    ids_of(next(reading) for _ in range(7))
    probe = ds._iter_world(world)
    assert ds.state_dict()["rows"] == 700, "the probe has handed out nothing yet"
    next(reading)
    assert ds.state_dict()["rows"] == 800
    next(probe)  # now the probe is the one reading
    assert ds.state_dict()["rows"] == 100
    reading.close(), probe.close()


def test_a_position_saved_and_loaded_through_torch_distributed_checkpoint_resumes(cache, tmp_path):
    """DCP flattens nested dicts into keys and loads into the state of a fresh dataset: a state
    holding a dict (the snapshot) failed with "Missing key in checkpoint state_dict"."""
    import torch.distributed.checkpoint as dcp

    saving = make(cache)
    reading = iter(saving)
    ids_of(next(reading) for _ in range(3))
    dcp.save({"data": saving}, checkpoint_id=str(tmp_path / "ckpt"))
    rest = ids_of(reading)
    resumed = make(cache)
    dcp.load({"data": resumed}, checkpoint_id=str(tmp_path / "ckpt"))
    assert resumed.state_dict()["rows"] == 300
    assert ids_of(resumed) == rest


def test_resume_rejects_other_settings_or_shards(cache):
    ds = make(cache)
    it = ds._iter_world(World(0, 2, 0, 1))
    next(it)
    state = ds.state_dict()
    with pytest.raises(ValueError, match="seed: saved 5, now 6"):
        DataCacheDataset(cache.endpoint, batch_size=100, columns=["id"], shuffle=True, seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match=r"columns: saved \['id'\], now \['id', 'label'\]"):
        DataCacheDataset(cache.endpoint, batch_size=100, columns=["id", "label"], shuffle=True, seed=5).load_state_dict(
            state
        )
    other = make(cache)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="saved state is for shard 0 of 2, but this reader is shard 0 of 3"):
        next(other._iter_world(World(0, 3, 0, 1)))
    # Moving to another epoch drops the saved position instead of applying it there.
    moved = make(cache)
    moved.load_state_dict(state)
    moved.set_epoch(1)
    assert moved.state_dict()["rows"] == 0
    assert len(ids_of(moved._iter_world(World(0, 2, 0, 1)))) == ROWS // 2
    # But not to an epoch before the saved one: the loop then read that epoch, and the saved one
    # again after it, counting one behind (a resume's start epoch off by one).
    later = make(cache)
    later.load_state_dict({**state, "epoch": 3})
    with pytest.raises(ValueError, match=r"set_epoch\(2\): the loaded state is a position in epoch 3, which comes"):
        later.set_epoch(2)
    later.set_epoch(3)
    assert later.state_dict()["rows"] == state["rows"]


@pytest.mark.parametrize(
    ("setting", "changed"),
    [
        ("seed", {"seed": 6}),
        ("columns", {"columns": ["id", "label"]}),
        ("filter", {"filter": "id >= 0"}),  # another row set: counts mean other rows
        ("shuffle", {"shuffle": False}),
        ("block_size", {"block_size": 512}),  # another shuffled order
        ("batch_size", {"batch_size": 50}),
        ("even", {"even": "pad"}),
        ("drop_last", {"drop_last": True}),
    ],
)
def test_resume_refuses_a_state_saved_with_any_other_setting(cache, setting, changed):
    """Each setting changes which rows a saved count stands for: resumed under another, rows
    would be repeated or skipped without a word."""
    ds = make(cache)
    it = ds._iter_world(World(0, 2, 0, 1))
    next(it)
    state = ds.state_dict()
    settings = {"batch_size": 100, "columns": ["id"], "shuffle": True, "seed": 5, **changed}
    with pytest.raises(ValueError, match=f"other dataset settings \\(.*{setting}: saved "):
        DataCacheDataset(cache.endpoint, **settings).load_state_dict(state)
    make(cache).load_state_dict(state)  # the same settings take it


@pytest.mark.parametrize("version", [4, None, "3"])
def test_resume_refuses_a_state_of_an_unknown_version(cache, version):
    ds = make(cache)
    it = ds._iter_world(World(0, 2, 0, 1))
    next(it)
    state = {k: v for k, v in ds.state_dict().items() if k != "version"}
    if version is not None:
        state["version"] = version
    with pytest.raises(ValueError, match="not a DataCacheDataset state"):
        make(cache).load_state_dict(state)


def loader(ds: DataCacheDataset) -> StatefulDataLoader:
    # forkserver and a timeout: see WORKERS in test_dataset_loader.py.
    return StatefulDataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="forkserver", timeout=60)


def test_stateful_dataloader_with_workers_resumes_mid_epoch(cache):
    ds = make(cache)
    ds.set_epoch(1)
    first = loader(ds)
    it = iter(first)
    seen = [next(it)["id"] for _ in range(7)]
    state = first.state_dict()
    del it

    again = make(cache)
    again.set_epoch(1)
    second = loader(again)
    second.load_state_dict(state)
    seen += [b["id"] for b in second]
    ids = torch.cat(seen).numpy()
    assert len(ids) == ROWS and np.array_equal(np.sort(ids), np.arange(ROWS))


def test_a_state_from_a_finished_epoch_does_not_rewind_a_later_one(cache):
    """The checkpoint is taken after epoch 4; the resumed loop runs epoch 5 (set_epoch first,
    as the docs show, or after StatefulDataLoader stored the state): epoch 5's order, all of it."""
    world = World(0, 1, 0, 1)
    done = make(cache)
    done.set_epoch(4)
    assert len(ids_of(done._iter_world(world))) == ROWS
    state = done.state_dict()
    assert (state["epoch"], state["rows"]) == (4, 0)  # read to its end: nothing left to resume

    reference = make(cache)
    reference.set_epoch(5)
    epoch5 = ids_of(reference._iter_world(world))

    resumed = make(cache)
    resumed.set_epoch(5)
    resumed.load_state_dict(state)
    assert resumed.epoch == 5
    assert ids_of(resumed._iter_world(world)) == epoch5


def test_stateful_dataloader_resumed_after_a_finished_epoch_reads_the_next(cache):
    ds = make(cache)
    ds.set_epoch(4)
    first = loader(ds)
    epoch4 = torch.cat([b["id"] for b in first]).numpy()
    state = first.state_dict()

    fresh = make(cache)
    fresh.set_epoch(5)
    epoch5 = torch.cat([b["id"] for b in loader(fresh)]).numpy()

    again = make(cache)
    again.set_epoch(5)
    second = loader(again)
    second.load_state_dict(state)
    again.set_epoch(5)
    ids = torch.cat([b["id"] for b in second]).numpy()
    assert again.epoch == 5
    assert len(ids) == ROWS and np.array_equal(np.sort(ids), np.arange(ROWS))
    assert np.array_equal(ids, epoch5) and not np.array_equal(ids, epoch4)


def test_a_read_run_to_its_end_leaves_nothing_to_resume_and_one_not_ended_its_empty_rest(cache):
    """A state saved once an epoch's read had ended (an unshuffled loop that never calls
    set_epoch, say) made the resumed run's next read of that epoch yield nothing: an epoch
    silently skipped. A read that handed out every row but has not ended yet resumes to its end."""
    ended = make(cache)
    assert len(ids_of(ended)) == ROWS
    state = ended.state_dict()
    assert (state["epoch"], state["rows"]) == (0, 0)
    resumed = make(cache)
    resumed.load_state_dict(state)
    assert sorted(ids_of(resumed)) == list(range(ROWS))

    handed_out = make(cache)
    batches = iter(handed_out)
    assert len(ids_of(next(batches) for _ in range(ROWS // 100))) == ROWS  # batches of 100
    state = handed_out.state_dict()
    assert (state["epoch"], state["rows"]) == (0, ROWS)
    resumed = make(cache)
    resumed.load_state_dict(state)
    assert ids_of(resumed) == []


def test_stateful_dataloader_without_workers_saves_and_resumes_in_this_process(cache):
    ds = make(cache)
    ds.set_epoch(3)
    first = StatefulDataLoader(ds, batch_size=None, num_workers=0)
    it = iter(first)
    seen = [next(it)["id"] for _ in range(7)]
    assert ds.state_dict()["rows"] == 700  # the main process read: its own position is the real one
    state = first.state_dict()
    del it

    again = make(cache)
    again.set_epoch(3)
    second = StatefulDataLoader(again, batch_size=None, num_workers=0)
    second.load_state_dict(state)
    seen += [b["id"] for b in second]
    ids = torch.cat(seen).numpy()
    assert len(ids) == ROWS and np.array_equal(np.sort(ids), np.arange(ROWS))


# -- a plain DataLoader with workers: its positions are in the workers -----------------------

WORKERS_HOLD_THE_POSITIONS = "positions to save are in the workers"


class _WritesShared(torch.utils.data.IterableDataset):
    """Writes its shared numbers where it is read: in a DataLoader worker."""

    def __init__(self) -> None:
        self.number, self.slots = SharedInt(1), SharedInts(4)

    def __iter__(self):
        self.number.value = 7
        self.slots[2] = -3
        yield 0


def _write_shared(number: SharedInt, slots: SharedInts, out) -> None:
    number.value = 9
    slots[1] = 5
    out.put((number.value, slots.values()))


def test_shared_ints_reach_dataloader_workers_only_and_a_checkpoint_holds_the_numbers():
    for method in ("fork", "spawn", "forkserver"):
        dataset = _WritesShared()
        assert list(
            DataLoader(dataset, batch_size=None, num_workers=1, multiprocessing_context=method, timeout=60)
        ) == [0]
        assert (dataset.number.value, dataset.slots.values()) == (7, [0, 0, -3, 0]), method
    # Any other process handed them (mp.spawn(train, args=(dataset,)), a forked rank) copies
    # them at its first use: every rank wrote the same worker slots and the same epoch.
    for method in ("fork", "spawn"):
        context = multiprocessing.get_context(method)
        shared, slots, out = SharedInt(1), SharedInts(4), context.Queue()
        child = context.Process(target=_write_shared, args=(shared, slots, out))
        child.start()
        assert out.get(timeout=60) == (9, [0, 5, 0, 0]), method
        child.join(60)
        assert child.exitcode == 0 and (shared.value, slots.values()) == (1, [0, 0, 0, 0]), method
    shared.value = 7
    # Pickled outside a process start (torch.save, deepcopy): the number alone, then independent.
    assert shared.__getstate__() == {"value": 7}
    for copy in (pickle.loads(pickle.dumps(shared)), deepcopy(shared)):
        assert copy.value == 7
        copy.value = 8
        assert shared.value == 7
    slots[2] = -3
    assert slots.__getstate__() == {"values": [0, 0, -3, 0]}
    copy = deepcopy(slots)
    copy.clear()
    assert (copy.values(), slots.values()) == ([0, 0, 0, 0], [0, 0, -3, 0])


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_state_dict_beside_a_plain_dataloader_with_workers_raises_mid_epoch_naming_the_fix(cache, context):
    ds = make(cache)
    ds.set_epoch(2)
    assert ds.state_dict()["rows"] == 0  # nothing read anywhere yet: a state like any other
    next(iter(ds))  # a first batch read here (checking shapes) is not the position once workers read
    it = iter(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=context, timeout=60))
    for _ in range(3):
        next(it)
    # Without the check this was a state with 0 (or 100) rows: resuming from it replayed rows.
    with pytest.raises(RuntimeError, match=WORKERS_HOLD_THE_POSITIONS) as err:
        ds.state_dict()
    assert "StatefulDataLoader(dataset, batch_size=None, num_workers=N)" in str(err.value)
    assert "num_workers=0" in str(err.value)
    # Read to its end, the epoch is over: the end-of-epoch checkpoint says nothing of it (the resume
    # loop's set_epoch(3) moves on), rather than refusing.
    assert sum(len(b["id"]) for b in it) + 300 == ROWS
    state = ds.state_dict()
    assert (state["epoch"], state["shard"], state["rows"]) == (2, -1, 0)
    del it
    # The next epoch has not been read by anyone: its state (from its start) is right again.
    ds.set_epoch(3)
    state = ds.state_dict()
    assert (state["epoch"], state["rows"]) == (3, 0)


# Forked workers (the default start method) run in a fresh interpreter: a child forked from this
# test process, which other suites leave with gRPC in use, cannot read (test_dataset_loader.py).
FORK_SCRIPT = """
import json, sys
from torch.utils.data import DataLoader
from kubeflow_data_cache.dataset import DataCacheDataset

ds = DataCacheDataset(sys.argv[1], batch_size=100, columns=["id"], shuffle=True, seed=5)
it = iter(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60))
rows = sum(len(next(it)["id"]) for _ in range(3))
try:
    out = {"rows": rows, "state": ds.state_dict()}
except RuntimeError as err:
    out = {"rows": rows, "error": str(err)}
print(json.dumps(out))
"""


def test_state_dict_beside_a_plain_dataloader_with_forked_workers_raises(cache):
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FORK_SCRIPT), cache.endpoint],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["rows"] == 300
    assert WORKERS_HOLD_THE_POSITIONS in got.get("error", ""), got
    assert "torchdata.stateful_dataloader.StatefulDataLoader" in got["error"]


def _saved_mid_epoch(cache, world: World, batches: int, **kwargs) -> tuple[dict, list[int]]:
    ds = make(cache, **kwargs)
    ds.set_epoch(3)
    it = ds._iter_world(world)
    head = ids_of(next(it) for _ in range(batches))
    return ds.state_dict(), head


def test_a_shuffled_state_keeps_the_stream_lengths_its_rows_were_counted_in(cache):
    state, _ = _saved_mid_epoch(cache, World(0, 1, 0, 1), 7)
    assert state["streams"] == [ROWS // 2, ROWS // 2]  # two data nodes, half the table each
    unshuffled = DataCacheDataset(cache.endpoint, batch_size=100, columns=["id"])
    next(iter(unshuffled))
    assert unshuffled.state_dict()["streams"] == [ROWS // 2, ROWS // 2]  # kept for the shard's size


def test_an_in_order_resume_follows_the_table_whatever_the_split_but_not_another_table(cache, cache_factory):
    """In order, rows follow the table: a cache with another number of data nodes continues the
    same epoch. A table of another size is another table (or snapshot): resuming by the row
    count was accepted silently, reading some rows twice and others never."""
    world = World(0, 1, 0, 1)

    def in_order(c) -> DataCacheDataset:
        return DataCacheDataset(c.endpoint, batch_size=100, columns=["id"])

    saving = in_order(cache)
    batches = saving._iter_world(world)
    head = ids_of(next(batches) for _ in range(7))
    state = saving.state_dict()
    full = ids_of(in_order(cache)._iter_world(world))
    resumed = in_order(cache_factory(ROWS, 3, data_nodes=3))  # the same table, split in three
    resumed.load_state_dict(state)
    assert head + ids_of(resumed._iter_world(world)) == full
    other = in_order(cache_factory(ROWS + 2_000, 3))
    other.load_state_dict(state)
    with pytest.raises(
        ValueError, match=r"\(10000 matching rows\), but the cache now serves it as snapshot \d+ \(12000"
    ):
        next(other._iter_world(world))
    # Another snapshot of the same size (here another table of as many rows; an append that keeps
    # this shard's size, or a compaction that rewrites the rows in another order): accepted, it
    # read some rows twice and others never.
    same_size = in_order(cache_factory(ROWS, 2))
    same_size.load_state_dict(state)
    with pytest.raises(ValueError, match=r"in snapshot \d+ \(10000 matching rows\), but the cache now serves it as "
                                         r"snapshot \d+ \(10000 matching rows\) \(the cache now holds another snapshot"):  # fmt: skip
        next(same_size._iter_world(world))


def test_an_in_order_padded_shard_that_wraps_resumes_only_on_the_same_split(cache, cache_factory):
    """The last of 3 padded shards of 10,000 rows ends with the table's first 2 rows: with two
    data nodes node 0 streams them first, with one node they come last. Resumed by its row
    count on the other split, the read repeated some rows and left others out, silently."""
    world = World(2, 3, 0, 1)

    def padded(c) -> DataCacheDataset:
        return DataCacheDataset(c.endpoint, batch_size=100, columns=["id"], even="pad")

    full = ids_of(padded(cache)._iter_world(world))
    saving = padded(cache)
    batches = saving._iter_world(world)
    head = ids_of(next(batches) for _ in range(5))
    state = saving.state_dict()
    assert state["streams"] == [2, 3332]  # node 0's stream, read first, holds the 2 wrapped rows
    again = padded(cache)  # the same split resumes
    again.load_state_dict(state)
    assert head + ids_of(again._iter_world(world)) == full
    one_node = cache_factory(ROWS, 3, data_nodes=1)
    alone = ids_of(padded(one_node)._iter_world(world))
    assert sorted(alone) == sorted(full) and alone != full  # the same rows, the wrapped ones last
    resumed = padded(one_node)
    resumed.load_state_dict(state)
    with pytest.raises(ValueError, match=r"streams of \[2, 3332\] rows, but the cache now serves it as streams of"):
        next(resumed._iter_world(world))


def test_resuming_against_a_cache_that_splits_the_shard_otherwise_is_refused(cache, cache_factory):
    """Another number of data nodes interleaves a shuffled shard otherwise: the saved row count
    would then mean other rows, and the read would repeat some and leave others out."""
    state, _ = _saved_mid_epoch(cache, World(0, 1, 0, 1), 7)
    three_nodes = cache_factory(ROWS, 3, data_nodes=3)  # the same table (small_table), three nodes
    resumed = make(three_nodes)
    resumed.load_state_dict(state)
    with pytest.raises(ValueError, match=r"streams of \[5000, 5000\] rows, but the cache now serves it as streams of"):
        next(resumed._iter_world(World(0, 1, 0, 1)))


@pytest.mark.parametrize("uneven", [False, True], ids=["equal-streams", "uneven-streams"])
def test_a_state_without_stream_lengths_resumes_only_where_the_order_is_unchanged(cache, uneven):
    """Equal streams: the order before stream lengths were kept was the same, so it resumes.
    Uneven ones (2,500 rows against 5,000): that order was a plain rotation, now spread; refused."""
    world = World(0, 1, 0, 1)
    filter_ = _uneven_filter(cache) if uneven else None
    full = ids_of(_epoch(cache, world, filter_))
    state, head = _saved_mid_epoch(cache, world, 13, filter=filter_)
    del state["streams"]  # as an older version saved it
    resumed = make(cache, filter=filter_)
    resumed.load_state_dict(state)
    if not uneven:
        assert head + ids_of(resumed._iter_world(world)) == full
    else:
        with pytest.raises(ValueError, match="a split this version cannot tell"):
            next(resumed._iter_world(world))


def _node_ids(cache) -> list[list[int]]:
    """The ids each data node holds (which depends on the order of the table's files, named by UUIDs)."""
    request = make(cache).shard_request(World(0, 1, 0, 1))
    with CacheClient(cache.endpoint) as client:
        endpoints = client.get_flight_info(request).endpoints
        return [[i for b in client.read_endpoint(request, e) for i in b.column("id").to_pylist()] for e in endpoints]


def _uneven_filter(cache) -> str:
    """Every row of node 1 and every other row of node 0: about 2,500 against 5,000."""
    node_1 = " OR ".join(f"id BETWEEN {a} AND {b}" for a, b in _runs(_node_ids(cache)[1]))
    return f"id % 2 = 0 OR {node_1}"


def _epoch(cache, world: World, filter_: str | None):
    ds = make(cache, filter=filter_)
    ds.set_epoch(3)
    return ds._iter_world(world)


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted ids as (first, last) runs of consecutive values."""
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return [(a, b) for a, b in runs]


def test_a_node_with_fewer_matching_rows_is_spread_over_the_shuffled_epoch(cache):
    """A filter keeps every row of node 1 and every other row of node 0 (2,500 against 5,000):
    node 0's rows are spread through the epoch instead of all given out at its start (a plain
    rotation of the two streams left the last ~40% of every epoch without a row of node 0)."""
    world = World(0, 1, 0, 1)
    ids = ids_of(_epoch(cache, world, _uneven_filter(cache)))
    node_0 = set(_node_ids(cache)[0])
    assert sum(1 for i in ids if i in node_0) == sum(1 for i in node_0 if i % 2 == 0)  # about 2,500
    assert node_0 & set(ids[int(len(ids) * 0.7) :])


def test_a_refused_resume_leaves_the_saved_split_in_the_state(cache, cache_factory):
    """state_dict after the refusal still says which split its rows were counted in, so saving
    it again and resuming on the new cache is refused again rather than accepted."""
    state, _ = _saved_mid_epoch(cache, World(0, 1, 0, 1), 7)
    three_nodes = cache_factory(ROWS, 3, data_nodes=3)
    resumed = make(three_nodes)
    resumed.load_state_dict(state)
    with pytest.raises(ValueError, match="split otherwise"):
        next(resumed._iter_world(World(0, 1, 0, 1)))
    again = resumed.state_dict()
    assert again["streams"] == [ROWS // 2, ROWS // 2] and again["rows"] == state["rows"]
    retried = make(three_nodes)
    retried.load_state_dict(again)
    with pytest.raises(ValueError, match="split otherwise"):
        next(retried._iter_world(World(0, 1, 0, 1)))


def test_states_are_version_3_and_older_ones_are_still_read(cache):
    world = World(0, 1, 0, 1)
    state, _ = _saved_mid_epoch(cache, world, 5)
    assert state["version"] == 3  # a client before the order checks refuses it instead of misreading it
    assert state["order"] == 2  # counted in the order this cache streams (protocol.ORDER_VERSION)
    # A shuffled version 1 state was counted in the block order before nodes dealt their windows:
    # the same count means other rows now, so it is read but its resume refused, naming both.
    old = {k: v for k, v in state.items() if k not in ("streams", "order")} | {"version": 1}
    resumed = make(cache)
    resumed.load_state_dict(old)
    with pytest.raises(ValueError, match="in shuffled order 1, but the cache now serves it as order 2"):
        next(resumed._iter_world(world))
    # In order, a version 1 state resumes where it stopped.
    in_order = DataCacheDataset(cache.endpoint, batch_size=100, columns=["id"])
    batches = in_order._iter_world(world)
    head = ids_of(next(batches) for _ in range(5))
    old = {k: v for k, v in in_order.state_dict().items() if k not in ("streams", "order")} | {"version": 1}
    again = DataCacheDataset(cache.endpoint, batch_size=100, columns=["id"])
    again.load_state_dict(old)
    full = ids_of(DataCacheDataset(cache.endpoint, batch_size=100, columns=["id"])._iter_world(world))
    assert head + ids_of(again._iter_world(world)) == full


def test_a_shuffled_state_counted_in_another_order_is_refused(cache):
    """A checkpoint from a cache version whose nodes ordered shuffled streams otherwise (tickets
    without ``order``: the block order) resumed on this one would repeat rows and skip others."""
    world = World(0, 1, 0, 1)
    state, _ = _saved_mid_epoch(cache, world, 9)
    resumed = make(cache)
    resumed.load_state_dict(state | {"order": 1})
    with pytest.raises(ValueError, match="the cache's version changed how its data nodes order a shuffled stream"):
        next(resumed._iter_world(world))
    version_2 = make(cache)  # saved by the client before orders were kept: taken as the block order
    version_2.load_state_dict({k: v for k, v in state.items() if k != "order"} | {"version": 2})
    with pytest.raises(ValueError, match="in shuffled order 1, but the cache now serves it as order 2"):
        next(version_2._iter_world(world))
    again = make(cache)
    again.load_state_dict(state)  # counted in this cache's own order: resumes
    next(again._iter_world(world))


def test_columns_in_another_order_resume_the_same_rows(cache):
    """The order of ``columns`` orders a batch's keys, not its rows: a state saved with one order
    resumes under another."""
    world = World(0, 1, 0, 1)
    first = DataCacheDataset(cache.endpoint, batch_size=100, columns=["id", "label"], shuffle=True, seed=5)
    it = first._iter_world(world)
    head = [i for batch in (next(it) for _ in range(3)) for i in batch["id"].tolist()]
    resumed = DataCacheDataset(cache.endpoint, batch_size=100, columns=["label", "id"], shuffle=True, seed=5)
    resumed.load_state_dict(first.state_dict())
    rest = [i for batch in resumed._iter_world(world) for i in batch["id"].tolist()]
    assert sorted(head + rest) == list(range(ROWS))


@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffled"])
def test_a_position_loaded_here_is_used_once_by_the_workers_that_take_it(cache, shuffle):
    """Loaded in this process and read by a DataLoader's workers: each pass starts new workers,
    and each took the position again from this process's copy (only the worker's copy was
    used up). Every pass of the epoch after the first left out the same 3,000 rows."""
    world = World(0, 1, 0, 1)

    def fresh() -> DataCacheDataset:
        return DataCacheDataset(cache.endpoint, batch_size=100, columns=["id"], shuffle=shuffle, seed=5)

    first = fresh()
    it = first._iter_world(world)
    head = ids_of(next(it) for _ in range(30))
    state = first.state_dict()
    it.close()

    resumed = fresh()
    resumed.load_state_dict(state)
    workers = DataLoader(resumed, batch_size=None, num_workers=1, multiprocessing_context="forkserver", timeout=60)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RepeatedEpochWarning)  # the same epoch on purpose
        passes = [ids_of(workers) for _ in range(3)]
        assert sorted(head + passes[0]) == list(range(ROWS))
        assert [sorted(p) for p in passes[1:]] == [list(range(ROWS))] * 2
        assert resumed.state_dict()["rows"] == 0, "used: nothing left to resume"
        # Loaded again, it is used again, once.
        resumed.load_state_dict(state)
        assert resumed.state_dict()["rows"] == 3000
        assert [len(ids_of(workers)) for _ in range(2)] == [ROWS - 3000, ROWS]


def _position_after(cache, world: World, batches: int) -> dict:
    """The state of an unshuffled reader of ``world`` after ``batches`` batches of 100."""
    first = DataCacheDataset(cache.endpoint, batch_size=100, columns=["id"])
    it = first._iter_world(world)
    ids_of(next(it) for _ in range(batches))
    state = first.state_dict()
    it.close()
    return state


def test_a_position_loaded_here_is_refused_by_every_other_shards_worker_however_they_start(cache):
    """A position of shard 0 of 2 read by two workers: worker 1 has none to resume. It refused
    it only when it started before worker 0 took the position (2 runs in 8)."""
    state = _position_after(cache, World(0, 1, 0, 2), batches=10)
    for _ in range(3):
        resumed = DataCacheDataset(cache.endpoint, batch_size=100, columns=["id"])
        resumed.load_state_dict(state)
        workers = DataLoader(resumed, batch_size=None, num_workers=2, multiprocessing_context="forkserver", timeout=60)
        with pytest.raises(ValueError, match="the saved state is for shard 0 of 2, but this reader is shard 1 of 2"):
            ids_of(workers)


def test_one_ranks_state_loaded_on_another_rank_names_the_checkpoint_per_rank():
    """A checkpoint saved on rank 0 only and loaded on every rank was told to "resume with the
    same ranks", which it had."""
    ds = DataCacheDataset("grpc://127.0.0.1:1", batch_size=100)  # refused before any call
    ds.load_state_dict({**ds.state_dict(), "shard": 0, "num_shards": 2, "rows": 100})  # rank 0's, 100 rows in
    with pytest.raises(ValueError, match=r"shard 0 of 2, but this reader is shard 1 of 2: each reader resumes its own "
                                         r"position: save every rank's state_dict\(\) and load it back on that rank"):  # fmt: skip
        next(ds._iter_world(World(1, 2, 0, 1)))


def test_a_position_used_by_one_split_is_gone_for_a_later_pass_of_another(cache):
    """Used by a 1-worker pass (shard 0 of 1), then the epoch read again by 2 workers: they
    refused it as the position of another split, though it had been used."""
    resumed = DataCacheDataset(cache.endpoint, batch_size=100, columns=["id"])
    resumed.load_state_dict(_position_after(cache, World(0, 1, 0, 1), batches=30))

    def read(workers: int) -> list[int]:
        return ids_of(
            DataLoader(resumed, batch_size=None, num_workers=workers, multiprocessing_context="forkserver", timeout=60)
        )

    assert len(read(1)) == ROWS - 3000
    assert sorted(read(2)) == list(range(ROWS))


def test_persistent_workers_started_before_a_load_leave_no_stale_position(cache):
    """They never see a position loaded after they started, and read the epoch whole: the state
    after that said the loaded position (a checkpoint resumed from it left 3,000 rows out)."""
    state = _position_after(cache, World(0, 1, 0, 1), batches=30)
    ds = DataCacheDataset(cache.endpoint, batch_size=100, columns=["id"])
    loader = DataLoader(
        ds, batch_size=None, num_workers=1, persistent_workers=True, multiprocessing_context="forkserver", timeout=60
    )
    assert len(ids_of(loader)) == ROWS
    ds.load_state_dict(state)
    assert ds.state_dict()["rows"] == 3000, "loaded, not yet read"
    assert len(ids_of(loader)) == ROWS, "the persistent worker never saw the load"
    assert ds.state_dict()["rows"] == 0


class _LastBatchLate(DataCacheDataset):
    """Hands out a shard's 1-row last batch a second late: the other worker's part has run out by
    then, and StatefulDataLoader has kept that worker's state from its end."""

    def from_arrow_rb_to_tensor(self, batch):
        if batch.num_rows == 1:
            import time

            time.sleep(1.0)
        return super().from_arrow_rb_to_tensor(batch)


# 2,049 rows over two workers: 1,025 (batches of 1,024 and 1) and 1,024 (one batch).
UNEVEN = {"batch_size": 1024, "columns": ["id"], "shuffle": True, "seed": 5, "filter": "id < 2049"}


def _stateful(ds: DataCacheDataset, persistent: bool, **options) -> StatefulDataLoader:
    return StatefulDataLoader(
        ds,
        batch_size=None,
        num_workers=2,
        multiprocessing_context="forkserver",
        timeout=60,
        persistent_workers=persistent,
        **options,
    )


@pytest.mark.parametrize("persistent", [False, True], ids=["workers", "persistent-workers"])
def test_a_worker_whose_part_ran_out_first_is_not_read_again_on_resume(cache, persistent):
    """A worker's state from the end of its part said "nothing read", and StatefulDataLoader
    keeps it while the other workers read on: a checkpoint then resumed that worker from its
    start, 1,024 rows read twice."""
    first = _stateful(_LastBatchLate(cache.endpoint, **UNEVEN), persistent)
    batches = iter(first)
    seen = [next(batches)["id"] for _ in range(3)]  # every row, the loop not ended
    assert sorted(len(b) for b in seen) == [1, 1024, 1024]
    state = first.state_dict()
    workers = state["_snapshot"]["_worker_snapshots"]
    assert sorted(w["dataset_state"]["rows"] for w in workers.values()) == [1024, 1025]
    del batches

    second = _stateful(_LastBatchLate(cache.endpoint, **UNEVEN), persistent)
    second.load_state_dict(state)
    assert [len(b["id"]) for b in second] == []
    assert np.array_equal(np.sort(torch.cat(seen).numpy()), np.arange(2049))


def test_persistent_workers_resumed_from_an_ended_epoch_read_it_again_whole(cache):
    """The loop ended before the save: StatefulDataLoader loads each worker's state, then starts
    a new pass over the same epoch (no set_epoch), and each worker must read its part again,
    not resume the ended one (which would yield nothing)."""
    first = _stateful(_LastBatchLate(cache.endpoint, **UNEVEN), persistent=True)
    assert sorted(len(b["id"]) for b in first) == [1, 1024, 1024]
    state = first.state_dict()

    second = _stateful(_LastBatchLate(cache.endpoint, **UNEVEN), persistent=True)
    second.load_state_dict(state)
    ids = torch.cat([b["id"] for b in second]).numpy()
    assert np.array_equal(np.sort(ids), np.arange(2049))


def test_a_resumed_worker_saved_again_before_its_first_batch_keeps_the_position(cache):
    """A checkpoint right after a resume (a job preempted again at once) holds the loaded
    positions, not "nothing read", though the workers took them when their iterators were made."""
    ds = make(cache)
    first = loader(ds)
    batches = iter(first)
    seen = [next(batches)["id"] for _ in range(7)]
    state = first.state_dict()
    del batches

    second = loader(make(cache))
    second.load_state_dict(state)
    iter(second)  # the workers load the positions and make their iterators
    again = second.state_dict()
    assert sorted(w["dataset_state"]["rows"] for w in again["_snapshot"]["_worker_snapshots"].values()) == sorted(
        w["dataset_state"]["rows"] for w in state["_snapshot"]["_worker_snapshots"].values()
    )

    third = loader(make(cache))
    third.load_state_dict(again)
    ids = torch.cat(seen + [b["id"] for b in third]).numpy()
    assert len(ids) == ROWS and np.array_equal(np.sort(ids), np.arange(ROWS))


@pytest.mark.parametrize("snapshot_every", [1, 8])
def test_a_second_pass_of_persistent_workers_saves_its_own_position(cache, snapshot_every):
    """Persistent workers reading the same epoch again (unshuffled, no set_epoch): each worker's
    state from the end of the first pass was still its state as the second began, before its
    first batch. A checkpoint then resumed half the table as read; with snapshots every 8 steps
    the resumed loader's fast-forward ran out and raised StopIteration."""

    def persistent(ds: DataCacheDataset) -> StatefulDataLoader:
        return _stateful(ds, persistent=True, snapshot_every_n_steps=snapshot_every)

    def unshuffled() -> DataCacheDataset:
        return DataCacheDataset(cache.endpoint, batch_size=1000, columns=["id"])

    first = persistent(unshuffled())
    assert sum(len(b["id"]) for b in first) == ROWS  # the first pass, whole
    batches = iter(first)  # the second pass, same epoch
    seen = [next(batches)["id"]]  # one worker's first batch: the other's snapshot is from the pass's start
    state = first.state_dict()
    del batches

    second = persistent(unshuffled())
    second.load_state_dict(state)
    ids = torch.cat(seen + [b["id"] for b in second]).numpy()
    assert len(ids) == ROWS and np.array_equal(np.sort(ids), np.arange(ROWS))
