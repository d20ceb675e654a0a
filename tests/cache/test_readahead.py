"""Readahead: items in order, errors where they happened, a bounded queue, and a producer that
stops when the consumer goes away (a client that disconnects mid-stream)."""

from __future__ import annotations

import gc
import queue
import threading
import time
import types
import weakref

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


@pytest.fixture
def watched(monkeypatch) -> types.SimpleNamespace:
    """``produced``: the items a test's source made; ``events``: how many it had made each time
    the producer found no room and blocked, and None where the consumer made room.

    While blocked it makes nothing until the consumer takes an item, so the count at that moment
    is exactly how far ahead it went: no sleep has to guess when it has stopped.
    """
    seen = types.SimpleNamespace(produced=[], events=[])

    class WatchedSemaphore(threading.Semaphore):
        # One lock over the failed try and its record, and over a release and its: a release
        # cannot fall between them and leave a stale count after it.
        watch = threading.Lock()

        def acquire(self, blocking=True, timeout=None):
            with self.watch:
                if super().acquire(blocking=False):
                    return True
                seen.events.append(len(seen.produced))
            return super().acquire(blocking, timeout)

        def release(self, n=1):
            with self.watch:
                seen.events.append(None)
                super().release(n)

    monkeypatch.setattr(
        readahead,
        "threading",
        types.SimpleNamespace(Semaphore=WatchedSemaphore, Event=threading.Event, Thread=threading.Thread),
    )
    return seen


def _next_then_ahead(stream: Readahead, watched: types.SimpleNamespace, seconds: float = 10) -> tuple[object, int]:
    """Take one item; then how many the source had made when the producer next blocked for
    room after that (-1 if it never did by the deadline: nothing bounded it)."""
    item = next(stream)
    events = watched.events
    made_room = max((i for i, e in enumerate(events) if e is None), default=-1)  # in next(), just now
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and len(events) <= made_room + 1:
        time.sleep(0.005)
    return item, (events[made_room + 1] if len(events) > made_room + 1 else -1)


@pytest.mark.parametrize("depth", [1, 3])
def test_counting_the_item_in_progress_computes_at_most_depth_ahead(depth, watched):
    """A data node's gathered batches are megabytes each: with count_in_progress the producer
    waits for room before it computes the next one, rather than computing it and holding it."""

    def source():
        for i in range(100):
            watched.produced.append(i)
            yield i

    stream = Readahead(source(), depth=depth, count_in_progress=True)
    # The item handed out and `depth` ahead of it, the one the producer computed last included.
    assert _next_then_ahead(stream, watched) == (0, 1 + depth)
    assert _next_then_ahead(stream, watched) == (1, 2 + depth)
    assert list(stream) == list(range(2, 100))


@pytest.mark.parametrize("count_in_progress", [False, True])
def test_the_producer_lets_an_item_go_once_handed_out(count_in_progress):
    """While the next item is computed, the producer keeps no reference to the last one: once
    the consumer is done with it (Flight has sent a batch), it is freed."""

    class Item:
        pass

    first, computing, go_on = Item(), threading.Event(), threading.Event()
    gone = weakref.ref(first)

    def source():
        nonlocal first
        item, first = first, None
        yield item
        del item
        computing.set()
        assert go_on.wait(10)  # a long gather of the next one
        yield Item()

    stream = Readahead(source(), depth=1, count_in_progress=count_in_progress)
    item = next(stream)
    del item
    assert computing.wait(10)
    gc.collect()
    assert gone() is None, "the producer still held the item it had handed out"
    go_on.set()
    assert len(list(stream)) == 1
