"""Real caches for the dataset tests, built on the shared LocalCache (tests/conftest.py)."""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Iterator

import pytest

from tests.conftest import LocalCache

# DataLoader workers in these tests start from a forkserver (a process that never used gRPC);
# preloading the dataset module there makes each worker start in a fraction of a second.
multiprocessing.set_forkserver_preload(["kubeflow_data_cache.dataset"])


@pytest.fixture(scope="session")
def cache_factory(table_factory) -> Iterator:
    """``cache_factory(rows, files, data_nodes=2, token=None) -> LocalCache``, one per distinct arguments.

    Caches outlive the test that started them (startup is the slow part) and stop together at the
    end of the session.
    """
    started: dict[tuple, LocalCache] = {}

    def get(rows: int, files: int, data_nodes: int = 2, token: str | None = None) -> LocalCache:
        key = (rows, files, data_nodes, token)
        if key not in started:
            table = table_factory(rows, files)
            env = {"DATA_CACHE_TOKEN": token} if token else None
            cache = LocalCache(table.metadata_location, data_nodes, env=env)
            cache.wait_ready()  # stops the cache and raises with its stderr if it fails
            started[key] = cache
        return started[key]

    try:
        yield get
    finally:
        for cache in started.values():  # signal all first so they shut down in parallel
            if cache.proc.poll() is None:
                cache.proc.send_signal(signal.SIGTERM)
        for cache in started.values():
            cache.stop()
