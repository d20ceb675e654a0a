"""Fixtures shared across the suites: real sample Iceberg tables and real local cache clusters."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import selectors
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kubeflow_data_cache.processes import stop_processes
from kubeflow_data_cache.sample import SampleTable, create_sample_table
from kubeflow_data_cache.security import CLUSTER_KEY_ENV

REPO_ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_SECONDS = 120.0
# How long a process whose stdout closed gets to exit (data-cache local stops its nodes first).
EXIT_WAIT_SECONDS = 30.0


# Ports handed to a process that binds them later come from below the kernel's ephemeral range
# (ip_local_port_range, 32768-60999 by default): a port-0 bind or an outgoing connection of any
# other process can take an ephemeral port between the pick and the bind, and then a test talks
# to somebody else's server. Each pytest-xdist worker scans a slice of its own, so two workers
# never pick the same port either.
PICKED_PORTS = range(20000, 32000)
# Where this process goes on scanning, from a random start: a process left over from an earlier
# run may still hold the ports a fixed start would give first.
_port_offsets = itertools.count(random.randrange(len(PICKED_PORTS)))


def json_from_a_fresh_process(script: str, *args: str) -> dict:
    """Run ``script`` in a fresh interpreter (what it measures starts from nothing this process
    holds) with ``args``; the JSON object on its last line of output."""
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def free_port() -> int:
    """A port nothing on this machine is bound to, for a process about to bind it."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    span = len(PICKED_PORTS) // workers
    first = PICKED_PORTS.start + worker * span
    for _ in range(span):
        port = first + next(_port_offsets) % span
        with socket.socket() as s:
            try:
                s.bind(("", port))  # the wildcard: a bind on any address of this port fails it
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {first}-{first + span - 1}")


# The key a LocalCache's head and nodes share (`local` makes one up where none is set): known,
# so that a test can sign a ticket it changed, and reach the node's checks behind the signature.
TEST_CLUSTER_KEY = "test-cluster-key"


class LocalCache:
    """`data-cache local` as a subprocess: waits for its READY line, stops it on exit."""

    def __init__(
        self,
        metadata_loc: str,
        data_nodes: int = 2,
        env: dict | None = None,
        args: tuple = (),
        options: tuple = (),
        preexec: Callable[[], None] | None = None,
        cluster_key: str | None = TEST_CLUSTER_KEY,
    ):
        """``args`` go after `local`, ``options`` (such as --log-level) before it; ``preexec``
        runs in the child before `data-cache` starts (its streams are set up by then).
        ``cluster_key`` None: none set, so `local` draws its own (``env`` may set one too)."""
        self.port = free_port()
        self.endpoint = f"grpc://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kubeflow_data_cache", *options, "local", "--metadata-loc", metadata_loc]
        cmd += ["--data-nodes", str(data_nodes), "--port", str(self.port), *args]
        key = (env or {}).get(CLUSTER_KEY_ENV, cluster_key)  # one in ``env`` wins
        child_env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k != CLUSTER_KEY_ENV}
        if key is not None:
            child_env[CLUSTER_KEY_ENV] = key
        # stderr goes to a file: a chatty failure could fill a pipe nobody reads and block the nodes.
        self._stderr_file = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (lives as long as the cache)
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=self._stderr_file,
            text=True,
            env=child_env,
            start_new_session=True,
            preexec_fn=preexec,
        )
        self.stderr = ""

    def wait_ready(self, timeout: float = READY_TIMEOUT_SECONDS) -> str:
        """The READY line, or the process's exit code and stderr if it ended first."""
        deadline = time.monotonic() + timeout
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=0.5):
                line = self.proc.stdout.readline()
                if line.startswith("READY"):
                    return line.strip()
                if line == "":
                    # stdout closed: the process is on its way out. Let it finish (stopping its
                    # nodes first, then its last message) rather than SIGTERM it mid-exit.
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.proc.wait(timeout=max(0.0, min(EXIT_WAIT_SECONDS, deadline - time.monotonic())))
                    break
        code = self.proc.poll()
        self.stop()
        raise RuntimeError(f"cache not ready (exit code {code}):\n{self.stderr[-4000:]}")

    def wait_failure(self, timeout: float = READY_TIMEOUT_SECONDS) -> str:
        """For a cache that must fail: the message of that failure. A cache that comes up after
        all fails the test, and is stopped first, so no cluster outlives its test."""
        try:
            line = self.wait_ready(timeout)
        except RuntimeError as err:
            return str(err)
        self.stop()
        pytest.fail(f"the cache came up ({line}) where it should have failed")

    def read_stderr(self) -> str:
        """What the processes wrote to stderr so far, without stopping them (pread leaves the
        file offset the children share untouched)."""
        fd = self._stderr_file.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")

    def stop(self) -> int:
        # `data-cache local` stops its nodes on SIGTERM; SIGKILL sweeps its session after.
        stop_processes([self.proc], 20, kill_group=True)
        with contextlib.suppress(ValueError, OSError):
            self.stderr = self.read_stderr()
        return self.proc.returncode


@contextlib.contextmanager
def running_cache(metadata_loc: str, data_nodes: int = 2, **kwargs) -> Iterator[LocalCache]:
    cache = LocalCache(metadata_loc, data_nodes, **kwargs)
    try:
        cache.wait_ready()
        yield cache
    finally:
        cache.stop()


@pytest.fixture(scope="session")
def table_factory(tmp_path_factory):
    """``make(rows, files, **kw) -> SampleTable``: each call writes a fresh table."""
    made: dict[tuple, SampleTable] = {}

    def make(rows: int, files: int, with_text: bool = True) -> SampleTable:
        key = (rows, files, with_text)
        if key not in made:
            warehouse = tmp_path_factory.mktemp(f"wh-{rows}-{files}")
            made[key] = create_sample_table(str(warehouse), rows, files, with_text=with_text)
        return made[key]

    return make


@pytest.fixture(scope="session")
def small_table(table_factory) -> SampleTable:
    return table_factory(10_000, 3)


@pytest.fixture(scope="session")
def small_cache(small_table) -> Iterator[LocalCache]:
    """One shared 2-node cache over ``small_table`` for read-only tests."""
    with running_cache(small_table.metadata_location, data_nodes=2) as cache:
        yield cache
