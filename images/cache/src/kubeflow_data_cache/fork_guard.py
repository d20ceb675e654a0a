"""Keep fork() from leaving a DataLoader worker hung in gRPC.

gRPC does not survive fork() while it is running: a child forked while its parent has an open
channel, or in the moments after the last one closed while gRPC's own threads wind down, can
block forever in its first gRPC call. DataLoader workers are forked children (the default start
method on Linux), so this module:

* before a fork, closes the cache clients no read is using (kept ones, see client.KeptClient),
  gives gRPC's threads up to FORK_QUIESCE_SECONDS to end, then lets its shutdown settle (below);
* in the child, remembers what was still open or running at the fork, so that the child's first
  cache call raises ForkedConnectionError with the fix instead of hanging.

grpcio (Ray, Google Cloud clients) names its threads as Arrow's bundled gRPC does and keeps them
running. gRPC threads already running when this process opened its first cache client are
therefore not Arrow's, and are left out (by thread id); grpcio threads started later still look
like Arrow's, and a worker forked then says to use forkserver.
"""

from __future__ import annotations

import glob
import os
import time
import weakref
from typing import Protocol

from kubeflow_data_cache.errors import ForkedConnectionError

# How long a fork waits for gRPC's threads to end once every client is closed: they end within
# milliseconds of the last close, so this bound is only met when something else runs gRPC.
FORK_QUIESCE_SECONDS = 2.0
# gRPC's last shutdown step can still hold its global init lock, in a thread without a gRPC name,
# just after the named threads end; a child forked then blocks for ever in its first grpc_init
# (about 1 fork in 600 here when a fork followed a close at once). A fork within this long of the
# last connection released, or of the last gRPC thread seen, waits out the rest.
FORK_SETTLE_SECONDS = 0.05
_POLL_SECONDS = 0.005
# The names gRPC gives its threads in the pyarrow build this package pins (a test checks that
# they appear while a client is open, so a rename in a later build shows up there).
GRPC_THREAD_PREFIXES = ("event_engine", "grpc_", "lifeguard", "default-executo", "resolver-execu")


class _Closable(Protocol):
    def close_if_idle(self) -> None: ...

    def forked(self) -> None: ...


_open_clients: weakref.WeakSet = weakref.WeakSet()  # clients with an open channel
_closing_clients: weakref.WeakSet = weakref.WeakSet()  # of those, closed while still in use
_keepers: weakref.WeakSet = weakref.WeakSet()  # holders of clients kept between reads
_inherited_clients = 0  # in a forked child: the parent's open clients at the fork
_inherited_threads: list[str] = []  # in a forked child: the parent's gRPC threads at the fork
_threads_at_fork: list[str] = []
# Whether this process ever opened a cache client: other gRPC users (grpcio) name their threads
# alike, and a process that never ran Arrow's gRPC has nothing to wait for.
_used = False
_foreign_threads: frozenset[int] = frozenset()  # gRPC threads already running at the first client
_last_release = float("-inf")  # time.monotonic() of the last connection freed or gRPC thread seen


def _grpc_thread_ids() -> dict[int, str]:
    """This process's gRPC threads, id -> name (Linux; elsewhere nothing is known: empty)."""
    found = {}
    for path in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(path) as f:
                name = f.read().strip()
        except OSError:  # the thread ended while we looked
            continue
        if name.startswith(GRPC_THREAD_PREFIXES):
            found[int(path.split("/")[-2])] = name
    return found


def grpc_threads() -> list[str]:
    """Names of this process's gRPC threads but those that predate its first cache client."""
    return sorted(name for tid, name in _grpc_thread_ids().items() if tid not in _foreign_threads)


def opening() -> None:
    """Call before creating a channel: Arrow's gRPC starts its threads with this process's first
    one, so the gRPC threads running before it are another library's (grpcio)."""
    global _foreign_threads
    if not _used:
        _foreign_threads = frozenset(_grpc_thread_ids())


def opened(client: object, connection: object) -> None:
    """``client`` (a CacheClient) opened ``connection`` (a FlightClient)."""
    global _used
    _used = True
    _open_clients.add(client)
    # Garbage collected without a close (CacheClient.close() calls released() itself), its
    # channel is shut down from then on: forks settle after it.
    weakref.finalize(connection, released)


def released() -> None:
    """A connection was closed or freed: gRPC may be shutting down from now."""
    global _last_release
    _last_release = time.monotonic()


def closing(client: object) -> None:
    """``client`` was closed while calls or streams still use some of its connections: they
    close as those end, within moments, and a fork waits for that (FORK_QUIESCE_SECONDS)."""
    _closing_clients.add(client)


def closed(client: object) -> None:
    _open_clients.discard(client)
    _closing_clients.discard(client)


def keep(keeper: _Closable) -> None:
    _keepers.add(keeper)


def check_usable() -> None:
    """Raise ForkedConnectionError in a child forked while its parent's gRPC was in use."""
    if _inherited_clients:
        raise ForkedConnectionError(
            f"this process was forked while its parent held {_inherited_clients} open cache client(s) (a "
            "DataLoader started its workers while the main process had a CacheClient or a half-read "
            "DataCacheDataset iterator); gRPC cannot be used after such a fork. Finish or close() them before "
            "iterating the DataLoader, or pass multiprocessing_context='forkserver'"
        )
    if _inherited_threads:
        raise ForkedConnectionError(
            f"this process was forked while gRPC was still running in its parent (threads "
            f"{', '.join(sorted(set(_inherited_threads)))} after {FORK_QUIESCE_SECONDS:.0f}s); gRPC cannot be used "
            "after such a fork. Pass multiprocessing_context='forkserver' to the DataLoader. (Something in the "
            "parent still runs gRPC: another gRPC library, or a connection left open by an earlier call that "
            "failed, such as one to a cache that stopped answering: see that error)"
        )


def _before_fork() -> None:
    global _threads_at_fork
    _threads_at_fork = []
    for keeper in list(_keepers):
        keeper.close_if_idle()
    # A read stopped early (a DataLoader's main process peeked at a batch) releases its
    # connections from its stream threads moments after its client was closed: wait for them,
    # as a child forked before would refuse gRPC.
    deadline = time.monotonic() + FORK_QUIESCE_SECONDS
    while _closing_clients and time.monotonic() < deadline:
        time.sleep(_POLL_SECONDS)
    if not _used or _open_clients:
        return  # nothing of ours ran; or the child refuses gRPC anyway (check_usable)
    deadline = time.monotonic() + FORK_QUIESCE_SECONDS
    threads = grpc_threads()
    while threads and time.monotonic() < deadline:
        released()
        time.sleep(_POLL_SECONDS)
        threads = grpc_threads()
    _threads_at_fork = threads
    settle = _last_release + FORK_SETTLE_SECONDS - time.monotonic()
    if not threads and settle > 0:
        time.sleep(settle)


def _after_fork_in_child() -> None:
    global _inherited_clients, _inherited_threads
    _inherited_clients = len(_open_clients)
    _inherited_threads = list(_threads_at_fork)
    for keeper in list(_keepers):
        keeper.forked()


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
