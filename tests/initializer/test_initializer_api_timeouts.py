"""A hung API server: the initializer's client gives up on it within a bounded number of tries."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kubernetes.config import kube_config

from kubeflow_cache_initializer.errors import KubeApiError
from kubeflow_cache_initializer.kube import API_RETRIES, TRAINJOBS, Kube
from kubeflow_cache_initializer.main import _api_client


class HungServer:
    """Accepts connections and reads requests, but never answers one."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.requests = 0
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if conn.recv(65536):
                self.requests += 1
            self._held.append(conn)

    def close(self) -> None:
        self._stop.set()
        for conn in self._held:
            conn.close()
        self.sock.close()


@pytest.fixture
def hung() -> Iterator[HungServer]:
    server = HungServer()
    yield server
    server.close()


def _kubeconfig(path: Path, port: int) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return path


def test_a_get_the_api_server_never_answers_is_sent_twice_then_fails(hung, tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod: kubeconfig
    # The kubernetes package reads KUBECONFIG when it is imported; the test sets what it read.
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(_kubeconfig(tmp_path / "config", hung.port)))
    api = _api_client()
    assert api.configuration.retries is API_RETRIES
    with api, pytest.raises(KubeApiError) as caught:
        Kube(api, request_timeout=0.3).get(TRAINJOBS, "team-a", "job-a")
    assert caught.value.status == 0 and "Unreachable" in str(caught.value)
    # urllib3's default would have sent it four times: 4 x the request timeout on a hung server.
    # The server counts a request once it has read it, which may come after the client gave up.
    settled = time.monotonic() + 5
    while hung.requests < 2 and time.monotonic() < settled:
        time.sleep(0.05)
    time.sleep(0.5)  # a third request, if one were sent, is counted by now
    assert hung.requests == 2
