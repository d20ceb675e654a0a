"""Readahead: items in order, errors where they happened, a bounded queue, and a producer that
stops when the consumer goes away (a client that disconnects mid-stream)."""

from __future__ import annotations

import threading
import time

import pytest

from kubeflow_data_cache.readahead import Readahead


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


def test_the_producer_runs_at_most_depth_items_ahead():
    produced = []

    def source():
        for i in range(100):
            produced.append(i)
            yield i

    stream = Readahead(source(), depth=3)
    assert next(stream) == 0
    time.sleep(0.3)  # time for the producer to run as far ahead as it may
    # The item handed out, `depth` queued, and one more in the producer's hands waiting for room.
    assert len(produced) <= 1 + 3 + 1
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


def test_closing_one_never_read_stops_its_producer_too():
    finished = threading.Event()

    def source():
        try:
            yield from range(10**9)
        finally:
            finished.set()

    stream = Readahead(source(), depth=1, name="never-read")
    time.sleep(0.1)  # started at once: it fills its one slot and waits for room
    stream.close()
    assert finished.wait(10)
    assert list(stream) == []
