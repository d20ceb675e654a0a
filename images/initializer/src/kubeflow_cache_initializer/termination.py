"""SIGTERM, raised as an error where the run is, except while the cache's LeaderWorkerSet is made.

Raised, it ends the run as any failure does: what the run made is deleted, and the reason goes
to the log and the termination message. Raised while the LeaderWorkerSet's create (or adoption
patch) was being answered, it left the cache the API server then made running, with no one left
to delete it: its pods held their CPU and memory through a Kueue suspension. So that call is
let finish (its retries cut short), and the SIGTERM is raised after it.

A handler's raise can also be lost: arriving inside a log call, it is caught by logging's own
error handling, which prints it and goes on. So the run's loops also ask `raise_if_received` at
each turn: a SIGTERM that came is raised there, if it was not already. The API calls' retry
loop asks `raise_if_lost` after the warning each retry logs (`Kube.before_retry`), until the
cleanup starts: the cleanup a SIGTERM began must still retry its deletes.

Once a cleanup starts (`cleaning_up`), SIGTERM is ignored: raised into a cleanup's retries (an
API outage that the delete waits out), it ended them, and the cache it was deleting held its
pods through the suspension the SIGTERM came for.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator

from kubeflow_cache_initializer.errors import TerminatedError
from kubeflow_cache_initializer.kube import Kube

MESSAGE = (
    "stopped by SIGTERM before the cache was ready (the pod was deleted or evicted, or its TrainJob "
    "suspended); the run deletes a cache no other TrainJob uses, so that its pods free their resources "
    "(a delete that failed is named after this)"
)

# Set while a call is held from SIGTERM: its Kube (whose retries a SIGTERM ends), and whether one came.
_holding: Kube | None = None
_pending = False
# Whether a SIGTERM came in this run.
_received = False


def start() -> None:
    """A new run (main's): no SIGTERM yet. One process runs several in the tests."""
    global _received
    _received = False


def raise_if_received() -> None:
    """Raise a SIGTERM that came, again where its first raise was lost (above). Asked only
    between calls, by the loops that make and wait, which a raised one leaves for good: the
    cleanup after it never asks."""
    if _received:
        raise TerminatedError(MESSAGE)


def raise_if_lost() -> None:
    """``raise_if_received``, except within ``held``: there a SIGTERM is held back, not lost (its
    call gets its last try, and the SIGTERM is raised after it), and raised at once it left a
    LeaderWorkerSet the API server had stored, its answer lost, with no one to delete it."""
    if _holding is None:
        raise_if_received()


def cleaning_up() -> None:
    """A cleanup starts: a SIGTERM from now on is ignored (see above). In the main thread only,
    where handlers are set (a test's run in another thread has none)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def on_sigterm(signum, frame) -> None:
    """The SIGTERM handler main installs."""
    global _pending, _received
    # Once: a second SIGTERM must not cut short the cleanup the first one started.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _received = True
    if _holding is None:
        raise TerminatedError(MESSAGE)
    _pending = True
    _holding.deadline = time.monotonic()  # no more retries: the call in flight is answered, then we stop


@contextlib.contextmanager
def held(kube: Kube) -> Iterator[None]:
    """Hold a SIGTERM back while the block runs; raise it once the block has finished."""
    global _holding, _pending
    _holding, _pending = kube, False
    try:
        yield
    except Exception as err:
        if _pending:  # the call failed for the retries the SIGTERM cut short: the SIGTERM is the cause
            raise TerminatedError(MESSAGE) from err
        raise
    finally:
        # Nothing left pending once raised: a later run in this process (a test's) saw it again.
        _holding, came, _pending = None, _pending, False
    if came:
        raise TerminatedError(MESSAGE)


@contextlib.contextmanager
def released() -> Iterator[None]:
    """Within ``held``, a stretch that waits rather than makes (an earlier cache's deletion, for
    up to the run's deadline): a SIGTERM is raised at once, as a pending one is on entry. Held
    there, it waited out the deadline, and the kubelet's grace (30 s) ended in a SIGKILL."""
    global _holding, _pending
    kube, _holding = _holding, None
    try:
        if kube is not None and _received:  # pending (held back) or raised and lost
            _pending = False
            raise TerminatedError(MESSAGE)
        yield
    finally:
        _holding = kube
