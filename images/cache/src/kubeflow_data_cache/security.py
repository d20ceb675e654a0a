"""Bearer-token auth and TLS for every Flight call; secrets never reach the logs."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from pathlib import Path

import pyarrow.flight as flight

from kubeflow_data_cache.errors import ConfigError

AUTH_HEADER = "authorization"
CLUSTER_KEY_ENV = "DATA_CACHE_CLUSTER_KEY"


def load_token(token: str | None, token_file: str | None) -> str | None:
    """The token from ``DATA_CACHE_TOKEN`` or the file ``DATA_CACHE_TOKEN_FILE`` (a mounted Secret).

    A token a request header cannot carry (a line break: an env value from a Secret made from a
    file that ends in a newline) is refused here, as clients refuse it: passed on, every call
    between head and nodes failed on its header and the cache never formed.
    """
    if token and token_file:
        raise ConfigError("set either DATA_CACHE_TOKEN or DATA_CACHE_TOKEN_FILE, not both")
    if token_file:
        source = f"DATA_CACHE_TOKEN_FILE {token_file!r}"
        try:
            token = Path(token_file).read_text().strip()
        except OSError as err:
            raise ConfigError(f"cannot read {source}: {err.strerror}") from None
        if not token:
            raise ConfigError(f"{source} is empty")
        return checked_token(token, source)
    if token is None:
        return None
    return _checked_secret(token, "DATA_CACHE_TOKEN", "put the cache's token in it, or unset it to run without one")


def load_cluster_key(key: str | None) -> str | None:
    """``DATA_CACHE_CLUSTER_KEY``: the secret the head and its data nodes show each other.

    A data node's ``register`` (to the head) and the head's ``load`` (to a data node) change
    what the cache serves, so where a key is set they carry it and are refused without it. Readers
    never need it: the reader token (DATA_CACHE_TOKEN) alone no longer lets a trainer, or any pod
    that can reach the port, register a data node of its own or make one load another table.
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
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())


def check_token(token: object, source: str = "token") -> None:
    """None (send no token) or a token a bearer header can carry; a ValueError naming where it
    came from (``source``) otherwise. The value is never shown: it is a secret."""
    if token is None:
        return
    if not isinstance(token, str):
        raise ValueError(f"{source} should be the cache's token as a string, or None; got a {type(token).__name__}")
    if not token:
        raise ValueError(
            f"{source} is empty: pass the cache's token, or None to use DATA_CACHE_TOKEN / DATA_CACHE_TOKEN_FILE"
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


def call_options(token: str | None, timeout: float | None = None) -> flight.FlightCallOptions:
    headers = [(AUTH_HEADER.encode(), f"Bearer {token}".encode())] if token else []
    return flight.FlightCallOptions(headers=headers, timeout=timeout)


class TokenAuthFactory(flight.ServerMiddlewareFactory):
    """Refuses any call whose ``authorization`` header is not ``Bearer <token>``."""

    def __init__(self, token: str, on_refused: Callable[[str], None] | None = None):
        self._expected = token.encode()
        # Refused calls never reach the handlers that count errors: told here, by method name.
        self._on_refused = on_refused

    def start_call(self, info, headers):
        values = headers.get(AUTH_HEADER) or headers.get(AUTH_HEADER.title()) or []
        given = values[0] if values else ""
        given = given.encode() if isinstance(given, str) else given
        # The scheme name is case-insensitive (RFC 7235): "bearer x" is as good as "Bearer x".
        scheme, _, credentials = given.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(credentials, self._expected):
            if self._on_refused is not None:
                # FlightMethod.GET_FLIGHT_INFO -> "GetFlightInfo", as the handlers name themselves.
                self._on_refused("".join(part.title() for part in info.method.name.split("_")))
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


def client_for(location: str, tls_root_certs: bytes | None = None) -> flight.FlightClient:
    kwargs = {"tls_root_certs": tls_root_certs} if tls_root_certs else {}
    return flight.FlightClient(location, **kwargs)
