"""IPv6 clusters: nodes advertise bracketed addresses and answer probes on their IPv6 address."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from kubeflow_data_cache.client import CacheClient
from kubeflow_data_cache.config import build_config, host_port
from kubeflow_data_cache.protocol import ShardRequest
from kubeflow_data_cache.service import HealthServer, Lifecycle, Metrics
from tests.conftest import LocalCache, free_port


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
DEADLINE = 60


@pytest.mark.parametrize(
    ("host", "port", "expected"),
    [
        ("10.0.0.5", 50051, "10.0.0.5:50051"),
        ("cache-0.cache", 50051, "cache-0.cache:50051"),
        ("fd00::12", 50051, "[fd00::12]:50051"),
        ("[fd00::12]", 50051, "[fd00::12]:50051"),
    ],
)
def test_host_port_brackets_ipv6_addresses(host, port, expected):
    assert host_port(host, port) == expected


def test_a_node_on_an_ipv6_pod_advertises_a_uri_clients_can_use():
    env = {"POD_IP": "fd00::12", "LWS_LEADER_ADDRESS": "fd00::1", "LWS_WORKER_INDEX": "1"}
    cfg = build_config("worker", {}, env)
    assert cfg.location(50051) == "grpc://[fd00::12]:50051"
    assert cfg.head_location == "grpc://[fd00::1]:50051"


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


@needs_ipv6
def test_the_health_server_on_a_wildcard_host_answers_on_ipv4_and_ipv6():
    server = HealthServer("0.0.0.0", 0, Lifecycle(), Metrics("head"), dict).start()
    try:
        assert _get(f"http://127.0.0.1:{server.port}/live") == 200
        assert _get(f"http://[::1]:{server.port}/live") == 200
    finally:
        server.stop()


@needs_ipv6
def test_an_ipv6_bind_host_serves_ipv6():
    server = HealthServer("::1", 0, Lifecycle(), Metrics("head"), dict).start()
    try:
        assert _get(f"http://[::1]:{server.port}/live") == 200
    finally:
        server.stop()


@contextlib.contextmanager
def _pod(role: str, env: dict[str, str], *args: str) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kubeflow_data_cache", role, *args],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@needs_ipv6
def test_a_cache_whose_pods_have_ipv6_addresses_serves_every_row(small_table):
    """Head and data node configured as the LeaderWorkerSet's pods are, on ::1, with the default
    (wildcard) bind host: probes on the IPv6 address pass and a client reads the whole table."""
    head_port, head_health, node_port, node_health = (free_port() for _ in range(4))
    common = {
        "METADATA_LOC": small_table.metadata_location,
        "POD_IP": "::1",
        "DATA_CACHE_STARTUP_TIMEOUT_SECONDS": "60",
    }
    head_env = {**common, "FLIGHT_PORT": str(head_port), "HEALTH_PORT": str(head_health), "LWS_GROUP_SIZE": "2"}
    node_env = {**common, "FLIGHT_PORT": str(node_port), "HEALTH_PORT": str(node_health), "LWS_WORKER_INDEX": "1"}
    with _pod("head", head_env) as head, _pod("worker", node_env, "--head", f"grpc://[::1]:{head_port}"):
        deadline = time.monotonic() + DEADLINE
        while _get_or_none(f"http://[::1]:{head_health}/ready") != 200:
            assert head.poll() is None, "the head exited"
            assert time.monotonic() < deadline, "the head did not get ready on its IPv6 address"
            time.sleep(0.2)
        assert _get(f"http://[::1]:{node_health}/ready") == 200
        with CacheClient(f"grpc://[::1]:{head_port}", deadline_seconds=30) as client:
            info = client.get_flight_info(ShardRequest())
            assert [loc.uri.decode() for e in info.endpoints for loc in e.locations] == [f"grpc://[::1]:{node_port}"]
            assert sum(batch.num_rows for batch in client.read_shard(ShardRequest())) == small_table.rows


def _get_or_none(url: str) -> int | None:
    try:
        return _get(url)
    except OSError:  # not listening yet
        return None


@needs_ipv6
def test_a_local_cache_on_ipv6_loopback_reports_a_bracketed_location(small_table):
    cache = LocalCache(small_table.metadata_location, 1, args=("--host", "::1"))
    try:
        ready = cache.wait_ready()
        assert ready == f"READY grpc://[::1]:{cache.port}"
        with CacheClient(ready.split()[1], deadline_seconds=30) as client:
            assert sum(batch.num_rows for batch in client.read_shard(ShardRequest())) == small_table.rows
    finally:
        cache.stop()
