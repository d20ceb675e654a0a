"""The dataset's epoch number, in memory its DataLoader workers share.

A DataLoader worker gets its own copy of the dataset when it starts. Persistent workers
(``persistent_workers=True``) keep that copy for the whole run, so an epoch stored as a plain
int would leave them on the epoch they started with: every epoch would repeat the first one's
shuffle, silently. Kept in shared memory instead, ``set_epoch`` in the main process reaches the
workers, however they were started: forked workers map the same page, and spawn and forkserver
workers are handed it by multiprocessing as it starts them. Any other pickling (a checkpoint, a
deepcopy) stores the number alone.
"""

from __future__ import annotations

import ctypes
import multiprocessing
from multiprocessing.context import get_spawning_popen
from typing import Any


class SharedEpoch:
    def __init__(self, value: int = 0) -> None:
        self._shared = multiprocessing.RawValue(ctypes.c_int64, value)

    @property
    def value(self) -> int:
        return int(self._shared.value)

    @value.setter
    def value(self, epoch: int) -> None:
        self._shared.value = epoch

    def __getstate__(self) -> dict[str, Any]:
        if get_spawning_popen() is not None:  # multiprocessing is starting a worker with us
            return {"shared": self._shared}
        return {"value": self.value}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "shared" in state:
            self._shared = state["shared"]
        else:
            self.__init__(state["value"])
