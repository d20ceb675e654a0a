"""`data-cache local` on every interface: what readers are told, and the head's health port.

`--host 0.0.0.0` used to be advertised as is (READY grpc://0.0.0.0:P, data node endpoints on
0.0.0.0), an address no other machine can connect to.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request

import pyarrow.flight as flight

from tests.cache.conftest import read_path_shards
from tests.cache.test_config_errors import assert_one_line_error
from tests.conftest import LocalCache, free_port

DEADLINE = 60


def _endpoint_hosts(location: str) -> set[str]:
    client = flight.FlightClient(location)
    try:
        info = client.get_flight_info(flight.FlightDescriptor.for_path("0", "1"))
    finally:
        client.close()
    return {loc.uri.decode().split("://", 1)[1].rsplit(":", 1)[0] for e in info.endpoints for loc in e.locations}


def test_a_wildcard_bind_advertises_the_given_host_and_serves_health_on_the_given_port(table_factory):
    table = table_factory(3000, 2)
    health = free_port()
    # 127.0.0.2 is loopback too on Linux: reachable only because the processes bind 0.0.0.0.
    args = ("--host", "0.0.0.0", "--advertise-host", "127.0.0.2", "--health-port", str(health))
    cache = LocalCache(table.metadata_location, 2, args=args)
    try:
        location = cache.wait_ready(timeout=DEADLINE).split()[1]
        assert location == f"grpc://127.0.0.2:{cache.port}"
        assert _endpoint_hosts(location) == {"127.0.0.2"}  # the data nodes advertise it too
        assert read_path_shards(location, total=3).num_rows == 3000
        with urllib.request.urlopen(f"http://127.0.0.2:{health}/ready", timeout=10) as ready:
            assert ready.status == 200
        assert f"the head's /ready, /live and /metrics: http://127.0.0.2:{health}" in cache.read_stderr()
    finally:
        cache.stop()


def test_a_wildcard_bind_advertises_this_machines_name_by_default(table_factory):
    table = table_factory(2000, 1)
    cache = LocalCache(table.metadata_location, 1, args=("--host", "0.0.0.0"))
    try:
        location = cache.wait_ready(timeout=DEADLINE).split()[1]
        name = socket.gethostname()
        assert location == f"grpc://{name}:{cache.port}"
        assert _endpoint_hosts(f"grpc://127.0.0.1:{cache.port}") == {name}
    finally:
        cache.stop()


def _local(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kubeflow_data_cache", "local", "--metadata-loc", "/nowhere/metadata.json"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=DEADLINE, env=os.environ)


def test_bad_advertise_host_or_health_port_is_refused_before_any_node_starts():
    port = free_port()
    assert_one_line_error(_local("--port", str(port), "--advertise-host", " "), "--advertise-host is empty")
    assert_one_line_error(_local("--port", str(port), "--health-port", str(port)), "also --port")
    assert_one_line_error(_local("--health-port", "70000"), "--health-port")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        assert_one_line_error(
            _local("--port", str(port), "--health-port", str(busy)), "already in use", "--health-port"
        )
