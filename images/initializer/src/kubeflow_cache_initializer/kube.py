"""The few Kubernetes API calls the initializer makes, as plain dicts over the client's REST layer.

One `Resource` per kind and one `Kube` method per verb: get, list, watch, create, patch (JSON
merge patch, which custom resources accept too) and delete. Errors become `KubeApiError` with
the HTTP status and the API's reason. Authentication, TLS and the host come from the
`kubernetes` client's `ApiClient`, so in-cluster config and kubeconfig both work.

A call that fails in a way that passes (no answer, 429, 5xx: an API server or an admission
webhook restarting) is tried again with backoff, honouring Retry-After, until the run's
deadline (`Kube.deadline`); each retry is logged, and `Kube.troubles` holds the calls failing
now for the timeout message. Retrying a POST or PATCH whose answer was lost is safe here:
create answers 409 and `apply.ensure` adopts, and patches carry a resourceVersion guard.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import urllib3
from kubernetes import client

from kubeflow_cache_initializer import constants as c
from kubeflow_cache_initializer.errors import KubeApiError
from kubeflow_cache_initializer.rbac import forbidden_hint

log = logging.getLogger(__name__)
MERGE_PATCH = "application/merge-patch+json"
# Statuses that pass: 0 (no answer, refused, reset), the API server's rate limit and its own or
# a webhook's troubles. 403, 404, 409, 422... are answers no retry changes.
TRANSIENT_STATUSES = frozenset({0, 429, 500, 502, 503, 504})
# An admission webhook that does not answer (its controller down, or its Service without
# endpoints): the API server's 500 "failed calling webhook". Retried, as it may be restarting, but
# for this long, not to the run's deadline: 10 minutes, twice with the Job's retry, and a message
# that named no fix.
WEBHOOK_RETRY_SECONDS = 120.0
RETRY_INITIAL_SECONDS = 0.5
RETRY_MAX_SECONDS = 10.0
# urllib3 by default sends a GET whose answer never came three more times: against a hung API
# server one call took 4 x API_REQUEST_TIMEOUT_SECONDS (2 min). One more try of a GET or DELETE
# covers a dropped connection (urllib3 never resends a POST or PATCH itself); a few quick
# connection retries cover a blip. Longer outages are `Kube._call`'s retries, under the deadline.
# Statuses are left to `Kube._call` (respect_retry_after_header off): urllib3 would otherwise
# answer a 429's Retry-After itself and, its status budget spent, report it as unreachable.
API_RETRIES = urllib3.Retry(total=3, connect=3, read=1, status=0, backoff_factor=0.5, respect_retry_after_header=False)


def with_bounded_retries(configuration: client.Configuration) -> client.Configuration:
    """``configuration`` with API_RETRIES, unless it already sets its own."""
    if configuration.retries is None:
        configuration.retries = API_RETRIES
    return configuration


@dataclass(frozen=True)
class Resource:
    """An API resource: its group, version, plural and kind; namespaced unless told otherwise."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def describe(self, namespace: str, name: str | None = None) -> str:
        """`leaderworkersets.leaderworkerset.x-k8s.io job-a-cache in namespace team-a`, for messages."""
        group = f".{self.group}" if self.group else ""
        where = f" in namespace {namespace}" if self.namespaced else ""
        return f"{self.plural}{group}" + (f" {name}" if name else "") + where

    def path(self, namespace: str, name: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        scope = f"/namespaces/{quote(namespace, safe='')}" if self.namespaced else ""
        path = f"{base}{scope}/{self.plural}"
        return f"{path}/{quote(name, safe='')}" if name else path


TRAINJOBS = Resource("trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob")
LEADER_WORKER_SETS = Resource("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", "LeaderWorkerSet")
SERVICES = Resource("", "v1", "services", "Service")
SERVICE_ACCOUNTS = Resource("", "v1", "serviceaccounts", "ServiceAccount")
PODS = Resource("", "v1", "pods", "Pod")
SECRETS = Resource("", "v1", "secrets", "Secret")
# What the caller may do in a namespace: created (never stored) by any authenticated user.
SELF_SUBJECT_RULES_REVIEWS = Resource(
    "authorization.k8s.io", "v1", "selfsubjectrulesreviews", "SelfSubjectRulesReview", namespaced=False
)


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

    def __init__(
        self,
        api_client: client.ApiClient,
        request_timeout: float = c.API_REQUEST_TIMEOUT_SECONDS,
        deadline: float | None = None,
    ):
        self.api_client = api_client
        self.request_timeout = request_timeout
        self.deadline = deadline  # time.monotonic() until which passing failures are retried; None: never
        # Asked before each retry in the main thread; may raise to end the retries (a SIGTERM
        # whose raise the retry's own warning swallowed: see termination). None: nothing to ask.
        self.before_retry: Callable[[], None] | None = None
        # "verb what" -> (monotonic time it began failing, its latest error), while it is retried.
        self.troubles: dict[str, tuple[float, str]] = {}

    def trouble_line(self) -> str | None:
        """The calls failing now, for a timeout message: the API was the trouble, not the cache."""
        now = time.monotonic()
        troubles = list(self.troubles.values())  # a copy: watcher threads change it
        if not troubles:
            return None
        return "; ".join(f"the API has failed for {now - since:.0f}s: {error}" for since, error in troubles)

    def _call(self, verb: str, *args: Any, stop: threading.Event | None = None, **kwargs: Any) -> Any:
        """One API call, tried again while it fails in a way that passes and the deadline allows.

        ``stop`` ends the retries early (a watcher being stopped), raising the latest error.
        """
        failing_since: float | None = None
        key = ""  # "verb what" of the failing call, set at its first failure
        delay = RETRY_INITIAL_SECONDS
        while True:
            try:
                result = self._call_once(verb, *args, **kwargs)
            except KubeApiError as err:
                key = trouble_key(err.verb, err.what)
                pause = self._retry_pause(err, delay)
                since = failing_since if failing_since is not None else time.monotonic()
                if webhook_down(err) and time.monotonic() - since >= WEBHOOK_RETRY_SECONDS:
                    pause = None  # its own budget, not the run's deadline
                if pause is None or (stop is not None and stop.is_set()):
                    if failing_since is not None:
                        err.retried_seconds = time.monotonic() - failing_since
                    if err.status not in TRANSIENT_STATUSES or self.deadline is None:
                        self.troubles.pop(key, None)  # an answer, not an outage
                    # else: given up at the deadline, still failing: the timeout message names it
                    raise
                if failing_since is None:
                    failing_since = time.monotonic()
                self.troubles[key] = (failing_since, str(err))
                log.warning("%s; trying again in %.1fs", err, pause)
                if self.before_retry is not None and threading.current_thread() is threading.main_thread():
                    self.before_retry()
                if stop is not None:
                    if stop.wait(pause):  # stopped while waiting: no further request
                        self.troubles.pop(key, None)
                        raise
                else:
                    time.sleep(pause)
                delay = min(delay * 2, RETRY_MAX_SECONDS)
                continue
            if key:
                self.troubles.pop(key, None)
            return result

    def _retry_pause(self, err: KubeApiError, delay: float) -> float | None:
        """Seconds to wait before trying ``err``'s call again, or None when it must not be."""
        if err.status not in TRANSIENT_STATUSES or self.deadline is None:
            return None
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            return None
        # The last try comes at the deadline itself, not one backoff step before it; a
        # Retry-After of 0 still waits the first backoff step, so it cannot make a busy loop.
        wait = delay if err.retry_after is None else max(err.retry_after, RETRY_INITIAL_SECONDS)
        return min(wait, remaining)

    def _call_once(
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
        what = resource.describe(namespace, name)
        try:
            response = self.api_client.call_api(*serialized, _request_timeout=(self.request_timeout, read_timeout))
            if stream_seconds is not None and 200 <= response.status <= 299:
                return WatchStream(response.response)
            # The body is read here, not by call_api: a connection that breaks or stalls mid-body
            # (IncompleteRead, ReadTimeout) is as unreachable as one that never answered.
            raw = response.read()
        except urllib3.exceptions.HTTPError as err:
            raise KubeApiError(verb, what, 0, "Unreachable", str(err)) from err
        if not 200 <= response.status <= 299:
            try:
                status = json.loads(raw)
            except ValueError:
                status = {"message": raw.decode(errors="replace").strip()}  # one line: Go's ends in \n
            message = status.get("message", "")
            raise KubeApiError(
                verb,
                what,
                response.status,
                status.get("reason") or response.reason or "",
                message,
                retry_after=_retry_after(response.headers.get("Retry-After")),
                hint=forbidden_hint(resource.group, resource.plural, verb, namespace, message)
                if response.status == 403
                else webhook_hint(resource, message)
                if response.status == 500
                else None,
                details=status.get("details") if isinstance(status.get("details"), dict) else None,
            )
        try:
            return json.loads(raw)
        except ValueError as err:  # e.g. a proxy's HTML page: an answer, but not the API's
            text = raw[:200].decode(errors="replace")
            raise KubeApiError(verb, what, response.status, "NotJSON", f"the answer is not JSON: {text!r}") from err

    def get(self, resource: Resource, namespace: str, name: str) -> dict:
        return self._call("get", "GET", resource, namespace, name)

    def list(self, resource: Resource, namespace: str, **selectors: str) -> tuple[list[dict], str]:
        """Items and the list's resourceVersion (to watch from); selectors: label_selector, field_selector."""
        found = self._call("list", "GET", resource, namespace, query=_selector_query(selectors))
        return found.get("items") or [], found["metadata"]["resourceVersion"]

    def watch(
        self,
        resource: Resource,
        namespace: str,
        resource_version: str,
        timeout_seconds: int,
        stop: threading.Event | None = None,
        **selectors: str,
    ) -> WatchStream:
        query = [
            ("watch", "true"),
            ("resourceVersion", resource_version),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", str(timeout_seconds)),
            *_selector_query(selectors),
        ]
        return self._call(
            "watch", "GET", resource, namespace, query=query, stream_seconds=float(timeout_seconds), stop=stop
        )

    def create(self, resource: Resource, namespace: str, body: dict) -> dict:
        return self._call("create", "POST", resource, namespace, body=body)

    def patch(self, resource: Resource, namespace: str, name: str, patch: dict) -> dict:
        """A JSON merge patch; put metadata.resourceVersion in it to fail with 409 on a concurrent change."""
        return self._call("patch", "PATCH", resource, namespace, name, body=patch, content_type=MERGE_PATCH)

    def delete(self, resource: Resource, namespace: str, name: str, preconditions: dict | None = None) -> None:
        """Delete an object; with ``preconditions`` (uid, resourceVersion) only the object as it
        was read: the API answers 409 if it changed since."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        if preconditions:
            body["preconditions"] = preconditions
        self._call("delete", "DELETE", resource, namespace, name, body=body)


def webhook_down(err: KubeApiError) -> bool:
    return err.status == 500 and "failed calling webhook" in err.message


def webhook_hint(resource: Resource, message: str) -> str | None:
    """What to check where an admission webhook did not answer the API server (None otherwise)."""
    if "failed calling webhook" not in message:
        return None
    # The webhook's Service, from the URL the API server called (https://<service>.<namespace>.svc):
    # the chart installs LeaderWorkerSet in its own release's namespace, kustomize in lws-system.
    where = re.search(r"https://([a-z0-9-]+)\.([a-z0-9-]+)\.svc", message)
    pods = f"`kubectl get pods,endpoints -n {where[2]}` (its Service {where[1]})" if where else "its namespace"
    if resource.group == "leaderworkerset.x-k8s.io":
        return f"the LeaderWorkerSet admission webhook does not answer: check the LeaderWorkerSet controller's pods, {pods}"
    return f"an admission webhook does not answer (the message names it): check the pods of the controller serving it, {pods}"


def trouble_key(verb: str, what: str) -> str:
    """How ``Kube.troubles`` files a failing call: one entry per call, whichever layer retries it."""
    return f"{verb} {what}"


def _retry_after(value: str | None) -> float | None:
    """Retry-After in seconds (the API server sends whole seconds), or None when absent or a date."""
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None


def _selector_query(selectors: dict[str, str]) -> list[tuple[str, str]]:
    names = {"label_selector": "labelSelector", "field_selector": "fieldSelector"}
    unknown = set(selectors) - set(names)
    if unknown:
        raise TypeError(f"unknown selectors {sorted(unknown)}; use {sorted(names)}")
    return [(names[key], value) for key, value in selectors.items() if value]
