"""Numbers the dataset shares with its DataLoader workers: the epoch, and which epoch they read.

A DataLoader worker gets its own copy of the dataset when it starts. Persistent workers
(``persistent_workers=True``) keep that copy for the whole run, so an epoch stored as a plain
int would leave them on the epoch they started with: every epoch would repeat the first one's
shuffle, silently. The other way round, a worker's reading is invisible to the main process, so
``state_dict()`` there would not know that the positions it should save live in the workers.
Kept in shared memory instead, a ``SharedInt`` written on either side reaches the other, however
the workers were started: forked workers map the same page, and spawn and forkserver workers are
handed it by multiprocessing as it starts them. Any other pickling (a checkpoint, a deepcopy)
stores the number alone.

Only DataLoader workers share it. A dataset handed to other processes (``mp.spawn(train,
args=(dataset,))``, a forked rank) reaches them the same way, and every rank then wrote the
same worker slots: one rank's finished worker hid another's read in progress from its
state_dict(). So the first use in a process that is neither the one that made the memory nor a
DataLoader worker copies the numbers into memory of its own; and so does such a process's first
fork, before it happens: a rank that forked its DataLoader workers before it first touched the
numbers left them on the memory it was handed, and its own set_epoch, the first touch, went to
its new copy, which they never saw (every epoch repeated epoch 0's shuffle).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import threading
import weakref
from multiprocessing.context import get_spawning_popen
from typing import Any


def _in_dataloader_worker() -> bool:
    from torch.utils.data import get_worker_info  # only the dataset (the torch extra) uses this module

    return get_worker_info() is not None


class _Shared:
    """Pickling for shared memory: handed over as it is while multiprocessing starts a process,
    as plain numbers otherwise (``_plain`` / ``_restore``); kept shared, in the new process,
    only where that is a DataLoader worker (``_shared``)."""

    _shared_memory: Any
    _owner: int | None  # the pid that may use _shared_memory without asking; None: ask first

    def _adopt(self, memory: Any) -> None:
        self._shared_memory, self._owner = memory, os.getpid()
        _track(self)

    @property
    def _shared(self) -> Any:
        if self._owner != os.getpid():  # a process started with us (forked or handed the memory)
            self._settle()
        return self._shared_memory

    def _settle(self) -> None:
        """Keep the memory this process was handed (a DataLoader worker) or copy it (any other),
        once: two threads settling at once (a fork's hook and a first use) made two copies, and
        a number written to the first was lost."""
        with _settle_lock:
            if self._owner == os.getpid():
                return
            if not _in_dataloader_worker():
                self._restore(self._plain_of(self._shared_memory))  # a copy of its own
            self._owner = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        if get_spawning_popen() is not None:  # multiprocessing is starting a process with us
            return {"shared": self._shared}
        return self._plain()

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "shared" in state:
            self._shared_memory, self._owner = state["shared"], None
            _track(self)
        else:
            self._restore(state)

    def _plain(self) -> dict[str, Any]:
        return self._plain_of(self._shared)

    @staticmethod
    def _plain_of(memory: Any) -> dict[str, Any]:
        raise NotImplementedError

    def _restore(self, state: dict[str, Any]) -> None:
        raise NotImplementedError


_live: weakref.WeakSet[_Shared] = weakref.WeakSet()
_live_lock = threading.Lock()
_settle_lock = threading.RLock()  # reentrant: a copy's own tracking runs inside a settle


def _track(shared: _Shared) -> None:
    with _live_lock:
        _live.add(shared)


def _settle_before_fork() -> None:
    """Before this process forks, each number it was handed and has not used yet is settled as
    its first use would settle it (``_Shared._shared``), so the children share what this
    process will read and write."""
    pid = os.getpid()
    with _live_lock:
        handed = [shared for shared in _live if shared._owner != pid]
    for shared in handed:
        shared._settle()


def _fresh_locks_in_child() -> None:
    """A child forked while another thread of its parent held a lock would wait on it for ever."""
    global _live_lock, _settle_lock
    _live_lock, _settle_lock = threading.Lock(), threading.RLock()


os.register_at_fork(before=_settle_before_fork, after_in_child=_fresh_locks_in_child)


class SharedInt(_Shared):
    """A 64-bit integer in shared memory, shared with the processes multiprocessing starts."""

    def __init__(self, value: int = 0) -> None:
        self._adopt(multiprocessing.RawValue(ctypes.c_int64, value))

    @property
    def value(self) -> int:
        return int(self._shared.value)

    @value.setter
    def value(self, value: int) -> None:
        self._shared.value = value

    @staticmethod
    def _plain_of(memory: Any) -> dict[str, Any]:
        return {"value": int(memory.value)}

    def _restore(self, state: dict[str, Any]) -> None:
        self.__init__(state["value"])


class SharedInts(_Shared):
    """A fixed row of 64-bit integers in shared memory, pickled as SharedInt is: one slot per
    DataLoader worker lets each write its own without a lock."""

    def __init__(self, size: int, values: list[int] | None = None) -> None:
        self._adopt(multiprocessing.RawArray(ctypes.c_int64, values if values is not None else size))

    def __len__(self) -> int:
        return len(self._shared)

    def __getitem__(self, index: int) -> int:
        return int(self._shared[index])

    def __setitem__(self, index: int, value: int) -> None:
        self._shared[index] = value

    def values(self) -> list[int]:
        return list(self._shared)

    def clear(self) -> None:
        ctypes.memset(self._shared, 0, ctypes.sizeof(self._shared))

    @staticmethod
    def _plain_of(memory: Any) -> dict[str, Any]:
        return {"values": list(memory)}

    def _restore(self, state: dict[str, Any]) -> None:
        self.__init__(len(state["values"]), state["values"])
