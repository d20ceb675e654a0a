"""Every error the cache raises on purpose, one named class each.

Messages give the bad value and what would fix it; the servers turn these into Flight error
statuses (clients) or a /ready reason plus a non-zero exit (nodes).
"""

from __future__ import annotations


class DataCacheError(Exception):
    """Base class of the cache's own errors."""


class ConfigError(DataCacheError):
    """A setting (env variable or flag) is missing or malformed."""


class TableLoadError(DataCacheError):
    """The Iceberg table could not be opened, planned or read."""


class UnsupportedTableError(TableLoadError):
    """The table uses a feature the cache cannot serve exactly (for example equality deletes)."""


class MemoryBudgetError(DataCacheError):
    """The table does not fit the data nodes' memory budget."""


class BadRequestError(DataCacheError, ValueError):
    """A client's descriptor, ticket or action body is malformed or out of range (a ValueError
    too, as every other bad argument of the client is)."""


class UnsignedTicketError(BadRequestError):
    """A ticket its data node's head did not sign (protocol.check_ticket_signature)."""


class NotReadyError(DataCacheError):
    """The cache has not finished loading (or its load failed)."""


class LoadFailedError(DataCacheError):
    """The cache's load failed: it serves nothing until it is restarted (or reloaded)."""


class NodeBusyError(DataCacheError):
    """A data node cannot start another stream now (too near its memory limit); retry shortly."""


class StaleTicketError(DataCacheError):
    """A ticket was issued for another load of this data node; ask the head again."""


class ClusterFormationError(DataCacheError):
    """The head and the data nodes did not find each other before the deadline."""


class CacheUnavailableError(DataCacheError):
    """The cache (head or a data node) could not be reached before the deadline."""


class CacheAuthError(DataCacheError):
    """The cache refused the bearer token (missing or wrong)."""


class ForkedConnectionError(DataCacheError):
    """This process was forked while its parent held open cache connections; gRPC cannot be used."""


# Sent as the extra_info of an UNAVAILABLE Flight error, so that clients tell a cache that answered
# "not ready yet" from one that did not answer by a marker, not by the words of a message.
NOT_READY_INFO = b"kubeflow-data-cache/not-ready"
# The extra_info of the INTERNAL error a cache whose load failed answers with: clients tell it
# from a failure while serving (both INTERNAL) by this marker.
LOAD_FAILED_INFO = b"kubeflow-data-cache/load-failed"


# gRPC refuses a call's trailers past 16 KiB, and Flight carries an error's message in them twice:
# a longer message (a 64 KiB filter quoted back) reached the client as "Stream removed" instead.
# Counted as gRPC sends it, percent-encoded: every byte of a character outside printable ASCII
# (and %) takes three, so 4,000 characters of column names in CJK took 19,602 bytes and failed.
MAX_ERROR_BYTES = 4000
# How much of a client's value an error quotes back.
SHOWN_VALUE_CHARS = 200


def shown(value: object) -> str:
    """``repr(value)`` for an error message, cut to SHOWN_VALUE_CHARS with its length said."""
    text = repr(value)
    if len(text) <= SHOWN_VALUE_CHARS:
        return text
    return f"{text[:SHOWN_VALUE_CHARS]}... ({len(text)} characters)"


def _sent_bytes(char: str) -> int:
    """What one character takes in a gRPC status message, percent-encoded as gRPC sends it."""
    return 1 if " " <= char <= "~" and char != "%" else 3 * len(char.encode("utf-8", "surrogatepass"))


def grpc_message_bytes(message: str) -> int:
    return sum(map(_sent_bytes, message))


def bounded_message(message: str) -> str:
    """``message`` within MAX_ERROR_BYTES as gRPC sends it: its middle left out, so that both the
    start (what failed) and the end (the fix) reach the client."""
    if grpc_message_bytes(message) <= MAX_ERROR_BYTES:
        return message
    budget = (MAX_ERROR_BYTES - 60) // 2
    head = _within(message, budget)
    tail = _within(message[::-1], budget)[::-1]
    return f"{head} [... {len(message) - len(head) - len(tail)} characters left out ...] {tail}"


def _within(text: str, budget: int) -> str:
    """The longest start of ``text`` that gRPC sends in ``budget`` bytes."""
    used = 0
    for i, char in enumerate(text):
        used += _sent_bytes(char)
        if used > budget:
            return text[:i]
    return text


def answered_not_ready(err: BaseException) -> bool:
    """Whether a cache process answered ``err``, saying that it is not ready yet (loading, or a
    head whose data node is down), as opposed to not answering at all."""
    return getattr(err, "extra_info", None) == NOT_READY_INFO


def server_message(err: BaseException) -> str:
    """An error's message without what pyarrow and gRPC append to it: the Python traceback of a
    Flight handler (". Detail: Python exception: ...") and gRPC's client debug context."""
    return str(err).split(". Detail:", 1)[0].split(". gRPC client debug context:", 1)[0].strip()


def first_line(err: BaseException) -> str:
    """The first line of ``server_message`` (DataFusion appends pages of plan detail), or the
    error's type where the message is empty."""
    text = server_message(err)
    return text.splitlines()[0] if text else type(err).__name__
