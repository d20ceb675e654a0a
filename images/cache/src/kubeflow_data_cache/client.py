"""The low-level cache client: ask the head for a shard, stream it from the data nodes.

One :class:`CacheClient` per process (Flight clients are not picklable, so a DataLoader worker
builds its own). Every call carries the bearer token; transient failures (a node still loading,
restarting, or briefly unreachable) are retried with exponential backoff under one deadline, and
everything else fails at once with a message that says what to fix.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import numbers
import random
import re
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, TypeVar
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.flight as flight

from kubeflow_data_cache import constants, fork_guard
from kubeflow_data_cache.allocator import tune_glibc_malloc
from kubeflow_data_cache.config import uri_port
from kubeflow_data_cache.daemon_call import DaemonCall
from kubeflow_data_cache.errors import (
    LOAD_FAILED_INFO,
    BadRequestError,
    CacheAuthError,
    CacheUnavailableError,
    DataCacheError,
    ForkedConnectionError,
    NotReadyError,
    answered_not_ready,
    first_line,
    server_message,
)
from kubeflow_data_cache.interleave import ResumePoint, resume_point, sequential_point
from kubeflow_data_cache.interleave import interleave as interleave_streams
from kubeflow_data_cache.protocol import (
    ACTION_STATUS,
    ShardRequest,
    SnapshotRows,
    Ticket,
    info_table,
    int_arg,
    ticket_order,
    ticket_rows,
    with_skip,
)
from kubeflow_data_cache.readahead import Readahead
from kubeflow_data_cache.security import (
    CERTIFICATE_REFUSED,
    TLS_NAME_MISMATCH,
    channel_options,
    check_token,
    is_tls,
    server_name_problem,
    speaks_tls,
)
from kubeflow_data_cache.stall_watch import StallWatch

__all__ = [
    "DEFAULT_DEADLINE_SECONDS",
    "CacheAuthError",
    "CacheClient",
    "CacheUnavailableError",
    "ForkedConnectionError",
]

log = logging.getLogger(__name__)

# Long enough to ride out a data node restart or a cache that is still loading when training
# starts; short enough that a wrong endpoint fails within a couple of minutes.
DEFAULT_DEADLINE_SECONDS = 120.0
# Unary calls (GetFlightInfo, DoAction) each get at most this long; DoGet streams have no
# per-call timeout because a large shard legitimately takes long to stream.
UNARY_TIMEOUT_SECONDS = 30.0
BACKOFF_INITIAL_SECONDS = 0.05
BACKOFF_MAX_SECONDS = 2.0
# How long a failing plaintext call waits, once, for a TLS handshake with the address: a frozen
# server accepts the connection and never answers, and that must not eat a short deadline.
TLS_PROBE_SECONDS = 2.0
# A restarted data node rejects old tickets; ask the head again at most this often per stream.
MAX_REPLANS = 3
# Retries are logged at INFO, which Python's logging hides unless set up: a wrong endpoint would
# wait out the whole deadline in silence. A call still failing after this long says so at
# WARNING, and again every RETRY_WARN_EVERY_SECONDS.
RETRY_WARN_AFTER_SECONDS = 10.0
RETRY_WARN_EVERY_SECONDS = 30.0
# A kept connection idle longer than this (an evaluation phase, a long checkpoint) is replaced
# by a fresh one at the next read: a new connection costs milliseconds, while an old one may have
# been dropped silently by something on the way.
KEPT_CLIENT_IDLE_SECONDS = 300.0
# A stream read that waits this long for its next batch (at most deadline_seconds) is cancelled
# and retried like a broken stream: the data node has stopped sending (stall_watch.py).
STREAM_STALL_SECONDS = 60.0
# A retry's wait is cut to what is left of the deadline, but not below this (one more try).
MIN_STALL_WAIT_SECONDS = 0.5
# Batches each endpoint stream reads ahead in its own thread, so all of a shard's data nodes send
# at once while the consumer converts (bounded memory per stream).
STREAM_READAHEAD_BATCHES = 2
# A thread waiting for an interruptible call waits this long at a time (a signal ends a wait at once).
SIGNAL_POLL_SECONDS = 0.5

# What Flight's gRPC transport accepts (grpc+tcp is grpc; grpc+unix a local socket).
ENDPOINT_SCHEMES = ("grpc", "grpc+tcp", "grpc+tls", "grpc+unix")
# Said to DataCacheDataset's users and CacheClient's alike (CacheClient reads no env).
ENDPOINT_HINT = (
    "set DATA_CACHE_ENDPOINT (or DataCacheDataset's endpoint argument; CacheClient's endpoint) to the "
    "cache's grpc:// address (grpc+tls:// where the cache serves TLS)"
)
# What gRPC says when the server's certificate does not verify: no retry changes that.
TLS_FAILURES = ("Ssl handshake failed", CERTIFICATE_REFUSED, "TSI_PROTOCOL_FAILURE")
CERTIFICATE_EXPIRED = "certificate has expired"  # OpenSSL's words, within gRPC's
# gRPC's words where the peer answered bytes that are not HTTP/2: an HTTP/1 server (a health
# port) or another protocol, which no retry turns into a cache.
NOT_GRPC = "Failed parsing HTTP/2"
TOKEN_HINT = (
    "set DATA_CACHE_TOKEN or DATA_CACHE_TOKEN_FILE (or DataCacheDataset's token argument; CacheClient's token, "
    "which reads no env) to the cache's token"
)

# The same errors gRPC reports for a refused connection, a failed DNS lookup, a server that
# went away mid-stream and a cache still loading: all worth another try until the deadline.
_TRANSIENT = (flight.FlightUnavailableError, flight.FlightTimedOutError)
_AUTH = (flight.FlightUnauthenticatedError, flight.FlightUnauthorizedError)

T = TypeVar("T")


class StreamStalledError(flight.FlightUnavailableError):
    """A data node sent nothing for the stall limit; retried like any unavailable stream."""


# The shortest timeout a retried call gets, for the try that falls at the deadline.
MIN_CALL_SECONDS = 0.5


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def check_endpoint(endpoint: str, source: str = "the cache endpoint") -> None:
    """A URI gRPC can dial, or a ValueError naming ``source`` (the argument, or the variable it
    came from) and what is wrong with it."""
    if isinstance(endpoint, str) and endpoint and endpoint != endpoint.strip():
        # A YAML or env file's stray space: gRPC would fail to parse it only when dialling.
        raise ValueError(f"{source} has spaces around it (a copied value?), got {endpoint!r}")
    if not isinstance(endpoint, str) or "://" not in endpoint or endpoint.partition("://")[0] not in ENDPOINT_SCHEMES:
        raise ValueError(
            f"{source} should be a grpc://, grpc+tls://, grpc+tcp:// or grpc+unix:// URI (grpc://host:50051), "
            f"got {endpoint!r}"
        )
    if endpoint.startswith("grpc+unix://"):
        return
    scheme, _, rest = endpoint.partition("://")
    authority = rest.rpartition("@")[2].split("/")[0]
    if authority.startswith("[") and "]" not in authority:
        raise ValueError(f"{source} opens a [ it does not close (grpc://[fd00::5]:50051), got {endpoint!r}")
    if not authority.startswith("[") and authority.count(":") > 1:
        # An IPv6 address without its brackets read as a host and a bad port, and was refused as such.
        address, _, last = authority.rpartition(":")
        for host, port in ((authority, str(constants.FLIGHT_PORT)), (address, last)):
            if _is_ipv6(host):
                raise ValueError(
                    f"{source} holds an IPv6 address without its brackets: write {scheme}://[{host}]:{port}, "
                    f"got {endpoint!r}"
                )
        raise ValueError(f"{source} has more than one ':' after its host (grpc://host:50051), got {endpoint!r}")
    if not uri_port(endpoint):
        named = authority.rpartition(":")[2]
        if named.isdigit():
            raise ValueError(f"{source} names port {named}, outside 1 to 65535, got {endpoint!r}")
        # Without one, gRPC would quietly dial port 443.
        raise ValueError(f"{source} should name its port (grpc://host:50051), got {endpoint!r}")
    try:
        flight.Location(endpoint)  # Arrow's own parse: a space or a stray % failed only at the first batch
    except pa.ArrowInvalid as err:
        raise ValueError(f"{source} is not a URI Flight can dial ({first_line(err)}), got {endpoint!r}") from None


def check_root_certs(pem: bytes) -> None:
    """PEM certificates, or a ValueError naming the argument (gRPC would only log that it could
    not load them, then fail every call with "empty address list")."""
    try:
        raw = bytes(pem) if isinstance(pem, (bytes, bytearray, memoryview)) else pem.encode()
        # Only the certificates: bundles carry comments (not always ASCII) between them.
        blocks = re.findall(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", raw, re.DOTALL)
        if not blocks:
            raise ValueError("no -----BEGIN CERTIFICATE----- block")
        ssl.create_default_context(cadata=b"\n".join(blocks).decode("ascii"))
    except (ssl.SSLError, ValueError, TypeError, AttributeError) as err:
        raise ValueError(
            f"tls_root_certs should be PEM certificates (-----BEGIN CERTIFICATE----- ...), as bytes or str: {err}"
        ) from None


def check_server_name(name: object, source: str = "tls_server_name") -> None:
    """None or a DNS name, or a ValueError naming the argument."""
    problem = server_name_problem(name, source)
    if problem:
        raise ValueError(problem)


def _backoff(delay: float, deadline: float | None) -> float:
    """The pause before the next try: ``delay`` with jitter (many workers that failed together
    must not retry in lockstep), cut short so that the last try falls at the deadline itself."""
    pause = delay * random.uniform(0.8, 1.2)
    return pause if deadline is None else max(0.0, min(pause, deadline - time.monotonic()))


class _RetryNotice:
    """One retried call's WARNING lines (RETRY_WARN_AFTER_SECONDS, then RETRY_WARN_EVERY_SECONDS)."""

    def __init__(self) -> None:
        self._since: float | None = None  # when the failures being reported began
        self._next = 0.0

    def failed(self, since: float, deadline: float, what: str, location: str, reason: str) -> None:
        now = time.monotonic()
        if since != self._since:  # a new run of failures (a stream that read again in between)
            self._since, self._next = since, since + RETRY_WARN_AFTER_SECONDS
        if now < self._next:
            return
        self._next = now + RETRY_WARN_EVERY_SECONDS
        log.warning(
            "%s at %s has failed for %.0fs (%s); still retrying, giving up in %.0fs",
            what,
            location,
            now - since,
            reason,
            max(0.0, deadline - now),
        )


def check_deadline_seconds(value: Any) -> None:
    """A finite number of seconds > 0, else a ValueError: nan passed a `<= 0` check and retried
    a refused endpoint for ever ("giving up in 0s"), as inf would."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not (real and 0 < value < math.inf):
        raise ValueError(f"deadline_seconds should be a number of seconds > 0, got {value!r}")


def plaintext_with_root_certs(endpoint: str, source: str) -> str:
    """Why certificates to trust and a plaintext endpoint do not go together: they were not
    used, and the token and rows went in clear without a word."""
    return (
        f"tls_root_certs is given, but {source} {endpoint} is plaintext, where they would not be used: dial "
        f"grpc+tls://{endpoint.split('://', 1)[-1]} to read over TLS, or leave tls_root_certs out"
    )


class CacheClient:
    """A Flight client for the cache's head, with one connection per data node location."""

    def __init__(
        self,
        endpoint: str,
        token: str | None = None,
        tls_root_certs: bytes | None = None,
        deadline_seconds: float = DEFAULT_DEADLINE_SECONDS,
        generic_options: list[tuple[str, Any]] | None = None,
        tls_server_name: str | None = None,
    ) -> None:
        check_endpoint(endpoint)
        check_token(token)
        check_deadline_seconds(deadline_seconds)
        if tls_root_certs is not None:
            check_root_certs(tls_root_certs)
            if not is_tls(endpoint):
                raise ValueError(plaintext_with_root_certs(endpoint, "endpoint"))
        check_server_name(tls_server_name)
        self.endpoint = endpoint
        self.deadline_seconds = float(deadline_seconds)
        self._token = token
        self._tls_root_certs = tls_root_certs
        # Checked in every node's certificate instead of the address dialled: a cache made by the
        # initializer advertises pod IPs, which no certificate made in advance can carry.
        self._tls_server_name = tls_server_name
        self._generic_options = generic_options  # gRPC channel arguments, for tuning
        self._headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        self._clients: dict[str, _Connection] = {}
        # Connections close() let go of, not closed yet (calls still used them). Each is closed
        # by whoever takes it out of this set: a release nested in another (a read finalized by
        # the garbage collector) closes it once, however the two interleave.
        self._retired: set[_Connection] = set()
        # Reentrant: a read's generator finalized by the garbage collector releases its
        # connection (taking this lock) in whatever code the collection ran, this lock held too.
        self._lock = threading.RLock()
        # At most half the deadline: a stalled read is cancelled and retried within it (at the
        # full deadline, the first stall used it all up and was never retried).
        self._stall_watch = StallWatch(min(self.deadline_seconds / 2, STREAM_STALL_SECONDS))
        self._head_answered = False  # a head that answered once is at the right address
        self._generation: str | None = None  # the load the last FlightInfo's tickets came from
        tune_glibc_malloc()  # once per process: received batches reuse buffers (allocator.py)

    @property
    def head_answered(self) -> bool:
        """Whether the head answered at this endpoint, so the address is right: an error then
        says the head stopped answering, not that the endpoint may be wrong."""
        return self._head_answered

    def remember_head_answered(self) -> None:
        """The head answered this endpoint before, in another client of the same reader (a
        DataLoader worker of an earlier epoch)."""
        self._head_answered = True

    # -- connections -------------------------------------------------------------------------

    def _acquire(self, location: str) -> _Connection:
        """The connection to ``location`` (opened where there is none), counted as in use until
        ``_release``: close() never closes one under a call or a stream (closing a FlightClient
        that another thread is calling crashed the process)."""
        if is_tls(self.endpoint) and not is_tls(location):
            # The head's answer names where to read: a plain location would carry the token and
            # the rows in clear, however the reader asked for TLS.
            raise DataCacheError(
                f"the cache at {self.endpoint} (TLS) sent data node location {location}, which is not TLS: "
                "refused, so the token and rows are not sent in clear. Every pod of the cache must serve TLS: "
                "give them all the same TLS Secret (DATA_CACHE_TLS_DIR) and restart the cache"
            )
        with self._lock:  # endpoint streams open connections from their readahead threads
            connection = self._clients.get(location)
            if connection is None:
                fork_guard.check_usable()  # a forked child: fail with the fix rather than hang
                fork_guard.opening()
                # A node back at its address after a long outage is reconnected within seconds.
                kwargs: dict[str, Any] = {"generic_options": channel_options(self._generic_options)}
                if self._tls_root_certs is not None:
                    kwargs["tls_root_certs"] = self._tls_root_certs
                if self._tls_server_name is not None:
                    kwargs["override_hostname"] = self._tls_server_name
                client = flight.FlightClient(location, **kwargs)
                connection = self._clients[location] = _Connection(client)
                fork_guard.opened(self, client)
            connection.users += 1
            return connection

    def _release(self, connection: _Connection) -> None:
        with self._lock:
            connection.users -= 1
            if not connection.users and connection in self._retired:
                self._close_retired(connection)  # its last user, after close()

    def _close_retired(self, connection: _Connection) -> None:
        try:
            self._retired.remove(connection)
        except KeyError:  # closed already, by a release nested in this one's caller
            return
        connection.client.close()
        fork_guard.released()
        if not self._clients and not self._retired:
            fork_guard.closed(self)

    @contextmanager
    def _connection(self, location: str) -> Iterator[flight.FlightClient]:
        """The FlightClient for ``location``, in use (never closed under it) within the block."""
        connection = self._acquire(location)
        try:
            yield connection.client
        finally:
            self._release(connection)

    def _options(self, timeout: float | None) -> flight.FlightCallOptions:
        return flight.FlightCallOptions(timeout=timeout, headers=self._headers)

    def close(self) -> None:
        """Close every connection; a later call opens new ones. A connection a call or a stream
        of another thread uses is closed when that ends (that call is not cut short)."""
        with self._lock:
            connections = list(self._clients.values())
            self._clients.clear()
            if connections:
                # Its channels shut down from now on, even where something (a kept exception's
                # traceback) holds a FlightClient past this close.
                fork_guard.released()
            self._retired.update(connections)
            for connection in connections:
                if not connection.users:
                    self._close_retired(connection)
            in_use = bool(self._retired)
            if in_use:
                # Its last calls and streams end within moments (a read's threads stop at their
                # next step): a fork meanwhile waits for them (fork_guard.closing).
                fork_guard.closing(self)
            else:
                fork_guard.closed(self)
        if not in_use:
            # Reads still going keep their stall watch: it ends its thread once they are done.
            self._stall_watch.close()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- errors and retries ------------------------------------------------------------------

    def _translate(self, err: Exception, location: str, what: str) -> Exception:
        """Turn a non-transient Flight error into one of the cache's errors, naming the fix."""
        reason = server_message(err)
        if isinstance(err, _AUTH):
            sent = "no token was sent" if self._token is None else "the token was rejected"
            # The cache's own refusal names the variables too: said once, with the token argument.
            said = "" if reason.startswith("missing or wrong bearer token") else f": {reason}"
            return CacheAuthError(f"the cache at {location} refused the token on {what} ({sent}{said}); {TOKEN_HINT}")
        if isinstance(err, flight.FlightInternalError) and getattr(err, "extra_info", None) == LOAD_FAILED_INFO:
            return NotReadyError(f"{what} failed at {location}: {reason}")
        if isinstance(err, flight.FlightInternalError | flight.FlightServerError):
            # A failure inside the cache (a data node's stream that broke on its side): its own
            # words, without the Python traceback a FlightServerError carries (in the node's log).
            return DataCacheError(f"{what} failed at {location}: {reason}")
        if isinstance(err, pa.ArrowInvalid):
            return BadRequestError(f"{what} rejected by {location}: {reason}")
        if isinstance(err, pa.ArrowNotImplementedError):  # a data node's address given for the head's, say
            return BadRequestError(f"{what} is not served by {location}: {reason}")
        return err

    def _unavailable(self, err: BaseException, location: str, what: str, waited: float) -> CacheUnavailableError:
        reason = server_message(err)
        if location == self.endpoint and answered_not_ready(err):
            return CacheUnavailableError(
                f"the data cache at {location} was still not ready after {waited:.0f}s ({what}): {reason}; "
                "a larger deadline_seconds waits longer"
            )
        if location == self.endpoint and self._head_answered:
            # The address is right (it answered before): the head itself stopped answering, and
            # the endpoint hint would send the reader astray. (A timeout alone proves nothing: a
            # connection to a wrong address that drops packets times out too.)
            return CacheUnavailableError(
                f"the data cache's head at {location} stopped answering ({what}, {waited:.0f}s): {reason}; check "
                "the head (in Kubernetes, the cache's leader pod: its status, events and log)"
            )
        if location == self.endpoint:
            hint, host = ENDPOINT_HINT, urlsplit(location).hostname or ""
            if host.endswith(constants.JOB_CACHE_SERVICE_SUFFIX):
                # Made from TRAIN_JOB_NAME (or named like it): the variable to set is not the likely fix.
                hint = (
                    f"the Service {host} is the one the cache initializer makes for a TrainJob: check that the "
                    "TrainJob uses the torch-distributed-with-cache runtime and that its dataset initializer "
                    f"succeeded (kubectl get service {host}); or {hint}"
                )
            return CacheUnavailableError(
                f"could not reach the data cache at {location} for {what} within {waited:.0f}s: {reason}; {hint}"
            )
        return CacheUnavailableError(
            f"data node {location} stayed unavailable for {waited:.0f}s during {what}: {reason}; check that data "
            "node (in Kubernetes, the cache's worker pod with that address: its status, events and log) and the "
            "head's /status"
        )

    def _refuse_if_tls(self, location: str, what: str, deadline: float) -> None:
        """A plaintext call to a cache that serves TLS fails as "Socket closed", like a cache
        still starting: it was retried to the deadline (120 s by default). Where the address
        completes a TLS handshake, say so at once."""
        budget = min(TLS_PROBE_SECONDS, deadline - time.monotonic())
        if budget > 0 and speaks_tls(location, timeout=budget):
            raise CacheUnavailableError(
                f"the cache at {location} serves TLS, and {what} was sent in plaintext: use its grpc+tls:// "
                "address with the certificate authority that signed its certificate as tls_root_certs (in a "
                "trainer, DATA_CACHE_ENDPOINT=grpc+tls://... and DATA_CACHE_TLS_DIR)"
            )

    def _retry(self, location: str, what: str, call: Callable[[float], T]) -> T:
        """Run ``call(timeout)`` until it succeeds, retrying transient errors until the deadline."""
        start = time.monotonic()
        deadline = start + self.deadline_seconds
        delay = BACKOFF_INITIAL_SECONDS
        notice = _RetryNotice()
        tls_asked = is_tls(location)
        while True:
            # The last try starts at the deadline: give it a moment (a timeout of 0 would be none).
            remaining = max(deadline - time.monotonic(), MIN_CALL_SECONDS)
            try:
                answer = call(remaining)
                if location == self.endpoint:
                    self._head_answered = True
                return answer
            except _TRANSIENT as err:
                if "wrong version number" in str(err).lower():
                    raise CacheUnavailableError(
                        f"the cache at {location} does not serve TLS ({what}: {server_message(err)}): use a "
                        "grpc:// endpoint (a trainer whose DATA_CACHE_TLS_DIR holds a certificate dials grpc+tls://; "
                        "a cache started before its namespace's TLS Secret existed serves plaintext until it is "
                        "made again)"
                    ) from err
                if TLS_NAME_MISMATCH in str(err):
                    raise CacheUnavailableError(
                        f"the TLS handshake with the cache at {location} failed for {what}: {server_message(err)}; "
                        "where the cache's certificate names none of its addresses, pass a name it carries as "
                        "tls_server_name (DATA_CACHE_TLS_SERVER_NAME in a trainer; data-cache for a cache made "
                        "by the initializer)"
                    ) from err
                if CERTIFICATE_EXPIRED in str(err):  # the certificate authority is right: no other will do
                    raise CacheUnavailableError(
                        f"the TLS handshake with the cache at {location} failed for {what}: {server_message(err)}; "
                        "the cache's certificate has expired: renew it (on Kubernetes, its TLS Secret) and start "
                        "the cache again"
                    ) from err
                if any(marker in str(err) for marker in TLS_FAILURES):
                    raise CacheUnavailableError(
                        f"the TLS handshake with the cache at {location} failed for {what}: {server_message(err)}; "
                        "pass the certificate authority that signed the cache's certificate (for a self-signed "
                        "one, the certificate itself) as tls_root_certs (DATA_CACHE_TLS_DIR in a trainer)"
                    ) from err
                if not tls_asked:
                    tls_asked = True  # once per call: the failure path only, a healthy read never asks
                    self._refuse_if_tls(location, what, deadline)
                if NOT_GRPC in str(err):  # after the TLS probe: a TLS server's answer does not parse either
                    hint = ENDPOINT_HINT if location == self.endpoint else "the head was told a wrong data node port"
                    raise CacheUnavailableError(
                        f"something answers at {location}, but not gRPC ({what}: {server_message(err)}): an HTTP "
                        f"server, such as a cache's health port ({constants.HEALTH_PORT}; Flight is on "
                        f"{constants.FLIGHT_PORT}); {hint}"
                    ) from err
                if time.monotonic() >= deadline:
                    raise self._unavailable(err, location, what, time.monotonic() - start) from err
                reason = server_message(err)
                log.info("%s at %s: %s; retrying in %.2fs", what, location, reason, delay)
                notice.failed(start, deadline, what, location, reason)
            except (flight.FlightError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
                raise self._translate(err, location, what) from err
            time.sleep(_backoff(delay, deadline))
            delay = min(delay * 2, BACKOFF_MAX_SECONDS)

    # -- calls -------------------------------------------------------------------------------

    def get_flight_info(self, request: ShardRequest, interruptible: bool = False) -> flight.FlightInfo:
        """Ask the head where shard ``request.shard`` of ``request.num_shards`` lives
        (``interruptible``: as read_shard's)."""
        descriptor = flight.FlightDescriptor.for_command(request.to_json())

        def ask(remaining: float) -> flight.FlightInfo:
            # The connection is taken for each try: one close() let go of meanwhile is opened again.
            with self._connection(self.endpoint) as head:
                return head.get_flight_info(descriptor, self._options(min(remaining, UNARY_TIMEOUT_SECONDS)))

        def call(remaining: float) -> flight.FlightInfo:
            if not interruptible:
                return ask(remaining)
            # Left behind on a signal: it ends at its own timeout.
            asking = DaemonCall(lambda: ask(remaining), "cache-get-flight-info")
            while not asking.wait(SIGNAL_POLL_SECONDS):
                pass
            return asking.result()

        info = self._retry(self.endpoint, "GetFlightInfo", call)
        self._forget_replaced_nodes(info)
        return info

    def _forget_replaced_nodes(self, info: flight.FlightInfo) -> None:
        """On the first FlightInfo of a new load (the cache restarted or reloaded: its tickets
        carry another generation), close the unused connections to data-node locations it does
        not name. Kept, every restart of a cache whose pods came back at new addresses left its
        old nodes' connections open for the client's life (two more per restart, a review saw)."""
        named = {location.uri.decode() for endpoint in info.endpoints for location in endpoint.locations}
        try:
            generation = Ticket.from_json(info.endpoints[0].ticket.ticket).generation if info.endpoints else None
        except BadRequestError:  # not this cache's ticket: nothing to compare
            return
        with self._lock:
            if generation is None or generation == self._generation:
                return
            replaced = self._generation is not None
            self._generation = generation
            if not replaced:
                return
            for location, connection in list(self._clients.items()):
                if location != self.endpoint and location not in named and not connection.users:
                    del self._clients[location]
                    self._retired.add(connection)
                    self._close_retired(connection)

    def status(self, location: str | None = None) -> dict[str, Any]:
        """The ``status`` action of the head (or of the node at ``location``) as a dict."""
        location = location or self.endpoint

        def call(remaining: float) -> dict[str, Any]:
            with self._connection(location) as client:
                results = client.do_action(
                    flight.Action(ACTION_STATUS, b""), self._options(min(remaining, UNARY_TIMEOUT_SECONDS))
                )
                body = b"".join(r.body.to_pybytes() for r in results)
            return json.loads(body) if body else {}

        return self._retry(location, "status", call)

    def read_shard(
        self,
        request: ShardRequest,
        interleave: bool | None = None,
        start: int = 0,
        check_streams: Callable[[list[int | None], int], None] | None = None,
        check_info: Callable[[flight.FlightInfo], None] | None = None,
        interruptible: bool = False,
    ) -> Iterator[pa.RecordBatch]:
        """Every record batch of one shard, from all of its data nodes; with ``start``, all but
        the first ``start`` rows (a resumed read).

        ``interleave`` (None: as the request is shuffled, so an unshuffled shard comes in table
        order, and a shuffled one fully mixed). With it the endpoints' streams are interleaved in units of exactly
        ``request.block_size`` rows, the unit the shuffle permutes, each stream's units spread
        evenly over the read by its length (interleave.py), so consecutive blocks come from
        different nodes as they would in the shuffled order. The unit does not depend on how a node
        cuts its batches, so the order is the same on every read (resume relies on that). Without
        ``interleave`` the streams are read one after the other (table order when unshuffled).
        Either way, with several endpoints every stream is open at once, each read up to
        STREAM_READAHEAD_BATCHES ahead in its own thread, so all the shard's data nodes send
        while the caller converts.

        A resumed read asks each data node to leave out the rows already handed out, so they
        are not sent again; a cache whose tickets do not say how many rows each stream holds
        (an older version) sends them, and they are dropped here as they arrive.

        ``check_streams`` is called with each stream's row count (None where the cache does not
        say) and the order the nodes stream a shuffled shard in (protocol.ORDER_VERSION; 1 for a
        cache that does not say) before any stream opens; it may raise to refuse the read, as may
        ``check_info``, called with the head's FlightInfo first.

        ``interruptible``: every call that can block (GetFlightInfo, a stream's next batch) runs
        in another thread, and this one waits for it in Python, where a signal (Ctrl-C's
        KeyboardInterrupt, a handler that saves a checkpoint) is handled at once. Blocked in a
        Flight call instead, it is handled once the call returns: a frozen head's GetFlightInfo
        at its 30 s timeout, a frozen data node's stream when the stall watch gives up on it.
        """
        start = _row_count(start)
        if interleave is None:
            interleave = request.shuffle
        info = self.get_flight_info(request, interruptible)
        if check_info is not None:
            check_info(info)
        if start > info.total_records:
            raise BadRequestError(
                f"cannot resume {start} rows into a shard of {info.total_records} rows: the saved position "
                "is from another table or other settings"
            )
        endpoints = list(info.endpoints)
        table = info_table(info.app_metadata)  # what the rows are counted in, for a node's new ticket
        lengths = [ticket_rows(e.ticket.ticket) for e in endpoints]
        if check_streams is not None:
            check_streams(lengths, max((ticket_order(e.ticket.ticket) for e in endpoints), default=1))
        nodes_skip = None not in lengths
        served = start if nodes_skip else 0
        if not served:
            point = ResumePoint((0,) * len(endpoints))
        elif interleave:
            point = resume_point(lengths, request.block_size, served)
        else:
            point = sequential_point(lengths, served)
        # Set when this read ends: a stream's thread retrying a node (or waiting out its backoff)
        # stops at once, where it went on retrying for the rest of its deadline, reconnecting a
        # client its owner had closed.
        stop = threading.Event()
        streams: list[Iterator[pa.RecordBatch]] = [
            self.read_endpoint(request, e, skip, stop, table=table)
            for e, skip in zip(endpoints, point.skips, strict=True)
        ]
        # One stream alone has nothing to overlap with, and the thread hop costs ~10% of a bare
        # DoGet's rate; read in this thread, though, a stream waiting on a frozen node holds a
        # signal (Ctrl-C) until the stall watch gives up on it (up to a minute): ``interruptible``.
        if len(streams) > 1 or interruptible:
            streams = [Readahead(s, STREAM_READAHEAD_BATCHES, f"cache-stream-{i}") for i, s in enumerate(streams)]
        try:
            # One stream has nothing to interleave with: its rows in order are the interleaved
            # order, and cutting it into block_size slices only cost time (1-row blocks: ~24x).
            if interleave and len(streams) > 1:
                batches = interleave_streams(streams, lengths if nodes_skip else None, request.block_size, point)
            else:
                batches = (batch for stream in streams for batch in stream)
            yield from batches if nodes_skip else drop_rows(batches, start)
        finally:
            stop.set()
            for stream in streams:
                stream.close()  # a generator or a Readahead: both stop their stream

    def read_endpoint(
        self,
        request: ShardRequest,
        endpoint: flight.FlightEndpoint,
        start: int = 0,
        stop: threading.Event | None = None,
        table: SnapshotRows | None = None,
    ) -> Iterator[pa.RecordBatch]:
        """One endpoint of ``get_flight_info(request)``, read in this thread: its batches (all
        but the first ``start`` rows); a broken stream is reopened after the rows already seen.
        ``table``: the snapshot and matching rows that FlightInfo said (protocol.info_table), which
        a new ticket for the node must come with.

        The same ticket yields the same rows in the same order, so the node is asked to leave
        out the rows received (an older cache sends them and they are dropped here): nothing is
        repeated or lost. A data node that restarted (and reloaded the same table) rejects the
        old ticket as stale: the head is asked for a fresh one. A stream that ends short of the
        rows its ticket promises, or goes past them, is an error, not another shard. ``stop``,
        once set, ends the retries at their next pause (read_shard sets it when its read ends).
        """
        if stop is None:
            stop = threading.Event()  # never set: retries end only at the deadline
        received = _row_count(start)  # rows of the stream before the next one to yield
        if received and ticket_rows(endpoint.ticket.ticket) == received:
            return  # a resumed read that had all of this stream: nothing to ask for
        failing_since: float | None = None
        delay = BACKOFF_INITIAL_SECONDS
        notice = _RetryNotice()
        replans = 0
        head_trouble = ""  # why the head did not say where the node is now, at the last try
        while True:
            location = endpoint.locations[0].uri.decode() if endpoint.locations else self.endpoint
            rows = ticket_rows(endpoint.ticket.ticket)
            if rows is not None:  # the node leaves out what this stream already gave
                wire, skip = flight.Ticket(with_skip(endpoint.ticket.ticket, received)), 0
            else:
                wire, skip = endpoint.ticket, received
            reader = None
            connection = None
            try:
                until = failing_since + self.deadline_seconds if failing_since is not None else None
                connection = self._acquire(location)  # in use while the stream is read
                reader = self._open_stream(connection, location, wire, self._wait_limit(until))
                for batch in drop_rows(self._batches(reader, location, until), skip):
                    if batch.num_rows == 0:
                        continue
                    received += batch.num_rows
                    if rows is not None and received > rows:
                        raise self._not_whole(location, f"went past row {rows}, where its ticket ends")
                    # Progress: the retry deadline and the stale-ticket count start again (a
                    # long stream may outlive several reloads of its node, each needing a replan).
                    failing_since, delay, replans = None, BACKOFF_INITIAL_SECONDS, 0
                    yield batch
                if rows is not None and received < rows:
                    raise self._not_whole(location, f"ended at row {received} of the {rows} its ticket holds")
                self._stall_watch.forget(reader)
                reader = None  # read to the end: nothing to cancel
                return
            except _TRANSIENT as err:
                now = time.monotonic()
                if failing_since is None:  # a stall began when its wait did, not when it was noticed
                    failing_since = now - self._stall_watch.limit if isinstance(err, StreamStalledError) else now
                if now - failing_since >= self.deadline_seconds:
                    error = self._unavailable(
                        err, location, f"DoGet at row {received} of its stream", now - failing_since
                    )
                    if head_trouble:
                        error = CacheUnavailableError(
                            f"{error}; the head at {self.endpoint} did not answer either when asked where the node is "
                            f"now ({head_trouble}): check the head too"
                        )
                    raise error from err
                reason = server_message(err)
                log.info("DoGet at %s broke after %d rows: %s; retrying", location, received, reason)
                notice.failed(failing_since, failing_since + self.deadline_seconds, "DoGet", location, reason)
                # A restarted data node may listen elsewhere now; the head knows where. Asked once,
                # within what is left of the deadline: a frozen head must not hold the read past it.
                fresh, lookup = self._lookup_while_retrying(request, endpoint, location, failing_since, table)
                endpoint, head_trouble = fresh or endpoint, _head_trouble(lookup)
            except pa.ArrowInvalid as err:
                if not _is_stale(err) or replans >= MAX_REPLANS:
                    raise self._translate(err, location, "DoGet") from err
                replans += 1
                log.info(
                    "the ticket for %s is stale (%s); asking the head for a new one", location, server_message(err)
                )
                if failing_since is None:
                    endpoint = self._fresh_endpoint(request, endpoint, location, table=table)
                    continue
                # Already retrying: the lookup gets what is left of that deadline, not one of its own.
                fresh, lookup = self._lookup_while_retrying(request, endpoint, location, failing_since, table)
                if fresh is not None:
                    endpoint = fresh
                    continue
                if time.monotonic() - failing_since >= self.deadline_seconds:
                    raise self._unavailable(
                        lookup, self.endpoint, "GetFlightInfo for a stale ticket", time.monotonic() - failing_since
                    ) from lookup
                head_trouble = _head_trouble(lookup)
                replans -= 1  # no new ticket came of it: the next try asks again
            except (flight.FlightError, pa.ArrowNotImplementedError) as err:
                raise self._translate(err, location, "DoGet") from err
            finally:
                # Left early (the consumer stopped, or an error): tell the node to stop sending.
                if reader is not None:
                    with suppress(flight.FlightError, pa.ArrowException):
                        reader.cancel()
                    self._stall_watch.forget(reader)
                if connection is not None:
                    self._release(connection)
            if stop.wait(_backoff(delay, failing_since + self.deadline_seconds if failing_since is not None else None)):
                return  # the read this stream belongs to ended: nobody waits for its rows
            delay = min(delay * 2, BACKOFF_MAX_SECONDS)

    def _lookup_while_retrying(
        self,
        request: ShardRequest,
        endpoint: flight.FlightEndpoint,
        location: str,
        failing_since: float,
        table: SnapshotRows | None = None,
    ) -> tuple[flight.FlightEndpoint | None, flight.FlightError | None]:
        """The head's current endpoint for a node being retried (it may have moved or reloaded),
        asked once within what is left of the retry's deadline (a frozen head must not hold the
        read past it): (the endpoint, None), or (None, the head's error) where it did not say.
        A refusal (the token, after a rotation; the request itself) is final: raised, named as
        the head's, not retried to the deadline nor passed on as a raw pyarrow error."""
        within = failing_since + self.deadline_seconds - time.monotonic()
        try:
            return self._fresh_endpoint(request, endpoint, location, within=within, table=table), None
        except (*_AUTH, pa.ArrowInvalid, pa.ArrowNotImplementedError) as lookup:
            raise self._translate(lookup, self.endpoint, "GetFlightInfo") from lookup
        except flight.FlightError as lookup:
            return None, lookup

    def _wait_limit(self, until: float | None) -> float:
        """How long a read may wait on a node: the stall limit, or while retrying (``until``: the
        deadline), what is left of it if less (the last try waited up to STREAM_STALL_SECONDS
        past it: a deadline of 70 s gave up after 120)."""
        if until is None:
            return self._stall_watch.limit
        return max(MIN_STALL_WAIT_SECONDS, min(self._stall_watch.limit, until - time.monotonic()))

    def _open_stream(
        self, connection: _Connection, location: str, ticket: flight.Ticket, limit: float
    ) -> flight.FlightStreamReader:
        """``do_get``, given up on (StreamStalledError, retried) after ``limit`` seconds.

        do_get returns once the node has sent its first message. A frozen node never sends it,
        and a call still opening cannot be cancelled (closing the client does not end it), so it
        runs in a helper thread; one that outlasts the limit is left to end on its own and
        cancels the stream if it still gets one.
        """
        # The helper thread holds the connection in use too: abandoned, it may outlive the stream.
        with self._lock:
            connection.users += 1
        try:
            opening = _Opening(connection.client, ticket, self._options(None), lambda: self._release(connection))
        except BaseException:  # no thread to be had: nobody else will release it
            self._release(connection)
            raise
        if not opening.done.wait(limit) and opening.abandon():
            raise StreamStalledError(f"data node {location} did not start its stream within {_secs(limit)} (stalled)")
        return opening.result()

    def _not_whole(self, location: str, what: str) -> DataCacheError:
        return DataCacheError(f"data node {location}'s stream {what}; the shard would not be exact")

    def _batches(
        self, reader: flight.FlightStreamReader, location: str, until: float | None
    ) -> Iterator[pa.RecordBatch]:
        """The stream's batches; the first awaited until the retry's deadline (``until``), the
        rest for the stall limit (a node that sent a batch has answered)."""
        while (chunk := self._next_chunk(reader, location, self._wait_limit(until))) is not None:
            until = None
            yield chunk.data

    def _next_chunk(
        self, reader: flight.FlightStreamReader, location: str, limit: float
    ) -> flight.FlightStreamChunk | None:
        """The stream's next chunk (None at its end), or StreamStalledError when the node sent
        nothing for ``limit`` seconds: the caller retries it as a broken stream."""
        self._stall_watch.arm(reader, limit)
        try:
            return reader.read_chunk()
        except StopIteration:
            return None
        except (flight.FlightError, pa.ArrowException) as err:
            if self._stall_watch.stalled(reader):
                raise StreamStalledError(f"data node {location} sent nothing for {_secs(limit)} (stalled)") from err
            raise
        finally:
            self._stall_watch.disarm(reader)

    def _fresh_endpoint(
        self,
        request: ShardRequest,
        old: flight.FlightEndpoint,
        location: str,
        within: float | None = None,
        table: SnapshotRows | None = None,
    ) -> flight.FlightEndpoint:
        """The head's current endpoint for the same data node (it may have moved or reloaded).

        With ``within``, the head is asked once, for at most that many seconds (the FlightError
        is the caller's); without, with get_flight_info's retries. Resuming by row count is only
        right if the node's part is the same rows: a ticket that places them differently (the
        table changed under a restarted cache) is an error.
        """
        was = Ticket.from_json(old.ticket.ticket)
        if within is None:
            info = self.get_flight_info(request)
        else:
            descriptor = flight.FlightDescriptor.for_command(request.to_json())
            timeout = min(UNARY_TIMEOUT_SECONDS, max(MIN_CALL_SECONDS, within))
            with self._connection(self.endpoint) as head:
                info = head.get_flight_info(descriptor, self._options(timeout))
        now_table = info_table(info.app_metadata)
        if table is not None and now_table is not None and now_table != table:
            # A cache restarted on a METADATA_LOC that names the table's folder plans its newest
            # snapshot: one of as many rows (a compaction) placed the same, and the read went on
            # by row count into other rows.
            raise BadRequestError(
                f"data node {was.node} ({location}) came back holding snapshot {now_table.snapshot_id} of the "
                f"table, not {table.snapshot_id} (the cache restarted on a changed table): the rows after those "
                "read are not the rest of this epoch; start the epoch again"
            )
        for endpoint in info.endpoints:
            now = Ticket.from_json(endpoint.ticket.ticket)
            if now.node != was.node:
                continue
            same_rows = now.rows is None or was.rows is None or now.rows == was.rows  # None: another version
            if (now.offset, now.node_rows, now.total) != (was.offset, was.node_rows, was.total) or not same_rows:
                break
            if request.shuffle and (now.order or 1) != (was.order or 1):
                # A cache of another version: the rows it sends after the same count are others.
                raise BadRequestError(
                    f"data node {was.node} ({location}) came back streaming this shard in shuffled order "
                    f"{now.order or 1}, not {was.order or 1} (a cache of another version); start the epoch again"
                )
            return endpoint
        raise BadRequestError(
            f"data node {was.node} ({location}) reloaded with other rows for this shard (the cache restarted with "
            "another number of data nodes, or on a changed table): resume from the last state_dict(), which an "
            "in-order read can on another node count, or start the epoch again"
        )


class _Connection:
    """A FlightClient and the calls and streams using it (CacheClient._acquire)."""

    def __init__(self, client: flight.FlightClient) -> None:
        self.client = client
        self.users = 0


class _Opening:
    """One do_get in a helper thread, which the caller may stop waiting for."""

    def __init__(
        self,
        client: flight.FlightClient,
        ticket: flight.Ticket,
        options: flight.FlightCallOptions,
        finished: Callable[[], None] = lambda: None,
    ):
        self._finished = finished  # called once the do_get returned, whoever waits for it
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._abandoned = False
        self._reader: flight.FlightStreamReader | None = None
        self._error: BaseException | None = None
        threading.Thread(target=self._open, args=(client, ticket, options), name="cache-do-get", daemon=True).start()

    def _open(self, client: flight.FlightClient, ticket: flight.Ticket, options: flight.FlightCallOptions) -> None:
        try:
            reader = client.do_get(ticket, options)
        except BaseException as err:  # handed to the caller, which raises it
            self._error = err
        else:
            with self._lock:
                if self._abandoned:  # nobody will read it: tell the node to stop
                    with suppress(flight.FlightError, pa.ArrowException):
                        reader.cancel()
                    return
                self._reader = reader
        finally:
            self.done.set()
            self._finished()

    def abandon(self) -> bool:
        """Stop waiting; False when the stream opened meanwhile (the caller takes it after all)."""
        with self._lock:
            if self._reader is not None or self.done.is_set():
                return False
            self._abandoned = True
            return True

    def result(self) -> flight.FlightStreamReader:
        if self._error is not None:
            raise self._error
        assert self._reader is not None  # done, without an error
        return self._reader


class KeptClient:
    """One CacheClient kept by its owner (a DataCacheDataset) from one read to the next.

    A new client per epoch opens a new connection to the head and to every data node, and a fresh
    connection is slow to start: on loopback that was about a third of an unshuffled 2M-row
    epoch's transfer time (docs/dataset.md). The kept client is shared by the owner's concurrent
    reads; one that no read uses is closed before this process forks (fork_guard.py). A forked
    child never uses or closes its parent's client: it makes its own. Pickling (spawn and
    forkserver DataLoader workers) drops the client.
    """

    def __init__(self, idle_seconds: float = KEPT_CLIENT_IDLE_SECONDS) -> None:
        self._lock = threading.Lock()
        self._client: CacheClient | None = None
        self._settings: tuple[Any, ...] | None = None
        self._reads = 0
        self._idle_seconds = idle_seconds
        self._last_used = time.monotonic()
        fork_guard.keep(self)

    @contextmanager
    def lease(
        self,
        endpoint: str,
        token: str | None,
        tls_root_certs: bytes | None,
        deadline_seconds: float,
        tls_server_name: str | None = None,
    ) -> Iterator[CacheClient]:
        """The kept client for these settings (a new one when they changed), for one read."""
        settings = (endpoint, token, tls_root_certs, deadline_seconds, tls_server_name)

        def connect() -> CacheClient:
            return CacheClient(endpoint, token, tls_root_certs, deadline_seconds, tls_server_name=tls_server_name)

        with self._lock:
            if self._settings != settings and not self._reads:
                if self._client is not None:
                    self._client.close()
                self._client, self._settings = connect(), settings
            elif not self._reads and time.monotonic() - self._last_used > self._idle_seconds:
                self._client.close()  # long idle: reconnect rather than trust an old connection
            kept = self._settings == settings
            if kept:
                client = self._client
                self._reads += 1
        if not kept:  # the settings changed while another read uses the kept client
            with connect() as client:
                yield client
            return
        try:
            yield client
        finally:
            with self._lock:
                self._reads -= 1
                self._last_used = time.monotonic()

    def close_if_idle(self) -> None:
        # Never block a fork: a keeper busy in another thread keeps its client (a child that
        # then tries gRPC gets ForkedConnectionError, not a hang).
        if not self._lock.acquire(blocking=False):
            return
        try:
            if not self._reads and self._client is not None:
                self._client.close()  # a closed CacheClient reconnects on its next call
        finally:
            self._lock.release()

    def forked(self) -> None:
        """In a forked child: forget the parent's client (kept referenced, never closed here:
        its destructor would touch the parent's gRPC channels) and any lock a parent thread held."""
        if self._client is not None:
            _INHERITED.append(self._client)
        self._lock = threading.Lock()
        self._client, self._settings, self._reads = None, None, 0

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
            self._client, self._settings = None, None

    def __getstate__(self) -> dict[str, Any]:
        return {"idle_seconds": self._idle_seconds}  # never the client: it is this process's

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["idle_seconds"])


# Clients a forked child inherited: kept referenced so that the child never runs their
# destructors on its parent's gRPC channels.
_INHERITED: list[CacheClient] = []


def _head_trouble(lookup: flight.FlightError | None) -> str:
    """Why the head did not say where a node is now, for the error at the deadline; "" where
    it answered (degraded: this very node is down), which is not trouble of the head's."""
    return "" if lookup is None or answered_not_ready(lookup) else server_message(lookup)


def _secs(seconds: float) -> str:
    """A wait as a reader reads it: whole seconds, tenths under ten (a last try's 0.5 s wait
    read "sent nothing for 0s")."""
    return f"{seconds:.0f}s" if seconds >= 10 else f"{seconds:.1f}s"


def _is_stale(err: BaseException) -> bool:
    reason = server_message(err).lower()
    return "stale ticket" in reason


def _row_count(value: object) -> int:
    count = int_arg(value)
    if count is None or count < 0:
        raise ValueError(f"start should be a row count >= 0, got {value!r}")
    return count


def drop_rows(record_batches: Iterator[pa.RecordBatch], skip: int) -> Iterator[pa.RecordBatch]:
    """The batches without their first ``skip`` rows."""
    for rb in record_batches:
        if skip >= rb.num_rows:
            skip -= rb.num_rows
            continue
        if skip:
            rb, skip = rb.slice(skip), 0
        yield rb
