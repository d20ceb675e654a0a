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
"""

from __future__ import annotations

import ctypes
import multiprocessing
from multiprocessing.context import get_spawning_popen
from typing import Any


class _Shared:
    """Pickling for shared memory: handed over as it is while multiprocessing starts a worker,
    as plain numbers otherwise (``_plain`` / ``_restore``)."""

    _shared: Any

    def __getstate__(self) -> dict[str, Any]:
        if get_spawning_popen() is not None:  # multiprocessing is starting a worker with us
            return {"shared": self._shared}
        return self._plain()

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "shared" in state:
            self._shared = state["shared"]
        else:
            self._restore(state)

    def _plain(self) -> dict[str, Any]:
        raise NotImplementedError

    def _restore(self, state: dict[str, Any]) -> None:
        raise NotImplementedError


class SharedInt(_Shared):
    """A 64-bit integer in shared memory, shared with the processes multiprocessing starts."""

    def __init__(self, value: int = 0) -> None:
        self._shared = multiprocessing.RawValue(ctypes.c_int64, value)

    @property
    def value(self) -> int:
        return int(self._shared.value)

    @value.setter
    def value(self, value: int) -> None:
        self._shared.value = value

    def _plain(self) -> dict[str, Any]:
        return {"value": self.value}

    def _restore(self, state: dict[str, Any]) -> None:
        self.__init__(state["value"])


class SharedInts(_Shared):
    """A fixed row of 64-bit integers in shared memory, pickled as SharedInt is: one slot per
    DataLoader worker lets each write its own without a lock."""

    def __init__(self, size: int, values: list[int] | None = None) -> None:
        self._shared = multiprocessing.RawArray(ctypes.c_int64, values if values is not None else size)

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

    def _plain(self) -> dict[str, Any]:
        return {"values": self.values()}

    def _restore(self, state: dict[str, Any]) -> None:
        self.__init__(len(state["values"]), state["values"])
