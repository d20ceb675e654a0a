"""INVALID_ARGUMENT and UNIMPLEMENTED answers (and GetSchema's others) without the server's Python traceback.

Flight has no error class for those two codes: a handler raises ValueError (pyarrow's
ArrowInvalid) or NotImplementedError, and pyarrow turns the Python exception into a status whose
detail it formats, when the answer is sent, with ``traceback.format_exception``. Every client
then read the message again after ". Detail: Python exception: Traceback ...", naming the
server's source files and lines (``/app/.venv/.../service.py``, line 188): noise in front of a
user, and the layout of the image to anyone who can send a bad request.

The exceptions here are what the cache raises for a client's own mistake. ``install`` makes the
traceback module format them as their class name alone (the detail then reads "Python exception:
InvalidArgument"); every other exception, in logs or elsewhere, is formatted as before.
"""

from __future__ import annotations

import traceback

import pyarrow as pa


class ClientStatus(Exception):
    """A status the client caused: its message says what to fix, and no server frame helps it."""


class InvalidArgument(ClientStatus, pa.ArrowInvalid):
    """INVALID_ARGUMENT (pyarrow maps ValueError, and so ArrowInvalid, to it)."""


class Unimplemented(ClientStatus, NotImplementedError):
    """UNIMPLEMENTED."""


class GetSchemaStatus(ClientStatus, OSError):
    """Any other status of a GetSchema call, its code leading the message ("UNAVAILABLE: the
    cache is not ready yet ..."). pyarrow's server passes no Flight error out of a GetSchema
    handler (it does for the other calls): raised as such, it reached the client as UNKNOWN with
    the server's traceback in the message. This one reaches it as UNKNOWN too (Arrow's IOError:
    pyarrow's client raises OSError, as it does for every GetSchema failure), without the traceback."""


_format_exception = traceback.format_exception


def _format_exception_hiding_client_statuses(exc, /, *args, **kwargs) -> list[str]:
    # Called as format_exception(type, value, tb) by pyarrow, as format_exception(value) by others;
    # where a value is given, it is the one formatted (whatever ``exc`` is), as in Python.
    value = args[0] if args else kwargs.get("value", exc)
    if isinstance(value, ClientStatus):
        return [type(value).__name__]
    return _format_exception(exc, *args, **kwargs)


def install() -> None:
    """Format client statuses without their traceback in this process (a server's, at its start)."""
    traceback.format_exception = _format_exception_hiding_client_statuses
