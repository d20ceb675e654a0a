"""What head and data nodes share: lifecycle state, metrics, error mapping, the HTTP endpoints."""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

import pyarrow.flight as flight
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kubeflow_data_cache.client_statuses import GetSchemaStatus, InvalidArgument, Unimplemented, install
from kubeflow_data_cache.errors import (
    LOAD_FAILED_INFO,
    NOT_READY_INFO,
    BadRequestError,
    DataCacheError,
    LoadFailedError,
    NodeBusyError,
    NotReadyError,
    StaleTicketError,
    bounded_message,
    first_line,
)
from kubeflow_data_cache.health_http import LoopHTTPServer, listening_socket
from kubeflow_data_cache.memory import resident_bytes
from kubeflow_data_cache.protocol import (
    ACTION_COUNT,
    ACTION_LOAD,
    ACTION_REGISTER,
    ACTION_STATUS,
    check_request_size,
)

log = logging.getLogger(__name__)

WAITING, LOADING, READY, FAILED = "waiting", "loading", "ready", "failed"
# A head whose data node is unreachable or reloading: not ready until it is back (not final).
DEGRADED = "degraded"
# After SIGTERM: not ready, so no new reader is sent here while open streams finish.
STOPPING = "stopping"


class Lifecycle:
    """A node's state: waiting -> loading -> ready, or failed with the reason; stopping once
    SIGTERM came."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.state = WAITING
        self.error: str | None = None
        self._detail = "waiting for the cluster to form"
        # While loading, a detail computed when asked (a data node's reads in flight, which age
        # without any event to set a new detail on): /ready, /status and NotReadyError use it.
        self.live_detail: Callable[[], str] | None = None
        self.failed_event = threading.Event()

    @property
    def detail(self) -> str:
        live = self.live_detail
        return live() if live is not None and self.state == LOADING else self._detail

    @detail.setter
    def detail(self, value: str) -> None:
        self._detail = value

    def set(self, state: str, detail: str = "") -> None:
        with self._lock:
            if self.state in (FAILED, STOPPING):
                # A failure is final until the process restarts, and so is a shutdown: a load
                # ending in the shutdown's grace must not turn /ready back to 200.
                return
            self.state, self.detail = state, detail

    def waiting_detail(self, detail: str) -> None:
        """Say why, while still waiting (a load that began meanwhile is left alone)."""
        with self._lock:
            if self.state == WAITING:
                self.detail = detail

    def fail(self, error: str) -> None:
        with self._lock:
            self.state, self.error, self.detail = FAILED, error, error
        self.failed_event.set()
        log.error("load failed: %s", error)

    def require_ready(self) -> None:
        if self.state == READY:
            return
        if self.state == FAILED:
            raise LoadFailedError(f"the cache failed to load: {self.error}")
        raise NotReadyError(f"the cache is not ready yet ({self.state}: {self.detail}); retry shortly")


# No `*_created` series beside each counter and histogram: they doubled what every scrape
# carries, and a process's start is process_start_time_seconds.
disable_created_metrics()

# Where Prometheus scrapes each process (the chart's PodMonitor names it too).
METRICS_PATH = "/metrics"
# From a cached answer (~100 us) to a head slowed by thousands of readers starting at once, and
# on to the slowest calls the cache makes: a head's GetFlightInfo for a new filter waits up to
# COUNT_TIMEOUT_SECONDS (25 s) for its nodes' counts, and a node's count up to
# FILTER_TIMEOUT_SECONDS (120 s); in a 10 s top bucket those were all "+Inf".
REQUEST_SECONDS_BUCKETS = (
    *(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    *(30.0, 60.0, 120.0),
)
# Every state a Lifecycle takes: data_cache_state has a series for each, always.
STATES = (WAITING, LOADING, READY, DEGRADED, FAILED, STOPPING)
# The DoAction types the metrics name (the ``action`` label); any other is counted as "other".
ACTION_LABELS = frozenset({ACTION_STATUS, ACTION_REGISTER, ACTION_LOAD, ACTION_COUNT})
# The Flight calls each role serves, as (method, action). Their requests and errors exist from
# the start, at 0: a series that first appears at 1 is no increase to Prometheus, so the first
# error after a start never fired an increase() or rate() alert. Calls a role only refuses (DoGet
# on the head, DoPut anywhere: always UNIMPLEMENTED) appear when first made, as before.
ROLE_CALLS = {
    "head": (
        *(("GetFlightInfo", ""), ("GetSchema", ""), ("ListFlights", ""), ("ListActions", "")),
        *(("DoAction", ACTION_STATUS), ("DoAction", ACTION_REGISTER)),
    ),
    "data-node": (
        *(("DoGet", ""), ("ListActions", "")),
        *(("DoAction", ACTION_STATUS), ("DoAction", ACTION_LOAD), ("DoAction", ACTION_COUNT)),
    ),
}
# The codes flight_errors counts a served call's failure as: a bad request, not ready or busy, a
# failure, a caller that left. A made-up action is UNIMPLEMENTED (action "other"), a call refused
# for its token UNAUTHENTICATED (action "", where a token is set: Metrics.count_token_refusals).
SERVED_CODES = ("INVALID_ARGUMENT", "UNAVAILABLE", "INTERNAL", "CANCELLED")


class Metrics:
    """Prometheus metrics of one process (its own registry, so tests can run many in one process)."""

    def __init__(self, role: str, table: str = "") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.rows_loaded = Gauge("data_cache_loaded_rows", "Rows held in memory", registry=r)
        self.bytes_loaded = Gauge("data_cache_loaded_bytes", "Arrow bytes held in memory", registry=r)
        self.load_seconds = Gauge(
            "data_cache_load_seconds",
            "Head: seconds planning and loading, without the wait for data nodes to register; "
            "data node: seconds from its assignment to ready",
            registry=r,
        )
        self.ready = Gauge("data_cache_ready", "1 when loaded and serving", registry=r)
        self.rows_served = Counter("data_cache_served_rows", "Rows sent to clients", registry=r)
        self.bytes_served = Counter("data_cache_served_bytes", "Arrow bytes sent to clients", registry=r)
        self.streams_refused = Counter(
            "data_cache_streams_refused",
            "DoGet streams a data node refused (UNAVAILABLE) near its memory limit",
            registry=r,
        )
        # ``action``: a DoAction's type (ACTION_LABELS), else "": the cache's own calls (a head's
        # status polls, a node's register, the head's load and count) are told from readers'.
        self.requests = Counter("data_cache_requests", "Flight calls", ["method", "action"], registry=r)
        self.errors = Counter("data_cache_errors", "Flight calls that failed", ["method", "action", "code"], registry=r)
        # The handler's own time: a whole unary call; for DoGet, checking the ticket and setting up
        # the stream (Flight's C++ writer sends it afterwards, out of the handler's sight).
        self.request_seconds = Histogram(
            "data_cache_request_seconds",
            "Seconds the handler of a Flight call ran (DoGet: until its stream was set up)",
            ["method", "action"],
            buckets=REQUEST_SECONDS_BUCKETS,
            registry=r,
        )
        memory = Gauge("data_cache_resident_memory_bytes", "Resident memory of the process", registry=r)
        memory.set_function(resident_bytes)
        info = Gauge("data_cache_info", "Role of this process and the table it caches", ["role", "table"], registry=r)
        info.labels(role=role, table=table).set(1)
        self.state = Gauge(
            "data_cache_state", "1 for the state /ready goes by, 0 for every other state", ["state"], registry=r
        )
        # What /ready says of a load under way ("loading: 414515 rows, 23 MiB read"): the rows
        # and bytes decoded so far, and how long the oldest read in flight has waited (a stalled
        # storage read). A head: the sums (and the longest wait) over its nodes' last polls.
        self.load_read_rows = Gauge("data_cache_load_read_rows", "Rows the load under way read so far", registry=r)
        self.load_read_bytes = Gauge(
            "data_cache_load_read_bytes", "Arrow bytes the load under way read so far", registry=r
        )
        self.load_oldest_read_seconds = Gauge(
            "data_cache_load_oldest_read_seconds",
            "Seconds the oldest read of the load under way has waited on storage (0: none in flight)",
            registry=r,
        )
        self.role = role
        for method, action in ROLE_CALLS.get(role, ()):
            self.requests.labels(method=method, action=action)
            self.request_seconds.labels(method=method, action=action)  # its _count and _bucket too
            for code in SERVED_CODES:
                self.errors.labels(method=method, action=action, code=code)
        if role in ROLE_CALLS:
            self.requests.labels(method="DoAction", action="other")
            self.errors.labels(method="DoAction", action="other", code="UNIMPLEMENTED")
        # The standard process_* series: process_start_time_seconds tells a restart, and CPU,
        # open files and virtual memory what a busy node spends (Linux; nothing elsewhere).
        ProcessCollector(registry=r)

    def count_token_refusals(self) -> None:
        """A token is set: the calls it refuses (token_refused) have their series from the
        start, for each method this role serves."""
        for method in dict.fromkeys(method for method, _ in ROLE_CALLS.get(self.role, ())):
            self.requests.labels(method=method, action="")
            self.errors.labels(method=method, action="", code="UNAUTHENTICATED")

    def token_refused(self, method: str) -> None:
        """Count a call the token check refused. Before the handler, so a DoAction's type is not
        known: action "". A request too, so that errors stay a subset of requests (an error rate
        above 1 otherwise)."""
        self.requests.labels(method=method, action="").inc()
        self.errors.labels(method=method, action="", code="UNAUTHENTICATED").inc()

    def follow(self, lifecycle: Lifecycle, rows: Callable[[], int], nbytes: Callable[[], int]) -> None:
        """Read ``ready``, the state and what is held when scraped, from the state /ready and
        /status answer with: gauges set on events drifted from them (ready 1 after SIGTERM, a new
        assignment's node still counting its old rows, a degraded head its whole table)."""
        self.ready.set_function(lambda: 1.0 if lifecycle.state == READY else 0.0)
        for state in STATES:
            self.state.labels(state=state).set_function(lambda state=state: 1.0 if lifecycle.state == state else 0.0)
        self.rows_loaded.set_function(rows)
        self.bytes_loaded.set_function(nbytes)

    def follow_load(self, progress: Callable[[], tuple[int, int, float]]) -> None:
        """Read the load under way when scraped: ``progress()`` is (rows, bytes, seconds the
        oldest read has waited), zeros where none is under way."""
        self.load_read_rows.set_function(lambda: progress()[0])
        self.load_read_bytes.set_function(lambda: progress()[1])
        self.load_oldest_read_seconds.set_function(lambda: progress()[2])

    def follow_data_nodes(self, states: Callable[[], list[str]], known: tuple[str, ...]) -> None:
        """A head: its data nodes by state (``states()``, one per node), a series for each of
        ``known`` always; a state not among them is not counted (the label stays bounded)."""
        nodes = Gauge(
            "data_cache_data_nodes",
            "The head's data nodes in each state, by its last look",
            ["state"],
            registry=self.registry,
        )
        for state in known:
            nodes.labels(state=state).set_function(lambda state=state: float(states().count(state)))

    def follow_memory(self, limit: int | None, open_streams: Callable[[str], int], kinds: tuple[str, ...]) -> None:
        """A data node: the memory limit its guards enforce (no series where it has none: a ratio
        of resident memory to it would otherwise divide by 0), and its open DoGet streams by kind,
        which its serving guard counts when it admits or refuses a new one."""
        if limit is not None:
            Gauge(
                "data_cache_memory_limit_bytes",
                "The memory limit a data node's load and serving guards enforce",
                registry=self.registry,
            ).set(limit)
        streams = Gauge("data_cache_open_streams", "DoGet streams being sent now", ["kind"], registry=self.registry)
        for kind in kinds:
            streams.labels(kind=kind).set_function(lambda kind=kind: float(open_streams(kind)))


# The gRPC status each pyarrow Flight error class stands for (FlightServerError: any other).
_FLIGHT_STATUS = (
    (flight.FlightUnavailableError, "UNAVAILABLE"),
    (flight.FlightTimedOutError, "DEADLINE_EXCEEDED"),
    (flight.FlightUnauthenticatedError, "UNAUTHENTICATED"),
    (flight.FlightUnauthorizedError, "PERMISSION_DENIED"),
    (flight.FlightCancelledError, "CANCELLED"),
    (flight.FlightInternalError, "INTERNAL"),
)


def flight_status(err: flight.FlightError) -> str:
    return next((code for cls, code in _FLIGHT_STATUS if isinstance(err, cls)), "UNKNOWN")


def action_label(method: str, call_args: tuple) -> str:
    """The metrics' ``action`` label of a call: a DoAction's type, bounded (anything a client
    makes up is ``other``); "" for every other method."""
    if method != "DoAction" or not call_args:
        return ""
    kind = getattr(call_args[-1], "type", None)
    return kind if kind in ACTION_LABELS else "other"


def _cancelled(context: Any) -> bool:
    """Whether a call's caller has left; False for what is not a server call's context."""
    is_cancelled = getattr(context, "is_cancelled", None)
    return bool(is_cancelled()) if callable(is_cancelled) else False


def flight_errors(metrics: Metrics, method: str) -> Callable:
    """Map our errors to Flight statuses, count them, and never let one crash the server."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            labels = {"method": method, "action": action_label(method, args)}
            metrics.requests.labels(**labels).inc()
            started = time.perf_counter()
            try:
                if args and _cancelled(args[0]):
                    # The caller left (its deadline passed while the call waited for a thread):
                    # answering it is work for no one, and under a storm of short deadlines that
                    # work kept gRPC adding threads, 3,600 on a head, until probes timed out.
                    raise flight.FlightCancelledError(f"{method}: the caller cancelled or its deadline passed")
                return fn(*args, **kwargs)
            except (BadRequestError, StaleTicketError) as err:
                metrics.errors.labels(**labels, code="INVALID_ARGUMENT").inc()
                raise InvalidArgument(bounded_message(str(err))) from None
            except (NotReadyError, NodeBusyError) as err:
                metrics.errors.labels(**labels, code="UNAVAILABLE").inc()
                info = NOT_READY_INFO if isinstance(err, NotReadyError) else b""
                raise flight.FlightUnavailableError(bounded_message(str(err)), info) from None
            except NotImplementedError as err:
                metrics.errors.labels(**labels, code="UNIMPLEMENTED").inc()
                raise Unimplemented(bounded_message(str(err))) from None
            except DataCacheError as err:
                metrics.errors.labels(**labels, code="INTERNAL").inc()
                info = LOAD_FAILED_INFO if isinstance(err, LoadFailedError) else b""
                raise flight.FlightInternalError(bounded_message(str(err)), info) from None
            except flight.FlightError as err:
                metrics.errors.labels(**labels, code=flight_status(err)).inc()
                raise
            except Exception as err:
                metrics.errors.labels(**labels, code="INTERNAL").inc()
                log.exception("%s failed", method)
                raise flight.FlightInternalError(
                    bounded_message(f"{method} failed: {type(err).__name__}: {err}")
                ) from None
            finally:
                metrics.request_seconds.labels(**labels).observe(time.perf_counter() - started)

        if method != "GetSchema":
            return inner

        @functools.wraps(fn)
        def get_schema(*args: Any, **kwargs: Any) -> Any:
            try:
                return inner(*args, **kwargs)
            except flight.FlightError as err:  # counted above, under its own code
                raise GetSchemaStatus(f"{flight_status(err)}: {err}") from None

        return get_schema

    return wrap


# Flight's name for each handler: the metrics' method label on every role.
FLIGHT_CALLS = {
    "do_action": "DoAction",
    "do_get": "DoGet",
    "get_flight_info": "GetFlightInfo",
    "get_schema": "GetSchema",
    "list_flights": "ListFlights",
    "list_actions": "ListActions",  # else counted when refused for its token, never when served
    "do_put": "DoPut",
    "do_exchange": "DoExchange",
}


class ReadOnlyFlight(flight.FlightServerBase):
    """The calls a cache never serves, refused with a reason (pyarrow's defaults give an empty
    UNIMPLEMENTED): the table is read-only, fixed at load, and read with GetFlightInfo + DoGet."""

    def do_put(self, context, descriptor, reader, writer):
        raise NotImplementedError(
            "DoPut is not supported: the cache serves the Iceberg table of METADATA_LOC read-only; "
            "write to the table and restart the cache on its new metadata"
        )

    def do_exchange(self, context, descriptor, reader, writer):
        raise NotImplementedError("DoExchange is not supported: read with GetFlightInfo, then DoGet per endpoint")

    def open_streams(self) -> int:
        """DoGet streams being sent now: what a stopping server waits for (runner.py)."""
        return 0


def meter_calls(server: Any, metrics: Metrics) -> None:
    """Wrap every Flight handler of the server (on the instance) in ``flight_errors``, labelled by
    Flight's names; a call made from inside the class bypasses the wrapper (not counted twice).
    A client's mistakes reach it without the server's traceback from here on (client_statuses)."""
    install()
    for name, method in FLIGHT_CALLS.items():
        setattr(server, name, flight_errors(metrics, method)(getattr(server, name)))


def parse_action_body(action: flight.Action, *, bounded: bool = True) -> dict[str, Any]:
    """The action's JSON object; with ``bounded``, refused past MAX_REQUEST_BYTES before it is
    copied or parsed (a head's ``load``, which lists a node's files, is not bounded)."""
    size = action.body.size if action.body is not None else 0
    if bounded:
        check_request_size(size, f"body of action {action.type!r}")
    if not size:
        return {}
    raw = action.body.to_pybytes()
    try:
        body = json.loads(raw)
    # ValueError: an integer of more digits than Python converts; RecursionError: deep nesting.
    except (ValueError, RecursionError) as err:
        raise BadRequestError(f"action {action.type!r}: body is not valid JSON ({first_line(err)})") from None
    if not isinstance(body, dict):
        raise BadRequestError(f"action {action.type!r}: body should be a JSON object")
    return body


# How long the health server waits on a connection, its request and answer included (probes
# send theirs at once).
HEALTH_REQUEST_TIMEOUT_SECONDS = 10.0


class HealthServer:
    """``/live``, ``/ready`` (503 with the reason until loaded), ``/status`` (JSON), ``/metrics``."""

    def __init__(self, host: str, port: int, lifecycle: Lifecycle, metrics: Metrics, status: Callable[[], dict]):
        lifecycle_, metrics_, status_ = lifecycle, metrics, status

        class Handler(BaseHTTPRequestHandler):
            # Fed a whole request by health_http.LoopHTTPServer, which reads it on its event loop
            # under one deadline per connection (the health port takes no token, and the per-job
            # Service exposes it: idle and trickling connections must not hold threads).

            def do_GET(self) -> None:
                self._respond(with_body=True)

            def do_HEAD(self) -> None:  # `curl -I`, uptime checkers: the same status and headers
                self._respond(with_body=False)

            def _not_allowed(self) -> None:
                # A method HTTP defines, on paths that only answer GET and HEAD: 405 with Allow
                # (http.server answers 501 "Unsupported method", in HTML, for every one).
                self._with_body = True
                self.send_response(405)
                self.send_header("Allow", "GET, HEAD")
                body = b"method not allowed: use GET (or HEAD)\n"
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

            def _respond(self, with_body: bool) -> None:
                self._with_body = with_body
                path = self.path.split("?")[0]
                if path == "/live":
                    self._send(200, "text/plain", b"ok\n")
                elif path == "/ready":
                    ready = lifecycle_.state == READY
                    reason = "ready" if ready else f"{lifecycle_.state}: {lifecycle_.detail}"
                    self._send(200 if ready else 503, "text/plain", (reason + "\n").encode())
                elif path == "/status":
                    self._send(200, "application/json", json.dumps(status_()).encode())
                elif path == METRICS_PATH:
                    self._send(200, CONTENT_TYPE_LATEST, generate_latest(metrics_.registry))
                else:
                    self._send(404, "text/plain", b"not found: try /ready, /live, /status or /metrics\n")

            def _send(self, code: int, ctype: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self._with_body:
                    self.wfile.write(body)

            def log_message(self, *args: Any) -> None:  # probes every few seconds: keep logs quiet
                pass

        # The probes' paths are answered on the server's loop, ahead of any /status or /metrics.
        self._http = LoopHTTPServer(
            listening_socket(host, port), Handler, HEALTH_REQUEST_TIMEOUT_SECONDS, frozenset({"/live", "/ready"})
        )
        self.port = self._http.port

    def start(self) -> HealthServer:
        self._http.start()
        return self

    def stop(self) -> None:
        self._http.stop()
