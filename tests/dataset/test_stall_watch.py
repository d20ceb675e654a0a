"""The stall watcher cancels a read that waits too long, and leaves no thread behind when idle."""

from __future__ import annotations

import threading

from kubeflow_data_cache import stall_watch
from kubeflow_data_cache.stall_watch import StallWatch


class _Read:
    """Stands for a stream reader: what the watcher calls on a stall."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()


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
    # Long enough that every thread is still there when checked just after its watch was armed
    # (at 0.3 s a throttled CI machine once let the first end before the fifth was made).
    monkeypatch.setattr(stall_watch, "IDLE_EXIT_SECONDS", 2.0)
    watches = [StallWatch(0.2) for _ in range(5)]  # dropped without close(), as a forgotten client is
    for watch in watches:
        read = _Read()
        watch.arm(read)
        watch.disarm(read)
    threads = [watch._thread for watch in watches]
    assert all(t is not None and t.is_alive() for t in threads)
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    read = _Read()
    watches[0].arm(read)  # watching again after the thread ended
    try:
        assert read.cancelled.wait(5)
    finally:
        watches[0].close()


def test_a_dropped_watcher_ends_its_thread_within_a_tick():
    """A client dropped without close() (a dataset per evaluation, a sweep) must not keep its
    watcher thread for the whole idle time."""
    import gc

    watch = StallWatch(0.2)  # ticks every 0.05 s
    read = _Read()
    watch.arm(read)
    watch.disarm(read)
    thread = watch._thread
    del watch
    gc.collect()
    thread.join(2)
    assert not thread.is_alive()


def test_a_dataset_dropped_after_a_read_leaves_no_watcher_thread(small_cache):
    import gc

    from kubeflow_data_cache.dataset import DataCacheDataset

    before = set(threading.enumerate())
    ds = DataCacheDataset(small_cache.endpoint, batch_size=1000, columns=["id"])
    assert sum(len(batch["id"]) for batch in ds) == 10_000
    watchers = [t for t in set(threading.enumerate()) - before if t.name == "cache-stall-watch"]
    assert watchers, "the read armed a watcher"
    del ds
    gc.collect()
    for thread in watchers:
        thread.join(5)  # well under IDLE_EXIT_SECONDS (30 s)
    assert not any(t.is_alive() for t in watchers)
