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


class BadRequestError(DataCacheError):
    """A client's descriptor, ticket or action body is malformed or out of range."""


class NotReadyError(DataCacheError):
    """The cache has not finished loading (or its load failed)."""


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


def first_line(err: BaseException) -> str:
    """The first line of an error's message (gRPC and DataFusion append pages of detail), or its
    type where the message is empty."""
    text = str(err)
    if not text.strip():
        return type(err).__name__
    # A Flight error raised by a Python handler carries "Detail: Python exception: Traceback ...".
    return text.splitlines()[0].split(". Detail: Python exception")[0]
