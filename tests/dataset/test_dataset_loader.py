"""DataCacheDataset through real DataLoaders: tensors, workers, projection, filter, settings."""

from __future__ import annotations

import multiprocessing
import pickle
import time
from copy import deepcopy

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from kubeflow_data_cache.client import CacheClient
from kubeflow_data_cache.dataset import DataCacheDataset, World, default_endpoint, default_token
from kubeflow_data_cache.errors import BadRequestError, ConfigError, ForkedConnectionError

ROWS = 10_000  # small_table (tests/conftest.py)
# Workers start from a fresh forkserver process: other suites may leave gRPC in use in this
# process, and a forked child cannot use gRPC then (see the fork test below). Never wait forever.
WORKERS = {"num_workers": 2, "multiprocessing_context": "forkserver", "timeout": 60}


@pytest.fixture(scope="module")
def cache(small_cache):
    return small_cache


def test_dataloader_with_two_workers_yields_every_row_once_as_tensors(cache):
    ds = DataCacheDataset(cache.endpoint, batch_size=300, shuffle=True, seed=3)
    batches = list(DataLoader(ds, batch_size=None, **WORKERS))
    ids = torch.cat([b["id"] for b in batches]).numpy()
    assert np.array_equal(np.sort(ids), np.arange(ROWS))
    # Each of the 2 workers (shards of 5000 rows) yields 16 full batches and one of 200 rows.
    assert sorted(len(b["id"]) for b in batches) == [200, 200] + [300] * 32

    b = batches[0]
    assert b["id"].dtype == torch.int64 and b["feature_a"].dtype == torch.float32
    assert b["feature_b"].dtype == torch.float64 and b["label"].dtype == torch.int32
    assert b["flag"].dtype == torch.bool
    assert b["embedding"].shape == (300, 4) and b["embedding"].dtype == torch.float32
    assert isinstance(b["text"], list) and all(isinstance(t, str) for t in b["text"])
    # Every value is a function of id (sample.py): rows arrive intact and aligned.
    ids = b["id"]
    assert torch.equal(b["label"], (ids % 10).to(torch.int32))
    assert torch.equal(b["flag"], ids % 2 == 0)
    assert torch.allclose(b["feature_a"], (ids % 1000).to(torch.float32) / 1000)
    assert torch.equal(b["embedding"][:, 3], ids.to(torch.float32) + 3)
    assert b["text"] == [f"row-{i}" for i in ids.tolist()]


def test_tensors_are_writable_and_do_not_alias_between_batches(cache):
    ds = DataCacheDataset(cache.endpoint, batch_size=100, columns=["id"])
    first, second = [b["id"] for _, b in zip(range(2), ds, strict=False)]
    before = second.clone()
    first += 1_000_000  # in-place ops on a batch must be allowed and stay within it
    assert torch.equal(second, before)


def test_columns_and_filter_are_applied_by_the_cache(cache):
    ds = DataCacheDataset(cache.endpoint, batch_size=64, columns=["id", "label"], filter="label = 3")
    batches = list(ds)
    assert set(batches[0]) == {"id", "label"}
    ids = torch.cat([b["id"] for b in batches])
    assert (torch.cat([b["label"] for b in batches]) == 3).all()
    assert np.array_equal(np.sort(ids.numpy()), np.arange(3, ROWS, 10))


def test_override_hook_converts_whole_record_batches(cache):
    class Features(DataCacheDataset):
        calls: list[int] = []

        def from_arrow_rb_to_tensor(self, batch):
            self.calls.append(batch.num_rows)
            x = np.stack([batch["feature_a"].to_numpy(), batch["feature_b"].to_numpy()], axis=1)
            return torch.from_numpy(x.astype(np.float32)), torch.from_numpy(batch["label"].to_numpy().copy())

    ds = Features(cache.endpoint, batch_size=10, columns=["feature_a", "feature_b", "label"])
    batches = list(ds)
    x, y = batches[0]
    assert x.shape == (10, 2) and y.shape == (10,)
    assert sum(len(y) for _, y in batches) == ROWS
    # Converted once per large run, not once per batch.
    assert len(Features.calls) < len(batches) / 10


def test_a_hook_written_as_upstreams_generator_is_told_the_difference(cache):
    """Upstream's example hook yields each batch_size chunk; this one returns a whole run."""

    class Upstream(DataCacheDataset):
        def from_arrow_rb_to_tensor(self, batch):
            yield {"label": torch.tensor(batch["label"].to_numpy())}

    with pytest.raises(
        TypeError, match=r"returned an iterator \(a generator, as in upstream's example.*return instead of yield"
    ):
        next(iter(Upstream(cache.endpoint, batch_size=10, columns=["label"])))


def test_a_hook_that_changes_the_row_count_is_named(cache):
    class Pairs(DataCacheDataset):
        def from_arrow_rb_to_tensor(self, batch):
            return {"x": torch.zeros(batch.num_rows * 2)}  # one value per pair of rows: wrong

    with pytest.raises(
        ValueError, match=r"from_arrow_rb_to_tensor returned \{'x': \d+\} rows for a \d+-row record batch"
    ):
        next(iter(Pairs(cache.endpoint, batch_size=10, columns=["label"])))


@pytest.mark.parametrize(
    ("convert", "named"),
    [
        # The tuple form of the docs' example, one row short: features would shift against labels.
        (lambda b: (torch.zeros(b.num_rows - 1), torch.zeros(b.num_rows)), r"\{'\[0\]': \d+\}"),
        (lambda b: {"ids": b["label"].to_pylist()[1:], "y": np.zeros(b.num_rows)}, r"\{'ids': \d+\}"),
        (lambda b: {"x": {"y": np.zeros(b.num_rows + 1)}}, r"\{\"x\['y'\]\": \d+\}"),
        # A 0-d tensor has no row dimension: named as such, not a bare TypeError from len().
        (lambda b: {"loss_weight": torch.tensor(1.0), "y": torch.zeros(b.num_rows)}, r"\{'loss_weight': 'a scalar'\}"),
    ],
)
def test_every_form_of_hook_output_is_checked_for_its_row_count(cache, convert, named):
    class Hook(DataCacheDataset):
        def from_arrow_rb_to_tensor(self, batch):
            return convert(batch)

    with pytest.raises(
        ValueError, match=r"from_arrow_rb_to_tensor returned " + named + r" rows for a \d+-row record batch"
    ):
        next(iter(Hook(cache.endpoint, batch_size=10, columns=["label"])))


def test_persistent_workers_follow_set_epoch(cache):
    def epoch_order(dataset, loader, epoch):
        dataset.set_epoch(epoch)
        ids = torch.cat([b["id"] for b in loader]).numpy()
        assert np.array_equal(np.sort(ids), np.arange(ROWS))
        return ids

    ds = DataCacheDataset(cache.endpoint, batch_size=500, columns=["id"], shuffle=True, seed=5)
    loader = DataLoader(ds, batch_size=None, persistent_workers=True, **WORKERS)
    orders = [epoch_order(ds, loader, epoch) for epoch in range(3)]
    # Workers started once, yet each epoch has its own order: the one new workers would read.
    assert not np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[1], orders[2])
    fresh = DataCacheDataset(cache.endpoint, batch_size=500, columns=["id"], shuffle=True, seed=5)
    assert np.array_equal(epoch_order(fresh, DataLoader(fresh, batch_size=None, **WORKERS), 2), orders[2])


def test_set_epoch_between_iter_and_the_first_batch_selects_the_epoch_read(cache):
    """As with DistributedSampler: a loop that makes its iterator, then calls set_epoch, reads
    the epoch it set. The iterator used to fix its epoch at iter(): it read the old epoch's
    order while state_dict() described the new one, so a checkpoint named rows not read."""

    def dataset():
        return DataCacheDataset(cache.endpoint, batch_size=500, columns=["id"], shuffle=True, seed=6)

    reference = dataset()
    reference.set_epoch(1)
    epoch_1 = torch.cat([b["id"] for b in reference]).numpy()

    ds = dataset()
    batches = iter(DataLoader(ds, batch_size=None))
    ds.set_epoch(1)
    first = next(batches)["id"].numpy()
    assert ds.state_dict()["epoch"] == 1 and ds.state_dict()["rows"] == 500
    ids = np.concatenate([first, *(b["id"].numpy() for b in batches)])
    assert np.array_equal(ids, epoch_1)


def _wait_until_every_worker_reads(ds: DataCacheDataset, workers: int, epoch: int) -> None:
    deadline = time.monotonic() + 60
    while ds._worker_reads.values()[:workers] != [epoch + 1] * workers:  # each worker's mark while it reads
        assert time.monotonic() < deadline, f"the workers did not start reading: {ds._worker_reads.values()[:workers]}"
        time.sleep(0.01)


def test_set_epoch_after_iter_with_workers_is_refused_not_read_as_a_mix_of_epochs(cache):
    """Workers start reading as iter(loader) returns: a set_epoch after it left workers that had
    started on the old epoch and any that had not on the new one, so the epoch repeated some rows
    and left out others (5,664 of 20,000 in a review's run), with nothing said."""
    ds = DataCacheDataset(cache.endpoint, batch_size=100, columns=["id"], shuffle=True, seed=8)
    batches = iter(DataLoader(ds, batch_size=None, **WORKERS))
    _wait_until_every_worker_reads(ds, 2, epoch=0)
    ds.set_epoch(1)
    with pytest.raises(RuntimeError, match=r"set_epoch\(1\) was called while DataLoader worker \d was reading epoch 0"):
        for _ in batches:
            pass


@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("loader_class", [DataLoader, StatefulDataLoader])
def test_set_epoch_after_an_epoch_cut_short_reads_the_next_epoch_whole(cache, persistent, loader_class):
    """A loop that breaks out of an epoch (max steps) and then calls set_epoch is no mix: the
    cut epoch's workers are done with (persistent ones still finish the batches asked ahead,
    which torch discards), and the next iter(loader) reads the new epoch in full."""

    def dataset():
        return DataCacheDataset(cache.endpoint, batch_size=100, columns=["id"], shuffle=True, seed=9)

    reference = dataset()
    reference.set_epoch(1)
    epoch_1 = torch.cat([b["id"] for b in DataLoader(reference, batch_size=None, **WORKERS)]).numpy()

    ds = dataset()
    loader = loader_class(ds, batch_size=None, persistent_workers=persistent, **WORKERS)
    for step, _ in enumerate(loader):
        if step == 3:
            break
    ds.set_epoch(1)
    ids = torch.cat([b["id"] for b in loader]).numpy()
    assert np.array_equal(ids, epoch_1)


def _set_epoch_in(ds: DataCacheDataset, epoch: int, out) -> None:
    ds.set_epoch(epoch)
    out.put(ds.epoch)


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_a_process_handed_the_dataset_that_is_no_dataloader_worker_has_its_own_epoch(method):
    """mp.spawn(train, args=(dataset,)) hands the dataset over as DataLoader workers get it; the
    ranks then shared one epoch, and each rank's workers wrote the same slots as the others'."""
    ds = DataCacheDataset("grpc://127.0.0.1:1", shuffle=True)
    ds.set_epoch(3)
    context = multiprocessing.get_context(method)
    out = context.Queue()
    rank = context.Process(target=_set_epoch_in, args=(ds, 7, out))
    rank.start()
    assert out.get(timeout=60) == 7
    rank.join(60)
    assert rank.exitcode == 0 and ds.epoch == 3


def _epochs_in_a_rank(ds: DataCacheDataset, epochs: int, out) -> None:
    """A rank's loop: persistent forked workers made before the rank touched the epoch, then
    set_epoch after each epoch, as the docs ask."""
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True, multiprocessing_context="fork")
    for epoch in range(epochs):
        out.put(torch.cat([b["id"] for b in loader]).tolist())
        ds.set_epoch(epoch + 1)


def test_a_handed_over_rank_reaches_its_persistent_forked_workers_with_set_epoch(cache):
    """A rank handed the dataset (mp.spawn(train, args=(dataset,))) that forked its DataLoader
    workers before it first used the epoch left them on the memory it was handed; its set_epoch
    went to its own copy, and every epoch repeated epoch 0's shuffle (a review's run), with only a
    warning to call set_epoch, which it did."""

    def dataset() -> DataCacheDataset:
        return DataCacheDataset(cache.endpoint, batch_size=100, columns=["id"], shuffle=True, seed=5)

    expected = []
    for epoch in range(3):
        reference = dataset()
        reference.set_epoch(epoch)
        expected.append(torch.cat([b["id"] for b in DataLoader(reference, batch_size=None, **WORKERS)]).tolist())
    assert expected[0] != expected[1] != expected[2]
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    rank = context.Process(target=_epochs_in_a_rank, args=(dataset(), 3, out))
    rank.start()
    try:
        got = [out.get(timeout=120) for _ in range(3)]
    finally:
        rank.join(60)
    assert rank.exitcode == 0
    for epoch in range(3):
        assert got[epoch] == expected[epoch], f"epoch {epoch}"


def test_a_copy_of_the_dataset_has_its_own_epoch():
    ds = DataCacheDataset("grpc://127.0.0.1:1", shuffle=True)
    ds.set_epoch(4)
    for copy in (pickle.loads(pickle.dumps(ds)), deepcopy(ds)):
        assert copy.epoch == 4
        copy.set_epoch(7)
        assert ds.epoch == 4


def test_forked_worker_fails_clearly_when_the_parent_holds_a_connection(cache):
    parent = CacheClient(cache.endpoint)
    assert parent.status()["state"] == "ready"  # an open gRPC channel in this process
    loader = DataLoader(DataCacheDataset(cache.endpoint), batch_size=None, num_workers=1, timeout=60)
    try:
        with pytest.raises(ForkedConnectionError, match="multiprocessing_context='forkserver'"):
            next(iter(loader))
    finally:
        parent.close()


def test_world_detection_from_env_and_worker():
    assert World.detect({"RANK": "1", "WORLD_SIZE": "3"}) == World(1, 3, 0, 1)
    assert World.detect({}) == World(0, 1, 0, 1)
    assert World(1, 2, 1, 3).shard == 4 and World(1, 2, 1, 3).num_shards == 6
    with pytest.raises(ConfigError, match="`RANK` should be an integer, got 'one'"):
        World.detect({"RANK": "one", "WORLD_SIZE": "2"})
    # Named as the env has them, with the fix: "rank 2 is out of range" said neither.
    for rank, size in (("2", "2"), ("-1", "2"), ("0", "0")):
        with pytest.raises(ConfigError, match=rf"RANK={rank} and WORLD_SIZE={size} \(from the environment\)"):
            World.detect({"RANK": rank, "WORLD_SIZE": size})
    # An empty value is unset, on both sides: RANK="" beside WORLD_SIZE=2 read as rank 0 of 2.
    with pytest.raises(ConfigError, match="`WORLD_SIZE` is set but `RANK` is not"):
        World.detect({"RANK": "", "WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="`RANK` is set but `WORLD_SIZE` is not"):
        World.detect({"RANK": "1", "WORLD_SIZE": " "})
    assert World.detect({"RANK": "", "WORLD_SIZE": ""}) == World(0, 1, 0, 1)
    # One without the other: every process would read as rank 0, duplicating rows silently.
    with pytest.raises(ConfigError, match="`WORLD_SIZE` is set but `RANK` is not"):
        World.detect({"WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="`RANK` is set but `WORLD_SIZE` is not"):
        World.detect({"RANK": "1"})
    # ...but a world of one says so with either alone.
    assert World.detect({"WORLD_SIZE": "1"}) == World.detect({"RANK": "0"}) == World(0, 1, 0, 1)


@pytest.mark.parametrize("name", ["PET_NNODES", "OMPI_COMM_WORLD_SIZE"])
def test_a_launch_of_several_processes_without_rank_is_refused(name):
    """A TrainJob whose command is `python train.py` gets Kubeflow's PET_* and no RANK: every
    process read as the only one, and read every row (twice the table for two), with no error."""
    with pytest.raises(ConfigError, match=rf"`{name}=2` says this is one of several processes, but `RANK`"):
        World.detect({name: "2"})
    assert World.detect({name: "1"}) == World(0, 1, 0, 1)
    assert World.detect({name: "2", "RANK": "1", "WORLD_SIZE": "2"}) == World(1, 2, 0, 1)
    assert World.detect({name: "2"}, explicit=(0, 1)) == World(0, 1, 0, 1)  # rank= and world_size= given
    # One process per node that torchrun did not start: its per-node count is torchrun's to use.
    assert World.detect({"PET_NNODES": "1", "PET_NPROC_PER_NODE": "4"}) == World(0, 1, 0, 1)


def test_an_explicit_rank_and_world_size_shard_over_the_data_parallel_group(cache, monkeypatch):
    """With tensor or pipeline parallelism the data-parallel group is not the whole world: peers
    that must see the same batch pass the group's rank, which wins over torch.distributed and the
    env (as DistributedSampler's num_replicas and rank do)."""
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    halves = [DataCacheDataset(cache.endpoint, batch_size=1000, columns=["id"], rank=r, world_size=2) for r in (0, 1)]
    ids = [torch.cat([b["id"] for b in half]).tolist() for half in halves]
    assert len(ids[0]) == len(ids[1]) == 5_000
    assert sorted(ids[0] + ids[1]) == list(range(10_000))
    assert halves[1].batches_per_epoch() == 5
    with pytest.raises(ValueError, match="rank is given but world_size is not"):
        DataCacheDataset(cache.endpoint, rank=1)
    with pytest.raises(ValueError, match=r"rank should be an integer from 0 to world_size - 1 \(1\), got 2"):
        DataCacheDataset(cache.endpoint, rank=2, world_size=2)
    with pytest.raises(ValueError, match="world_size should be a positive integer, got 0"):
        DataCacheDataset(cache.endpoint, rank=0, world_size=0)


def test_endpoint_and_token_settings(tmp_path, monkeypatch):
    assert default_endpoint({"DATA_CACHE_ENDPOINT": "grpc://c:1", "TRAIN_JOB_NAME": "j"}) == "grpc://c:1"
    assert default_endpoint({"TRAIN_JOB_NAME": "job-a"}) == "grpc://job-a-cache-service:50051"
    with pytest.raises(ConfigError, match="set DATA_CACHE_ENDPOINT"):
        default_endpoint({})
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    assert default_token({"DATA_CACHE_TOKEN_FILE": str(token_file)}) == "s3cret"
    assert default_token({"DATA_CACHE_TOKEN": "a", "DATA_CACHE_TOKEN_FILE": str(token_file)}) == "a"
    with pytest.raises(ConfigError, match="DATA_CACHE_TOKEN_FILE .*missing"):
        default_token({"DATA_CACHE_TOKEN_FILE": str(tmp_path / "missing")})
    # Set but empty (a Secret key that is there but empty): refused, as the cache refuses it,
    # rather than read as "no token" and refused later by the cache in other words.
    for empty in ("", "  "):
        with pytest.raises(ConfigError, match="DATA_CACHE_TOKEN is set but empty"):
            default_token({"DATA_CACHE_TOKEN": empty})

    for name in ("DATA_CACHE_ENDPOINT", "TRAIN_JOB_NAME", "DATA_CACHE_TOKEN", "DATA_CACHE_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="no cache endpoint"):
        DataCacheDataset()
    monkeypatch.setenv("TRAIN_JOB_NAME", "job-b")
    monkeypatch.setenv("DATA_CACHE_TOKEN_FILE", str(token_file))
    ds = DataCacheDataset()
    assert (ds.endpoint, ds.token) == ("grpc://job-b-cache-service:50051", "s3cret")
    # A token from the environment is checked at construction too, naming where it came from
    # (not at the first batch inside a DataLoader worker), and never shown.
    token_file.write_text("\n")
    with pytest.raises(ConfigError, match="DATA_CACHE_TOKEN_FILE .* is empty"):
        DataCacheDataset()
    monkeypatch.setenv("DATA_CACHE_TOKEN", "s3cret\n")
    with pytest.raises(ConfigError, match="DATA_CACHE_TOKEN holds a line break") as refused:
        DataCacheDataset()
    assert "s3cret" not in str(refused.value)
    monkeypatch.setenv("DATA_CACHE_TOKEN", "s3cret ")
    with pytest.raises(ConfigError, match="DATA_CACHE_TOKEN starts or ends with a space") as refused:
        DataCacheDataset()
    assert "s3cret" not in str(refused.value)


def test_drop_last_implies_even_drop_and_arguments_are_checked():
    assert DataCacheDataset("grpc://h:1", drop_last=True).even == "drop"
    assert DataCacheDataset("grpc://h:1", drop_last=True, even="pad").even == "pad"
    assert DataCacheDataset("grpc://h:1").even is None
    with pytest.raises(ValueError, match="even should be one of"):
        DataCacheDataset("grpc://h:1", even="trim")
    with pytest.raises(ValueError, match="batch_size should be a positive integer"):
        DataCacheDataset("grpc://h:1", batch_size=0)
    with pytest.raises(ValueError, match="drop_last should be True or False, got 'no'"):
        DataCacheDataset("grpc://h:1", drop_last="no")
    # A string is a sequence of letters: "id" would have asked for columns 'i' and 'd'.
    with pytest.raises(ValueError, match=r"got the string 'id': try \['id'\]"):
        DataCacheDataset("grpc://h:1", columns="id")
    # A set's order differs between processes (hash seeds): keys and saved states would too.
    with pytest.raises(ValueError, match=r"got a set: try \['id', 'label'\]"):
        DataCacheDataset("grpc://h:1", columns={"label", "id"})
    # In Python's words: the protocol's refusal said "or be null".
    with pytest.raises(BadRequestError, match="at least one column, or be None for all of them"):
        DataCacheDataset("grpc://h:1", columns=[])
    # A generator is read once: checked and kept from the same read.
    assert DataCacheDataset("grpc://h:1", columns=(c for c in ["id", "label"])).shard_request(World()).columns == (
        "id",
        "label",
    )
    with pytest.raises(BadRequestError, match=r"names \['id'\] more than once"):
        DataCacheDataset("grpc://h:1", columns=["id", "label", "id"])


def test_an_endpoint_that_is_not_grpc_is_refused_with_the_form_it_takes():
    for endpoint in ("http://h:1", "h:1", "grpc:/h:1"):
        with pytest.raises(ValueError, match="should be a grpc://, grpc\\+tls://, grpc\\+tcp:// or grpc\\+unix:// URI"):
            CacheClient(endpoint)
        # The dataset checks at construction, not at the first batch inside a DataLoader worker.
        with pytest.raises(ValueError, match="should be a grpc://, grpc\\+tls://, grpc\\+tcp:// or grpc\\+unix:// URI"):
            DataCacheDataset(endpoint)
    CacheClient("grpc+tls://h:1").close()
    CacheClient("grpc://[::1]:50051").close()
    with pytest.raises(ValueError, match="tls_root_certs should be PEM certificates"):
        DataCacheDataset("grpc+tls://h:1", tls_root_certs=b"garbage")
    # Without a port gRPC would quietly dial 443.
    for endpoint in ("grpc://127.0.0.1", "grpc+tls://cache", "grpc://h:port"):
        with pytest.raises(ValueError, match="^endpoint should name its port"):
            DataCacheDataset(endpoint)
    for endpoint, port in (("grpc://h:0", 0), ("grpc://h:70000", 70000)):
        with pytest.raises(ValueError, match=f"^endpoint names port {port}, outside 1 to 65535"):
            DataCacheDataset(endpoint)


def test_an_endpoint_from_the_environment_is_named_with_what_is_wrong(monkeypatch):
    """An env file's stray space or a port past 65535 read as "should name its port", and as if
    the argument had been wrong."""
    monkeypatch.setenv("DATA_CACHE_ENDPOINT", "grpc://cache:50051 ")
    with pytest.raises(ValueError, match="^DATA_CACHE_ENDPOINT has spaces around it"):
        DataCacheDataset()
    monkeypatch.setenv("DATA_CACHE_ENDPOINT", "grpc://cache:99999")
    with pytest.raises(ValueError, match="^DATA_CACHE_ENDPOINT names port 99999, outside 1 to 65535"):
        DataCacheDataset()


@pytest.mark.parametrize(
    ("endpoint", "says"),
    [
        # Each was refused as "names port N, outside 1 to 65535", which was not the trouble.
        ("grpc://fd00::5:50051", r"an IPv6 address without its brackets: write grpc://\[fd00::5\]:50051"),
        ("grpc://fd00::5", r"an IPv6 address without its brackets: write grpc://\[fd00::5\]:50051"),
        ("grpc://[fd00::5:50051", r"opens a \[ it does not close"),
        ("grpc://host:50051:1", "has more than one ':' after its host"),
        # Taken at construction, then refused at the first batch (in a DataLoader worker) as if
        # the cache had "rejected" the request.
        ("grpc://my host:50051", "is not a URI Flight can dial"),
        ("grpc://ho%st:50051", "is not a URI Flight can dial"),
    ],
)
def test_an_endpoint_gRPC_cannot_dial_is_refused_at_construction_saying_why(endpoint, says):
    with pytest.raises(ValueError, match=f"^the cache endpoint .*{says}"):
        CacheClient(endpoint)
    with pytest.raises(ValueError, match=f"^endpoint .*{says}"):
        DataCacheDataset(endpoint)


def test_an_endpoint_made_from_a_job_name_it_cannot_carry_names_that_variable(monkeypatch):
    monkeypatch.delenv("DATA_CACHE_ENDPOINT", raising=False)
    monkeypatch.setenv("TRAIN_JOB_NAME", "my job")
    with pytest.raises(ValueError, match="^the endpoint made from TRAIN_JOB_NAME is not a URI Flight can dial"):
        DataCacheDataset()


def test_an_empty_endpoint_or_a_token_no_header_can_carry_is_refused(monkeypatch):
    monkeypatch.setenv("DATA_CACHE_ENDPOINT", "grpc://elsewhere:50051")
    # An empty value (from a config file, say) is a mistake, not "use the environment".
    with pytest.raises(
        ValueError, match=r"should be a grpc://, grpc\+tls://, grpc\+tcp:// or grpc\+unix:// URI .*, got ''"
    ):
        DataCacheDataset("")
    assert DataCacheDataset().endpoint == "grpc://elsewhere:50051"
    secret = "s3cret\n"
    for token, refusal in (
        ("", "token is empty"),
        (secret, "a line break, a control or a non-ASCII character"),
        ("caf\u00e9", "non-ASCII"),
        # A copy-paste slip the cache refuses too: "the token was rejected" would not say why.
        (" s3cret", "token starts or ends with a space"),
        (123, "token should be the cache's token as a string, or None; got a int"),
        (b"s3cret", "got a bytes"),
    ):
        with pytest.raises(ValueError, match=refusal) as refused:
            DataCacheDataset("grpc://h:1", token=token)
        assert "s3cret" not in str(refused.value)  # a token is never shown
        with pytest.raises(ValueError, match=refusal):
            CacheClient("grpc://h:1", token=token)
    assert DataCacheDataset("grpc://h:1", token="a.b-c_d~e+f/g=").token == "a.b-c_d~e+f/g="


def test_numeric_arguments_take_numpy_integers_and_refuse_what_cannot_work():
    ds = DataCacheDataset("grpc://h:1", batch_size=np.int64(64))
    assert ds.batch_size == 64 and type(ds.batch_size) is int
    ds.set_epoch(np.int32(3))
    assert ds.epoch == 3
    # epoch + 1 is a worker's mark in the shared int64 slots: the largest epoch is 2**63 - 2.
    for epoch in (-1, 2**63 - 1, 2**63, 1.0, True):
        with pytest.raises(ValueError, match=r"epoch should be an integer in \[0, 9223372036854775807\)"):
            ds.set_epoch(epoch)
    ds.set_epoch(2**63 - 2)
    assert ds.epoch == 2**63 - 2
    assert DataCacheDataset("grpc://h:1", deadline_seconds=np.int64(30)).deadline_seconds == 30
    picked = DataCacheDataset("grpc://h:1", shuffle=True, seed=np.int64(3), block_size=np.int32(64))
    assert (picked.shard_request(World()).seed, picked.shard_request(World()).block_size) == (3, 64)
    # Every bad argument is a ValueError, those the request checks (BadRequestError) included.
    for bad in ({"seed": -1}, {"seed": 1.5}, {"block_size": 0}, {"columns": []}, {"filter": 3}):
        with pytest.raises(ValueError):
            DataCacheDataset("grpc://h:1", **bad)
    for deadline in (0, -1, float("inf"), float("nan"), "10", True):
        with pytest.raises(ValueError, match="deadline_seconds should be a number of seconds > 0"):
            DataCacheDataset("grpc://h:1", deadline_seconds=deadline)
