"""A call that may block for ever, run in a daemon thread its caller waits on for a while.

A filesystem call (an object store endpoint that never answers, a file that is a FIFO) cannot be
cancelled: one that outlasts its wait is left behind to end on its own. A daemon thread does not
hold the process's exit, where a pool's threads are joined at exit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class DaemonCall:
    """``work()`` started at once in a daemon thread named ``name``."""

    def __init__(self, work: Callable[[], Any], name: str) -> None:
        self._outcome: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, args=(work,), name=name, daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], Any]) -> None:
        try:
            self._outcome["value"] = work()
        except BaseException as err:  # raised again in the caller, by result()
            self._outcome["error"] = err

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, seconds: float) -> bool:
        """Whether the call has ended, after waiting at most ``seconds`` for it."""
        self._thread.join(max(0.0, seconds))
        return self.done

    def result(self) -> Any:
        """The call's value, or its error raised again; only once it is done."""
        if "error" in self._outcome:
            raise self._outcome["error"]
        return self._outcome["value"]
