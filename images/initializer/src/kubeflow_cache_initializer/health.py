"""Reading the cache's health: hopeless pod states, and the head's `/status` load progress."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import threading

from kubeflow_cache_initializer import constants as c

log = logging.getLogger(__name__)

# Waiting reasons from which a container never starts without someone changing the pod or image.
IMAGE_ERRORS = frozenset({"InvalidImageName", "ErrImageNeverPull"})
# Waiting reasons that are often passing (a registry's 5xx or rate limit, a busy node's runtime
# timing out, a Secret its controller has not written yet) but final when they last: the caller
# gives them CACHE_START_ERROR_GRACE_SECONDS.
PULL_ERRORS = frozenset({"ErrImagePull", "ImagePullBackOff"})
CONFIG_ERRORS = frozenset({"CreateContainerConfigError", "CreateContainerError", "RunContainerError"})


def pod_name(pod: dict) -> str:
    return pod["metadata"]["name"]


def is_head(pod: dict) -> bool:
    return (pod["metadata"].get("labels") or {}).get(c.LABEL_COMPONENT) == c.COMPONENT_HEAD


def is_ready(pod: dict) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(cond.get("type") == "Ready" and cond.get("status") == "True" for cond in conditions)


def _memory_hint(pod: dict) -> str:
    return "HEAD_MEM" if is_head(pod) else "WORKER_MEM"


def hopeless_reason(pod: dict) -> str | None:
    """Why this cache pod can never become ready, or None while it still may."""
    name = pod_name(pod)
    status = pod.get("status") or {}
    for cs in _container_statuses(status):
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason", "") in IMAGE_ERRORS:
            return _start_error(name, cs, waiting)
        # A past crash of a container that is ready again is history, not a verdict.
        for when in ("state",) if cs.get("ready") else ("state", "lastState"):
            term = (cs.get(when) or {}).get("terminated")
            if not term:
                continue
            if term.get("reason") == "OOMKilled":
                return f"cache pod {name} was OOMKilled: its memory limit is too small (raise {_memory_hint(pod)})"
            if term.get("exitCode", 0) != 0:
                detail = (term.get("message") or term.get("reason") or "").strip()
                return f"cache pod {name} exited with code {term['exitCode']}: {detail}"
    for cs in status.get("containerStatuses") or []:  # an init container's exit 0 is its success
        waiting = (cs.get("state") or {}).get("waiting") or {}
        term = (cs.get("lastState") or {}).get("terminated") or {}
        if waiting.get("reason") == "CrashLoopBackOff" and term and term.get("exitCode", 0) == 0:
            # The cache server exits 0 only when told to stop: over and over, that is a failing
            # liveness probe or a command that ends at once. Waited out to the deadline before.
            return (
                f"cache pod {name} keeps exiting with code 0 (CrashLoopBackOff): the cache server exits 0 only "
                f"when stopped, so its liveness probe fails (kubectl describe pod {name}) or its command ends at "
                "once (check CACHE_IMAGE)"
            )
    return None


def start_error(pod: dict) -> str | None:
    """Why a container of this pod cannot start now, where that may still pass (PULL_ERRORS,
    CONFIG_ERRORS); None when none is waiting on such an error."""
    for cs in _container_statuses(pod.get("status") or {}):
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason", "") in PULL_ERRORS | CONFIG_ERRORS:
            return _start_error(pod_name(pod), cs, waiting)
    return None


def _container_statuses(status: dict) -> list[dict]:
    return (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or [])


def _start_error(name: str, cs: dict, waiting: dict) -> str:
    reason, message = waiting.get("reason", ""), waiting.get("message", "")
    if reason in IMAGE_ERRORS | PULL_ERRORS:
        return f"cache pod {name} cannot pull image {cs.get('image', '')}: {reason}: {message}"
    return f"cache pod {name} cannot start container {cs.get('name')}: {reason}: {message}"


def failed_reason(pod: dict) -> str | None:
    """Why this pod failed as a whole (phase Failed). Not hopeless by itself: cache pods restart
    their containers (restartPolicy Always), so only the kubelet fails a pod, evicting it under
    node pressure or refusing it at admission (OutOfcpu), and their StatefulSet makes it again
    (elsewhere, or once the pressure passed); the caller gives it CACHE_UNSCHEDULABLE_GRACE_SECONDS."""
    status = pod.get("status") or {}
    if status.get("phase") != "Failed":
        return None
    return f"cache pod {pod_name(pod)} failed: {status.get('reason', '')} {status.get('message', '')}".strip()


def unschedulable_reason(pod: dict) -> str | None:
    """Why the scheduler cannot place this pod now. Not hopeless by itself: a cluster autoscaler
    may be adding a node, so the caller gives it CACHE_UNSCHEDULABLE_GRACE_SECONDS first."""
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if (
            cond.get("type") == "PodScheduled"
            and cond.get("status") == "False"
            and cond.get("reason") == "Unschedulable"
        ):
            return f"cache pod {pod_name(pod)} is unschedulable: {cond.get('message', '')}".strip()
    return None


def head_pod_ip(pods: list[dict]) -> str | None:
    for pod in pods:
        status = pod.get("status") or {}
        if is_head(pod) and status.get("phase") == "Running" and status.get("podIP"):
            return status["podIP"]
    return None


def fetch_head_status(
    pod_ip: str, port: int, timeout: float = c.STATUS_HTTP_TIMEOUT_SECONDS
) -> tuple[dict | None, str | None]:
    """The head's `/status` JSON and None; or None and why it did not answer (yet).

    `timeout` bounds the whole call, connect and answer, not only each read: a server that
    trickles its answer a byte at a time passes every read's timeout, and the wait's deadline is
    checked only between calls. A watchdog shuts the socket at the deadline, which ends the read
    in progress.
    """
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    url = f"http://{host}:{port}{c.STATUS_PATH}"
    conn = http.client.HTTPConnection(pod_ip, port, timeout=timeout)  # no proxy: a pod IP
    expired = threading.Event()
    sock: list[socket.socket] = []

    def expire() -> None:
        expired.set()
        # The socket itself, not conn.sock: an HTTP/1.0 answer (the head's) or one that says
        # `Connection: close` makes getresponse() drop conn.sock while the body is still read.
        for connected in sock:
            with contextlib.suppress(OSError):
                connected.shutdown(socket.SHUT_RDWR)

    watchdog = threading.Timer(timeout, expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.connect()  # bounded by `timeout` itself
        sock.append(conn.sock)
        if expired.is_set():  # it fired while connecting, with no socket to shut yet
            raise TimeoutError("connected at the deadline")
        conn.request("GET", c.STATUS_PATH)
        response = conn.getresponse()
        if response.status != 200:
            return None, f"GET {url}: HTTP {response.status} {response.reason}"
        status = json.load(response)
    except (OSError, ValueError, http.client.HTTPException) as err:
        # Not answering yet, not a failed run: a head that died mid-answer (IncompleteRead), or an
        # address now held by something that does not speak HTTP (BadStatusLine).
        log.debug("head /status on %s not available: %r", pod_ip, err)
        if expired.is_set():
            return None, f"GET {url}: no whole answer within {timeout:g} s"
        if isinstance(err, http.client.HTTPException):
            return None, f"GET {url}: not a whole HTTP answer ({type(err).__name__}: {str(err).strip()[:200]})"
        return None, f"GET {url}: {err}"
    finally:
        watchdog.cancel()
        conn.close()
    if not isinstance(status, dict):
        return None, f"GET {url}: not a JSON object"
    return status, None


def not_ready_reason(pod: dict) -> str:
    """What a cache pod that is not ready waits on, in a few words: the timeout message names it."""
    name = pod_name(pod)
    status = pod.get("status") or {}
    for cond in status.get("conditions") or []:
        # SchedulingGated (Kueue and other gate users), Unschedulable: the scheduler's own words.
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return f"{name} not scheduled: {cond.get('reason', '')}: {cond.get('message', '')}".rstrip(": ")
    for cs in _container_statuses(status):
        waiting = (cs.get("state") or {}).get("waiting")
        if waiting:  # ContainerCreating (CNI, volumes), PodInitializing, a pull in progress...
            detail = f"{waiting.get('reason', '')}: {waiting.get('message', '')}".rstrip(": ")
            return f"{name} container {cs.get('name')} waiting: {detail}"
    if status.get("phase") == "Running":  # loading (the head line says how far), or its probe fails
        return f"{name} running, not ready"
    return f"{name} {status.get('phase') or 'Pending'}"


def node_entries(status: dict) -> list[dict]:
    """The head's per-node entries that are JSON objects: a head of another version may shape
    them otherwise (a crash on one made a healthy cache's run fail "unexpectedly")."""
    nodes = status.get("nodes")
    return [node for node in nodes if isinstance(node, dict)] if isinstance(nodes, list) else []


def status_failure(status: dict) -> str | None:
    """The load error the head or one of its data nodes reports, if any."""
    if status.get("state") == "failed":
        return f"the cache head reports a failed load: {status.get('error') or 'no reason given'}"
    for node in node_entries(status):
        # Only `failed` is final: an `unreachable` node (starting, restarting) carries an error too.
        if node.get("state") == "failed":
            return f"data node {node.get('index')} failed to load: {node.get('error') or 'no reason given'}"
    return None


def _human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


def _number(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def describe_status(status: dict | None) -> str:
    """One line of load progress, e.g. `head loading: 1/2 data nodes loaded, 5,000 rows, 1.2 MiB
    (<the head's detail>)`.

    Rows and bytes count what loading nodes have decoded so far, not only what loaded nodes
    hold (the head's own totals, which stay at 0 until a node is done). Until the head is ready
    its detail follows: the nodes it cannot reach, and a read that has waited on storage."""
    if status is None:
        return "head status not available yet"
    nodes = node_entries(status)
    loaded = sum(1 for node in nodes if node.get("state") == "ready")
    rows = nbytes = 0
    for node in nodes:
        loading = node.get("loading")
        so_far = loading if node.get("state") != "ready" and isinstance(loading, dict) else node
        rows += _number(so_far.get("rows"))
        nbytes += _number(so_far.get("bytes"))
    state = status.get("state", "unknown")
    line = f"head {state}: {loaded}/{len(nodes)} data nodes loaded, {rows:,} rows, {_human_bytes(nbytes)}"
    detail = status.get("detail")
    if state != "ready" and isinstance(detail, str) and detail:
        line += f" ({detail})"
    return line
