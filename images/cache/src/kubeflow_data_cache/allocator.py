"""Which allocators a cache process uses, and why.

On a data node, two jobs with opposite needs:

- Loading decodes Parquet through pyarrow's default pool, which also holds the rows for good.
  Decode scratch is freed when the load ends; pyarrow's default allocator (mimalloc) keeps those
  pages resident, which measured as ~0.4x of the node's Arrow bytes of dead weight. jemalloc
  with both decay times at 0 hands freed pages straight back to the OS, so a loaded node holds
  its rows plus the interpreter and little else.
- Serving gathers (shuffled or filtered reads) allocate and free one output batch at a time.
  There, returning pages at once would fault them in again on every batch, so gathers use a
  separate pool that keeps its few in-flight buffers: glibc's malloc, which a data node tunes
  to keep freed buffers in its one arena (below) and trims when the node goes idle.

Arrow reads ``ARROW_DEFAULT_MEMORY_POOL`` and jemalloc its ``JE_ARROW_MALLOC_CONF`` once, when
first used, so the data node's choice is made in ``data-cache worker`` before pyarrow loads.
Values already set in the environment win, so an operator can still pick another pool.

In cache clients (a trainer) and data nodes, ``tune_glibc_malloc`` keeps glibc from mapping
and unmapping a fresh buffer for every batch gRPC receives or sends.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping, MutableMapping

log = logging.getLogger(__name__)

DATA_NODE_POOL = "jemalloc"
# Freed pages go back to the OS at once instead of after a decay period.
DATA_NODE_JEMALLOC_CONF = "dirty_decay_ms:0,muzzy_decay_ms:0"


def configure_data_node(environ: MutableMapping[str, str] | None = None) -> bool:
    """Pick the data node's load pool. Returns False when pyarrow is already loaded (too late)."""
    environ = os.environ if environ is None else environ
    if "pyarrow" in sys.modules:
        log.debug("pyarrow already imported; keeping its memory pool")
        return False
    environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", DATA_NODE_POOL)
    environ.setdefault("JE_ARROW_MALLOC_CONF", DATA_NODE_JEMALLOC_CONF)
    return True


@functools.cache
def serve_pool():
    """The pool for per-request gathers: glibc's malloc where this process tuned it, else
    mimalloc where this pyarrow build has it.

    A gathered batch is allocated in its stream's gather thread and freed in a gRPC thread once
    sent. Tuned glibc (tune_glibc_malloc; one arena on a data node) puts the next batch in the
    memory the last one left, whichever thread freed it, and ``malloc_trim`` hands it all back
    once the node is idle. mimalloc keeps a freed batch's pages with the heap of the thread that
    allocated it, and each stream's thread is new: shuffled all-column reads of a 2-node, 2M-row
    cache peaked 77-101 MiB above the node's ready size for ~14 MiB of batches alive at once,
    against 34-40 MiB with glibc, at the same speed.
    """
    import pyarrow as pa

    if tune_glibc_malloc():
        return pa.system_memory_pool()
    try:
        return pa.mimalloc_memory_pool()
    except NotImplementedError:
        return pa.default_memory_pool()


# How long a data node must have no gathering stream open before the gather pool's free pages
# are handed back (GatherReclaim). Longer than the gap between two epochs' streams.
GATHER_RECLAIM_IDLE_SECONDS = 2.0


class GatherReclaim:
    """Hands the gather pool's free pages back to the OS once no stream has been open for
    GATHER_RECLAIM_IDLE_SECONDS; counts the gathering (shuffled or filtered) ones apart, for the
    serving memory guard.

    The gather pool keeps what its batches freed, for the next ones: tuned glibc under its
    raised trim threshold; mimalloc (where glibc is not tuned) in the heap of each stream's own
    thread, abandoned when that thread exits. Either way, after a burst of many streams (40
    stalled shuffled readers here) a node held the burst's peak (~1.7 GB for 28 MiB of rows with
    mimalloc) until the next job read. After the delay, a new thread hands it back (it must have
    used the pool for mimalloc's collect to reach abandoned heaps: 1178 -> 128 MiB in a
    standalone test), so streams that follow each other keep their pages. One timer at most is
    pending, however many streams come and go. In-order streams count for the quiet spell too:
    their rebased offset copies (offsets.py) are glibc memory that the raised trim threshold
    keeps, and 40 stalled in-order readers of a string table left their nodes 95 MiB above
    ready for good when only gathering streams set the timer.
    """

    def __init__(self, idle_seconds: float = GATHER_RECLAIM_IDLE_SECONDS):
        self._idle = idle_seconds
        self._lock = threading.Lock()
        self._open = 0  # streams of any kind: the quiet spell
        self._gathering = 0  # of them, gathering streams: open_streams
        self._last_close = 0.0
        self._pending = False  # a timer is set: it reschedules itself rather than another starting
        self.reclaims = 0

    def opened(self, gathering: bool = True) -> None:
        with self._lock:
            self._open += 1
            self._gathering += gathering

    def closed(self, gathering: bool = True) -> None:
        with self._lock:
            self._open -= 1
            self._gathering -= gathering
            if self._open:
                return
            self._last_close = time.monotonic()
            if self._pending:
                return
            self._pending = True
        try:
            self._schedule(self._idle)
        except RuntimeError:  # no thread to be had: the next close tries again
            with self._lock:
                self._pending = False

    def _schedule(self, delay: float) -> None:
        timer = threading.Timer(delay, self._fire)
        timer.name, timer.daemon = "gather-reclaim", True
        timer.start()

    def _fire(self) -> None:
        with self._lock:
            if self._open:
                self._pending = False  # the close of the last open stream sets a timer again
                return
            wait = self._last_close + self._idle - time.monotonic()
            if wait <= 0:
                self._pending = False
        if wait > 0:
            self._schedule(wait)  # a stream came and went meanwhile: idle since its close
            return
        reclaim_gather_memory()
        self.reclaims += 1

    @property
    def open_streams(self) -> int:
        """Gathering streams open now."""
        return self._gathering

    @property
    def all_open_streams(self) -> int:
        """Streams of any kind open now."""
        return self._open


def reclaim_gather_memory() -> None:
    """Hand the gather pool's free pages, and glibc's free memory, back to the OS: when a node
    goes idle (GatherReclaim), or when it nears its memory limit (memory.ServeMemoryGuard)."""
    import pyarrow as pa

    pool = serve_pool()
    if pool.backend_name != "system":
        # A mimalloc collect only reaches abandoned pages from a thread whose heap is set up.
        pa.allocate_buffer(64, memory_pool=pool)
        pool.release_unused()
    # gRPC's send buffers and the gathers' index arrays (and batches, with the system pool) went
    # through glibc, whose tuned trim threshold keeps what they freed: hand that back.
    trim_glibc_malloc()


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
GLIBC_MMAP_THRESHOLD = 32 << 20
GLIBC_TRIM_THRESHOLD = 128 << 20
# A data node's glibc arenas. Left alone, glibc gives threads their own arenas (up to 8 per
# core), and each gRPC thread's keeps its freed message buffers: with the thresholds above, a
# node's resident memory grew by ~250 MiB over 30 shuffled whole-table reads here (a 56 MiB
# node), ~90 MiB with two arenas, at the same speed. One arena, because malloc_trim only
# shortens the main arena's heap: the free top of any other arena's heap goes back to the OS
# only from free(), once it exceeds the trim threshold, which at 128 MiB (above) is more than
# such a heap can hold. With two, ~10-15 MiB a node stayed resident after shuffled reads however
# long it sat idle; with one, ~3-4 MiB, and reads measured as fast (paired runs, 1 to 4 readers).
# Nodes only: in a trainer, torch's CPU threads allocate through glibc too, and fewer arenas
# could make them wait on each other.
DATA_NODE_GLIBC_ARENAS = 1
_glibc_tuned: bool | None = None


def _glibc(function: str):
    """glibc's ``function``, or None where the C library is not glibc (musl, macOS)."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl and macOS have no such symbol
        return getattr(libc, function)
    except (OSError, AttributeError):
        return None


def _tuning_off(environ: Mapping[str, str]) -> bool:
    """``DATA_CACHE_TUNE_MALLOC=0``: leave glibc's malloc as it is."""
    return environ.get("DATA_CACHE_TUNE_MALLOC", "1").strip().lower() in ("0", "false", "no", "off")


def tune_glibc_malloc(environ: Mapping[str, str] | None = None) -> bool:
    """Keep gRPC's message buffers out of fresh mmaps, in cache clients and data nodes.

    Flight copies each received record batch (about 1.5 MB at the default batch size) into one
    buffer that glibc allocates with mmap and unmaps on free, so every batch faults its pages in
    again: a third of the client's CPU went to that here. A fixed 32 MiB mmap threshold and a
    128 MiB trim threshold let those buffers be reused (one DoGet stream: ~1.1 -> ~1.8 GB/s on
    this project's test machine; on the sending data node, another 10-15%). Arrow's own buffers
    do not go through glibc (see above). glibc only, once per process;
    ``DATA_CACHE_TUNE_MALLOC=0`` leaves malloc alone. Returns whether the settings are in effect.
    """
    global _glibc_tuned
    if _glibc_tuned is not None:
        return _glibc_tuned
    environ = os.environ if environ is None else environ
    _glibc_tuned = False
    if _tuning_off(environ):
        return False
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    _glibc_tuned = bool(mallopt(_M_MMAP_THRESHOLD, GLIBC_MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, GLIBC_TRIM_THRESHOLD)
    )
    log.debug("glibc malloc tuned for gRPC buffers: %s", _glibc_tuned)
    return _glibc_tuned


def trim_glibc_malloc() -> bool:
    """Return glibc's free memory to the OS (``malloc_trim(0)``): the free chunks of every arena,
    and the free top of the main arena's heap only (why data nodes keep one arena). True when
    some was released; False when none was, or where the C library is not glibc. Cheap when
    idle: the pages it hands back are already free."""
    trim = _glibc("malloc_trim")
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def free_heap_bytes() -> int | None:
    """The free bytes glibc's arenas hold for reuse (``mallinfo2``), None where it cannot tell
    (not glibc, or one before 2.33)."""
    mallinfo2 = _glibc("mallinfo2")
    if mallinfo2 is None:
        return None
    mallinfo2.argtypes, mallinfo2.restype = [], _Mallinfo2
    info = mallinfo2()
    return int(info.fordblks + info.fsmblks)


def trim_glibc_malloc_above(free_bytes: int) -> bool:
    """``trim_glibc_malloc`` where glibc holds more than ``free_bytes`` free: handing back a
    little costs the next reads its page faults, and the tuned thresholds exist to keep it."""
    free = free_heap_bytes()
    return free is not None and free > free_bytes and trim_glibc_malloc()


def cap_glibc_arenas(arenas: int, environ: Mapping[str, str] | None = None) -> bool:
    """Let glibc make at most ``arenas`` arenas; an operator's ``MALLOC_ARENA_MAX`` wins.

    Only before threads have made more: glibc fixes its limit once it has more arenas than that,
    and ignores a later cap (while mallopt still reports success). Returns whether it was set.
    """
    environ = os.environ if environ is None else environ
    if environ.get("MALLOC_ARENA_MAX"):
        return False
    mallopt = _glibc("mallopt")
    return mallopt is not None and bool(mallopt(_M_ARENA_MAX, arenas))


def prepare_data_node(environ: MutableMapping[str, str] | None = None) -> None:
    """What ``data-cache worker`` sets first, before pyarrow loads and threads start: the load
    pool, glibc's thresholds for gRPC buffers, and the arena cap."""
    configure_data_node(environ)
    tune_glibc_malloc(environ)
    cap_glibc_arenas(DATA_NODE_GLIBC_ARENAS, environ)


# The head's glibc mmap threshold, fixed: an order's build (sharding.py) allocates arrays of
# tens of MiB in the gRPC thread that asked for it. Left dynamic, glibc raises the threshold to
# 32 MiB at the first such array freed, and later builds' arrays then came from each thread's own
# arena and stayed there once freed: 16 calls at distinct seeds over a 2M-block order, built one
# at a time, took a head from 28 to 763 MiB and left 672 MiB resident (its default limit is 1 GiB).
# Fixed at 1 MiB, every large array is mapped for its build and unmapped after: 169 MiB at the
# peak, 78 MiB after, built as fast.
HEAD_GLIBC_MMAP_THRESHOLD = 1 << 20


def prepare_head(environ: Mapping[str, str] | None = None) -> bool:
    """What ``data-cache head`` sets first: a fixed glibc mmap threshold (above). An operator's
    ``MALLOC_MMAP_THRESHOLD_``, or ``DATA_CACHE_TUNE_MALLOC=0``, leaves malloc alone. Returns
    whether it was set (False where the C library is not glibc)."""
    environ = os.environ if environ is None else environ
    if environ.get("MALLOC_MMAP_THRESHOLD_") or _tuning_off(environ):
        return False
    mallopt = _glibc("mallopt")
    return mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, HEAD_GLIBC_MMAP_THRESHOLD))
