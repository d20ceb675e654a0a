"""A head and data nodes run in this process on loopback, with their health servers: for tests
that reach into a server's state (its lifecycle, metrics, load threads) while it runs."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest

from kubeflow_data_cache.config import build_config
from kubeflow_data_cache.head import Head
from kubeflow_data_cache.node import DataNode
from kubeflow_data_cache.service import HealthServer


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def wait_for(predicate, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("condition not met before the deadline")


FLAGS = {"host": "127.0.0.1", "advertise_host": "127.0.0.1", "port": 0, "health_port": 0, "startup_timeout": 60}


@pytest.fixture
def cluster():
    """start(metadata_loc, with_node=True, **node_flags) -> (head, head_health, node, node_health);
    all stopped after."""
    started = []

    def start(metadata_loc: str, with_node: bool = True, **node_flags):
        head = Head(build_config("head", {**FLAGS, "metadata_loc": metadata_loc, "data_nodes": 1}, env={}))
        head_health = HealthServer("127.0.0.1", 0, head.lifecycle, head.metrics, head.status).start()
        started.append((head, head_health))
        head.start()
        node = None
        if with_node:
            cfg = build_config("worker", {**FLAGS, "index": 0, "head": head.location, **node_flags}, env={})
            node = DataNode(cfg)
            node_health = HealthServer("127.0.0.1", 0, node.lifecycle, node.metrics, node.status).start()
            started.append((node, node_health))
            node.start_registering()
        return head, head_health, node, (node_health if with_node else None)

    yield start
    for server, health in started:
        server.stop()
        health.stop()
