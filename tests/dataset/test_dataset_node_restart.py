"""A data node dies mid-epoch: restarted, the stream resumes exactly; gone, the error names it.

The head and data nodes run as separate `data-cache head` / `data-cache worker` processes here
(not `data-cache local`, which stops everything when one node dies) so one node can be killed
and replaced while the head keeps serving.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kubeflow_data_cache import client as client_module
from kubeflow_data_cache.client import CacheClient
from kubeflow_data_cache.dataset import DataCacheDataset
from kubeflow_data_cache.errors import CacheUnavailableError
from kubeflow_data_cache.processes import stop_processes
from kubeflow_data_cache.protocol import ShardRequest
from tests.conftest import free_port
from tests.freeze import freeze

# Enough bytes per node (text and embedding columns) that a stream is still in flight when the
# node is killed, rather than already sitting in the client's buffers.
ROWS = 200_000
READY_SECONDS = 90.0
STOP_SECONDS = 15.0


def node_cmd(role: str, *args: str) -> list[str]:
    common = ["--host", "127.0.0.1", "--advertise-host", "127.0.0.1", "--health-port", "0"]
    return [sys.executable, "-m", "kubeflow_data_cache", role, *args, *common, "--startup-timeout", "90"]


class Cluster:
    def __init__(self, metadata: str, log_dir) -> None:
        self.port = free_port()
        self.endpoint = f"grpc://127.0.0.1:{self.port}"
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.head_cmd = node_cmd("head", "--metadata-loc", metadata, "--data-nodes", "2", "--port", str(self.port))
        self.spawn("head", self.head_cmd)
        for k in range(2):
            self.start_node(k)

    def spawn(self, name: str, cmd: list[str]) -> None:
        with (self.log_dir / f"{name}-{len(self.procs)}.log").open("w") as log:
            self.procs[name] = subprocess.Popen(cmd, stderr=log, start_new_session=True)

    def start_node(self, k: int) -> None:
        self.spawn(f"node-{k}", node_cmd("worker", "--index", str(k), "--head", self.endpoint, "--port", "0"))

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait(timeout=10)
        self.procs[f"dead-{name}"] = proc

    def kill_node(self, k: int) -> None:
        self.kill(f"node-{k}")

    def restart_head(self) -> None:
        self.kill("head")
        self.spawn("head", self.head_cmd)

    def wait_ready(self) -> dict:
        client = CacheClient(self.endpoint, deadline_seconds=READY_SECONDS)
        deadline = time.monotonic() + READY_SECONDS
        while time.monotonic() < deadline:
            status = client.status()
            if status["state"] == "ready" and all(n["state"] == "ready" for n in status["nodes"]):
                return status
            time.sleep(0.2)
        raise AssertionError(f"cache not ready within {READY_SECONDS}s: {status}")


def stop_groups(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every process group at once; SIGKILL what outlives the grace period."""
    stop_processes(procs, STOP_SECONDS, term_group=True, kill_group=True)


@pytest.fixture(scope="module")
def cluster(table_factory, tmp_path_factory):
    cluster = Cluster(table_factory(ROWS, 4).metadata_location, tmp_path_factory.mktemp("restart-logs"))
    try:
        cluster.wait_ready()
        yield cluster
    finally:
        stop_groups(list(cluster.procs.values()))


def test_restarted_node_resumes_the_stream_without_repeating_rows(cluster, caplog):
    caplog.set_level(logging.INFO, logger="kubeflow_data_cache.client")
    # No BDP probing keeps gRPC's flow-control window small, so most of node 0's rows are still
    # on the node (not in this process's buffers) when it is killed: the stream really breaks.
    client = CacheClient(cluster.endpoint, deadline_seconds=60, generic_options=[("grpc.http2.bdp_probe", 0)])
    # Unshuffled, not interleaved: node 0's stream is read first, then node 1's.
    batches = client.read_shard(ShardRequest(columns=None, batch_size=1000), interleave=False)
    ids = [next(batches).column("id").to_numpy() for _ in range(10)]
    cluster.kill_node(0)
    cluster.start_node(0)  # on a new port: the client must ask the head where it went
    ids += [b.column("id").to_numpy() for b in batches]

    got = np.concatenate(ids)
    assert len(got) == ROWS and np.array_equal(np.sort(got), np.arange(ROWS))
    broke = [r.getMessage() for r in caplog.records if "broke after" in r.getMessage()]
    assert any(" 0 rows" not in m for m in broke), f"the stream never broke mid-way: {broke}"


def test_restarted_head_reloads_the_nodes_and_old_tickets_are_renewed(cluster, caplog):
    caplog.set_level(logging.INFO, logger="kubeflow_data_cache.client")
    client = CacheClient(cluster.endpoint, deadline_seconds=60, generic_options=[("grpc.http2.bdp_probe", 0)])
    request = ShardRequest(columns=("id",), batch_size=1000)
    batches = client.read_shard(request, interleave=False)
    ids = [next(batches).column("id").to_numpy() for _ in range(3)]
    unused = client.get_flight_info(request).endpoints[1]  # a ticket of this load, not opened yet
    # A new head is a new load generation: the nodes reload under it. Streams already open go on;
    # a ticket from before is stale by the time it is used, and is renewed through the head.
    cluster.restart_head()
    cluster.wait_ready()
    ids += [b.column("id").to_numpy() for b in batches]
    got = np.concatenate(ids)
    assert len(got) == ROWS and np.array_equal(np.sort(got), np.arange(ROWS))

    renewed = np.concatenate([b.column("id").to_numpy() for b in client.read_endpoint(request, unused)])
    assert any("is stale" in r.getMessage() for r in caplog.records)
    node1 = cluster.wait_ready()["nodes"][1]["rows"]
    assert len(renewed) == node1 and len(np.unique(renewed)) == node1


def test_a_stream_open_when_its_node_reloads_ends_as_stale_and_the_read_resumes_exactly(cluster, caplog):
    """A stream open on a node that takes a newer load (a restarted head) would keep the old
    rows in memory beside the new load's until it ended: it ends at its next batch as a stale
    ticket instead, and the reader resumes after the rows it has, with a ticket from the new head."""
    caplog.set_level(logging.INFO, logger="kubeflow_data_cache.client")
    client = CacheClient(cluster.endpoint, deadline_seconds=60, generic_options=[("grpc.http2.bdp_probe", 0)])
    # Shuffled, all columns, small batches: each stream has many batches still on its node,
    # beyond what gRPC's window (no BDP probing) lets this process buffer.
    request = ShardRequest(columns=None, batch_size=200, shuffle=True, seed=3)
    batches = client.read_shard(request, interleave=False)
    ids = [next(batches).column("id").to_numpy() for _ in range(3)]
    cluster.restart_head()
    cluster.wait_ready()
    ids += [b.column("id").to_numpy() for b in batches]
    got = np.concatenate(ids)
    assert len(got) == ROWS and np.array_equal(np.sort(got), np.arange(ROWS))
    ended = [r.getMessage() for r in caplog.records if "while this stream of load" in r.getMessage()]
    assert ended, "no open stream was ended by the reload"
    assert all(re.search(r"after [1-9][0-9]* rows", m) for m in ended), ended  # mid-stream, not at its start


@contextlib.contextmanager
def node_frozen_mid_stream(cluster, deadline_seconds: float) -> Iterator[tuple[str, Iterator]]:
    """A read of the shard under way on node 0's stream, then node 0 stopped (SIGSTOP: a hung pod,
    a partition, connected and sending nothing) until the block ends; its location and the read."""
    location = cluster.wait_ready()["nodes"][0]["location"]
    client = CacheClient(
        cluster.endpoint, deadline_seconds=deadline_seconds, generic_options=[("grpc.http2.bdp_probe", 0)]
    )
    batches = client.read_shard(ShardRequest(columns=None, batch_size=1000), interleave=False)
    next(batches)
    frozen = cluster.procs["node-0"]
    freeze(frozen.pid)
    try:
        yield location, batches
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
        client.close()
    cluster.wait_ready()  # the node answers again, and the head serves again


def test_a_frozen_node_is_given_up_on_not_waited_for_for_ever(cluster):
    """The read is cancelled after the stall limit, retried, and the node named within the deadline."""
    with node_frozen_mid_stream(cluster, deadline_seconds=4) as (location, batches):
        started = time.monotonic()
        with pytest.raises(CacheUnavailableError, match=rf"data node {location} stayed unavailable .*stalled"):
            for _ in batches:
                pass
        assert time.monotonic() - started < 30


def test_a_node_frozen_before_its_stream_starts_is_given_up_on_within_the_deadline(cluster, monkeypatch):
    """The retry after a stall opens a new stream on the same frozen node; opening waits for the
    node's first message, which never comes, so opening is bounded by the stall limit too."""
    monkeypatch.setattr(client_module, "STREAM_STALL_SECONDS", 1.0)  # below the deadline: retries happen
    outcome: list[BaseException | None] = []

    def read_rest(batches) -> None:
        try:
            for _ in batches:
                pass
            outcome.append(None)
        except BaseException as err:
            outcome.append(err)

    with node_frozen_mid_stream(cluster, deadline_seconds=6) as (location, batches):
        reader = threading.Thread(target=read_rest, args=(batches,), daemon=True)
        started = time.monotonic()
        reader.start()
        reader.join(40)  # without the bound it waits for as long as the node stays frozen
        waited, still_waiting = time.monotonic() - started, reader.is_alive()
    assert not still_waiting, "the read was still waiting on the frozen node"
    assert waited < 30
    (error,) = outcome
    assert isinstance(error, CacheUnavailableError)
    assert re.search(rf"data node {location} stayed unavailable .*stalled", str(error))
    assert "check that data node (in Kubernetes, the cache's worker pod with that address" in str(error)


def test_a_frozen_node_is_given_up_on_at_the_deadline_not_a_stall_limit_later(cluster, monkeypatch):
    """Each wait on a frozen node lasts the stall limit, but the last one only what is left of the
    deadline: with waits of 60 s a deadline of 70 s gave up after 120 s (here 5 s and 6 s: 10 s)."""
    monkeypatch.setattr(client_module, "STREAM_STALL_SECONDS", 5.0)
    deadline = 6.0
    with node_frozen_mid_stream(cluster, deadline_seconds=deadline) as (location, batches):
        started = time.monotonic()
        with pytest.raises(CacheUnavailableError, match=rf"data node {location} stayed unavailable"):
            for _ in batches:
                pass
        waited = time.monotonic() - started
    # The stall watcher ticks every second at this limit: the last wait may end that late; the
    # old code gave up 4 s late.
    assert waited < deadline + 2.5, f"gave up {waited - deadline:.1f}s after the deadline"


def test_node_that_stays_down_is_named(cluster):
    location = cluster.wait_ready()["nodes"][1]["location"]
    cluster.kill_node(1)
    ds = DataCacheDataset(cluster.endpoint, columns=["id"], deadline_seconds=2)
    with pytest.raises(CacheUnavailableError, match=f"data node {location} stayed unavailable"):
        list(ds)


def test_a_head_that_stops_answering_is_named_not_the_endpoint_setting(cluster):
    """A head that answered and then hung (SIGSTOP): the endpoint is right, so the error says the
    head stopped answering instead of telling the reader to set DATA_CACHE_ENDPOINT."""
    # status, which a head answers whatever its state: an earlier test may have left a node down.
    client = CacheClient(cluster.endpoint, deadline_seconds=2)
    client.status()
    head = cluster.procs["head"]
    freeze(head.pid)
    try:
        with pytest.raises(CacheUnavailableError, match=rf"head at {cluster.endpoint} stopped answering") as err:
            client.status()
        assert "DATA_CACHE_ENDPOINT" not in str(err.value)
    finally:
        os.kill(head.pid, signal.SIGCONT)
        client.close()
    with CacheClient(cluster.endpoint, deadline_seconds=30) as again:
        assert again.status()["role"] == "head"  # it answers again


def test_a_plain_loaders_new_worker_names_a_head_that_stopped_answering(table_factory, tmp_path):
    """A plain DataLoader starts new workers every epoch, each with a client of its own: one whose
    head froze after an epoch read well was told to check its address (set DATA_CACHE_ENDPOINT),
    as if the head had never answered. The dataset remembers that it did, for every worker."""
    from torch.utils.data import DataLoader

    cluster = Cluster(table_factory(ROWS, 4).metadata_location, tmp_path)  # its own: every node up
    head = cluster.procs["head"]
    try:
        cluster.wait_ready()
        ds = DataCacheDataset(cluster.endpoint, batch_size=4096, columns=["id"], deadline_seconds=2)
        # forkserver: a fork of this process would carry the clients other tests left open.
        loader = DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="forkserver", timeout=60)
        assert sum(len(batch["id"]) for batch in loader) == ROWS  # epoch 0, in a worker gone since
        freeze(head.pid)
        ds.set_epoch(1)
        with pytest.raises(CacheUnavailableError, match=rf"head at {cluster.endpoint} stopped answering") as err:
            next(iter(loader))
        assert "DATA_CACHE_ENDPOINT" not in str(err.value)
    finally:
        os.kill(head.pid, signal.SIGCONT)
        stop_groups(list(cluster.procs.values()))


def test_a_dead_node_is_not_blamed_on_a_head_that_answered(cluster):
    """The head answers 'not ready' (degraded: this very node is down) when asked where the node
    went: that is an answer, and the error must not send the reader to check the head."""
    deadline = 12.0  # past the head's supervision poll: it reports the node down meanwhile
    for k in range(2):
        if f"node-{k}" not in cluster.procs:
            cluster.start_node(k)
    location = cluster.wait_ready()["nodes"][0]["location"]
    client = CacheClient(cluster.endpoint, deadline_seconds=deadline, generic_options=[("grpc.http2.bdp_probe", 0)])
    batches = client.read_shard(ShardRequest(columns=None, batch_size=1000), interleave=False)
    try:
        for _ in range(10):
            next(batches)
        cluster.kill_node(0)
        with pytest.raises(CacheUnavailableError, match=rf"data node {location} stayed unavailable") as err:
            for _ in batches:
                pass
        assert client.status()["state"] == "degraded", "the head should have reported the node down by now"
    finally:
        client.close()
    assert "did not answer either" not in str(err.value)
    cluster.start_node(0)
    cluster.wait_ready()


def test_a_frozen_head_does_not_hold_a_read_of_a_dead_node_past_the_deadline(cluster):
    """A broken stream asks the head where its node went: with the head frozen too, that question
    took a flat 30 s (a deadline of 5 s gave up after 30); it now gets what is left of the
    deadline, and the error says the head did not answer either."""
    deadline = 4.0
    for k in range(2):  # an earlier test may have left a node down
        if f"node-{k}" not in cluster.procs:
            cluster.start_node(k)
    location = cluster.wait_ready()["nodes"][0]["location"]
    client = CacheClient(cluster.endpoint, deadline_seconds=deadline, generic_options=[("grpc.http2.bdp_probe", 0)])
    batches = client.read_shard(ShardRequest(columns=None, batch_size=1000), interleave=False)
    for _ in range(10):
        next(batches)
    head = cluster.procs["head"]
    freeze(head.pid)
    try:
        cluster.kill_node(0)
        started = time.monotonic()
        with pytest.raises(CacheUnavailableError, match=rf"data node {location} stayed unavailable") as err:
            for _ in batches:
                pass
        waited = time.monotonic() - started
    finally:
        os.kill(head.pid, signal.SIGCONT)
        client.close()
    assert f"the head at {cluster.endpoint} did not answer either" in str(err.value)
    # The old code waited out a flat 30 s for the frozen head.
    assert waited < deadline + 10, f"gave up {waited - deadline:.1f}s after the deadline"
    cluster.start_node(0)
    # Just continued, the head still reports the dead node ready until its next poll: wait
    # for the new one, so whatever runs next finds a cache that is really whole.
    deadline_at = time.monotonic() + READY_SECONDS
    while cluster.wait_ready()["nodes"][0]["location"] == location:
        assert time.monotonic() < deadline_at, "the head never took the restarted data node 0"
        time.sleep(0.2)


@contextlib.contextmanager
def _thawed_after(cluster, frozen: subprocess.Popen, reader: subprocess.Popen) -> Iterator[None]:
    """However the block ends: ``frozen`` (SIGSTOPped in it) runs again, ``reader`` is gone, and
    the cluster serves again for the next test."""
    try:
        yield
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
        reader.kill()
        reader.wait(timeout=10)
    cluster.wait_ready()


# A training script reading in its main thread (num_workers=0), its shard on one data node (rank
# 0 of 2), told by the test when to go on, and saying how each batch and the read ended.
_CTRL_C_READER = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, whatever the parent ignores
from kubeflow_data_cache import client
init = client.CacheClient.__init__
def small_windows(self, *args, **kwargs):  # the node's rows stay on the node, not in our buffers
    kwargs.setdefault("generic_options", [("grpc.http2.bdp_probe", 0)])
    init(self, *args, **kwargs)
client.CacheClient.__init__ = small_windows
from kubeflow_data_cache.dataset import DataCacheDataset
batches = iter(DataCacheDataset(endpoint=sys.argv[1], batch_size=1000, deadline_seconds=120, rank=0, world_size=2))
next(batches)
print("reading", flush=True)
sys.stdin.readline()
try:
    for _ in batches:
        print("batch", flush=True)
    print("finished", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


@pytest.fixture()
def wide_cluster(table_factory, tmp_path):
    """Tens of MB per data node: more than a socket's buffers hold, so a read still waits on its
    node when it freezes."""
    cluster = Cluster(table_factory(1_000_000, 4).metadata_location, tmp_path)
    try:
        cluster.wait_ready()
        yield cluster
    finally:
        stop_groups(list(cluster.procs.values()))


@pytest.mark.slow
def test_ctrl_c_ends_a_read_waiting_on_a_frozen_node_at_once(wide_cluster):
    """A shard on one data node was read in the caller's thread, blocked in a Flight call while the
    node was frozen: Ctrl-C came through only when the stall watch gave up on the node (a minute
    at this deadline), and a handler saving a checkpoint on SIGTERM waited as long."""
    cluster = wide_cluster
    reader = subprocess.Popen(
        [sys.executable, "-c", _CTRL_C_READER, cluster.endpoint],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    frozen = cluster.procs["node-0"]
    lines: list[str] = []
    with _thawed_after(cluster, frozen, reader):
        assert reader.stdout.readline().strip() == "reading"
        freeze(frozen.pid)
        reader.stdin.write("go\n")
        reader.stdin.flush()
        threading.Thread(target=lambda: lines.extend(line.strip() for line in reader.stdout), daemon=True).start()
        # The batches already here are read; then the read waits on the frozen node.
        quiet_since, seen = time.monotonic(), 0
        while time.monotonic() - quiet_since < 2.0:
            time.sleep(0.1)
            if len(lines) != seen:
                quiet_since, seen = time.monotonic(), len(lines)
        assert "finished" not in lines, "the whole shard was buffered before the node froze"
        sent = time.monotonic()
        reader.send_signal(signal.SIGINT)
        while "interrupted" not in lines and time.monotonic() - sent < 20 and reader.poll() is None:
            time.sleep(0.05)
        assert "interrupted" in lines, lines[-3:]
        assert time.monotonic() - sent < 5


_CTRL_C_ASKER = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from kubeflow_data_cache.dataset import DataCacheDataset
dataset = DataCacheDataset(endpoint=sys.argv[1], batch_size=1000, deadline_seconds=120)
print("asking", flush=True)
try:
    next(iter(dataset))
    print("answered", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_ctrl_c_ends_a_read_waiting_on_a_frozen_head_at_once(cluster):
    """The first batch asks the head where the shard lives; a frozen head held Ctrl-C until the
    call's own timeout (30 s)."""
    head = cluster.procs["head"]
    freeze(head.pid)
    reader = subprocess.Popen(
        [sys.executable, "-c", _CTRL_C_ASKER, cluster.endpoint], stdout=subprocess.PIPE, text=True
    )
    with _thawed_after(cluster, head, reader):
        assert reader.stdout.readline().strip() == "asking"
        time.sleep(1.0)  # asking by now
        sent = time.monotonic()
        reader.send_signal(signal.SIGINT)
        out, _ = reader.communicate(timeout=40)
        assert out.split() == ["interrupted"]
        assert time.monotonic() - sent < 5


def test_a_read_across_a_cache_restarted_on_another_snapshot_is_refused_not_continued(table_factory, tmp_path):
    """A cache restarted on a METADATA_LOC naming the table's folder plans its newest snapshot:
    one of as many rows (a compaction) placed its nodes' rows as before, and a read under way went
    on by row count into other rows. Here the group restarts on another table of as many rows."""
    from kubeflow_data_cache.errors import BadRequestError

    first = Cluster(table_factory(ROWS, 4).metadata_location, tmp_path)
    try:
        first.wait_ready()
        client = CacheClient(first.endpoint, deadline_seconds=60, generic_options=[("grpc.http2.bdp_probe", 0)])
        batches = client.read_shard(ShardRequest(columns=("id",), batch_size=1000), interleave=False)
        [next(batches) for _ in range(5)]
        for name in [n for n in first.procs if not n.startswith("dead-")]:
            first.kill(name)
        # The whole group again, at the head's address (its Service), on the other snapshot.
        first.head_cmd[first.head_cmd.index("--metadata-loc") + 1] = table_factory(ROWS, 3).metadata_location
        first.spawn("head", first.head_cmd)
        for k in range(2):
            first.start_node(k)
        first.wait_ready()
        with pytest.raises(BadRequestError, match=r"came back holding snapshot \d+ of the table, not \d+"):
            for _ in batches:
                pass
    finally:
        stop_groups(list(first.procs.values()))
