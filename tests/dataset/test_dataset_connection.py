"""The dataset keeps its connection from epoch to epoch, and that never breaks a fork.

The checks that count sockets or fork run in a fresh interpreter: this test process holds other
suites' datasets and servers, whose connections would be counted, and after which a forked
child cannot use gRPC (test_dataset_loader.py).
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap

import pytest

from kubeflow_data_cache.client import CacheClient, KeptClient
from tests.fake_grpcio import START_GRPC_LIKE_THREAD

SCRIPT_TIMEOUT_SECONDS = 180

# Prints one JSON line: established connections per cache location after each step.
CONNECTIONS_SCRIPT = """
import json, sys, time, psutil
from kubeflow_data_cache import fork_guard
from kubeflow_data_cache.client import CacheClient
threads_before = fork_guard.grpc_threads()
from kubeflow_data_cache.dataset import DataCacheDataset
from kubeflow_data_cache.protocol import ShardRequest

endpoint = sys.argv[1]
with CacheClient(endpoint) as probe:
    nodes = sorted({e.locations[0].uri.decode() for e in probe.get_flight_info(ShardRequest()).endpoints})
ports = {int(loc.rsplit(":", 1)[1]): loc for loc in [endpoint, *nodes]}

def connections():
    counts = {loc: 0 for loc in ports.values()}
    for c in psutil.Process().net_connections(kind="tcp"):
        if c.status == psutil.CONN_ESTABLISHED and c.raddr and c.raddr.port in ports:
            counts[ports[c.raddr.port]] += 1
    return counts

ds = DataCacheDataset(endpoint, batch_size=500, columns=["id"], shuffle=True)
seen = []
for epoch in range(3):
    ds.set_epoch(epoch)
    ids = sorted(int(i) for b in ds for i in b["id"])
    seen.append({"rows": len(ids), "distinct": len(set(ids)), "connections": connections()})
threads_open = fork_guard.grpc_threads()
ds.close()
deadline = time.monotonic() + 10
while (any(connections().values()) or fork_guard.grpc_threads()) and time.monotonic() < deadline:
    time.sleep(0.05)
print(json.dumps({
    "epochs": seen, "after_close": connections(), "nodes": len(nodes),
    "threads": [threads_before, threads_open, fork_guard.grpc_threads()],
}))
"""

# Reads in the main process, then through forked DataLoader workers (the default start method);
# then holds a half-read iterator across a fork, which must fail with the fix, not hang.
FORK_SCRIPT = """
import json, sys, torch
from torch.utils.data import DataLoader
from kubeflow_data_cache.dataset import DataCacheDataset
from kubeflow_data_cache.errors import ForkedConnectionError

ds = DataCacheDataset(sys.argv[1], batch_size=700, columns=["id"])
loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60)
out = {"main": [], "workers": []}
for _ in range(3):  # a fork right after a read is the case that used to hang now and then
    out["main"].append(sum(len(b["id"]) for b in ds))
    ids = torch.cat([b["id"] for b in loader])
    out["workers"].append([len(ids), len(torch.unique(ids))])
half_read = iter(ds)
next(half_read)
try:
    next(iter(loader))
    out["busy_fork"] = "no error"
except ForkedConnectionError as err:
    out["busy_fork"] = str(err)
print(json.dumps(out))
"""

# grpcio started beside the cache, before its first connection (Ray, Google Cloud clients).
GRPCIO_FORK_SCRIPT = (
    START_GRPC_LIKE_THREAD
    + """
import json, sys, time
from torch.utils.data import DataLoader
from kubeflow_data_cache.dataset import DataCacheDataset

ds = DataCacheDataset(sys.argv[1], batch_size=700, columns=["id"])
main = sum(len(b["id"]) for b in ds)
loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60)
started = time.monotonic()
workers = sum(len(b["id"]) for b in loader)
print(json.dumps({"main": main, "workers": workers, "seconds": time.monotonic() - started}))
"""
)

# Prints one JSON line: for a client closed, and one dropped unclosed, how long the fork that
# follows at once waits after the release, and how long the fork after that waits.
SETTLE_SCRIPT = """
import gc, json, sys, time, types
from kubeflow_data_cache import fork_guard
from kubeflow_data_cache.client import CacheClient
out = {"settle": fork_guard.FORK_SETTLE_SECONDS}
for how in ("close", "close-kept", "drop"):
    client = CacheClient(sys.argv[1], deadline_seconds=30)
    client.status()
    released = time.monotonic()
    if how == "close":
        client.close()
    elif how == "close-kept":  # something holds a FlightClient (a kept error's traceback)
        held = list(client._clients.values())
        client.close()
        while fork_guard.grpc_threads():  # the fork comes once gRPC's named threads have ended
            time.sleep(0.001)
    else:
        del client
        gc.collect()
    assert not fork_guard._open_clients, how
    fork_guard._before_fork()  # what os.fork() runs first
    first = time.monotonic() - released
    # The second fork, counted rather than timed: what it slept, and whether a gRPC thread
    # showed up again meanwhile (a new release, which rightly starts a new settle).
    slept, releases = [], []
    real_released = fork_guard.released
    fork_guard.time = types.SimpleNamespace(
        monotonic=time.monotonic, sleep=lambda s: (slept.append(s), time.sleep(s))[1])
    fork_guard.released = lambda: (releases.append(1), real_released())[1]
    fork_guard._before_fork()
    fork_guard.time, fork_guard.released = time, real_released
    out[how] = [first, sum(slept), len(releases)]
print(json.dumps(out))
"""


CLOSE_RACE_SCRIPT = """
import collections, json, sys, threading, time
from kubeflow_data_cache.client import CacheClient
from kubeflow_data_cache.protocol import ShardRequest

client = CacheClient(sys.argv[1], deadline_seconds=20)
counts, stop = collections.Counter(), threading.Event()

errors = []

def work(kind):
    try:
        while not stop.is_set():
            if kind == "status":
                client.status()
            elif kind == "info":
                client.get_flight_info(ShardRequest())
            else:
                rows = sum(b.num_rows for b in client.read_shard(ShardRequest(shuffle=kind == "shuffled")))
                assert rows == 10_000, rows
            counts[kind] += 1
    except Exception as err:
        errors.append(f"{kind}: {type(err).__name__}: {err}")

threads = [threading.Thread(target=work, args=(k,)) for k in ("status", "info", "in-order", "shuffled")]
for t in threads:
    t.start()
closes, until = 0, time.monotonic() + 3
while time.monotonic() < until:
    client.close()
    closes += 1
    time.sleep(0.001)
stop.set()
for t in threads:
    t.join(30)
client.close()
print(json.dumps({"closes": closes, "calls": counts, "errors": errors}))
"""


def test_close_while_other_threads_call_and_read_neither_crashes_nor_cuts_them_short(cache):
    """close() closed FlightClients that other threads were calling: a segfault (or an abort on
    std::bad_weak_ptr) within a second. A connection in use now closes when its last user ends."""
    got = _run(CLOSE_RACE_SCRIPT, cache.endpoint)
    assert got["errors"] == []
    assert got["closes"] > 100 and all(got["calls"].get(k, 0) > 0 for k in ("status", "info", "in-order", "shuffled"))


FORK_AFTER_PEEK_SCRIPT = """
import json, os, sys
from kubeflow_data_cache.client import CacheClient, KeptClient
from kubeflow_data_cache.protocol import ShardRequest

kept = KeptClient()
results = []
for _ in range(5):
    with kept.lease(sys.argv[1], None, None, 30.0) as client:
        peek = client.read_shard(ShardRequest(batch_size=64))  # both nodes' streams, read ahead
        next(peek)
        peek.close()  # the stream threads release their connections moments later
    pid = os.fork()  # what a DataLoader does next: its forked workers read
    if pid == 0:
        try:
            with CacheClient(sys.argv[1]) as child:
                os._exit(0 if sum(b.num_rows for b in child.read_shard(ShardRequest())) == 10_000 else 3)
        except BaseException as err:
            print(type(err).__name__, err, file=sys.stderr, flush=True)
            os._exit(4)
    results.append(os.waitpid(pid, 0)[1])
print(json.dumps({"children": results}))
"""


def test_a_fork_right_after_a_peek_at_the_data_waits_for_its_streams_to_let_go(cache):
    """A main-process peek (a read stopped after a batch), then a fork: the closed client's stream
    threads still held their connections, so the child inherited an 'open' client and refused to
    read (ForkedConnectionError) in 9 runs of 10. The fork waits for them now."""
    got = _run(FORK_AFTER_PEEK_SCRIPT, cache.endpoint)
    assert got["children"] == [0] * 5


def test_close_leaves_the_stall_watch_to_reads_still_going():
    """close() stopped the stall watch: a read still going in another thread, on a node that
    froze, was never cancelled, and blocked until the node woke."""
    import threading

    client = CacheClient("grpc://127.0.0.1:1", deadline_seconds=2)  # channels connect lazily
    connection = client._acquire("grpc://127.0.0.1:1")  # a read in another thread uses it

    class FrozenRead:
        cancelled = threading.Event()

        def cancel(self) -> None:
            self.cancelled.set()

    read = FrozenRead()
    client._stall_watch.arm(read, 0.2)
    client.close()
    assert read.cancelled.wait(5), "the read was not cancelled after its stall limit"
    client._stall_watch.disarm(read)
    client._release(connection)
    assert not connection.users and not client._retired


def test_a_release_inside_a_locked_section_does_not_deadlock():
    """A read's generator finalized by the garbage collector releases its connection wherever the
    collection ran, possibly inside the client's own locked section (it hung for good)."""
    import threading

    client = CacheClient("grpc://127.0.0.1:1", deadline_seconds=2)
    connection = client._acquire("grpc://127.0.0.1:1")
    client.close()  # retired, in use: the release closes it

    def collected_inside_a_locked_section() -> None:
        with client._lock:
            client._release(connection)

    worker = threading.Thread(target=collected_inside_a_locked_section, daemon=True)
    worker.start()
    worker.join(5)
    assert not worker.is_alive(), "deadlocked"
    assert not client._retired


def test_a_release_nested_in_close_closes_each_connection_once():
    """The garbage collector may finalize a read (releasing its connection) at any allocation,
    close() included: each connection is still closed exactly once, and none is left counted."""
    from kubeflow_data_cache import fork_guard
    from kubeflow_data_cache.client import _Connection

    client = CacheClient("grpc://127.0.0.1:1", deadline_seconds=2)
    closes: list[str] = []

    class Fake:
        def __init__(self, name: str, on_close=None) -> None:
            self.name, self.on_close = name, on_close

        def close(self) -> None:
            closes.append(self.name)
            if self.on_close:
                self.on_close()

    busy = _Connection(Fake("busy"))
    busy.users = 1  # a read in another thread, finalized while close() runs
    idle = _Connection(Fake("idle", on_close=lambda: client._release(busy)))
    client._clients.update({"grpc://busy:1": busy, "grpc://idle:1": idle})
    fork_guard._open_clients.add(client)
    client.close()
    assert sorted(closes) == ["busy", "idle"] and not client._retired and not busy.users
    assert client not in fork_guard._open_clients and client not in fork_guard._closing_clients


def test_close_during_a_retry_lets_the_next_try_reconnect():
    """The retried call kept the FlightClient it took before its first try: closed under it, the
    next try failed as "FlightClient is closed", reported as the endpoint's refusal."""
    import threading
    import time

    from kubeflow_data_cache.errors import CacheUnavailableError
    from kubeflow_data_cache.protocol import ShardRequest
    from tests.conftest import free_port

    client = CacheClient(f"grpc://127.0.0.1:{free_port()}", deadline_seconds=2)  # nothing listens there
    outcome = []

    def ask() -> None:
        try:
            client.get_flight_info(ShardRequest())
        except Exception as err:  # the test looks at which error it is
            outcome.append(err)

    asking = threading.Thread(target=ask)
    asking.start()
    time.sleep(0.5)
    client.close()
    asking.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], CacheUnavailableError), outcome
    assert "could not reach the data cache" in str(outcome[0])


def _run(script: str, endpoint: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), endpoint],
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_SECONDS,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def fork_guard_quiesce_seconds() -> float:
    from kubeflow_data_cache.fork_guard import FORK_QUIESCE_SECONDS

    return FORK_QUIESCE_SECONDS


@pytest.fixture(scope="module")
def cache(small_cache):
    return small_cache


def test_one_connection_per_location_is_kept_across_epochs_and_closed_on_close(cache):
    got = _run(CONNECTIONS_SCRIPT, cache.endpoint)
    assert got["nodes"] == 2
    for epoch in got["epochs"]:
        assert epoch["rows"] == epoch["distinct"] == 10_000
        # The head and each data node: one connection each, the same one every epoch.
        assert list(epoch["connections"].values()) == [1, 1, 1], epoch
    assert not any(got["after_close"].values()), got["after_close"]
    # fork_guard knows gRPC's threads by name: none before, some while connected, none after.
    before, while_open, after = got["threads"]
    assert before == [] and while_open and after == [], got["threads"]


def test_forked_loader_workers_after_a_main_process_read(cache):
    got = _run(FORK_SCRIPT, cache.endpoint)
    assert got["main"] == [10_000] * 3
    assert got["workers"] == [[10_000, 10_000]] * 3
    # A read still in progress keeps its connection across the fork: the child says how to fix it.
    assert "half-read DataCacheDataset iterator" in got["busy_fork"], got["busy_fork"]


def test_forked_workers_beside_grpcio_are_neither_refused_nor_held(cache):
    """grpcio's threads would keep every fork waiting FORK_QUIESCE_SECONDS and every worker
    refusing the cache; where grpcio is loaded, the guard relies on closing its own clients."""
    got = _run(GRPCIO_FORK_SCRIPT, cache.endpoint)
    assert got["main"] == got["workers"] == 10_000
    assert got["seconds"] < fork_guard_quiesce_seconds() * 2, got


def test_a_fork_right_after_a_release_lets_grpc_settle_first(cache):
    """gRPC's shutdown can hold its init lock a moment after its named threads end: a worker
    forked then hung for ever in its first call (1 fork in ~670 when a fork followed a close)."""
    got = _run(SETTLE_SCRIPT, cache.endpoint)
    settle = got["settle"]
    for how in ("close", "close-kept", "drop"):
        first, second_slept, second_releases = got[how]
        assert first >= settle, (how, got)
        # Only the fork right after a release waits out the rest; a second one sleeps only if
        # gRPC released again in between.
        assert second_slept == 0 or second_releases, (how, got)


def _connected(client: CacheClient) -> bool:
    return bool(client._clients)


def test_kept_client_is_shared_by_reads_and_closed_only_when_idle():
    keeper = KeptClient()
    settings = ("grpc://127.0.0.1:1", None, None, 5.0)
    with keeper.lease(*settings) as first:
        first._release(first._acquire("grpc://127.0.0.1:1"))  # channels connect lazily: no server needed
        with keeper.lease(*settings) as second:
            assert second is first  # concurrent reads share the kept client
        with keeper.lease("grpc://127.0.0.1:2", None, None, 5.0) as other:
            assert other is not first  # other settings while in use: a client of its own
        keeper.close_if_idle()  # what a fork does now: the read in progress keeps its channels
        assert _connected(first)
    with keeper.lease(*settings) as again:
        assert again is first  # the next read reuses it
    keeper.close_if_idle()
    assert not _connected(first)
    with keeper.lease("grpc://127.0.0.1:2", None, None, 5.0) as changed:
        assert changed is not first  # settings changed while idle: replaced


def test_kept_client_pickles_without_its_connection():
    keeper = KeptClient()
    with keeper.lease("grpc://127.0.0.1:1", None, None, 5.0) as client:
        client._release(client._acquire("grpc://127.0.0.1:1"))
    copy = pickle.loads(pickle.dumps(keeper))
    with copy.lease("grpc://127.0.0.1:1", None, None, 5.0) as fresh:
        assert fresh is not client and not _connected(fresh)
    keeper.close()


def test_kept_client_reconnects_after_a_long_idle():
    keeper = KeptClient(idle_seconds=0.0)
    settings = ("grpc://127.0.0.1:1", None, None, 5.0)
    with keeper.lease(*settings) as client:
        client._release(client._acquire("grpc://127.0.0.1:1"))
    with keeper.lease(*settings) as again:
        assert again is client and not _connected(again)  # closed on the way in: it reconnects
    fresh = KeptClient()  # the default: minutes
    with fresh.lease(*settings) as client:
        client._release(client._acquire("grpc://127.0.0.1:1"))
    with fresh.lease(*settings) as again:
        assert _connected(again)
    fresh.close()


def test_a_client_closes_its_unused_connections_to_the_data_nodes_of_a_replaced_cache(small_table):
    """A cache that restarts at the same endpoint, its data nodes at new addresses (new pod IPs):
    the client's connections to the old nodes were kept for its whole life, two more per restart
    (a review's run). The first FlightInfo of the new load closes them."""
    from kubeflow_data_cache.protocol import ShardRequest
    from tests.conftest import LocalCache

    def read_all(client: CacheClient) -> int:
        return sum(batch.num_rows for batch in client.read_shard(ShardRequest(columns=("id",))))

    first = LocalCache(small_table.metadata_location, 2)
    first.wait_ready()
    with CacheClient(first.endpoint) as client:
        try:
            assert read_all(client) == small_table.rows
            old_nodes = set(client._clients) - {first.endpoint}
            assert len(old_nodes) == 2
        finally:
            first.stop()
        second = LocalCache(small_table.metadata_location, 2, args=("--port", str(first.port)))
        try:
            second.wait_ready()
            assert read_all(client) == small_table.rows
            open_now = set(client._clients)
        finally:
            second.stop()
    new_nodes = open_now - {first.endpoint}
    assert len(new_nodes) == 2, open_now  # the head and the two nodes of the new load, no more
    assert first.endpoint in open_now
    assert not (old_nodes - new_nodes) & open_now
