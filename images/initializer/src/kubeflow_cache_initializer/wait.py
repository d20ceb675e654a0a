"""Waiting for the cache: watches on the LeaderWorkerSet and its pods, a deadline, no sleep loop.

Two watcher threads feed one queue with the API's events (re-listing after a 410 Gone); the
waiting loop keeps the latest LeaderWorkerSet and pods, logs `2/3 cache pods ready` and the
head's load progress whenever they change, and asks the head's `/status` at most every
`CACHE_STATUS_POLL_SECONDS` (sooner when the LeaderWorkerSet or the head pod changes). It
returns once the LeaderWorkerSet is Available and the head reports `ready` (or, when the head's
`/status` cannot be reached from here, once Available has held for a few poll periods); it
raises `CacheFailedError` as soon as a pod or the head shows a hopeless state, and
`CacheTimeoutError` at the deadline, naming each pod that is not ready and what it waits on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from kubeflow_cache_initializer import constants as c
from kubeflow_cache_initializer import health, termination
from kubeflow_cache_initializer.builders import cache_names, group_size_of, health_port_of, pods_selector
from kubeflow_cache_initializer.config import Config
from kubeflow_cache_initializer.errors import (
    CacheDeletedError,
    CacheFailedError,
    CacheTimeoutError,
    InitializerError,
    KubeApiError,
)
from kubeflow_cache_initializer.kube import (
    LEADER_WORKER_SETS,
    PODS,
    TRANSIENT_STATUSES,
    Kube,
    Resource,
    WatchStream,
    trouble_key,
)

log = logging.getLogger(__name__)
WATCH_RETRY_SECONDS = 1.0
WATCH_RETRY_MAX_SECONDS = 10.0
# For all the watchers together (daemon threads: one still reading is left behind). Joined one
# after the other at 5 s each, they took up to 10 s of the pod's grace after a SIGTERM, before
# the cleanup had sent its delete.
STOP_JOIN_SECONDS = 2.0
# While the cache looks ready but a watch has yet to give its first answer, how often the wait
# looks again: a watch the API refuses (403) must fail the run even where the cache is up by
# the first look, or a missing grant goes unseen until the day the cache starts slowly.
FIRST_ANSWER_POLL_SECONDS = 0.05
# Not-ready pods named in a progress line or the timeout message; the rest are counted.
NOT_READY_NAMED = 3
# How long (in CACHE_STATUS_POLL_SECONDS periods) the head's /status may stay unreachable while
# the LeaderWorkerSet is Available before the Available condition alone is taken as ready
# (see _Progress.ready).
STATUS_UNREACHABLE_PERIODS = 3


class _Watcher(threading.Thread):
    """Watches one resource from a resourceVersion until stopped or the deadline; events go to a queue.

    A watch that breaks, or that the API answers with a passing error (5xx, 429, no answer), is
    watched again with backoff until the deadline: an API server restarting costs a pause, not
    the run. Its trouble is in ``kube.troubles`` meanwhile, so the timeout message names it.
    """

    def __init__(self, kube: Kube, resource: Resource, namespace: str, version: str, deadline: float, out, **selectors):
        super().__init__(name=f"watch-{resource.plural}", daemon=True)
        self.kube, self.resource, self.namespace = kube, resource, namespace
        self.version, self.deadline, self.out, self.selectors = version, deadline, out, selectors
        self.stopped = threading.Event()
        self.answered = threading.Event()  # the first watch call has opened, or failed
        self.stream: WatchStream | None = None
        self.trouble_key = trouble_key("watch", resource.describe(namespace))  # as Kube._call files it
        self.failing_since: float | None = None
        self.delay = WATCH_RETRY_SECONDS
        self.gone_again = False  # the last watch call was answered 410 Gone (HTTP), and listed again

    def stop(self) -> None:
        self.stopped.set()
        if self.stream is not None:
            self.stream.close()

    def run(self) -> None:
        try:
            self._run()
        finally:
            self.answered.set()

    def _run(self) -> None:
        while not self.stopped.is_set():
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                self._watch_once(max(1, min(int(remaining) + 1, c.MAX_WATCH_SECONDS)))
                continue
            except KubeApiError as err:
                if err.status not in TRANSIENT_STATUSES:  # 403, 404...: no retry will help
                    if not self.stopped.is_set():
                        self.out.put((self.resource, "FAILED", err))
                    return
                error = str(err)
            except Exception as err:  # a dropped connection: watch again from the last version
                error = f"watch {self.resource.describe(self.namespace)} broke: {err}"
            self.answered.set()  # a failing watch has answered too: the wait need not hold for it
            if self.stopped.is_set() or time.monotonic() >= self.deadline:
                return  # the wait is over: its own message says so
            if self.failing_since is None:
                self.failing_since = time.monotonic()
            self.kube.troubles[self.trouble_key] = (self.failing_since, error)
            log.info("%s; watching again in %.0fs", error, self.delay)
            self.stopped.wait(min(self.delay, max(0.0, self.deadline - time.monotonic())))
            self.delay = min(self.delay * 2, WATCH_RETRY_MAX_SECONDS)

    def _connected(self) -> None:
        """A watch is open again: whatever failed before has passed."""
        self.failing_since, self.delay = None, WATCH_RETRY_SECONDS
        self.kube.troubles.pop(self.trouble_key, None)
        self.answered.set()

    def _watch_once(self, seconds: int) -> None:
        try:
            self.stream = self.kube.watch(
                self.resource, self.namespace, self.version, seconds, stop=self.stopped, **self.selectors
            )
        except KubeApiError as err:
            if not err.gone:
                raise
            if self.gone_again:
                # 410 for a version just listed: not an old version, a server or proxy that
                # says so to every watch. Retried with backoff, and named if the wait times out.
                raise OSError(
                    f"watch {self.resource.describe(self.namespace)} answered 410 Gone again after a fresh list"
                ) from None
            # Our resourceVersion is too old, said as the HTTP status rather than as an event in
            # the stream (as some API servers and proxies do): the same answer, list again.
            self._relist()
            self.gone_again = True
            self.answered.set()
            return
        self.gone_again = False
        self._connected()
        if self.stopped.is_set():
            self.stream.close()
            return
        for kind, obj in self.stream:
            if kind == "ERROR":
                if obj.get("code") == 410:  # our resourceVersion is too old: list again, watch from there
                    self._relist()
                    return
                raise KubeApiError(
                    "watch", self.resource.plural, obj.get("code", 0), obj.get("reason", ""), obj.get("message", "")
                )
            self.version = obj["metadata"]["resourceVersion"]
            if kind != "BOOKMARK":
                self.out.put((self.resource, kind, obj))

    def _relist(self) -> None:
        items, self.version = self.kube.list(self.resource, self.namespace, **self.selectors)
        self.out.put((self.resource, "RELIST", items))


def _available(lws: dict | None) -> bool:
    conditions = ((lws or {}).get("status") or {}).get("conditions") or []
    return any(cond.get("type") == "Available" and cond.get("status") == "True" for cond in conditions)


class _Progress:
    """The latest state of the cache and what has been logged about it.

    The expected pod count and the head's health port come from the LeaderWorkerSet itself, not
    from this run's settings: a TrainJob that joins a shared cache judges it by what it is.
    """

    def __init__(self, cfg: Config, lws: dict, pods: list[dict], kube: Kube | None = None):
        self.cfg = cfg
        self.kube = kube
        self.lws: dict | None = lws
        self.pods = {health.pod_name(p): p for p in pods}
        self.status: dict | None = None
        self.status_error: str | None = None  # why the head's /status did not answer, at the last poll
        self.unreachable_since: float | None = None  # /status failing while the LeaderWorkerSet is Available
        self.logged: dict[str, str] = {}
        self.unschedulable_since: dict[str, float] = {}
        self.failed_since: dict[str, float] = {}
        self.start_error_since: dict[str, float] = {}
        self.missing_since: dict[str, float] = {}  # the group's, while fewer cache pods exist than it has

    def apply(self, resource: Resource, kind: str, obj) -> bool:
        """Take one queued event; True when the head should be asked for its status now."""
        if kind == "FAILED":
            if isinstance(obj, KubeApiError):
                raise obj
            raise InitializerError(f"watching {resource.plural} failed: {obj}")
        if resource == LEADER_WORKER_SETS:
            self.lws = (obj[0] if obj else None) if kind == "RELIST" else (None if kind == "DELETED" else obj)
            return True
        if kind == "RELIST":
            self.pods = {health.pod_name(p): p for p in obj}
            return True
        if kind == "DELETED":
            self.pods.pop(health.pod_name(obj), None)
        else:
            self.pods[health.pod_name(obj)] = obj
        return health.is_head(obj)

    @property
    def group_size(self) -> int:
        return group_size_of(self.lws) or self.cfg.cluster_size

    @property
    def health_port(self) -> int:
        return health_port_of(self.lws) or self.cfg.health_port

    def group_pods(self) -> list[dict]:
        """The pods of the LeaderWorkerSet as it is now, by name. Pods created before it are a
        deleted one's: a failed run's cache is deleted in the background, and its pods may still
        be terminating (a head exits 1 on SIGTERM after a failed load) while the Job's retry
        makes the next; their errors are not this cache's. Kubernetes writes creationTimestamp
        in one format (RFC 3339, seconds, UTC), so the strings compare as times."""
        born = ((self.lws or {}).get("metadata") or {}).get("creationTimestamp") or ""
        pods = sorted(self.pods.values(), key=health.pod_name)
        return [pod for pod in pods if (pod["metadata"].get("creationTimestamp") or "") >= born]

    def pods_line(self) -> str:
        """`2/3 cache pods ready`, and what the others wait on (the first few, by name)."""
        pods = self.group_pods()
        ready = sum(1 for pod in pods if health.is_ready(pod))
        waiting = [health.not_ready_reason(pod) for pod in pods if not health.is_ready(pod)]
        line = f"{ready}/{self.group_size} cache pods ready"
        if waiting:
            more = len(waiting) - NOT_READY_NAMED
            line += " (" + "; ".join(waiting[:NOT_READY_NAMED]) + (f"; and {more} more" if more > 0 else "") + ")"
        return line

    def head_line(self) -> str:
        line = health.describe_status(self.status)
        return f"{line} ({self.status_error})" if self.status is None and self.status_error else line

    def summary(self) -> str:
        parts = [self.pods_line(), self.head_line(), self.missing_pods(), self.kube and self.kube.trouble_line()]
        return "; ".join(part for part in parts if part)

    def took_status(self, status: dict | None, error: str | None) -> None:
        """Keep one /status poll's answer, counting failed ones while the group is Available."""
        self.status, self.status_error = status, error
        if status is None and error is not None and _available(self.lws):
            self.unreachable_since = self.unreachable_since or time.monotonic()
        else:
            self.unreachable_since = None

    def missing_pods(self) -> str | None:
        """What to check when some of the group's pods were never created (None when all exist).

        Nothing in the pods or the LeaderWorkerSet says why: the refusal is an event on its
        StatefulSet, which the initializer is not allowed to read.
        """
        exist = len(self.group_pods())
        if exist >= self.group_size:
            return None
        return (
            f"only {exist} of the {self.group_size} cache pods exist: something refuses to create "
            "the others (a ResourceQuota or LimitRange, Pod Security admission, an OpenShift SCC) or the "
            f"LeaderWorkerSet controller is not running; `kubectl get events -n {self.cfg.namespace} "
            "--field-selector reason=FailedCreate` names it"
        )

    def log_changes(self) -> None:
        for key, line in (("pods", self.pods_line()), ("head", self.head_line())):
            if self.logged.get(key) != line:
                self.logged[key] = line
                log.info("%s", line)

    def check(self) -> None:
        name = cache_names(self.cfg).cache
        if self.lws is None:
            raise _deleted(name)
        now = time.monotonic()
        for pod in self.group_pods():
            reason = health.hopeless_reason(pod)
            if reason:
                raise CacheFailedError(reason)
            self._for_longer_than(
                self.start_error_since,
                health.pod_name(pod),
                health.start_error(pod),
                now,
                self.cfg.start_error_grace_seconds,
            )
            self._for_longer_than(
                self.unschedulable_since,
                health.pod_name(pod),
                health.unschedulable_reason(pod),
                now,
                self.cfg.unschedulable_grace_seconds,
            )
            self._for_longer_than(
                self.failed_since,
                health.pod_name(pod),
                health.failed_reason(pod),
                now,
                self.cfg.unschedulable_grace_seconds,
            )
        self._for_longer_than(self.missing_since, name, self.missing_pods(), now, self.cfg.unschedulable_grace_seconds)
        failure = health.status_failure(self.status) if self.status else None
        if failure:
            raise CacheFailedError(failure)

    @staticmethod
    def _for_longer_than(since: dict[str, float], name: str, problem: str | None, now: float, grace: float) -> None:
        """Fail when ``problem`` has held for ``name`` (a pod, or the group) for ``grace`` seconds;
        forget it once gone."""
        if not problem:
            since.pop(name, None)
            return
        started = since.setdefault(name, now)
        if now - started >= grace:
            raise CacheFailedError(f"{problem} (for {now - started:.0f}s)")

    def ready(self, at_deadline: bool = False) -> bool:
        """Whether the cache serves; ``at_deadline``: the last look, which takes an unreachable
        /status at its word before the grace has run (the alternative deletes a loaded cache)."""
        if not _available(self.lws):
            return False
        if (self.status or {}).get("state") == "ready":
            return True
        # Available means every cache pod passed its readiness probe, and the head's /ready
        # answers 200 only once every data node has loaded: the cache is ready. Its /status is
        # wanted for the progress line, but a NetworkPolicy may let the kubelet reach the pods
        # and not this initializer; that must not throw away a loaded cache at the deadline.
        grace = STATUS_UNREACHABLE_PERIODS * self.cfg.status_poll_seconds
        if self.unreachable_since is not None and (time.monotonic() - self.unreachable_since >= grace or at_deadline):
            log.warning(
                "the LeaderWorkerSet is Available (every cache pod passed its readiness probe), but the head's "
                "/status has not answered for %.0fs (%s): taking the cache as ready. If a NetworkPolicy "
                "isolates the cache pods, training pods must still reach the Service on port %d",
                time.monotonic() - self.unreachable_since,
                self.status_error,
                c.FLIGHT_PORT,
            )
            return True
        return False


def _deleted(name: str) -> CacheDeletedError:
    return CacheDeletedError(f"LeaderWorkerSet {name} was deleted while waiting for it: run the TrainJob again")


def wait_until_ready(kube: Kube, cfg: Config, deadline: float) -> dict | None:
    """Block until the cache is Available and its head reports ready; return the head's status
    (None when the cache was taken as ready without it: its /status could not be reached)."""
    namespace, name = cfg.namespace, cache_names(cfg).cache
    try:
        lws = kube.get(LEADER_WORKER_SETS, namespace, name)
    except KubeApiError as err:
        if err.not_found:  # gone since it was made or joined: as when a watch sees it go
            raise _deleted(name) from None
        raise
    pods, pods_version = kube.list(PODS, namespace, label_selector=pods_selector(cfg))
    events: queue.Queue = queue.Queue()
    watchers = [
        _Watcher(
            kube,
            LEADER_WORKER_SETS,
            namespace,
            lws["metadata"]["resourceVersion"],
            deadline,
            events,
            field_selector=f"metadata.name={name}",
        ),
        _Watcher(kube, PODS, namespace, pods_version, deadline, events, label_selector=pods_selector(cfg)),
    ]
    for watcher in watchers:
        watcher.start()

    def answered() -> bool:
        return all(watcher.answered.is_set() for watcher in watchers)

    try:
        return _wait(cfg, _Progress(cfg, lws, pods, kube), events, deadline, answered)
    finally:
        for watcher in watchers:
            watcher.stop()
        until = time.monotonic() + STOP_JOIN_SECONDS
        for watcher in watchers:
            watcher.join(max(0.0, until - time.monotonic()))


def _wait(
    cfg: Config, progress: _Progress, events: queue.Queue, deadline: float, answered: Callable[[], bool]
) -> dict | None:
    """The waiting loop; ``answered``: whether every watch has had its first answer, before
    which the cache is not taken as ready (until the deadline)."""
    next_status_at = 0.0
    while True:
        termination.raise_if_received()
        # Asked first: a watcher queues its refusal before it counts as answered, so the events
        # taken next hold it, and a refused watch fails the run before readiness is judged.
        watches_answered = answered()
        if _take_events(progress, events, 0.0):
            next_status_at = 0.0
        now = time.monotonic()
        if now >= next_status_at:
            ip = health.head_pod_ip(progress.group_pods())
            progress.took_status(*(health.fetch_head_status(ip, progress.health_port) if ip else (None, None)))
            next_status_at = time.monotonic() + cfg.status_poll_seconds
        progress.log_changes()
        progress.check()
        if watches_answered and progress.ready():
            return progress.status
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if progress.ready(at_deadline=True):
                return progress.status
            raise CacheTimeoutError(
                f"the cache was not ready within CACHE_READY_TIMEOUT_SECONDS={cfg.ready_timeout_seconds:g}: "
                f"{progress.summary()}"
            )
        timeout = max(0.0, min(remaining, next_status_at - time.monotonic()))
        if not watches_answered:
            timeout = min(timeout, FIRST_ANSWER_POLL_SECONDS)
        if _take_events(progress, events, timeout):
            next_status_at = 0.0


def _take_events(progress: _Progress, events: queue.Queue, timeout: float) -> bool:
    """Apply every queued event, waiting up to ``timeout`` for the first; True when the head
    should be asked for its status now."""
    ask_head = False
    try:
        event = events.get(timeout=timeout) if timeout > 0 else events.get_nowait()
        while True:
            ask_head = progress.apply(*event) or ask_head
            event = events.get_nowait()
    except queue.Empty:
        return ask_head
