"""Subprocesses the suite starts: a `data-cache local` cluster and a moto S3 server.

Each is a context manager that stops its process (and the process group it leads) on exit,
Ctrl-C included; every wait has a deadline.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import selectors
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.config import MOTO_START_SECONDS, READY_TIMEOUT_SECONDS, S3_BUCKET, S3_CREDENTIALS
from kubeflow_data_cache.processes import stop_processes

STOP_GRACE_SECONDS = 20.0
# A node logs "<role> serving Flight at <uri> (bind ...), health at :<port>" once it listens.
_SERVING = re.compile(r"serving Flight at (\S+) .*health at :(\d+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, grace: float = STOP_GRACE_SECONDS) -> None:
    """SIGTERM (the process stops its own children), then SIGKILL to its whole session if it
    outlives ``grace``, or if anything of its session outlives it."""
    stop_processes([proc], grace, kill_group=True)


def read_line(proc: subprocess.Popen, deadline: float, what: str) -> str:
    """The next stdout line of ``proc`` before ``deadline`` (monotonic), else RuntimeError."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        while time.monotonic() < deadline:
            if sel.select(timeout=min(0.5, max(0.0, deadline - time.monotonic()))):
                line = proc.stdout.readline()
                if line == "":
                    raise RuntimeError(f"{what}: the process exited with code {proc.wait(timeout=5)}")
                return line
            if proc.poll() is not None:
                raise RuntimeError(f"{what}: the process exited with code {proc.returncode}")
        raise RuntimeError(f"{what}: no answer before the deadline")
    finally:
        sel.close()


class _Drain(threading.Thread):
    """Reads a pipe to the end so the child never blocks on a full stderr; keeps the tail."""

    def __init__(self, pipe) -> None:
        super().__init__(daemon=True)
        self.pipe, self.lines = pipe, collections.deque(maxlen=2000)

    def run(self) -> None:
        for line in self.pipe:
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)


class CacheProcess:
    """`data-cache local --metadata-loc M --data-nodes N --port P`, timed from spawn to READY."""

    def __init__(self, metadata_loc: str, data_nodes: int, env: dict[str, str] | None = None) -> None:
        self.metadata_loc, self.data_nodes = metadata_loc, data_nodes
        self.port = free_port()
        self.endpoint = f"grpc://127.0.0.1:{self.port}"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.ready_wall_seconds = 0.0

    def __enter__(self) -> CacheProcess:
        cmd = [sys.executable, "-m", "kubeflow_data_cache", "local", "--metadata-loc", self.metadata_loc]
        cmd += ["--data-nodes", str(self.data_nodes), "--port", str(self.port)]
        cmd += ["--startup-timeout", str(int(READY_TIMEOUT_SECONDS))]
        started = time.monotonic()
        # Own session: a terminal Ctrl-C reaches only us; __exit__ then stops the cluster in order.
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env, start_new_session=True
        )
        self._stderr = _Drain(self.proc.stderr)
        self._stderr.start()
        try:
            line = read_line(self.proc, started + READY_TIMEOUT_SECONDS, "data-cache local")
            if not line.startswith("READY"):
                raise RuntimeError(f"data-cache local printed {line!r} instead of READY")
        except BaseException as err:
            self.__exit__(None, None, None)
            if isinstance(err, RuntimeError):
                raise RuntimeError(f"{err}\n{self._stderr.text()[-3000:]}") from None
            raise
        self.ready_wall_seconds = time.monotonic() - started
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self._stderr.join(timeout=5)

    def data_node_pids(self) -> dict[int, int]:
        """Data node index -> pid, from the `data-cache worker --index K` children of `local`."""
        import psutil

        pids = {}
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                args = child.cmdline()
                if "worker" in args and "--index" in args:
                    pids[int(args[args.index("--index") + 1])] = child.pid
        return pids

    def status(self) -> dict[str, Any]:
        from kubeflow_data_cache.client import CacheClient

        with CacheClient(self.endpoint, deadline_seconds=30) as client:
            return client.status()

    def health_ports(self) -> dict[str, int]:
        """Flight location -> HTTP health port of each process, from their start-up log lines."""
        return {m.group(1): int(m.group(2)) for m in _SERVING.finditer(self._stderr.text())}

    def metric(self, location: str, name: str) -> float | None:
        """One sample of ``name`` from the /metrics of the process serving ``location``."""
        port = self.health_ports().get(location)
        if port is None:
            return None
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        return None


class MotoServer:
    """`moto_server` on a free loopback port, with the benchmark bucket created."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    @property
    def properties(self) -> dict[str, str]:
        """pyiceberg FileIO properties for this server."""
        return {
            "s3.endpoint": self.endpoint,
            "s3.access-key-id": S3_CREDENTIALS["key"],
            "s3.secret-access-key": S3_CREDENTIALS["secret"],
            "s3.region": S3_CREDENTIALS["region"],
        }

    @property
    def env(self) -> dict[str, str]:
        """The same, as the AWS variables the cache maps to FileIO properties."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": S3_CREDENTIALS["key"],
            "AWS_SECRET_ACCESS_KEY": S3_CREDENTIALS["secret"],
            "AWS_REGION": S3_CREDENTIALS["region"],
        }

    def __enter__(self) -> MotoServer:
        exe = Path(sys.executable).with_name("moto_server")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "moto.server"]
        self.proc = subprocess.Popen(
            [*cmd, "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            self._wait_listening()
            import boto3

            boto3.client(
                "s3",
                endpoint_url=self.endpoint,
                aws_access_key_id=S3_CREDENTIALS["key"],
                aws_secret_access_key=S3_CREDENTIALS["secret"],
                region_name=S3_CREDENTIALS["region"],
            ).create_bucket(Bucket=S3_BUCKET)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + MOTO_START_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with code {self.proc.returncode}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return
            time.sleep(0.1)
        raise RuntimeError(f"moto_server did not listen on port {self.port} within {MOTO_START_SECONDS:.0f}s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop_process(self.proc)
