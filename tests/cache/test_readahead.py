"""Readahead: items in order, errors where they happened, a bounded queue, and a producer that
stops when the consumer goes away (a client that disconnects mid-stream)."""

from __future__ import annotations

import queue
import threading
import time
import types

import pytest

from kubeflow_data_cache import readahead
from kubeflow_data_cache.readahead import Readahead


@pytest.fixture
def waits_for_room(monkeypatch) -> threading.Event:
    """Set when a Readahead's producer offers an item to a full queue: it waits for room."""
    full = threading.Event()

    class WatchedQueue(queue.Queue):
        def put(self, item, block=True, timeout=None):
            if self.full():
                full.set()
            super().put(item, block, timeout)

    monkeypatch.setattr(readahead, "queue", types.SimpleNamespace(Queue=WatchedQueue, Full=queue.Full))
    return full


def test_items_come_in_order():
    assert list(Readahead(iter(range(1000)), depth=3)) == list(range(1000))


def test_a_failure_is_raised_after_the_items_before_it():
    def source():
        yield from range(5)
        raise ValueError("bad row group")

    got = []
    with pytest.raises(ValueError, match="bad row group"):
        for item in Readahead(source(), depth=2):
            got.append(item)
    assert got == list(range(5))


def test_the_producer_runs_at_most_depth_items_ahead(waits_for_room):
    produced = []
    taken = threading.Event()

    def source():
        for i in range(100):
            produced.append(i)
            yield i
            if i == 0:  # the rest once the consumer has the first: any wait for room comes after
                assert taken.wait(10)

    stream = Readahead(source(), depth=3)
    assert next(stream) == 0
    taken.set()
    assert waits_for_room.wait(10), f"the producer never waited for room ({len(produced)} items produced)"
    # The item handed out, `depth` queued, and one more in the producer's hands waiting for room.
    assert len(produced) == 1 + 3 + 1
    stream.close()


def test_closing_early_stops_the_producer_thread():
    finished = threading.Event()

    def source():
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            finished.set()

    stream = Readahead(source(), depth=2, name="test-readahead")
    assert next(stream) == 0
    stream.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(t.name == "test-readahead" for t in threading.enumerate()):
        time.sleep(0.05)
    assert not any(t.name == "test-readahead" for t in threading.enumerate())
    assert finished.is_set()  # the source generator was closed, its cleanup ran


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="depth should be >= 1"):
        list(Readahead(iter([1]), depth=0))


def test_closing_one_never_read_stops_its_producer_too(waits_for_room):
    finished = threading.Event()

    def source():
        try:
            yield from range(10**9)
        finally:
            finished.set()

    stream = Readahead(source(), depth=1, name="never-read")
    # Started at once: it fills its one slot and waits for room, where the close must reach it.
    assert waits_for_room.wait(10), "the producer of a never-read stream never waited for room"
    stream.close()
    assert finished.wait(10)
    assert list(stream) == []
