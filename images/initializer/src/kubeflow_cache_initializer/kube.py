"""The few Kubernetes API calls the initializer makes, as plain dicts over the client's REST layer.

One `Resource` per kind and one `Kube` method per verb: get, list, watch, create, patch (JSON
merge patch, which custom resources accept too) and delete. Errors become `KubeApiError` with
the HTTP status and the API's reason. Authentication, TLS and the host come from the
`kubernetes` client's `ApiClient`, so in-cluster config and kubeconfig both work.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import urllib3
from kubernetes import client

from kubeflow_cache_initializer import constants as c
from kubeflow_cache_initializer.errors import KubeApiError

MERGE_PATCH = "application/merge-patch+json"
# urllib3 by default sends a GET whose answer never came three more times: against a hung API
# server one call took 4 x API_REQUEST_TIMEOUT_SECONDS (2 min). One more try covers a dropped
# connection; connection failures (an API server restarting) keep a few tries with backoff.
API_RETRIES = urllib3.Retry(total=3, connect=3, read=1, status=0, backoff_factor=0.5)


def with_bounded_retries(configuration: client.Configuration) -> client.Configuration:
    """``configuration`` with API_RETRIES, unless it already sets its own."""
    if configuration.retries is None:
        configuration.retries = API_RETRIES
    return configuration


@dataclass(frozen=True)
class Resource:
    """A namespaced API resource: its group, version, plural and kind."""

    group: str
    version: str
    plural: str
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str, name: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        path = f"{base}/namespaces/{quote(namespace, safe='')}/{self.plural}"
        return f"{path}/{quote(name, safe='')}" if name else path


TRAINJOBS = Resource("trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob")
LEADER_WORKER_SETS = Resource("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", "LeaderWorkerSet")
SERVICES = Resource("", "v1", "services", "Service")
SERVICE_ACCOUNTS = Resource("", "v1", "serviceaccounts", "ServiceAccount")
PODS = Resource("", "v1", "pods", "Pod")


class WatchStream:
    """One open watch request: iterate (type, object) pairs; `close` ends it from any thread."""

    def __init__(self, response: Any):
        self._response = response
        self._closed = threading.Event()

    def __iter__(self) -> Iterator[tuple[str, dict]]:
        buffer = b""
        try:
            for chunk in self._response.stream(amt=None, decode_content=True):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        event = json.loads(line)
                        yield event["type"], event["object"]
        except Exception:
            if not self._closed.is_set():
                raise
        finally:
            self.close()

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            # Shutting down a half-dead connection may fail; it is closed either way.
            with contextlib.suppress(Exception):
                self._response.shutdown()
            self._response.release_conn()

    def __enter__(self) -> WatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Kube:
    """get / list / watch / create / patch / delete of namespaced resources as dicts."""

    def __init__(self, api_client: client.ApiClient, request_timeout: float = c.API_REQUEST_TIMEOUT_SECONDS):
        self.api_client = api_client
        self.request_timeout = request_timeout

    def _call(
        self,
        verb: str,
        method: str,
        resource: Resource,
        namespace: str,
        name: str | None = None,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        stream_seconds: float | None = None,
    ) -> Any:
        path = resource.path(namespace, name)
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        serialized = self.api_client.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or None,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        read_timeout = self.request_timeout if stream_seconds is None else stream_seconds + self.request_timeout
        group = f".{resource.group}" if resource.group else ""
        what = f"{resource.plural}{group}" + (f" {name}" if name else "") + f" in namespace {namespace}"
        try:
            response = self.api_client.call_api(*serialized, _request_timeout=(self.request_timeout, read_timeout))
        except urllib3.exceptions.HTTPError as err:
            raise KubeApiError(verb, what, 0, "Unreachable", str(err)) from err
        if not 200 <= response.status <= 299:
            raw = response.read()
            try:
                status = json.loads(raw)
            except ValueError:
                status = {"message": raw.decode(errors="replace")}
            raise KubeApiError(
                verb,
                what,
                response.status,
                status.get("reason") or response.reason or "",
                status.get("message", ""),
            )
        if stream_seconds is not None:
            return WatchStream(response.response)
        return json.loads(response.read())

    def get(self, resource: Resource, namespace: str, name: str) -> dict:
        return self._call("get", "GET", resource, namespace, name)

    def list(self, resource: Resource, namespace: str, **selectors: str) -> tuple[list[dict], str]:
        """Items and the list's resourceVersion (to watch from); selectors: label_selector, field_selector."""
        found = self._call("list", "GET", resource, namespace, query=_selector_query(selectors))
        return found.get("items") or [], found["metadata"]["resourceVersion"]

    def watch(
        self, resource: Resource, namespace: str, resource_version: str, timeout_seconds: int, **selectors: str
    ) -> WatchStream:
        query = [
            ("watch", "true"),
            ("resourceVersion", resource_version),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", str(timeout_seconds)),
            *_selector_query(selectors),
        ]
        return self._call("watch", "GET", resource, namespace, query=query, stream_seconds=float(timeout_seconds))

    def create(self, resource: Resource, namespace: str, body: dict) -> dict:
        return self._call("create", "POST", resource, namespace, body=body)

    def patch(self, resource: Resource, namespace: str, name: str, patch: dict) -> dict:
        """A JSON merge patch; put metadata.resourceVersion in it to fail with 409 on a concurrent change."""
        return self._call("patch", "PATCH", resource, namespace, name, body=patch, content_type=MERGE_PATCH)

    def delete(self, resource: Resource, namespace: str, name: str) -> None:
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        self._call("delete", "DELETE", resource, namespace, name, body=body)


def _selector_query(selectors: dict[str, str]) -> list[tuple[str, str]]:
    names = {"label_selector": "labelSelector", "field_selector": "fieldSelector"}
    unknown = set(selectors) - set(names)
    if unknown:
        raise TypeError(f"unknown selectors {sorted(unknown)}; use {sorted(names)}")
    return [(names[key], value) for key, value in selectors.items() if value]
