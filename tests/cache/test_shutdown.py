"""SIGTERM of a data node with a reader that stopped reading mid-stream: not ready at once, saying
so over Flight while the stream holds it, gone within the shutdown grace instead of waiting for
the reader for ever."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
import urllib.error

import pyarrow.flight as flight
import pytest

from kubeflow_data_cache.client import CacheClient
from kubeflow_data_cache.constants import SHUTDOWN_GRACE_SECONDS
from kubeflow_data_cache.processes import stop_processes
from kubeflow_data_cache.protocol import ShardRequest
from tests.cache.inprocess import get, wait_for
from tests.conftest import free_port
from tests.freeze import freeze


def probe(port: int, path: str) -> tuple[int, str]:
    """get(), or (0, reason) while nothing listens (before start, after exit)."""
    try:
        return get(port, path)
    except urllib.error.URLError as err:
        return 0, str(err.reason)


def cmd(role: str, *args: str) -> list[str]:
    common = ["--host", "127.0.0.1", "--advertise-host", "127.0.0.1", "--startup-timeout", "90"]
    return [sys.executable, "-m", "kubeflow_data_cache", role, *args, *common]


def test_a_stalled_reader_does_not_hold_a_stopping_node(table_factory, tmp_path):
    metadata = table_factory(200_000, 4).metadata_location
    port, head_health, node_health = free_port(), free_port(), free_port()
    head = subprocess.Popen(
        cmd(
            "head",
            "--metadata-loc",
            metadata,
            "--data-nodes",
            "1",
            "--port",
            str(port),
            "--health-port",
            str(head_health),
        ),
        stderr=(tmp_path / "head.log").open("w"),
    )
    node = subprocess.Popen(
        cmd(
            "worker",
            "--index",
            "0",
            "--head",
            f"grpc://127.0.0.1:{port}",
            "--port",
            "0",
            "--health-port",
            str(node_health),
        ),
        stderr=(tmp_path / "node.log").open("w"),
    )
    try:
        wait_for(lambda: probe(node_health, "/ready")[0] == 200, timeout=90)
        client = CacheClient(f"grpc://127.0.0.1:{port}", generic_options=[("grpc.http2.bdp_probe", 0)])
        endpoint = client.get_flight_info(ShardRequest(batch_size=1000)).endpoints[0]
        reader = flight.FlightClient(endpoint.locations[0].uri.decode(), generic_options=[("grpc.http2.bdp_probe", 0)])
        stream = reader.do_get(endpoint.ticket)
        stream.read_chunk()  # then stop reading: the node's writer blocks on flow control

        node.send_signal(signal.SIGTERM)
        started = time.monotonic()
        code, body = wait_for(lambda: (r := probe(node_health, "/ready"))[0] != 200 and r, timeout=10)
        assert code == 503 and "stopping" in body
        # The stream holds the node: its Flight server still answers, saying why it serves no
        # more (it refused connections at once, and the head called the node unreachable).
        (status,) = reader.do_action(flight.Action("status", b""))
        assert json.loads(status.body.to_pybytes())["state"] == "stopping"
        with pytest.raises(flight.FlightUnavailableError, match="stopping"):
            reader.do_get(endpoint.ticket).read_all()

        def head_sees() -> str:
            nodes = json.loads(probe(head_health, "/status")[1])["nodes"]
            return nodes[0]["state"] == "stopping"

        wait_for(head_sees, timeout=SHUTDOWN_GRACE_SECONDS - 1)  # the head polls every 5 s
        node.wait(timeout=SHUTDOWN_GRACE_SECONDS + 20)
        assert time.monotonic() - started < SHUTDOWN_GRACE_SECONDS + 20
        assert "exiting without them" in (tmp_path / "node.log").read_text()
        reader.close()
        client.close()
    finally:
        stop_processes([head, node], 15)


def _has_pyarrow(pid: int) -> bool:
    """Whether process ``pid`` has loaded pyarrow's library: its interpreter is up and importing."""
    with open(f"/proc/{pid}/maps") as maps:
        return "libarrow" in maps.read()


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (a node catches SIGTERM once
    runner.run_node's handlers are in; Python's KeyboardInterrupt is a SIGINT handler)."""
    with open(f"/proc/{pid}/status") as status:
        caught = next(line for line in status if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) >> (sig - 1) & 1)


def _start_local_with(table, sitecustomize: str, tmp_path) -> subprocess.Popen:
    """`data-cache local` (2 data nodes) with ``sitecustomize`` first on its process tree's path,
    in a process group of its own, as a terminal's foreground job is (a Ctrl-C reaches it all)."""
    import os

    (tmp_path / "sitecustomize.py").write_text(sitecustomize)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    local = ["local", "--metadata-loc", table.metadata_location, "--data-nodes", "2", "--port", "0"]
    return subprocess.Popen(
        [sys.executable, "-m", "kubeflow_data_cache", *local],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )


# Put first on the path of local's process tree: each node (not local itself) stops itself as
# soon as pyarrow is loaded, before any of the node's own code (and handlers) runs. Watching for
# that from outside raced the node: under load it was past its imports before it was caught.
STOP_AFTER_PYARROW = """
import os, signal
if set(open("/proc/self/cmdline", "rb").read().split(b"\\0")) & {b"head", b"worker"}:
    import pyarrow
    os.kill(os.getpid(), signal.SIGSTOP)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the processes' state in /proc")
def test_ctrl_c_while_the_nodes_still_start_stops_local_without_tracebacks(small_table, tmp_path):
    """A terminal's Ctrl-C reaches the whole process group, nodes included: while they were still
    importing, it printed their KeyboardInterrupt tracebacks and nothing else. `local` stops them."""
    import os

    import psutil

    proc = _start_local_with(small_table, STOP_AFTER_PYARROW, tmp_path)
    # Each of local's processes (its head and two data nodes) stops itself once it has loaded
    # pyarrow, still without its own handlers: the Ctrl-C reaches all three mid-import, however
    # fast or slow this machine imports.
    frozen: dict[int, psutil.Process] = {}
    parent = psutil.Process(proc.pid)
    try:
        deadline = time.monotonic() + 60
        while len(frozen) < 3:
            assert proc.poll() is None, f"local exited with {proc.returncode} before its nodes started"
            assert time.monotonic() < deadline, f"{len(frozen)} of local's 3 processes loaded pyarrow within 60s"
            for child in parent.children():
                with contextlib.suppress(psutil.NoSuchProcess):
                    if child.pid not in frozen and child.status() == "stopped":
                        frozen[child.pid] = child
                        assert _has_pyarrow(child.pid), f"{child.cmdline()} stopped before pyarrow loaded"
                        assert not _catches(child.pid, signal.SIGTERM), f"{child.cmdline()} was past its imports"
            time.sleep(0.005)
        # Local is frozen too, until each node that catches the SIGINT (as Python does unless it is
        # ignored) has dealt with it: otherwise local's SIGTERM could end it first, hiding its traceback.
        catching = [child for child in frozen.values() if _catches(child.pid, signal.SIGINT)]
        freeze(parent.pid, timeout=max(deadline - time.monotonic(), 1.0))
        os.killpg(proc.pid, signal.SIGINT)
        for child in frozen.values():
            child.resume()
        for child in catching:  # it exits (a zombie until local runs again) or gets past its imports
            while child.status() != "zombie" and not _catches(child.pid, signal.SIGTERM):
                assert time.monotonic() < deadline, f"{child.cmdline()} neither exited nor started on a SIGINT"
                time.sleep(0.01)
    finally:
        for process in [*frozen.values(), parent]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.resume()
    _, stderr = proc.communicate(timeout=60)
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    # A stop asked for, not a failure: exit 0 as when serving, and no error logged.
    assert proc.returncode == 0 and "stopped by a signal before the cache was ready" in stderr, stderr
    assert " ERROR " not in stderr, stderr
    _, alive = psutil.wait_procs(list(frozen.values()), timeout=15)
    assert not alive, f"still running after local stopped: {[p.cmdline() for p in alive]}"


# The head (only) never starts forming the cluster: the cache stays "not ready" for as long as
# the test needs, with every process past its start and its signal handlers in.
HEAD_NEVER_FORMS = """
if b"head" in open("/proc/self/cmdline", "rb").read().split(b"\\0"):
    import kubeflow_data_cache.head
    kubeflow_data_cache.head.Head.start = lambda self: None
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the processes' state in /proc")
def test_ctrl_c_while_the_cache_loads_exits_0_though_the_nodes_exit_first(small_table, tmp_path):
    """Nodes past their start catch the terminal's Ctrl-C themselves and exit 0. `local` must not
    then take a node that exited for a failed cache (exit 1, 'cache failed'): the stop was asked for.
    `local` is held (SIGSTOP) until every node has exited, the order that made it fail."""
    import os

    import psutil

    proc = _start_local_with(small_table, HEAD_NEVER_FORMS, tmp_path)
    parent = psutil.Process(proc.pid)
    try:
        deadline = time.monotonic() + 60
        while True:  # until the head and both data nodes have their handlers in
            assert proc.poll() is None, f"local exited with {proc.returncode} before its nodes started"
            assert time.monotonic() < deadline, "local's 3 processes did not all start within 60s"
            children = parent.children()
            with contextlib.suppress(psutil.NoSuchProcess, FileNotFoundError):
                # SIGINT's own handler, not only SIGTERM's: run_node installs them one after the
                # other, and a SIGINT sent in between still meets the start's SIG_IGN, lost.
                if len(children) == 3 and all(_catches(child.pid, signal.SIGINT) for child in children):
                    break
            time.sleep(0.01)
        deadline = time.monotonic() + 60  # the start's time, slow on a busy machine, is not the exit's
        freeze(parent.pid, timeout=max(deadline - time.monotonic(), 1.0))
        os.killpg(proc.pid, signal.SIGINT)
        for child in children:
            while child.status() != psutil.STATUS_ZOMBIE:
                assert time.monotonic() < deadline, f"{child.cmdline()} did not exit on Ctrl-C"
                time.sleep(0.01)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            parent.resume()
    stdout, stderr = proc.communicate(timeout=60)
    assert "READY" not in stdout, "the cache must still be loading when Ctrl-C comes"
    assert proc.returncode == 0 and "stopped by a signal before the cache was ready" in stderr, stderr
    assert " ERROR " not in stderr and "cache failed" not in stderr, stderr


def _pid1(args: list[str]) -> subprocess.Popen:
    """``data-cache ARGS`` as PID 1 of a new PID namespace, as in its container, or a skip where
    this machine lets no such namespace be made."""
    import shutil

    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-fp", "--mount-proc", "true"], capture_output=True).returncode:
        pytest.skip("no PID namespace can be made here (`unshare -fp` is missing or not permitted)")
    return subprocess.Popen(
        [unshare, "-fp", "--mount-proc", sys.executable, "-m", "kubeflow_data_cache", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_sigterm_as_pid_1_while_starting_stops_the_process(small_table):
    """The kernel drops a signal PID 1 has no handler for: a SIGTERM during the second of imports
    before the runner installed its own was lost, and the pod ran on until the kubelet's SIGKILL."""
    import psutil

    args = ["head", "--metadata-loc", small_table.metadata_location, "--data-nodes", "1", "--host", "127.0.0.1",
            "--port", "0", "--health-port", "0", "--startup-timeout", "60"]  # fmt: skip
    outer = _pid1(args)
    try:
        deadline = time.monotonic() + 10
        while not (children := psutil.Process(outer.pid).children()) and time.monotonic() < deadline:
            time.sleep(0.01)
        (cache,) = children
        # Caught once its command line is parsed, before pyarrow (Arrow's C++ library) is loaded:
        # it used to be caught only after the servers had started, a second later.
        while not _catches(cache.pid, signal.SIGTERM):
            assert time.monotonic() < deadline, "SIGTERM never got a handler"
            time.sleep(0.002)
        with open(f"/proc/{cache.pid}/maps") as maps:
            assert "libarrow" not in maps.read(), "SIGTERM is handled only after the imports"
        cache.send_signal(signal.SIGTERM)
        assert outer.wait(timeout=20) == 0, outer.stderr.read()[-2000:]
        assert "head stopping on SIGTERM" in outer.stderr.read()
    finally:
        with contextlib.suppress(ProcessLookupError):
            outer.kill()
        outer.wait()


def _signal_masks(pid: int) -> str:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as status:
        return status.read()
    return ""


def _catches(pid: int, sig: int) -> bool:
    line = next((row for row in _signal_masks(pid).splitlines() if row.startswith("SigCgt:")), "SigCgt: 0")
    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
