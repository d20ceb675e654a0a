"""SIGTERM of a data node with a reader that stopped reading mid-stream: not ready at once,
gone within the shutdown grace instead of waiting for the reader for ever."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.error

import pyarrow.flight as flight

from kubeflow_data_cache.client import CacheClient
from kubeflow_data_cache.constants import SHUTDOWN_GRACE_SECONDS
from kubeflow_data_cache.processes import stop_processes
from kubeflow_data_cache.protocol import ShardRequest
from tests.cache.inprocess import get, wait_for
from tests.conftest import free_port


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
    port, node_health = free_port(), free_port()
    head = subprocess.Popen(
        cmd("head", "--metadata-loc", metadata, "--data-nodes", "1", "--port", str(port), "--health-port", "0"),
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
        node.wait(timeout=SHUTDOWN_GRACE_SECONDS + 20)
        assert time.monotonic() - started < SHUTDOWN_GRACE_SECONDS + 20
        assert "exiting without them" in (tmp_path / "node.log").read_text()
        reader.close()
        client.close()
    finally:
        stop_processes([head, node], 15)


def test_ctrl_c_while_the_nodes_still_start_stops_local_without_tracebacks(small_table):
    """A terminal's Ctrl-C reaches the whole process group, nodes included: while they were still
    importing, it printed their KeyboardInterrupt tracebacks and nothing else. `local` stops them."""
    import os

    import psutil

    local = ["local", "--metadata-loc", small_table.metadata_location, "--data-nodes", "2", "--port", "0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kubeflow_data_cache", *local],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a group of its own, as a terminal's foreground job is
    )
    deadline = time.monotonic() + 30
    while len(psutil.Process(proc.pid).children()) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    children = psutil.Process(proc.pid).children()
    assert len(children) == 3, "local should have started its head and two data nodes"
    time.sleep(0.3)  # the nodes' interpreters are up and importing (pyarrow, pyiceberg: seconds)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    # A stop asked for, not a failure: exit 0 as when serving, and no error logged.
    assert proc.returncode == 0 and "stopped by a signal before the cache was ready" in stderr, stderr
    assert " ERROR " not in stderr, stderr
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, f"still running after local stopped: {[p.cmdline() for p in alive]}"
