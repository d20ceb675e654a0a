"""Bearer-token auth and TLS for every Flight call; secrets never reach the logs."""

from __future__ import annotations

import hmac
import logging
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow.flight as flight

from kubeflow_data_cache.errors import ConfigError

log = logging.getLogger(__name__)

AUTH_HEADER = "authorization"
CLUSTER_KEY_ENV = "DATA_CACHE_CLUSTER_KEY"
# A folder where a kubernetes.io/tls Secret may be mounted (an optional Secret volume: its files
# when the Secret exists, an empty folder when not), and the name every Flight client checks in
# the cache's certificate instead of the address it dials (pod IPs no certificate made in advance
# can name).
TLS_DIR_ENV = "DATA_CACHE_TLS_DIR"
TLS_SERVER_NAME_ENV = "DATA_CACHE_TLS_SERVER_NAME"
# That Secret's files: `kubectl create secret tls` writes the first two, cert-manager adds ca.crt.
TLS_SECRET_CERT, TLS_SECRET_KEY, TLS_SECRET_CA = "tls.crt", "tls.key", "ca.crt"
_SERVER_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?")


TLS_SCHEME = "grpc+tls"
# gRPC's words where a peer's certificate does not verify, and where it verified but names
# neither the address dialled nor the override: no retry changes either.
CERTIFICATE_REFUSED = "certificate verify failed"
TLS_NAME_MISMATCH = "is not in peer certificate"


def is_tls(location: str) -> bool:
    """Whether a Flight location is dialed over TLS (grpc+tls://)."""
    return location.lower().startswith(f"{TLS_SCHEME}://")


def speaks_tls(location: str, timeout: float = 2.0) -> bool | None:
    """Whether the server at a Flight location completes a TLS handshake (its certificate is not
    checked: only the protocol is asked), False where it connects but does not, None where it
    does not connect, all within ``timeout``. A data node and its head dial each other with their
    own scheme, so a pod group whose TLS Secret reached only some pods failed every call in a way
    that named no TLS."""
    deadline = time.monotonic() + timeout
    parts = urlsplit(location)
    if parts.hostname is None or parts.port is None:
        return None
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as raw:
            raw.settimeout(max(deadline - time.monotonic(), 0.001))  # the handshake gets what is left
            # A bare context, made only once something answers: ``create_default_context`` reads
            # the system's CA bundle (~40 ms of CPU) for a check this question turns off, and a
            # data node asked on every failed registration, while its head was still starting.
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
            context.set_alpn_protocols(["h2"])  # as gRPC offers it
            try:
                with context.wrap_socket(raw, server_hostname=parts.hostname):
                    return True
            except (ssl.SSLError, ConnectionResetError, BrokenPipeError):  # answered, not in TLS
                return False
    except OSError:  # refused, unreachable or too slow: nothing learnt
        return None


def load_token(token: str | None, token_file: str | None) -> str | None:
    """The token from ``DATA_CACHE_TOKEN`` or the file ``DATA_CACHE_TOKEN_FILE`` (a mounted Secret).

    A token a request header cannot carry (a line break: an env value from a Secret made from a
    file that ends in a newline) is refused here, as clients refuse it: passed on, every call
    between head and nodes failed on its header and the cache never formed.
    """
    if token is not None:
        # Checked first: an empty one beside a file is as much a mistake as an empty one alone.
        token = _checked_secret(
            token, "DATA_CACHE_TOKEN", "put the cache's token in it, or unset it to run without one"
        )
        if token_file is not None:
            raise ConfigError("set either DATA_CACHE_TOKEN or DATA_CACHE_TOKEN_FILE, not both")
        return token
    if token_file is not None:
        return read_token_file(token_file)
    return None


def read_token_file(token_file: str) -> str:
    """The token in ``DATA_CACHE_TOKEN_FILE`` (a mounted Secret), stripped of surrounding
    whitespace; a ConfigError naming the fix where the setting, the file or its token is not one
    (the cache and its readers alike)."""
    if not token_file.strip():
        # Set from a manifest whose value went missing: without a word, auth would be off.
        raise ConfigError(
            "DATA_CACHE_TOKEN_FILE is set but empty: give the path of the mounted token file, or unset it "
            "to run without a token"
        )
    source = f"DATA_CACHE_TOKEN_FILE {token_file!r}"
    try:
        token = Path(token_file).read_text().strip()
    except OSError as err:
        raise ConfigError(f"cannot read {source}: {err.strerror}") from None
    except UnicodeDecodeError:
        # Not the decoder's message: it quotes a byte of the secret and where it sits.
        raise ConfigError(f"{source} is not text: a token is printable ASCII") from None
    if not token:
        raise ConfigError(f"{source} is empty: mount the Secret holding the cache's token")
    return checked_token(token, source)


def load_cluster_key(key: str | None) -> str | None:
    """``DATA_CACHE_CLUSTER_KEY``: the secret the head and its data nodes show each other.

    A data node's ``register`` (to the head) and the head's ``load`` (to a data node) change
    what the cache serves, so where a key is set they carry it and are refused without it; so
    does the head's ``count``, which runs a reader's filter on a node once for all its readers.
    Readers never need it: the reader token (DATA_CACHE_TOKEN) alone no longer lets a trainer, or
    any pod that can reach the port, register a data node of its own or make one load another
    table. The head also signs its tickets with it, and data nodes serve no other
    (protocol.check_ticket_signature).
    """
    if key is None:
        return None
    return _checked_secret(key, CLUSTER_KEY_ENV, "give the head and every data node the same key, or unset it on all")


def _checked_secret(value: str, source: str, fix: str) -> str:
    """A secret as set: refused when empty (set from a Secret key that is there but empty, it
    would turn auth off without a word), or where check_token refuses it."""
    if not value.strip():
        raise ConfigError(f"{source} is set but empty: {fix}")
    return checked_token(value, source)


def checked_token(value: str, source: str) -> str:
    """``value`` where check_token takes it (a line break, or a space at either end, it
    refuses); a ConfigError naming ``source`` otherwise: a setting, not an argument."""
    try:
        check_token(value, source)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return value


def key_matches(expected: str | None, given: object) -> bool:
    """Whether an action body's ``cluster_key`` is the expected one (anything, where none is set)."""
    if expected is None:
        return True
    if not isinstance(given, str):
        return False
    # A lone surrogate (JSON allows "\ud800") cannot be encoded: a wrong key, not a server error.
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode())


# A call refused for its cluster key (or a ticket for its signature) is warned of at most this
# often: any holder of the reader token can send `register`, `load`, `count` or a forged ticket in
# a loop, and each refusal was a warning line.
# The refusals between two warnings are counted in the second (and in data_cache_errors_total).
REFUSAL_WARN_EVERY_SECONDS = 60.0
UNKNOWN_PEER = "an unknown address"


def caller(context: object) -> str:
    """Who made a Flight call, as gRPC gives it ("ipv4:10.0.0.7:53122"): the address of the
    connection, not anything the caller says, for a refusal's log line."""
    peer = getattr(context, "peer", None)
    try:
        return str(peer()) if callable(peer) else UNKNOWN_PEER
    except Exception:  # a context whose call has ended: the refusal is still worth its line
        return UNKNOWN_PEER


class RefusalWarnings:
    """Warns of the first refusal of a spell, naming its caller; then at most once every
    ``every`` seconds, saying how many were refused since (memory.ServeMemoryGuard warns of the
    first refusal of a spell the same way). A refusal after a quiet ``every`` seconds starts a
    new spell, and is warned of at once."""

    def __init__(self, logger: logging.Logger, every: float | None = None, clock: Callable[[], float] = time.monotonic):
        self._log, self._every, self._clock = logger, every, clock
        self._lock = threading.Lock()
        self._warned_at: float | None = None
        self._unsaid = 0  # refused since the last warning, not warned of

    def refused(self, message: str, peer: str | None) -> None:
        """``peer``: the caller, where the refusing code knows it (None: not said)."""
        with self._lock:
            now = self._clock()
            # The setting read when refusing (None: REFUSAL_WARN_EVERY_SECONDS), so tests can lower it.
            every = REFUSAL_WARN_EVERY_SECONDS if self._every is None else self._every
            if self._warned_at is not None and now - self._warned_at < every:
                self._unsaid += 1
                return
            unsaid, self._unsaid, self._warned_at = self._unsaid, 0, now
        said = [f"from {peer}"] if peer else []
        said += [f"{unsaid} more refused since the last warning"] if unsaid else []
        if said:
            self._log.warning("%s (%s)", message, "; ".join(said))
        else:
            self._log.warning("%s", message)


# The longest token taken. gRPC servers refuse request metadata past 8 KiB at random (16 KiB
# always); a call's other headers (path, authority, user agent, deadline) take a few hundred
# bytes: a 7,900-character token failed a cache's loads, 8,050 let it report ready and then
# failed every reader. A signed JWT with a few claims is 1-2 KB.
MAX_TOKEN_CHARS = 6144


def check_token(token: object, source: str = "token") -> None:
    """None (send no token) or a token a bearer header can carry; a ValueError naming where it
    came from (``source``) otherwise. The value is never shown: it is a secret."""
    if token is None:
        return
    if not isinstance(token, str):
        raise ValueError(f"{source} should be the cache's token as a string, or None; got a {type(token).__name__}")
    if not token:
        raise ValueError(
            f"{source} is empty: pass the cache's token, or None (DataCacheDataset then reads DATA_CACHE_TOKEN / "
            "DATA_CACHE_TOKEN_FILE; CacheClient sends none)"
        )
    if not all(" " <= char <= "~" for char in token):
        # gRPC refuses such a header only when the call is made, with a message about metadata.
        raise ValueError(
            f"{source} holds a line break, a control or a non-ASCII character, which a request header cannot "
            "carry: check how it was set (a trailing newline, say)"
        )
    if token.strip() != token:
        # A copy-paste slip: no peer's copy matches it, and "the token was rejected" would not say why.
        raise ValueError(f"{source} starts or ends with a space: remove it")
    if len(token) > MAX_TOKEN_CHARS:
        raise ValueError(
            f"{source} is {len(token)} characters long, more than {MAX_TOKEN_CHARS}: gRPC refuses a call whose "
            "headers pass 8 KiB (at random from there, always past 16 KiB), and the token travels in one; "
            "use a shorter token"
        )


def call_options(token: str | None, timeout: float | None = None) -> flight.FlightCallOptions:
    headers = [(AUTH_HEADER.encode(), f"Bearer {token}".encode())] if token else []
    return flight.FlightCallOptions(headers=headers, timeout=timeout)


class TokenAuthFactory(flight.ServerMiddlewareFactory):
    """Refuses any call whose ``authorization`` header is not ``Bearer <token>``."""

    def __init__(self, token: str, on_refused: Callable[[str], None] | None = None):
        self._expected = token.encode()
        # Refused calls never reach the handlers that count errors: told here, by method name.
        self._on_refused = on_refused
        # And logged, at most once a minute: trainers refused after a token's rotation left the
        # cache's logs silent. A middleware is not told the caller's address.
        self._warnings = RefusalWarnings(log)

    def start_call(self, info, headers):
        values = headers.get(AUTH_HEADER) or headers.get(AUTH_HEADER.title()) or []
        given = values[0] if values else ""
        given = given.encode() if isinstance(given, str) else given
        # The scheme name is case-insensitive (RFC 7235): "bearer x" is as good as "Bearer x".
        scheme, _, credentials = given.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(credentials, self._expected):
            # FlightMethod.GET_FLIGHT_INFO -> "GetFlightInfo", as the handlers name themselves.
            method = "".join(part.title() for part in info.method.name.split("_"))
            if self._on_refused is not None:
                self._on_refused(method)
            # Which of the two, never the value: a client not given the token, or an old one.
            what = "a wrong bearer token" if given else "no bearer token"
            self._warnings.refused(f"refused a {method} call with {what}", None)
            raise flight.FlightUnauthenticatedError(
                "missing or wrong bearer token: pass the cache's token (DATA_CACHE_TOKEN or DATA_CACHE_TOKEN_FILE)"
            )
        return None  # accepted; nothing to keep for the rest of the call


def tls_certificates(cert_file: str | None, key_file: str | None) -> list[tuple[bytes, bytes]]:
    if not cert_file and not key_file:
        return []
    if not (cert_file and key_file):
        raise ConfigError("TLS needs both DATA_CACHE_TLS_CERT and DATA_CACHE_TLS_KEY")
    try:
        return [(Path(cert_file).read_bytes(), Path(key_file).read_bytes())]
    except OSError as err:
        raise ConfigError(f"cannot read TLS file {err.filename!r}: {err.strerror}") from None


@dataclass(frozen=True)
class TlsFolder:
    """What a TLS Secret's folder holds (None where a file is absent)."""

    cert: str | None
    key: str | None
    ca: str | None

    @property
    def empty(self) -> bool:
        return self.cert is None and self.key is None


def tls_folder(folder: str, source: str = TLS_DIR_ENV) -> TlsFolder:
    """The TLS Secret files in ``folder``. A folder that is not there is refused (a typo would
    otherwise turn TLS off); an empty one is a Secret that does not exist: no TLS."""
    path = Path(folder)
    if not path.is_dir():
        raise ConfigError(
            f"{source} {folder!r} is not a folder: point it at where the TLS Secret is mounted, or unset it"
        )
    found = [str(path / name) if (path / name).is_file() else None for name in (TLS_SECRET_CERT, TLS_SECRET_KEY)]
    ca = path / TLS_SECRET_CA
    return TlsFolder(found[0], found[1], str(ca) if ca.is_file() else None)


def server_name_problem(name: object, source: str) -> str | None:
    """Why ``name`` cannot be the name checked in the cache's certificate, or None where it can
    (None itself: check the address dialled)."""
    if name is None or (isinstance(name, str) and _SERVER_NAME.fullmatch(name)):
        return None
    return f"{source} should be the DNS name the cache's certificate carries (data-cache, say), got {name!r}"


def checked_server_name(name: str | None, source: str) -> str | None:
    """``name`` where server_name_problem finds none; a ConfigError (a setting) otherwise."""
    problem = server_name_problem(name, source)
    if problem:
        raise ConfigError(problem)
    return name


# gRPC waits longer and longer between attempts to reconnect a channel whose peer is down, up
# to 120 s: a data node or head back at the same address after a long outage went unseen by the
# channel kept for it for 30 s and more (the head stayed degraded, nodes could not register).
# Every channel to a cache process caps the wait at this.
RECONNECT_BACKOFF_MAX_MS = 2000
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS),)


def channel_options(extra: list[tuple[str, object]] | None = None) -> list[tuple[str, object]]:
    """CHANNEL_OPTIONS with ``extra`` (gRPC channel arguments) added, ``extra`` winning a key both set."""
    return list({**dict(CHANNEL_OPTIONS), **dict(extra or [])}.items())


def client_for(
    location: str, tls_root_certs: bytes | None = None, server_name: str | None = None
) -> flight.FlightClient:
    """A Flight client for a peer: over TLS (a grpc+tls:// location) trusting ``tls_root_certs``
    and, where given, checking ``server_name`` in its certificate instead of the address."""
    kwargs: dict = {"generic_options": channel_options()}
    if tls_root_certs:
        kwargs["tls_root_certs"] = tls_root_certs
    if tls_root_certs and server_name:
        kwargs["override_hostname"] = server_name
    return flight.FlightClient(location, **kwargs)
