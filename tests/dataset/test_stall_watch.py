"""The stall watcher cancels a read that waits too long, and leaves no thread behind when idle."""

from __future__ import annotations

import threading
import time

from kubeflow_data_cache import stall_watch
from kubeflow_data_cache.stall_watch import StallWatch


class _Read:
    """Stands for a stream reader: what the watcher calls on a stall."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()


def _watch_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "cache-stall-watch")


def test_a_read_armed_past_the_limit_is_cancelled_and_marked_stalled():
    watch = StallWatch(0.2)
    read = _Read()
    watch.arm(read)
    try:
        assert read.cancelled.wait(5)
        assert watch.stalled(read)
        watch.forget(read)
        assert not watch.stalled(read)
    finally:
        watch.close()


def test_a_disarmed_read_is_left_alone():
    watch = StallWatch(0.2)
    read = _Read()
    watch.arm(read)
    watch.disarm(read)
    try:
        assert not read.cancelled.wait(0.6)
    finally:
        watch.close()


def test_an_idle_watcher_ends_its_thread_and_the_next_arm_starts_one(monkeypatch):
    monkeypatch.setattr(stall_watch, "IDLE_EXIT_SECONDS", 0.3)
    before = _watch_threads()
    watches = [StallWatch(0.2) for _ in range(5)]  # dropped without close(), as a forgotten client is
    for watch in watches:
        read = _Read()
        watch.arm(read)
        watch.disarm(read)
    assert _watch_threads() == before + 5
    deadline = time.monotonic() + 10
    while _watch_threads() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _watch_threads() == before
    read = _Read()
    watches[0].arm(read)  # watching again after the thread ended
    try:
        assert read.cancelled.wait(5)
    finally:
        watches[0].close()
