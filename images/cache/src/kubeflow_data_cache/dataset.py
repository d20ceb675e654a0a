"""``DataCacheDataset``: a torch IterableDataset that streams one shard of the cache per reader.

Readers are ranks x DataLoader workers; reader ``rank * num_workers + worker_id`` asks the head
for that shard of the epoch's order and yields ready-made batches. Conversion runs once per
large Arrow record batch (vectorized), then the tensors are sliced into ``batch_size`` pieces,
so no Python code runs per row (except for string columns, which become lists of ``str``).
See docs/dataset.md. torch is the package's optional ``torch`` extra: only this module imports it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from multiprocessing.context import get_spawning_popen
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.flight as flight
import torch
from torch.utils.data import IterableDataset, get_worker_info

from kubeflow_data_cache.allocator import trim_glibc_malloc_above
from kubeflow_data_cache.client import (
    DEFAULT_DEADLINE_SECONDS,
    CacheClient,
    KeptClient,
    check_deadline_seconds,
    check_endpoint,
    check_root_certs,
    check_server_name,
    check_token,
    int_arg,
    plaintext_with_root_certs,
)
from kubeflow_data_cache.constants import JOB_CACHE_SERVICE_SUFFIX
from kubeflow_data_cache.errors import BadRequestError, ConfigError
from kubeflow_data_cache.interleave import rotation_order
from kubeflow_data_cache.protocol import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_BLOCK_SIZE,
    EVEN_MODES,
    ShardRequest,
    SnapshotRows,
    info_inner_list_lengths,
    info_list_lengths,
    info_matching_rows,
    info_null_counts,
    info_table,
)
from kubeflow_data_cache.row_bytes import varies as varies_in_size
from kubeflow_data_cache.security import (
    TLS_DIR_ENV,
    TLS_SERVER_NAME_ENV,
    checked_server_name,
    checked_token,
    is_tls,
    read_token_file,
    tls_folder,
)
from kubeflow_data_cache.shared_epoch import SharedInt, SharedInts

__all__ = ["DataCacheDataset", "World", "column_to_tensor", "default_endpoint"]

CACHE_PORT = 50051
# 2: a shuffled state keeps its stream lengths ("streams"), and its rows count in the spread
# order (interleave.py); a client before that would resume it in another order, so it refuses
# version 2. 3: a state also keeps the shuffled order its rows were counted in ("order",
# protocol.ORDER_VERSION; absent: 1) and an in-order one its stream lengths, both checked on
# resume; a client before that would not check them, so it refuses version 3. Versions 1 and 2
# are still read.
STATE_VERSION = 3
READABLE_STATE_VERSIONS = (1, 2, 3)
# Rows converted per call of from_arrow_rb_to_tensor: large enough that per-call overhead
# vanishes, small enough to bound the memory held between batches; with wide rows, fewer, so a
# run holds about CONVERT_MAX_BYTES (but always at least one batch).
CONVERT_ROWS = DEFAULT_BATCH_SIZE
CONVERT_MAX_BYTES = 8 << 20
# Free heap a reader keeps between epochs (more is handed back to the OS when an epoch ends).
KEEP_FREE_HEAP_BYTES = 256 << 20
# Batches a run's tensors are split into at once (each a view object per column, ~600 bytes).
SPLIT_VIEWS = 1024
# Rows per transfer batch asked of the data nodes (each caps a batch at 4 MiB of the requested
# columns). In order, a node sends zero-copy slices and larger messages cut gRPC's per-message
# cost: a 2M-row, 3-column epoch took ~20% less time at 2**18 than at 2**16 here. Shuffled,
# every batch is a gather on the node, which overlaps better with sending in smaller ones.
TRANSFER_ROWS_IN_ORDER = 1 << 18
TRANSFER_ROWS_SHUFFLED = DEFAULT_BATCH_SIZE
# set_epoch's bound: epoch + 1 must fit the signed 64-bit shared slots.
MAX_EPOCH = 2**63 - 1
# Slots for DataLoader workers to say which epoch they read (worker i writes slot i % this).
WORKER_SLOTS = 256


def default_endpoint(env: dict[str, str] | None = None, tls: bool = False) -> str:
    """``DATA_CACHE_ENDPOINT``, else the TrainJob's cache service (over TLS where ``tls``: the
    trainer holds the cache's certificate), else a ConfigError."""
    env = os.environ if env is None else env
    if env.get("DATA_CACHE_ENDPOINT"):
        return env["DATA_CACHE_ENDPOINT"]
    if env.get("TRAIN_JOB_NAME"):
        return f"{'grpc+tls' if tls else 'grpc'}://{env['TRAIN_JOB_NAME']}{JOB_CACHE_SERVICE_SUFFIX}:{CACHE_PORT}"
    raise ConfigError(
        "no cache endpoint: pass endpoint='grpc://host:port', set DATA_CACHE_ENDPOINT, "
        "or run inside a TrainJob (which sets TRAIN_JOB_NAME)"
    )


def _endpoint_source(env: dict[str, str] | None = None) -> str:
    """Where default_endpoint found the endpoint, for error messages."""
    env = os.environ if env is None else env
    return "DATA_CACHE_ENDPOINT" if env.get("DATA_CACHE_ENDPOINT") else "the endpoint made from TRAIN_JOB_NAME"


def default_tls_root_certs(env: dict[str, str] | None = None) -> bytes | None:
    """The certificate to trust from ``DATA_CACHE_TLS_DIR``, a TLS Secret's folder: its
    ``ca.crt``, else its ``tls.crt`` (self-signed); None where the variable is unset or the
    folder holds neither (the runtime mounts the Secret as optional: no Secret, no TLS)."""
    env = os.environ if env is None else env
    folder = env.get(TLS_DIR_ENV)
    if not folder:
        return None
    found = tls_folder(folder)
    path = found.ca or found.cert
    if path is None:
        return None
    try:
        pem = Path(path).read_bytes()
    except OSError as err:
        raise ConfigError(f"{TLS_DIR_ENV} {folder!r}: cannot read {path}: {err.strerror}") from None
    try:
        check_root_certs(pem)
    except ValueError:
        raise ConfigError(f"{TLS_DIR_ENV} {folder!r}: {path} holds no PEM certificate; check the TLS Secret") from None
    return pem


def default_tls_server_name(env: dict[str, str] | None = None) -> str | None:
    """``DATA_CACHE_TLS_SERVER_NAME``: the name checked in the cache's certificate, or None."""
    env = os.environ if env is None else env
    return checked_server_name(env.get(TLS_SERVER_NAME_ENV) or None, TLS_SERVER_NAME_ENV)


def default_token(env: dict[str, str] | None = None) -> str | None:
    """``DATA_CACHE_TOKEN``, else the contents of ``DATA_CACHE_TOKEN_FILE``, else None."""
    env = os.environ if env is None else env
    if "DATA_CACHE_TOKEN" in env:
        if not env["DATA_CACHE_TOKEN"].strip():  # as the cache refuses it: sending none would read as "no token"
            raise ConfigError("DATA_CACHE_TOKEN is set but empty: put the cache's token in it, or unset it")
        return checked_token(env["DATA_CACHE_TOKEN"], "DATA_CACHE_TOKEN")
    path = env.get("DATA_CACHE_TOKEN_FILE")
    return None if path is None else read_token_file(path)


def _env_int(env: dict[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"`{name}` should be an integer, got {raw!r}") from None


# Launchers' variables that say this process is one of several, where RANK and WORLD_SIZE say
# nothing: Kubeflow Trainer's node count (a TrainJob of several nodes whose command is
# `python train.py` runs it once on each, with no RANK) and Open MPI's. Not its
# PET_NPROC_PER_NODE: that is torchrun's to use (the CPU count, for `auto`), one process without it.
LAUNCH_SIZE_VARIABLES = ("PET_NNODES", "OMPI_COMM_WORLD_SIZE")


def _refuse_a_launch_without_rank(env: dict[str, str]) -> None:
    """Refuse to read as the only process where a launcher says there are several: each one read
    every row of the table (twice the rows for two, with no error)."""
    for name in LAUNCH_SIZE_VARIABLES:
        raw = env.get(name, "").strip()
        if raw.isdecimal() and int(raw) > 1:
            raise ConfigError(
                f"`{name}={raw}` says this is one of several processes, but `RANK` and `WORLD_SIZE` are not set, "
                "so each process would read every row: launch with torchrun (it sets both), set them, or pass "
                "rank= and world_size= to DataCacheDataset"
            )


def _data_parallel(rank: Any, world_size: Any) -> tuple[int, int] | None:
    """The dataset's own ``(rank, world_size)``, checked; None to detect them."""
    if rank is None and world_size is None:
        return None
    if rank is None or world_size is None:
        given, missing = ("rank", "world_size") if rank is not None else ("world_size", "rank")
        raise ValueError(f"{given} is given but {missing} is not: give both (the data-parallel group's), or neither")
    r, w = int_arg(rank), int_arg(world_size)
    if w is None or w < 1:
        raise ValueError(f"world_size should be a positive integer, got {world_size!r}")
    if r is None or not 0 <= r < w:
        raise ValueError(f"rank should be an integer from 0 to world_size - 1 ({w - 1}), got {rank!r}")
    return r, w


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _caller_outside_package() -> int:
    """The ``stacklevel`` that points a warning given here at the first frame outside this
    package: the training loop that asked for the batch (or torch's DataLoader code in a
    worker), however deep in a read the warning is found."""
    level, frame = 1, sys._getframe(1)  # the frame that calls warnings.warn
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep):
        frame, level = frame.f_back, level + 1
    return level


class RepeatedEpochWarning(UserWarning):
    """A shuffled epoch read again without ``set_epoch``: the same order as the last read."""


class EmptyEpochWarning(UserWarning):
    """An epoch in which no reader yields a batch, though the table (or filter) has rows: ``even``
    or ``drop_last`` leaves every shard nothing to yield."""


@dataclass(frozen=True)
class World:
    """Who is reading: this process's rank and DataLoader worker, hence its shard."""

    rank: int = 0
    world_size: int = 1
    worker_id: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        if not (0 <= self.rank < self.world_size):
            raise ConfigError(f"rank {self.rank} is out of range for world size {self.world_size}")
        if not (0 <= self.worker_id < self.num_workers):
            raise ConfigError(f"worker {self.worker_id} is out of range for {self.num_workers} DataLoader workers")

    @property
    def shard(self) -> int:
        return self.rank * self.num_workers + self.worker_id

    @property
    def num_shards(self) -> int:
        return self.world_size * self.num_workers

    @classmethod
    def detect(
        cls,
        env: dict[str, str] | None = None,
        parent: tuple[int, int] | None = None,
        explicit: tuple[int, int] | None = None,
    ) -> World:
        """The rank and world size from ``explicit`` (the dataset's own: a data-parallel group
        that is not the whole world), else torch.distributed when initialized, else ``parent``
        (the process group of the process that started this one: a spawn or forkserver
        DataLoader worker), else ``RANK``/``WORLD_SIZE``; and the DataLoader worker. The
        parent's group comes before the env: a launcher's per-pod RANK/WORLD_SIZE need not be
        the group's."""
        env = os.environ if env is None else env
        dist = torch.distributed
        if explicit is not None:
            rank, world_size = explicit
        elif dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
        elif parent is not None:
            rank, world_size = parent
        else:
            # An empty value counts as unset, here as in _env_int: RANK="" beside WORLD_SIZE=2 was
            # read as rank 0 of 2 in every process, with no error.
            rank_text, size_text = env.get("RANK", "").strip(), env.get("WORLD_SIZE", "").strip()
            has_rank, has_size = bool(rank_text), bool(size_text)
            # One without the other is fine only for a world of one (RANK=0, or WORLD_SIZE=1).
            alone_ok = rank_text in ("", "0") and size_text in ("", "1")
            if has_rank != has_size and not alone_ok:
                # Each process would read as rank 0 (or as the only one): duplicated rows, no error.
                given, missing = ("RANK", "WORLD_SIZE") if has_rank else ("WORLD_SIZE", "RANK")
                raise ConfigError(
                    f"`{given}` is set but `{missing}` is not (or is empty): set both (torchrun does), or neither "
                    "for one process"
                )
            if not has_rank and not has_size:
                _refuse_a_launch_without_rank(env)
            rank, world_size = _env_int(env, "RANK", 0), _env_int(env, "WORLD_SIZE", 1)
            if not 0 <= rank < world_size:
                raise ConfigError(
                    f"RANK={rank} and WORLD_SIZE={world_size} (from the environment): RANK should be in "
                    f"[0, WORLD_SIZE) and WORLD_SIZE at least 1; set them as torchrun does, or pass rank= and "
                    "world_size= to DataCacheDataset"
                )
        info = get_worker_info()
        if info is None:
            return cls(rank, world_size)
        return cls(rank, world_size, info.id, info.num_workers)


@dataclass
class _Progress:
    """Rows this reader has handed out in the current epoch: what state_dict saves."""

    epoch: int
    shard: int
    num_shards: int
    rows: int = 0
    # A shuffled read's stream lengths (rows per data node in this shard): the interleaved order,
    # hence what a row count means, depends on them. None until the head has answered.
    streams: list[int] | None = None
    # The order the nodes stream a shuffled shard in (protocol.ORDER_VERSION), which a row count
    # means as much as the lengths. None until the head has answered, or unshuffled.
    order: int | None = None
    # The snapshot and matching rows the head said the rows are counted in (protocol.info_table):
    # a position means other rows in another snapshot, even where this shard's size is the same.
    # None until the head has answered, or from a cache that does not say.
    table: SnapshotRows | None = None
    # The read ran to its end (the iterator raised StopIteration), not only handed out its rows.
    done: bool = False


class DataCacheDataset(IterableDataset):
    """Stream the cached table as batches: a dict of column name to tensor (or list of str).

    ``even`` makes every shard the same size so every rank yields the same number of batches
    (DDP needs that): ``"drop"`` leaves out up to ``num_shards - 1`` rows per epoch, ``"pad"``
    repeats as many (with more shards than rows, a row more than twice). ``drop_last=True`` also
    drops each shard's final partial batch, so every batch has exactly ``batch_size`` rows; it
    implies ``even="drop"`` unless ``even`` is given.
    With neither, every row is yielded exactly once per epoch over all ranks and workers.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        batch_size: int = 1024,
        columns: Sequence[str] | None = None,
        filter: str | None = None,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        token: str | None = None,
        even: str | None = None,
        tls_root_certs: bytes | None = None,
        deadline_seconds: float = DEFAULT_DEADLINE_SECONDS,
        block_size: int = DEFAULT_BLOCK_SIZE,
        tls_server_name: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        super().__init__()
        self._data_parallel = _data_parallel(rank, world_size)
        size = int_arg(batch_size)
        if size is None or size < 1:
            raise ValueError(f"batch_size should be a positive integer, got {batch_size!r}")
        if not isinstance(drop_last, bool):
            raise ValueError(f"drop_last should be True or False, got {drop_last!r}")
        if isinstance(columns, str):
            raise ValueError(f"columns should be a list of column names, got the string {columns!r}: try [{columns!r}]")
        if isinstance(columns, (set, frozenset)):
            # A set's order changes from process to process: batches' keys, and saved states, with it.
            raise ValueError(
                f"columns should be a list of column names in the order wanted, got a set: try {sorted(columns)!r}"
            )
        if columns is not None:
            columns = list(columns)  # once: a generator read twice is empty the second time
            if not columns:
                # The protocol's own refusal says "or be null", a word from its JSON, not from Python.
                raise BadRequestError("columns should name at least one column, or be None for all of them")
        if even is not None and even not in EVEN_MODES:
            raise ValueError(f"even should be one of {EVEN_MODES} or None, got {even!r}")
        check_deadline_seconds(deadline_seconds)
        if tls_root_certs is not None:
            check_root_certs(tls_root_certs)
        self.tls_root_certs = tls_root_certs if tls_root_certs is not None else default_tls_root_certs()
        check_server_name(tls_server_name)
        self.tls_server_name = tls_server_name if tls_server_name is not None else default_tls_server_name()
        # None, not any false value, means "from the environment": an empty string from a config
        # file is a mistake to name, not a reason to connect wherever the environment points.
        self.endpoint = endpoint if endpoint is not None else default_endpoint(tls=self.tls_root_certs is not None)
        # Here, not at the first batch inside a DataLoader worker; naming where the value came from.
        source = "endpoint" if endpoint is not None else _endpoint_source()
        check_endpoint(self.endpoint, source)
        if self.tls_root_certs is not None and not is_tls(self.endpoint):
            if tls_root_certs is not None:  # asked for TLS in so many words: reading in clear is no answer
                raise ValueError(plaintext_with_root_certs(self.endpoint, source))
            warnings.warn(  # maybe another cache, plain on purpose: said, not refused
                f"{TLS_DIR_ENV} {os.environ.get(TLS_DIR_ENV)} holds the cache's certificate, but {source} "
                f"{self.endpoint} is plaintext, so it is not used: the token and rows travel in clear. Dial "
                "grpc+tls:// to read over TLS",
                stacklevel=2,
            )
            self.tls_root_certs = None  # as said: the client refuses certificates with a plaintext endpoint
        check_token(token)
        self.token = token if token is not None else default_token()
        self.batch_size = size
        self.drop_last = drop_last
        self.even = even if even is not None else ("drop" if drop_last else None)
        self.deadline_seconds = deadline_seconds
        # Validated now (bad seed, columns, filter type) rather than in a DataLoader worker.
        # numpy integers (np.int64 from a config or an RNG) count as integers, as for batch_size.
        seed, block_size = (v if (n := int_arg(v)) is None else n for v in (seed, block_size))
        self._request = ShardRequest(
            seed=seed,
            shuffle=shuffle,
            columns=tuple(columns) if columns is not None else None,
            filter=filter,
            batch_size=TRANSFER_ROWS_SHUFFLED if shuffle else TRANSFER_ROWS_IN_ORDER,
            even=self.even,
            block_size=block_size,
        )
        self._epoch = SharedInt()  # set_epoch reaches persistent DataLoader workers (shared_epoch.py)
        # Per DataLoader worker: epoch + 1 while it reads that epoch, -(epoch + 1) once it read it
        # to the end, 0 before. Tells state_dict in the main process that the positions to save
        # are in the workers, not here (a plain DataLoader's workers read their own copies).
        self._worker_reads = SharedInts(WORKER_SLOTS)
        # 1 once the head answered a reader of this dataset, in any process: a plain DataLoader's
        # workers are new every epoch, and a head that stopped answering in a later one was
        # reported as an address to check (set DATA_CACHE_ENDPOINT), not as the head.
        self._head_answered = SharedInt()
        self._finished_epoch: int | None = None  # the epoch this process last read to the end
        # Set once the repeat warning was given, in any worker: said once per dataset, not per
        # worker per epoch (a plain DataLoader starts new workers every epoch).
        self._repeat_warned = SharedInt()
        self._empty_warned = SharedInt()  # the same, for EmptyEpochWarning
        # One connection to the cache, kept from epoch to epoch (client.KeptClient).
        self._connection = KeptClient()
        self._progress: _Progress | None = None
        self._resume: dict[str, Any] | None = None
        # A position loaded in this process is copied into every DataLoader worker started after,
        # each pass's new ones too, while only the copy that reads is used up: set (to the taker's
        # shard count) once a reader took it, so it is used once, as in this process. A worker's
        # own load (StatefulDataLoader hands each its position) is its own, and does not go
        # through this.
        self._resume_loaded_here = False
        self._resume_taken = SharedInt()

    @property
    def shuffle(self) -> bool:
        return self._request.shuffle

    @property
    def epoch(self) -> int:
        return self._epoch.value

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (its shuffle order), like DistributedSampler.set_epoch: before the
        epoch's ``iter(loader)`` (DataLoader workers start reading as it returns)."""
        # Shared with the workers as a signed 64-bit integer, which also holds epoch + 1 (a
        # worker's mark while it reads, shared_epoch.py): so at most 2**63 - 2.
        number = int_arg(epoch)
        if number is None or not 0 <= number < MAX_EPOCH:
            raise ValueError(f"epoch should be an integer in [0, {MAX_EPOCH}), got {epoch!r}")
        epoch = number
        if self._resume is not None and self._resume["epoch"] > epoch:
            # Dropped, as for an earlier epoch, the loop went on to read this epoch (and the saved
            # one again after it), counting epochs one behind: a resume's start epoch off by one.
            saved = self._resume["epoch"]
            raise ValueError(
                f"set_epoch({epoch}): the loaded state is a position in epoch {saved}, which comes after it; "
                f"call set_epoch({saved}) to resume there, or do not load the state to read epoch {epoch} whole"
            )
        if self._resume is not None and self._resume["epoch"] != epoch:
            self._resume = None  # a saved position belongs to its own epoch only: that one is over
        self._epoch.value = epoch

    def close(self) -> None:
        """Close the connection kept between epochs (the next iteration opens a new one)."""
        self._connection.close()

    def shard_request(self, world: World, epoch: int | None = None) -> ShardRequest:
        """The request this reader sends for ``epoch`` (default: the current epoch)."""
        epoch = self.epoch if epoch is None else epoch
        return replace(self._request, shard=world.shard, num_shards=world.num_shards, epoch=epoch)

    def batches_per_epoch(self, num_workers: int = 0) -> int:
        """How many batches this rank yields in the current epoch, read with ``num_workers``
        DataLoader workers (what ``len(loader)`` would be; an LR schedule's or ``max_steps``' input).

        The head answers with each of this rank's shard sizes (filter, ``even`` and the cache's
        current row count included); a deliberate method rather than ``__len__``, because a
        DataLoader asks ``len`` in the main process, which cannot know how many workers read.
        """
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers should be the DataLoader's num_workers (>= 0), got {num_workers!r}")
        me = self._world()
        return self._rank_batches(me.rank, me.world_size, max(1, num_workers))

    def _rank_batches(self, rank: int, world_size: int, readers: int) -> int:
        batches = 0
        with self._lease() as client:
            for worker in range(readers):
                rows = client.get_flight_info(
                    self.shard_request(World(rank, world_size, worker, readers))
                ).total_records
                batches += rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)
        return batches

    # -- iteration ---------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        if get_worker_info() is not None and self._progress is not None and self._progress.done:
            # A new pass in a DataLoader worker (persistent workers; the same epoch again where no
            # set_epoch comes between): the last pass's end is no longer where this worker is.
            # StatefulDataLoader snapshots the worker as the pass starts, before its first batch,
            # and that state said the whole part was read: a resume then read none of it.
            self._progress = None
        return self._iter_world(self._world())

    def _world(self) -> World:
        """This reader, from torch.distributed, the env or the pickling parent (__getstate__)."""
        return World.detect(parent=self.__dict__.get("_parent_world"), explicit=self._data_parallel)

    @contextlib.contextmanager
    def _lease(self) -> Iterator[CacheClient]:
        """The connection kept between epochs, for one read (client.KeptClient.lease), told
        whether the head answered this dataset before."""
        with self._connection.lease(
            self.endpoint, self.token, self.tls_root_certs, self.deadline_seconds, self.tls_server_name
        ) as client:
            if self._head_answered.value:
                client.remember_head_answered()
            try:
                yield client
            finally:
                if client.head_answered and not self._head_answered.value:
                    self._head_answered.value = 1

    def __getstate__(self) -> dict[str, Any]:
        # A spawn or forkserver DataLoader worker starts without the process group, and
        # without RANK/WORLD_SIZE when the group was set up by hand (mp.spawn with a tcp://
        # init_method), or with a launcher's that are not the group's: it would read as rank
        # 0 of 1, every rank the whole table. So the rank travels to the process being started;
        # only there: a checkpoint or a copy of the dataset must not carry this rank elsewhere.
        state = self.__dict__.copy()
        state.pop("_parent_world", None)
        dist = torch.distributed
        if get_spawning_popen() is not None and dist.is_available() and dist.is_initialized():
            state["_parent_world"] = (dist.get_rank(), dist.get_world_size())
        return state

    def _iter_world(self, world: World) -> Iterator[Any]:
        """Set up this reader's epoch at the first ``next()``, then stream.

        A generator, so nothing is fixed at ``iter()``: in this process (``num_workers=0``), like
        DistributedSampler's iterator, one made before ``set_epoch`` (``iter(loader)``, then
        ``set_epoch(e)``, then the first batch) reads epoch ``e``. Set up at ``iter()``, it read
        the epoch before, and state_dict() described epoch ``e`` while the rows handed out were
        the old epoch's. Until the first ``next()`` state_dict() says what it said before the
        iterator was made (the saved position still to resume, or nothing of this epoch read),
        which is where it stands. DataLoader workers start reading as ``iter(loader)`` returns:
        for them set_epoch comes before it (_stream refuses one that came after).

        The epoch is read once: a worker's parent may change it at any moment, and a request for
        one epoch recorded as another's was a state naming rows that were not read."""
        epoch = self.epoch
        request = self.shard_request(world, epoch)
        skip, streams, order, table = self._take_resume(world, epoch)
        slot = None
        if get_worker_info() is not None:
            slot = world.worker_id % WORKER_SLOTS
            # A worker with this id (this one, or its predecessor of a plain DataLoader) read it.
            read_before = self._worker_reads[slot] == -(epoch + 1)
            self._worker_reads[slot] = epoch + 1
        else:  # this process reads now: what workers read before is no longer the position
            read_before = self._finished_epoch == epoch
            self._worker_reads.clear()
        if read_before and self.shuffle and not skip:
            self._warn_repeated_epoch()
        progress = _Progress(epoch, world.shard, world.num_shards, skip, streams, order, table)
        current = self._progress
        # The saved position is that of the iterator that last handed out a batch (_stream): a
        # second iterator made beside a reading one (a probe) takes over only when it yields,
        # unless it resumes or nothing of this epoch was handed out yet.
        if skip or current is None or current.epoch != epoch or not current.rows:
            self._progress = progress
        try:
            yield from self._stream(request, skip, progress, slot)
        finally:
            # The tuned malloc (tune_glibc_malloc) keeps freed batches for reuse, in every thread's
            # arena: with wide rows (256 KiB images) a reader's process held ~1.15 GB of free heap
            # after 10 epochs, more than an epoch's data, in each DataLoader worker. Handed back
            # between epochs, where it is a lot; a little stays for the next epoch's batches.
            trim_glibc_malloc_above(KEEP_FREE_HEAP_BYTES)

    def _stream(self, request: ShardRequest, skip: int, progress: _Progress, slot: int | None) -> Iterator[Any]:
        with self._lease() as client:
            # The nodes leave out the rows a resumed reader handed out before (client.read_shard).
            record_batches = client.read_shard(
                request,
                interleave=request.shuffle,
                start=skip,
                check_streams=lambda lengths, order: _check_streams(request, progress, skip, lengths, order),
                check_info=lambda info: self._check_info(info, request, progress, skip),
                # Signals reach the main thread only: there Ctrl-C (or a handler that saves a
                # checkpoint) must not wait on a frozen node's Flight call (up to a minute). Not in
                # a DataLoader worker, whose parent takes the Ctrl-C: the thread hop costs ~10%.
                interruptible=slot is None and threading.current_thread() is threading.main_thread(),
            )
            # Closed here, not left to the garbage collector: an error raised in this loop (a
            # conversion hook that fails, say) and kept by the caller (a notebook keeps the last
            # one) holds these frames, and with them the streams' threads and gRPC streams open.
            with contextlib.closing(record_batches), contextlib.closing(self._rebatch(record_batches)) as batches:
                for batch, rows in batches:
                    if slot is not None and self.epoch != progress.epoch:
                        raise _epoch_changed_error(progress.epoch, self.epoch, slot)
                    # Counted before the yield: state_dict taken after receiving a batch includes it.
                    progress.rows += rows
                    self._progress = progress
                    yield batch
        # Read to the end (not abandoned): this reader's part of the epoch is done.
        progress.done = True
        if slot is not None:
            self._worker_reads[slot] = -(progress.epoch + 1)
        else:
            self._finished_epoch = progress.epoch

    def _warn_repeated_epoch(self) -> None:
        """Forgetting set_epoch trains every epoch on the first one's order, and nothing fails."""
        if self._repeat_warned.value:
            return
        self._repeat_warned.value = 1
        warnings.warn(
            f"DataCacheDataset(shuffle=True) is reading epoch {self.epoch} again, in the same order as "
            "the last read: call dataset.set_epoch(epoch) before each epoch for a new order (as with "
            "DistributedSampler). To repeat an order on purpose, filter kubeflow_data_cache.dataset."
            "RepeatedEpochWarning.",
            RepeatedEpochWarning,
            stacklevel=_caller_outside_package(),
        )

    def _rebatch(self, record_batches: Iterator[pa.RecordBatch]) -> Iterator[tuple[Any, int]]:
        """Group record batches into runs of ~CONVERT_ROWS, convert each run once, slice it.

        A run is cut at a multiple of ``batch_size``; the remainder starts the next run, so
        every batch but the shard's last has exactly ``batch_size`` rows. A run is also converted
        once it holds CONVERT_MAX_BYTES and a batch: its row target comes from the first batch's
        average row, and rows far longer later (images after thumbnails, long documents after
        short ones) piled up to that many rows, the whole 10 MiB shard of a test table in one
        run sized for 1 MiB.
        """
        size = self.batch_size
        target = 0  # set from the first batch's row width
        pending: list[pa.RecordBatch] = []
        pending_rows = pending_bytes = 0
        fixed_row_bytes = 0.0  # where no column varies in size, every row's bytes (else 0)

        def nbytes(rb: pa.RecordBatch) -> float:
            # A slice's nbytes walks its buffers (~6 us): an interleaved epoch of 1024-row units
            # took 20% longer counting them. Rows of one size are counted by their number.
            return rb.num_rows * fixed_row_bytes if fixed_row_bytes else rb.nbytes

        shapes: dict[str, tuple[int, ...]] = {}  # each list column's row shape, as the first run had it
        for rb in record_batches:
            if rb.num_rows == 0:
                continue
            if not target:
                row_bytes = max(1.0, rb.nbytes / rb.num_rows)
                target = max(size, min(CONVERT_ROWS, int(CONVERT_MAX_BYTES // row_bytes)) // size * size)
                if not any(varies_in_size(field.type) for field in rb.schema):
                    fixed_row_bytes = row_bytes
            if rb.num_rows >= target:
                # A whole transfer batch is converted on its own: no concat copies it. A short tail
                # before it (where one node's stream ended) is completed with its first rows.
                if pending_rows:
                    need = -pending_rows % size
                    pending.append(rb.slice(0, need))
                    yield from self._slices(_concat(pending), size, shapes)
                    rb, pending, pending_rows, pending_bytes = rb.slice(need), [], 0, 0
                full = rb.num_rows // size * size
                if full:
                    yield from self._slices(rb.slice(0, full), size, shapes)
                if full < rb.num_rows:
                    pending, pending_rows = [rb.slice(full)], rb.num_rows - full
                    pending_bytes = nbytes(pending[0])
                continue
            pending.append(rb)
            pending_rows += rb.num_rows
            pending_bytes += nbytes(rb)
            if pending_rows < target and (pending_bytes < CONVERT_MAX_BYTES or pending_rows < size):
                continue
            run = _concat(pending)
            full = pending_rows // size * size
            yield from self._slices(run.slice(0, full), size, shapes)
            pending = [run.slice(full)] if pending_rows > full else []
            pending_rows -= full
            pending_bytes = nbytes(pending[0]) if pending else 0
        if pending_rows:
            run = _concat(pending)
            full = pending_rows // size * size
            keep = pending_rows if not self.drop_last else full
            if keep:
                yield from self._slices(run.slice(0, keep), size, shapes)

    def _slices(self, run: pa.RecordBatch, size: int, shapes: dict[str, tuple[int, ...]]) -> Iterator[tuple[Any, int]]:
        converted = self.from_arrow_rb_to_tensor(run)
        rows = run.num_rows
        _check_rows(converted, rows)  # a misaligned value would shift features against labels silently
        if self._default_conversion():
            _check_row_shapes(converted, shapes)
        if isinstance(converted, dict) and converted and all(isinstance(v, torch.Tensor) for v in converted.values()):
            # All tensors (numeric columns): one split() call per column makes many views at once,
            # about twice as fast as slicing batch by batch in Python. At most SPLIT_VIEWS at a
            # time: a run of 2^18 rows in batches of one made 262,144 views a column at once,
            # ~450 MiB for 3 columns of a 16 MB table.
            keys = list(converted)
            values = list(converted.values())
            step = size * SPLIT_VIEWS
            for lo in range(0, rows, step):
                splits = [v[lo : lo + step].split(size) for v in values]
                for start, parts in zip(range(lo, min(lo + step, rows), size), zip(*splits, strict=True), strict=True):
                    yield dict(zip(keys, parts, strict=True)), min(size, rows - start)
            return
        if isinstance(converted, dict) and all(isinstance(v, _SLICEABLE) for v in converted.values()):
            # The default hook's shape: skip the generic walk, it costs as much as the rest per batch.
            items = list(converted.items())
            for start in range(0, rows, size):
                yield {k: v[start : start + size] for k, v in items}, min(size, rows - start)
            return
        for start in range(0, rows, size):
            stop = min(start + size, rows)
            yield _slice(converted, start, stop), stop - start

    def _check_info(self, info: flight.FlightInfo, request: ShardRequest, progress: _Progress, skip: int) -> None:
        _check_table(progress, skip, info_table(info.app_metadata))
        self._check_columns(info)
        self._warn_if_no_shard_yields(info, request)

    def _warn_if_no_shard_yields(self, info: flight.FlightInfo, request: ShardRequest) -> None:
        """Say, once per dataset, when ``even`` or ``drop_last`` leaves this epoch no batch on any
        reader while the table has rows: the loop trained zero steps each epoch, without a word.
        Under ``even`` every shard has this one's size, so all readers are in the same case."""
        matching = info_matching_rows(info.app_metadata)
        rows = info.total_records
        if matching == 0 and not self._empty_warned.value:
            # Whatever ``even``: a filter that matches nothing (a typo in a value) trained zero
            # steps each epoch without a word.
            self._empty_warned.value = 1
            what = (
                f"the filter {self._request.filter!r} matches no row" if self._request.filter else "the table is empty"
            )
            warnings.warn(
                f"DataCacheDataset yields no batch on any reader this epoch: {what} in the cached table",
                EmptyEpochWarning,
                stacklevel=_caller_outside_package(),
            )
            return
        if self.even is None or not matching or self._empty_warned.value:
            return
        if rows and not (self.drop_last and rows < self.batch_size):
            return
        self._empty_warned.value = 1
        holder = "the filter's matching rows" if self._request.filter else "the table's rows"
        if rows:
            why = f"leave {rows} rows in each, fewer than batch_size={self.batch_size} with drop_last=True"
            fix = "a smaller batch_size, drop_last=False, or fewer ranks or DataLoader workers"
        else:
            why = 'leave no row in any under even="drop"'
            fix = 'even="pad" (repeats a few rows), or fewer ranks or DataLoader workers'
        warnings.warn(
            f"DataCacheDataset yields no batch on any reader this epoch: {holder} ({matching}) split into "
            f"{request.num_shards} shards (ranks x DataLoader workers) {why}. Use {fix}.",
            EmptyEpochWarning,
            stacklevel=_caller_outside_package(),
        )

    def _check_columns(self, info: flight.FlightInfo) -> None:
        """Refuse, before the first batch, a column the default conversion cannot take: of a type
        it has no tensor for, or because the table holds nulls in it, or lists of different
        lengths: found at the batch that holds
        one, that could be hours into an epoch (and one rank failing alone leaves its DDP peers
        waiting). The head counts them in the table, or in a filter's matches; an overridden
        from_arrow_rb_to_tensor may fill nulls or pad lists itself."""
        if not self._default_conversion():
            return
        counts = info_null_counts(info.app_metadata)
        lengths = info_list_lengths(info.app_metadata)
        inner = info_inner_list_lengths(info.app_metadata)
        for field in info.schema:
            # Its type first, from the schema: refused at the first batch, a rank whose shard
            # was empty (a small or filtered table) never refused it, and went on to its next
            # collective while its peers failed.
            if (refusal := type_refusal(field.name, field.type)) is not None:
                raise TypeError(f"{refusal} (refused before the first batch)")
            refusal = null_refusal(field.name, field.type, counts.get(field.name, 0))
            if refusal is None and field.name in lengths and _has_tensor_form(field.type):
                refusal = ragged_refusal(field.name, *lengths[field.name])
            if refusal is None and field.name in inner and _has_tensor_form(field.type):
                ragged = [(depth, b) for depth, b in enumerate(inner[field.name], 2) if b is not None and b[0] != b[1]]
                if ragged:
                    depth, (low, high) = ragged[0]
                    refusal = ragged_refusal(field.name, low, high, depth)
            if refusal:
                holder = "the filter's rows hold" if self._request.filter else "the table holds"
                raise ValueError(f"{refusal} ({holder} them; refused before the first batch)")

    def _default_conversion(self) -> bool:
        """Whether batches go through the default from_arrow_rb_to_tensor: not a subclass's, nor a
        function set on the instance (``ds.from_arrow_rb_to_tensor = pad``), whose nulls and
        ragged lists the default's checks refused, naming as the fix what the user had done."""
        hook = self.from_arrow_rb_to_tensor
        return getattr(hook, "__func__", None) is DataCacheDataset.from_arrow_rb_to_tensor

    def from_arrow_rb_to_tensor(self, batch: pa.RecordBatch) -> Any:
        """Convert a record batch (many training batches long) to a row-aligned structure.

        Override to tokenize or reshape. Return a dict or tuple of tensors, numpy arrays or
        lists whose first dimension is the row: the result is sliced into ``batch_size`` rows.
        """
        # The batch is this reader's own (received, or a fresh concat): tensors may share its memory.
        return {
            name: column_to_tensor(name, col, copy=False)
            for name, col in zip(batch.schema.names, batch.columns, strict=True)
        }

    # -- resume ------------------------------------------------------------------------------

    def _fingerprint(self) -> dict[str, Any]:
        """What must not change between save and resume for row counts to mean the same rows."""
        req = self._request
        return {
            "seed": req.seed,
            "shuffle": req.shuffle,
            "columns": list(req.columns) if req.columns is not None else None,
            "filter": req.filter,
            "even": req.even,
            "block_size": req.block_size,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
        }

    def state_dict(self) -> dict[str, Any]:
        """Where this reader is: epoch, shard and rows handed out (DataLoader workers: per worker).

        In the main process of a plain DataLoader with workers, the workers hold the positions:
        while they are part-way through the epoch this raises, naming the fix; once they have read
        it to the end, the state says nothing of that epoch (resume with set_epoch(next)), as
        for a read of this process's own that ran to its end.
        """
        if self._read_by_workers():
            return self._empty_state()
        if (resume := self._pending_resume()) is not None:
            return dict(resume)
        if self._progress is None or self._progress.epoch != self.epoch:
            return self._empty_state()
        if self._progress.done and get_worker_info() is None:
            # A read of this process's own that ran to its end leaves nothing to resume: the
            # next read of its epoch reads it whole, resumed or not (its state once made that
            # read yield nothing). Not so in a DataLoader worker: StatefulDataLoader keeps the
            # state a worker had when its part ran out, also while the other workers read on, and
            # a checkpoint then resumed that worker from its start, its rows read twice. (Where
            # the loop had ended, StatefulDataLoader runs out the loaded positions, then starts
            # a new pass: the epoch is read whole again.)
            return self._empty_state()
        return self._state(self._progress)

    def _empty_state(self) -> dict[str, Any]:
        """Nothing of the current epoch read here."""
        return self._state(_Progress(self.epoch, -1, -1))

    def _state(self, progress: _Progress) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "epoch": progress.epoch,
            "shard": progress.shard,
            "num_shards": progress.num_shards,
            "rows": progress.rows,
            "streams": progress.streams,
            "order": progress.order,
            # Where the head said it: a list, which torch.distributed.checkpoint keeps whole (a
            # dict it flattens into keys that a fresh dataset's state, its template, lacks:
            # "Missing key"); left out otherwise, so that the template of a fresh dataset, and
            # states saved before the field, load as they did (checked by sizes alone).
            **({"table": list(progress.table)} if progress.table is not None else {}),
            **self._fingerprint(),
        }

    def _read_by_workers(self) -> bool:
        """True when DataLoader workers read the whole current epoch after this process last read;
        RuntimeError, naming the fix, when they are part-way through it (or stopped there)."""
        if get_worker_info() is not None:
            return False  # a worker's own position is real
        mark = self.epoch + 1
        reads = self._worker_reads.values()
        if mark in reads:
            raise RuntimeError(
                f"DataLoader workers are part-way through epoch {self.epoch} of this dataset: the positions to "
                "save are in the workers, and this process's state_dict() would restart the epoch from its "
                "start. Use torchdata.stateful_dataloader.StatefulDataLoader(dataset, batch_size=None, "
                "num_workers=N) and save loader.state_dict(), read with num_workers=0, or save once the "
                "epoch has been read to its end"
            )
        return -mark in reads

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration of ``state["epoch"]`` skips the rows already handed out.

        A state from an epoch before the one ``set_epoch`` selected is ignored: that epoch is over.
        """
        if not isinstance(state, dict) or state.get("version") not in READABLE_STATE_VERSIONS:
            raise ValueError(f"not a DataCacheDataset state (version {STATE_VERSION}): {state!r}")
        changed = {
            k: (v, state.get(k)) for k, v in self._fingerprint().items() if not _same_setting(k, state.get(k), v)
        }
        if changed:
            detail = ", ".join(f"{k}: saved {saved!r}, now {now!r}" for k, (now, saved) in changed.items())
            raise ValueError(f"the saved state was taken with other dataset settings ({detail})")
        saved = int(state["epoch"])
        if self.epoch > saved:
            # set_epoch already moved past the saved epoch: a loop resuming after an epoch that
            # finished, or StatefulDataLoader applying the state after the loop's set_epoch. That
            # epoch is over; rewinding to it would replay its order (or serve nothing).
            self._resume = None
            return
        self._epoch.value = saved
        self._resume = dict(state) if state["rows"] > 0 else None
        self._resume_loaded_here = get_worker_info() is None
        if self._resume_loaded_here:
            self._resume_taken.value = 0
            # What workers read before the load is no longer the position: the loaded one is,
            # until a reader takes it. (Persistent workers started before the load never see
            # it; once they have read the epoch, the state says so again.)
            self._worker_reads.clear()

    def _pending_resume(self) -> dict[str, Any] | None:
        """The loaded position still to use: not one a DataLoader worker already took."""
        if self._resume is not None and self._resume_loaded_here and self._resume_taken.value:
            return None
        return self._resume

    def _take_resume(self, world: World, epoch: int) -> tuple[int, list[int] | None, int | None, SnapshotRows | None]:
        """Rows to leave out of this reader's read of ``epoch``, and the stream lengths, shuffled
        order and snapshot they were counted in (None where the state does not say)."""
        state, self._resume = self._resume, None
        if state is None or state["epoch"] != epoch:
            return 0, None, None, None
        # Which split's reader took it (its shard count), where a worker did: a reader of another
        # split reads whole (the position was used). A reader of the same split checks it whether
        # or not it was taken: a loaded position is one reader's, and the others of its split have
        # none to resume (checked after the taking, a worker of another shard refused it or not by
        # which of two workers started first).
        taken_by = self._resume_taken.value if self._resume_loaded_here else 0
        if taken_by and taken_by != world.num_shards:
            return 0, None, None, None
        if (state["shard"], state["num_shards"]) != (world.shard, world.num_shards):
            # The same split, another shard: one rank's state loaded on every rank (a checkpoint
            # saved on rank 0 only), not a change of ranks.
            fix = (
                "each reader resumes its own position: save every rank's state_dict() and load it back on that "
                "rank (a checkpoint per rank, not rank 0's on all), with DataLoader workers through "
                "StatefulDataLoader, which keeps each worker's; and resume with the same ranks and workers "
                "(another layout of as many shards splits the rows otherwise)"
                if state["num_shards"] == world.num_shards
                else "resume with the same ranks and DataLoader workers"
            )
            raise ValueError(
                f"the saved state is for shard {state['shard']} of {state['num_shards']}, but this reader is "
                f"shard {world.shard} of {world.num_shards}: {fix}"
            )
        if taken_by:
            return 0, None, None, None  # used by this shard's worker of an earlier pass
        if self._resume_loaded_here:
            self._resume_taken.value = world.num_shards
        streams = state.get("streams")  # absent in states saved before stream lengths were kept
        order = state.get("order")  # absent in states saved before orders were versioned
        table = _saved_table(state.get("table"))  # absent where the head did not say, or before the field
        return int(state["rows"]), (list(streams) if streams is not None else None), order, table


def _epoch_changed_error(reading: int, selected: int, worker: int) -> RuntimeError:
    """set_epoch while a DataLoader worker reads: some workers read one epoch, some the other."""
    return RuntimeError(
        f"set_epoch({selected}) was called while DataLoader worker {worker} was reading epoch {reading}: "
        "workers start reading as iter(loader) returns, so workers that started before the call read "
        f"epoch {reading} and any that started after read epoch {selected}, repeating some rows and "
        "leaving out others. Call dataset.set_epoch(epoch) before iter(loader) (before the epoch's "
        "for loop), as with DistributedSampler"
    )


def _check_streams(
    request: ShardRequest, progress: _Progress, skip: int, lengths: list[int | None], order: int
) -> None:
    """Keep a read's stream lengths (and a shuffled one's order), and refuse to resume a position
    counted in others.

    A shuffled shard interleaves its data nodes' streams by their lengths (interleave.py), so
    ``skip`` rows mean other rows when the cache splits the shard otherwise (another number of
    data nodes, another table): resuming would repeat some rows and leave out others.
    """
    saved = progress.streams
    if not request.shuffle:
        # In order, the rows follow the table whatever the split: another number of data nodes
        # is fine, but a shard of another size is another table (or snapshot), whose rows past
        # the saved count are not the rest of the saved epoch. Not so for a padded shard that
        # wraps past the table's end to its first rows: those come first with several nodes
        # (node 0's stream is read first) and last with one, so its split must not change.
        if None in lengths:
            return
        now = [int(n) for n in lengths]
        if skip and saved is not None and request.even == "pad" and saved != now:
            _refuse_resume(
                skip,
                f"streams of {saved} rows",
                f"streams of {now} rows",
                "a padded shard's rows that wrap to the table's start come first or last as the data nodes "
                "split it, so another split reads them in another order",
            )
        if skip and saved is not None and sum(saved) != sum(now):
            _refuse_resume(
                skip,
                f"a shard of {sum(saved)} rows",
                f"a shard of {sum(now)} rows",
                "another table or snapshot: the rows after the saved count are not the rest of the saved epoch",
            )
        progress.streams = now
        return
    # A position saved before orders were versioned was counted in the first one (an older client
    # or cache): against a cache that deals its windows, the same count means other rows.
    saved_order = progress.order if progress.order is not None else 1
    if skip and saved_order != order:
        _refuse_resume(
            skip,
            f"shuffled order {saved_order}",
            f"order {order}",
            "the cache's version changed how its data nodes order a shuffled stream (protocol.ORDER_VERSION)",
        )
    progress.order = order
    if None in lengths:  # an older cache, whose tickets do not say: its streams simply rotate
        if skip and saved is not None and not rotation_order(saved, request.block_size):
            _refuse_resume(skip, f"streams of {saved} rows", "streams of unknown lengths (an older cache)")
        return
    now = [int(n) for n in lengths if n is not None]
    if skip and saved != now:
        if saved is None:  # a state from before stream lengths were saved, when streams simply rotated
            if not rotation_order(now, request.block_size):
                _refuse_resume(skip, "a split this version cannot tell", f"streams of {now} rows")
        else:
            _refuse_resume(skip, f"streams of {saved} rows", f"streams of {now} rows")
    progress.streams = now  # only once accepted: a state saved after a refusal keeps the old split


def _saved_table(saved: Any) -> SnapshotRows | None:
    """A state's ``table`` ([snapshot_id, matching_rows]) as protocol.info_table gives it."""
    return SnapshotRows(*saved) if isinstance(saved, (list, tuple)) and len(saved) == 2 else None


def _check_table(progress: _Progress, skip: int, now: SnapshotRows | None) -> None:
    """Keep the snapshot and matching rows a read's rows are counted in, and refuse to resume a
    position counted in others: new data files sort among the old ones (their names are random),
    and a compaction rewrites the same rows in another order, so a saved count means other rows
    even where this shard's size (which _check_streams compares) is unchanged."""
    saved = progress.table
    if skip and saved is not None and now is not None and saved != now:
        _refuse_resume(
            skip,
            f"snapshot {saved.snapshot_id} ({saved.matching_rows} matching rows)",
            f"snapshot {now.snapshot_id} ({now.matching_rows} matching rows)",
            "the cache now holds another snapshot of the table: the rows after the saved count are not the "
            "rest of the saved epoch",
        )
    if now is not None:
        progress.table = now


def _same_setting(name: str, saved: Any, now: Any) -> bool:
    """Whether a saved setting reads the same rows as the current one: columns in another order do."""
    if name == "columns" and isinstance(saved, list) and isinstance(now, list):
        return sorted(saved) == sorted(now)
    return saved == now


def _refuse_resume(
    skip: int,
    saved: str,
    now: str,
    why: str = "another number of data nodes, or rows split otherwise: the order differs",
) -> None:
    raise ValueError(
        f"the saved state counted {skip} rows of this shard in {saved}, but the cache now serves it as {now} "
        f"({why}), so resuming would repeat rows and leave others out; start the epoch again (skip "
        "load_state_dict, or set_epoch to the next epoch)"
    )


def _concat(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    return batches[0] if len(batches) == 1 else pa.concat_batches(batches)


_SLICEABLE = (torch.Tensor, np.ndarray, list)


def _row_counts(obj: Any, path: str = "") -> dict[str, int]:
    """The first dimension of every sliceable leaf of a hook's output, by its path."""
    if isinstance(obj, _SLICEABLE):
        if getattr(obj, "ndim", 1) == 0:  # a 0-d tensor or array: a scalar, no row dimension
            return {path or "result": -1}
        return {path or "result": len(obj)}
    if isinstance(obj, dict):
        return {
            k: n for key, v in obj.items() for k, n in _row_counts(v, f"{path}[{key!r}]" if path else str(key)).items()
        }
    if isinstance(obj, tuple):
        return {k: n for i, v in enumerate(obj) for k, n in _row_counts(v, f"{path}[{i}]").items()}
    return {}  # _slice names the unsupported type


def _check_rows(converted: Any, rows: int) -> None:
    if isinstance(converted, Iterator):
        # The upstream example's hook is a generator, called per batch_size rows: here it failed
        # as "should return tensors ..., got generator", naming nothing of the difference.
        raise TypeError(
            "from_arrow_rb_to_tensor returned an iterator (a generator, as in upstream's example, whose hook "
            "yields each batch): here it is called once for a record batch many training batches long and "
            "returns one row-aligned dict or tuple (return instead of yield, without a batch dimension of "
            "its own), which the dataset slices into batch_size rows"
        )
    wrong = {k: n for k, n in _row_counts(converted).items() if n != rows}
    if wrong:
        shown = {k: ("a scalar" if n < 0 else n) for k, n in wrong.items()}
        raise ValueError(
            f"from_arrow_rb_to_tensor returned {shown} rows for a {rows}-row record batch (it converts "
            "many training batches at once, sliced to batch_size afterwards); every value's first "
            "dimension must be the row"
        )


def _slice(obj: Any, start: int, stop: int) -> Any:
    if isinstance(obj, _SLICEABLE):
        return obj[start:stop]
    if isinstance(obj, dict):
        return {k: _slice(v, start, stop) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(_slice(v, start, stop) for v in obj)
    raise TypeError(
        f"from_arrow_rb_to_tensor should return tensors, numpy arrays or lists (in a dict or tuple), "
        f"got {type(obj).__name__}"
    )


def _is_list_type(t: pa.DataType) -> bool:
    return pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t)


def _has_tensor_form(t: pa.DataType) -> bool:
    """Whether the default conversion makes a tensor of a column of type ``t``."""
    while _is_list_type(t):
        t = t.value_type
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def ragged_refusal(name: str, low: int, high: int, depth: int = 1) -> str:
    """``depth``: 1 for a column's own lists, 2 for the lists inside them, and so on."""
    which = "lists" if depth == 1 else f"lists {depth} deep (inside its lists)"
    return (
        f"column {name!r} holds {which} of {low} to {high} values, which do not stack into a tensor; "
        "override from_arrow_rb_to_tensor to pad them"
    )


def _check_row_shapes(converted: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuse a list column whose rows change shape between conversion runs of one read: each run
    stacks its own rows, so lists of 8 values in one and 9 in the next made tensors of two widths
    with no error. (A read is refused before its first batch from the head's counts, which a
    cache older than its readers may not send: then this is the check.)"""
    for name, value in converted.items():
        if isinstance(value, torch.Tensor) and value.dim() > 1:
            shape = tuple(value.shape[1:])
            first = shapes.setdefault(name, shape)
            if shape != first:
                raise ValueError(
                    f"column {name!r} holds lists shaped {list(first)} in this reader's earlier rows and "
                    f"{list(shape)} in later ones, which do not stack into tensors of one shape; override "
                    "from_arrow_rb_to_tensor to pad them"
                )


def null_refusal(name: str, t: pa.DataType, nulls: int) -> str | None:
    """Why the default conversion cannot take ``nulls`` nulls in column ``name`` of type ``t``,
    or None where it can (floats become NaN, strings None) or there are none."""
    if not nulls:
        return None
    quoted = '"' + name.replace('"', '""') + '"'
    fix = f"leave those rows out with filter='{quoted} IS NOT NULL', or override from_arrow_rb_to_tensor to fill them"
    if _is_list_type(t):
        if not _has_tensor_form(t):
            # Lists of strings (say) never become a tensor: leaving their nulls out would only
            # lead to that refusal (column_to_tensor's, which names the fixes that work).
            return None
        return f"column {name!r} has {nulls} null list(s); {fix}"
    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        return f"column {name!r} ({t}) has {nulls} null value(s); {fix}"
    return None


def column_to_tensor(
    name: str, col: pa.Array | pa.ChunkedArray, copy: bool = True, _depth: int = 1
) -> torch.Tensor | list[str]:
    """One column as a tensor (lists of equal length as 2-D) or, for strings, a list of str.

    Iceberg has no fixed-size list type, so a fixed-size list written to a table reads back as a
    variable list: any list column whose rows all have the same length becomes a 2-D tensor.

    With ``copy`` (the default) the tensor owns a copy of the values, so writing to it can never
    touch Arrow memory that others share or that is read-only (a memory-mapped file). Without it,
    integer and floating columns with no nulls become tensors over the Arrow buffer itself, for
    a batch the caller owns outright, such as one just received from the cache; the tensor keeps
    the buffer alive. Booleans (bit-packed) and columns with nulls are always converted.

    A ChunkedArray (``table.column(name)`` in an overridden hook) is combined first, a copy.
    """
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    t = col.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return col.to_pylist()
    # Checked first: padding lists of strings, or leaving their nulls out, would not help.
    if (refusal := type_refusal(name, t)) is not None:
        raise TypeError(refusal)
    if _is_list_type(t):
        if col.null_count:
            raise ValueError(null_refusal(name, t, col.null_count))
        width = t.list_size if pa.types.is_fixed_size_list(t) else _uniform_length(name, col, _depth)
        values = col.flatten()
        if null_refusal(name, values.type, values.null_count):  # a filter on the column cannot drop these
            raise ValueError(
                f"column {name!r} ({t}) holds {values.null_count} null value(s) inside its lists, which are "
                "not null themselves, so no filter on the column leaves them out; override "
                "from_arrow_rb_to_tensor to fill them, or write the table without them"
            )
        inner = column_to_tensor(name, values, copy, _depth + 1)
        return inner.reshape(len(col), width, *inner.shape[1:])
    # An integer, floating or boolean column: type_refusal let no other through.
    if col.null_count and not pa.types.is_floating(t):
        raise ValueError(null_refusal(name, t, col.null_count))
    if not copy and col.null_count == 0 and not pa.types.is_boolean(t):
        return torch.from_dlpack(col)  # a view of the Arrow buffer; it keeps the buffer alive
    # writable=True copies once: the tensor must not alias Arrow's immutable buffers.
    return torch.from_numpy(col.to_numpy(zero_copy_only=False, writable=True))


def type_refusal(name: str, t: pa.DataType) -> str | None:
    """Why the default conversion takes no column of type ``t`` (None: it takes it)."""
    if pa.types.is_string(t) or pa.types.is_large_string(t) or _has_tensor_form(t):
        return None
    if _is_list_type(t):
        return (
            f"column {name!r} holds lists of {t.value_type}, which have no tensor form; leave it out with "
            "columns=[...] or override from_arrow_rb_to_tensor (to tokenize it, say)"
        )
    return (
        f"column {name!r} has type {t}, which has no default tensor conversion; leave it out with "
        "columns=[...] or override from_arrow_rb_to_tensor"
    )


def _uniform_length(name: str, col: pa.Array, depth: int = 1) -> int:
    if len(col) == 0:
        return 0
    bounds = pc.min_max(pc.list_value_length(col))
    low, high = bounds["min"].as_py(), bounds["max"].as_py()
    if low != high:
        raise ValueError(ragged_refusal(name, low, high, depth))
    return int(low)
