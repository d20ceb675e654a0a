"""Freezing a process the way a hung pod freezes: SIGSTOP, and wait until it has taken effect."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def thread_states(pid: int) -> list[str]:
    """The scheduler state letter of each thread of ``pid`` ('T': stopped)."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            text = stat.read_text()
        except (FileNotFoundError, ProcessLookupError):  # a thread that exited meanwhile
            continue
        states.append(text.rpartition(")")[2].split()[0])
    return states


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every one of its threads is stopped.

    kill() returns before the stop takes effect: the kernel wakes one thread to take the signal,
    and until that thread is scheduled the others run on. On a loaded machine a gRPC thread woke
    by a request could answer it meanwhile (a CI run saw a "frozen" head answer ``status``), so a
    test that means "this process answers nothing from now on" has to wait for all of them.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not all(state in "tT" for state in thread_states(pid)):
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} did not stop within {timeout}s of SIGSTOP: {thread_states(pid)}")
        time.sleep(0.001)
