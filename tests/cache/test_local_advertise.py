"""`data-cache local` on every interface: what readers are told, and the head's health port.

`--host 0.0.0.0` used to be advertised as is (READY grpc://0.0.0.0:P, data node endpoints on
0.0.0.0), an address no other machine can connect to.
"""

from __future__ import annotations

import socket
import urllib.request

import pyarrow.flight as flight

from tests.cache.conftest import read_descriptor
from tests.cache.test_config_errors import assert_one_line_error, data_cache
from tests.conftest import LocalCache, free_port

DEADLINE = 60


def _read_all(location: str) -> tuple[set[str], int]:
    """As an upstream client reads the whole table: the hosts its endpoints name, and its rows."""
    info, table = read_descriptor(location, flight.FlightDescriptor.for_path("0", "1"))
    hosts = {loc.uri.decode().split("://", 1)[1].rsplit(":", 1)[0] for e in info.endpoints for loc in e.locations}
    return hosts, table.num_rows


def test_a_wildcard_bind_advertises_the_given_host_and_serves_health_on_the_given_port(table_factory):
    table = table_factory(3000, 2)
    health = free_port()
    # 127.0.0.2 is loopback too on Linux: reachable only because the processes bind 0.0.0.0.
    args = ("--host", "0.0.0.0", "--advertise-host", "127.0.0.2", "--health-port", str(health))
    cache = LocalCache(table.metadata_location, 2, args=args)
    try:
        location = cache.wait_ready(timeout=DEADLINE).split()[1]
        assert location == f"grpc://127.0.0.2:{cache.port}"
        assert _read_all(location) == ({"127.0.0.2"}, 3000)  # the data nodes advertise it too
        with urllib.request.urlopen(f"http://127.0.0.2:{health}/ready", timeout=10) as ready:
            assert ready.status == 200
        assert f"the head's /ready, /live, /status and /metrics: http://127.0.0.2:{health}" in cache.read_stderr()
    finally:
        cache.stop()


def test_a_wildcard_bind_advertises_this_machines_name_by_default(table_factory):
    table = table_factory(2000, 1)
    cache = LocalCache(table.metadata_location, 1, args=("--host", "0.0.0.0"))
    try:
        location = cache.wait_ready(timeout=DEADLINE).split()[1]
        name = socket.gethostname()
        assert location == f"grpc://{name}:{cache.port}"
        assert _read_all(f"grpc://127.0.0.1:{cache.port}") == ({name}, 2000)
    finally:
        cache.stop()


def _local(*args: str):
    return data_cache("local", "--metadata-loc", "/nowhere/metadata.json", *args)


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
