"""The data node's memory pools (allocator.py): the choice is made before pyarrow loads, an
operator's own setting wins, and freed load memory really leaves the process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pytest

from kubeflow_data_cache.allocator import configure_data_node

_CHILD = """
import sys
from kubeflow_data_cache.allocator import configure_data_node
configure_data_node()
import numpy as np
import pyarrow as pa

def resident():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS"))

print(pa.default_memory_pool().backend_name)
before = resident()
# Many mid-sized buffers, like Parquet decode scratch (one huge one is unmapped by any allocator).
bufs = [pa.allocate_buffer(1 << 20) for _ in range(256)]
for buf in bufs:
    np.frombuffer(buf, dtype=np.uint8)[:] = 1  # touch every page
held = resident()
del bufs, buf
pa.default_memory_pool().release_unused()
print(held - before, resident() - before)
"""


def _jemalloc_built() -> bool:
    try:
        pa.jemalloc_memory_pool()
    except NotImplementedError:
        return False
    return True


def _child(env_overrides: dict[str, str]) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ARROW_DEFAULT_MEMORY_POOL", "JE_ARROW_MALLOC_CONF")}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], env={**env, **env_overrides}, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_too_late_once_pyarrow_is_loaded():
    environ: dict[str, str] = {}
    assert configure_data_node(environ) is False  # this test process imported pyarrow already
    assert environ == {}


@pytest.mark.skipif(not _jemalloc_built(), reason="this pyarrow build has no jemalloc")
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc to read the resident set")
def test_data_node_pool_returns_freed_memory_to_the_os():
    backend, held, after = _child({})
    assert backend == "jemalloc"
    assert int(held) >= 200 << 20  # the 256 MiB buffer was resident
    assert int(after) < 4 << 20  # and left with the free (default jemalloc kept ~85 MiB, mimalloc ~8)


def test_operator_setting_wins():
    backend, *_ = _child({"ARROW_DEFAULT_MEMORY_POOL": "system"})
    assert backend == "system"


_GATHER_POOL_SCRIPT = """
from kubeflow_data_cache.allocator import prepare_data_node, serve_pool
prepare_data_node()  # what `data-cache worker` runs first
import pyarrow as pa
print(serve_pool().backend_name, pa.default_memory_pool().backend_name)
"""


def _gather_pool(**env: str) -> list[str]:
    environ = {k: v for k, v in os.environ.items() if k not in ("DATA_CACHE_TUNE_MALLOC", "ARROW_DEFAULT_MEMORY_POOL")}
    out = subprocess.run(
        [sys.executable, "-c", _GATHER_POOL_SCRIPT], capture_output=True, text=True, timeout=60, env=environ | env
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_data_nodes_gather_through_tuned_glibc_and_apart_from_the_rows():
    """Gathered batches are freed by other threads than the ones that made them: tuned glibc
    (one arena) reuses that memory for the next batch, where mimalloc kept it per thread."""
    _require_glibc()
    gather, rows = _gather_pool()
    assert gather == "system" and rows != "system"


def test_gathers_use_mimalloc_where_glibc_is_left_alone():
    """Untuned glibc would map and unmap every batch: gathers then keep mimalloc's pages."""
    gather, rows = _gather_pool(DATA_CACHE_TUNE_MALLOC="0")
    assert gather == ("mimalloc" if _built(pa.mimalloc_memory_pool) else rows)


def _built(pool_factory) -> bool:
    try:
        pool_factory()
    except NotImplementedError:
        return False
    return True


def test_client_malloc_tuning_is_on_by_default_and_can_be_turned_off(monkeypatch):
    import ctypes

    import kubeflow_data_cache.allocator as allocator

    try:
        ctypes.CDLL(None).gnu_get_libc_version  # noqa: B018
    except AttributeError:
        pytest.skip("not glibc: the tuning does not apply")
    monkeypatch.setattr(allocator, "_glibc_tuned", None)
    assert allocator.tune_glibc_malloc({"DATA_CACHE_TUNE_MALLOC": "0"}) is False
    monkeypatch.setattr(allocator, "_glibc_tuned", None)
    assert allocator.tune_glibc_malloc({}) is True
    assert allocator.tune_glibc_malloc({"DATA_CACHE_TUNE_MALLOC": "0"}) is True  # once per process


# Threads that each allocate and free a message-sized buffer, then glibc's own arena count.
_ARENAS_SCRIPT = """
import ctypes, os, sys, threading
from kubeflow_data_cache import allocator
if sys.argv[1] == "node":
    allocator.prepare_data_node()  # what `data-cache worker` runs first
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
barrier = threading.Barrier(8)
def work():
    barrier.wait()  # all at once: each would take an arena of its own
    for _ in range(50):
        libc.free(libc.malloc(4 << 20))
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
sys.stdout.flush()
libc.malloc_info(0, ctypes.c_void_p.in_dll(libc, "stdout"))
libc.fflush(None)
"""


def _arenas(mode: str, **env: str) -> int:
    import os
    import subprocess
    import sys

    environ = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"} | env
    out = subprocess.run(
        [sys.executable, "-c", _ARENAS_SCRIPT, mode], capture_output=True, text=True, timeout=60, env=environ
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.count("<heap nr=")


def _require_glibc() -> None:
    import ctypes

    try:
        ctypes.CDLL(None).gnu_get_libc_version  # noqa: B018
    except AttributeError:
        pytest.skip("not glibc: the tuning does not apply")


def test_data_nodes_cap_glibc_arenas():
    """A data node's gRPC threads share DATA_NODE_GLIBC_ARENAS arenas instead of keeping freed
    message buffers in one arena each (what grew a serving node's memory); an operator's
    MALLOC_ARENA_MAX wins."""
    from kubeflow_data_cache.allocator import DATA_NODE_GLIBC_ARENAS

    _require_glibc()
    assert 1 <= _arenas("node") <= DATA_NODE_GLIBC_ARENAS
    assert _arenas("plain") > DATA_NODE_GLIBC_ARENAS  # without the cap, the threads made more
    assert DATA_NODE_GLIBC_ARENAS < _arenas("node", MALLOC_ARENA_MAX="5") <= 5


@pytest.mark.parametrize(
    ("preparation", "argv"),
    [
        # A short deadline: a worker that skipped the preparation fails soon instead of waiting.
        ("prepare_data_node", ["worker", "--head", "grpc://127.0.0.1:1", "--index", "0", "--startup-timeout", "2"]),
        ("prepare_head", ["head", "--metadata-loc", "/nonexistent/metadata.json", "--data-nodes", "1"]),
    ],
)
def test_each_node_command_prepares_its_process_first(monkeypatch, preparation, argv):
    import kubeflow_data_cache.allocator as allocator
    from kubeflow_data_cache import cli

    class Prepared(Exception):
        pass

    def prepare(environ=None):
        raise Prepared

    monkeypatch.setattr(allocator, preparation, prepare)
    import kubeflow_data_cache.runner as runner

    def ran(cfg):  # run_node ends in os._exit: a regression must fail this test, not end pytest
        raise AssertionError(f"the {argv[0]} ran without preparing its process first")

    monkeypatch.setattr(runner, "run_node", ran)
    with pytest.raises(Prepared):
        cli.main(argv)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("shuffle", "readers", "least_burst"),
    # All-column shuffled batches (3.6 MiB) are gathered when Flight asks for them
    # (node.gather_ahead): ~106 MiB for 20 streams, over 150 MiB when each gathered 4 ahead.
    [(True, 20, 80 << 20), (False, 40, 30 << 20)],
    ids=["shuffled", "in-order"],
)
def test_a_burst_of_stalled_readers_leaves_no_memory_behind(table_factory, shuffle, readers, least_burst):
    """Each stalled shuffled stream holds its gathered batches and what gRPC buffered for it;
    each in-order stream of a table with strings, its copies with rebased offsets (offsets.py).
    Once every reader is gone (SIGKILLed here), the node must hand those pages back: shuffled,
    they stayed resident until the next job's reads (~1.7 GB for 28 MiB of rows in a soak); in
    order, while only gathering streams set the idle reclaim, 40 readers left 95 MiB for good."""
    import signal
    import time

    import psutil

    from kubeflow_data_cache.allocator import GATHER_RECLAIM_IDLE_SECONDS
    from tests.cache.stalled_readers import stalled_readers
    from tests.conftest import LocalCache

    cache = LocalCache(table_factory(300_000, 3).metadata_location, 1)
    try:
        cache.wait_ready()
        node = next(p for p in psutil.Process(cache.proc.pid).children() if "worker" in p.cmdline())
        idle = node.memory_info().rss
        with stalled_readers(cache.endpoint, readers, shuffle=shuffle) as (holder, got):
            assert got["held"] == readers, got
            settled = time.monotonic() + 10  # the streams fill their read-ahead as they are scheduled
            while (burst := node.memory_info().rss - idle) <= least_burst and time.monotonic() < settled:
                time.sleep(0.1)
            assert burst > least_burst, f"the stalled streams should hold their batches ({burst >> 20} MiB)"
            holder.send_signal(signal.SIGKILL)
            holder.wait(10)
        deadline = time.monotonic() + GATHER_RECLAIM_IDLE_SECONDS + 15
        while node.memory_info().rss - idle > burst / 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        left = node.memory_info().rss - idle
        assert left <= burst / 3, f"{left >> 20} MiB of a {burst >> 20} MiB burst still resident"
    finally:
        cache.stop()


def test_gather_reclaim_waits_for_quiet_and_keeps_one_timer():
    """Streams that come and go quickly (an epoch's workers, many small filtered reads) set one
    timer between them, and the pages go back only once none has been open for the delay."""
    import threading
    import time

    from kubeflow_data_cache.allocator import GatherReclaim

    def timers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "gather-reclaim"]

    def all_fired(among: list[threading.Thread] | None = None) -> bool:
        """Whether the timers ``among`` (default: all, new ones too) have fired, within 10 s."""
        deadline = time.monotonic() + 10
        while any(among is None or t in among for t in timers()):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    # A delay well past any pause of a loaded machine inside the loop below, which would fire
    # a reclaim between two streams and read as a broken timer.
    reclaim = GatherReclaim(idle_seconds=1.0)
    for _ in range(50):
        reclaim.opened()
        reclaim.closed()
        assert len(timers()) <= 1
    reclaim.opened()  # one stays open past the delay: nothing is reclaimed under it
    pending = timers()
    assert pending, "the last close should have set a timer"
    assert all_fired(pending), "the timer set before the stream opened did not fire"
    assert reclaim.reclaims == 0
    reclaim.closed()
    deadline = time.monotonic() + 5
    while reclaim.reclaims == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reclaim.reclaims == 1
    assert all_fired(), "a reclaim timer still pending 10s after the reclaim"
    assert reclaim.reclaims == 1, "one quiet spell, one reclaim"


def test_in_order_streams_hold_off_the_reclaim_but_are_not_gathering_streams():
    """The memory guard's "alone" rule counts gathering streams; the quiet spell counts all."""
    import time

    from kubeflow_data_cache.allocator import GatherReclaim

    reclaim = GatherReclaim(idle_seconds=0.2)
    reclaim.opened(gathering=True)
    reclaim.opened(gathering=False)
    assert reclaim.open_streams == 1
    reclaim.closed(gathering=True)
    assert reclaim.open_streams == 0
    time.sleep(0.6)
    assert reclaim.reclaims == 0, "an in-order stream is still open"
    reclaim.closed(gathering=False)
    deadline = time.monotonic() + 5
    while reclaim.reclaims == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reclaim.reclaims == 1 and reclaim.open_streams == 0


# With the tuned thresholds (a data node's and a cache client's settings), 96 MiB malloc'ed in
# 1 MiB blocks, under the mmap threshold, touched, then freed: they stay in glibc's arenas.
_FREED_IN_ARENAS = """
import ctypes
from kubeflow_data_cache.allocator import tune_glibc_malloc

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

assert tune_glibc_malloc({})
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(1 << 20) for _ in range(96)]
for block in blocks:
    ctypes.memset(block, 1, 1 << 20)
held = rss()
for block in reversed(blocks):
    libc.free(block)
kept = rss()
"""

_TRIM_SCRIPT = (
    _FREED_IN_ARENAS
    + """
from kubeflow_data_cache.allocator import trim_glibc_malloc
assert trim_glibc_malloc()
print(held >> 20, kept >> 20, rss() >> 20)
"""
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_a_reclaim_hands_back_what_glibc_kept_for_the_tuned_thresholds():
    """gRPC's send buffers and the gathers' index arrays go through glibc, whose raised trim
    threshold keeps them after a burst of reads: GatherReclaim trims them away once idle."""
    out = subprocess.run([sys.executable, "-c", _TRIM_SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    held, kept, trimmed = map(int, out.stdout.split())
    assert kept > held - 32, "the tuned thresholds keep freed buffers resident"
    assert trimmed < kept - 64, f"malloc_trim left {kept - trimmed} of ~96 MiB resident"


def test_gather_reclaim_also_trims_glibc(monkeypatch):
    import time

    from kubeflow_data_cache import allocator

    trims = []
    monkeypatch.setattr(allocator, "trim_glibc_malloc", lambda: trims.append(1) or True)
    reclaim = allocator.GatherReclaim(idle_seconds=0.1)
    reclaim.opened()
    reclaim.closed()
    deadline = time.monotonic() + 5
    while not trims and time.monotonic() < deadline:
        time.sleep(0.05)
    assert trims == [1] and reclaim.reclaims == 1


_TRIM_ABOVE_SCRIPT = (
    _FREED_IN_ARENAS
    + """
from kubeflow_data_cache.allocator import free_heap_bytes, trim_glibc_malloc_above
free = free_heap_bytes()
small = trim_glibc_malloc_above(free + (1 << 20))  # less free than the bound: kept for reuse
after_small = rss()
large = trim_glibc_malloc_above(32 << 20)
print(free >> 20, kept >> 20, int(small), after_small >> 20, int(large), rss() >> 20)
"""
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2 and malloc_trim")
def test_a_reader_hands_back_free_heap_only_past_its_bound():
    """Between epochs a reader hands back what its tuned malloc kept when that is a lot (wide rows
    left ~1.15 GB free in each process), and keeps a little for the next epoch's batches."""
    out = subprocess.run([sys.executable, "-c", _TRIM_ABOVE_SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    free, kept, small, after_small, large, trimmed = map(int, out.stdout.split())
    assert free >= 90, "the freed blocks stay in glibc's arenas"
    assert small == 0 and after_small >= kept - 8
    assert large == 1 and trimmed < kept - 64


def test_every_epoch_of_a_reader_ends_with_the_free_heap_check(small_cache, small_table, monkeypatch):
    """Read whole or left early, an epoch's end hands back glibc's free heap past the bound."""
    from kubeflow_data_cache import dataset as ds_module
    from kubeflow_data_cache.dataset import KEEP_FREE_HEAP_BYTES, DataCacheDataset

    calls = []
    monkeypatch.setattr(ds_module, "trim_glibc_malloc_above", lambda bound: calls.append(bound) or False)
    ds = DataCacheDataset(small_cache.endpoint, batch_size=1000, columns=["id"])
    assert sum(len(b["id"]) for b in ds) == small_table.rows
    assert calls == [KEEP_FREE_HEAP_BYTES]
    it = iter(ds)
    next(it)
    it.close()  # a loop that breaks out early
    assert calls == [KEEP_FREE_HEAP_BYTES] * 2


_THREAD_TRIM_SCRIPT = """
import ctypes, threading
from kubeflow_data_cache.allocator import prepare_data_node, trim_glibc_malloc

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

prepare_data_node()  # what `data-cache worker` runs first
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
before = rss()

def serve():  # a gRPC or gathering thread: buffers under the mmap threshold, freed in turn
    blocks = [libc.malloc(1 << 20) for _ in range(48)]
    for block in blocks:
        ctypes.memset(block, 1, 1 << 20)
    for block in reversed(blocks):
        libc.free(block)

thread = threading.Thread(target=serve)
thread.start()
thread.join()
kept = rss()
trim_glibc_malloc()  # what GatherReclaim does once the node is idle
print((kept - before) >> 20, (rss() - before) >> 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's arenas and malloc_trim")
def test_an_idle_data_node_hands_back_what_its_serving_threads_freed():
    """malloc_trim shortens only the main arena's heap; the free top of another arena's heap
    stays resident under the node's raised trim threshold. A data node keeps one arena, so what
    its serving threads freed goes back once the node is idle (with two, ~10-15 MiB a node stayed
    after shuffled reads)."""
    _require_glibc()
    environ = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "DATA_CACHE_TUNE_MALLOC")}
    out = subprocess.run(
        [sys.executable, "-c", _THREAD_TRIM_SCRIPT], capture_output=True, text=True, timeout=60, env=environ
    )
    assert out.returncode == 0, out.stderr
    kept, left = map(int, out.stdout.split())
    assert kept >= 40, f"the tuned thresholds should keep the thread's freed buffers ({kept} MiB)"
    assert left <= 8, f"{left} of {kept} MiB a serving thread freed is still resident after the trim"


_LOAD_TRIM_SCRIPT = """
import ctypes, json, sys
from kubeflow_data_cache.allocator import prepare_data_node
prepare_data_node()  # what `data-cache worker` runs first: jemalloc for Arrow, glibc tuned to keep
from kubeflow_data_cache import store
from kubeflow_data_cache.plan import assign_rows, open_table, plan_table

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

t = open_table(sys.argv[1]); plan, tasks = plan_table(t, sys.argv[1])
(a,) = assign_rows(plan, 1)
# What a node's start-up leaves in glibc's heap (imports, table open, planning), made large and
# certain: 32 freed MiB under a small block that pins the heap's top, so only malloc_trim's hand-
# back of free pages inside the heap returns them (the raised trim threshold never does).
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(1 << 20) for _ in range(32)]
for block in blocks:
    ctypes.memset(block, 1, 1 << 20)
pin = libc.malloc(64)
for block in blocks:
    libc.free(block)
before = rss()
starts = []
read_piece = store.read_piece
def spy(*args, **kwargs):
    starts.append(rss())
    return read_piece(*args, **kwargs)
store.read_piece = spy
loaded = store.NodeStore.load(t, tasks, plan.schema, list(a.pieces), 1)
print(json.dumps({"before": before, "starts": starts, "rows_bytes": loaded.nbytes}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_a_load_hands_back_glibc_memory_freed_before_its_later_reads(table_factory):
    """A data node keeps what glibc frees (its raised trim threshold, for serving), so what its
    start-up and each read freed sat under the rows through the load's last read, its resident
    peak (1.34x the rows above an idle node on the benchmark's 2-node cluster; 1.2x since). The
    load trims after each read: later reads start without it."""
    _require_glibc()
    location = table_factory(60_000, 3).metadata_location
    environ = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "DATA_CACHE_TUNE_MALLOC")}
    out = subprocess.run(
        [sys.executable, "-c", _LOAD_TRIM_SCRIPT, location], capture_output=True, text=True, timeout=120, env=environ
    )
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    before, starts = figures["before"], figures["starts"]
    assert len(starts) == 3, figures
    assert figures["rows_bytes"] < 8 << 20, figures  # the freed 32 MiB dwarf what the reads keep
    # Untrimmed, each later read starts above ``before`` (its rows kept on top of all of it).
    for n, start in enumerate(starts[1:], start=2):
        assert start < before - (16 << 20), f"read {n} started at {(start - before) / 2**20:+.1f} MiB: {figures}"


_HEAD_ORDERS_SCRIPT = """
import threading
from kubeflow_data_cache import allocator, sharding
from kubeflow_data_cache.protocol import ShardRequest

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

allocator.prepare_head()  # what `data-cache head` runs first
rows = 2_000_000
before = rss()

def build(i):  # what the head's GetFlightInfo does, in the gRPC thread that asked
    req = ShardRequest(shard=0, num_shards=8, seed=100 + i, epoch=i, shuffle=True, block_size=1)
    sharding.endpoint_rows([0, rows // 2, rows], rows, req)

threads = [threading.Thread(target=build, args=(i,)) for i in range(6)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print((rss() - before) >> 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mmap threshold")
def test_a_head_hands_back_what_its_order_builds_freed():
    """Six readers' calls at distinct seeds over a 2M-block order (block_size 1), each built in
    its own gRPC thread: with glibc's dynamic mmap threshold the builds' freed arrays stayed in
    each thread's arena, ~390 MiB here after the calls, for one order of ~46 MiB kept alive."""
    _require_glibc()
    environ = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "DATA_CACHE_TUNE_MALLOC")}
    out = subprocess.run(
        [sys.executable, "-c", _HEAD_ORDERS_SCRIPT], capture_output=True, text=True, timeout=120, env=environ
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) < 120, f"{out.stdout.strip()} MiB kept after the builds"
