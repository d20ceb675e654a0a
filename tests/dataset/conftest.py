"""Real caches on loopback for the dataset tests: `data-cache local` as a subprocess.

Each cache runs in its own process group so teardown (and a failing test) stops the head and
every data node; nothing waits without a deadline.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import pytest

from kubeflow_data_cache.sample import create_sample_table

READY_TIMEOUT_SECONDS = 90.0
STOP_TIMEOUT_SECONDS = 15.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Cache:
    endpoint: str
    rows: int
    metadata_location: str
    process: subprocess.Popen
    log: Path


def stop_groups(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every process group at once, then SIGKILL whatever outlives the grace period."""
    for proc in procs:
        if proc.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
    for proc in procs:
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group, if any
        proc.wait(timeout=STOP_TIMEOUT_SECONDS)


def wait_for_line(proc: subprocess.Popen, prefix: str, timeout: float, log: Path) -> str:
    """The first stdout line starting with ``prefix``; fails with the log tail on exit or deadline."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while (remaining := deadline - time.monotonic()) > 0:
            if sel.select(timeout=min(remaining, 0.5)):
                line = proc.stdout.readline()
                if line.startswith(prefix):
                    return line.strip()
                if not line and proc.poll() is not None:
                    break
    finally:
        sel.close()
    tail = log.read_text()[-3000:] if log.exists() else ""
    raise RuntimeError(f"no {prefix!r} line within {timeout:.0f}s (exit code {proc.poll()}); log:\n{tail}")


def start_cache(
    metadata_location: str, rows: int, log_dir: Path, data_nodes: int = 2, token: str | None = None
) -> Cache:
    """Start `data-cache local` on a free port; return once it prints READY (stop it with stop_groups)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATA_CACHE_")}
    if token is not None:
        env["DATA_CACHE_TOKEN"] = token
    log = log_dir / f"cache-{port}.log"
    cmd = [sys.executable, "-m", "kubeflow_data_cache", "local", "--metadata-loc", metadata_location]
    cmd += ["--data-nodes", str(data_nodes), "--port", str(port)]
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True)
    try:
        line = wait_for_line(proc, "READY ", READY_TIMEOUT_SECONDS, log)
    except BaseException:
        stop_groups([proc])
        raise
    return Cache(line.split()[1], rows, metadata_location, proc, log)


def sample_table(root: Path, rows: int, files: int) -> str:
    """A real sample Iceberg table under ``root``; its metadata location."""
    return create_sample_table(str(root / "warehouse"), rows=rows, files=files).metadata_location


@pytest.fixture(scope="session")
def cache_factory(tmp_path_factory) -> Iterator:
    """``cache_factory(rows, files, data_nodes, token=None)``: one cache per distinct arguments per session.

    Caches outlive the test that started them (startup is the slow part); all stop at session end.
    """
    started: dict[tuple, Cache] = {}
    procs: list[subprocess.Popen] = []

    def get(rows: int, files: int, data_nodes: int = 2, token: str | None = None) -> Cache:
        key = (rows, files, data_nodes, token)
        if key not in started:
            root = tmp_path_factory.mktemp(f"table-{rows}-{files}")
            metadata = sample_table(root, rows, files)
            started[key] = start_cache(metadata, rows, root, data_nodes, token)
            procs.append(started[key].process)
        return started[key]

    try:
        yield get
    finally:
        stop_groups(procs)
