"""Stopping child processes: SIGTERM, one shared deadline, then SIGKILL; never an endless wait.

Used by ``data-cache local`` for its nodes, and by the demo, the benchmarks and the tests for the
clusters and jobs they start. ``die_with_parent`` and ``end_with_parent`` cover the case where
nobody is left to stop them: the parent was SIGKILLed.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import NoReturn

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# What stops a cache process in order, as SIGTERM does: Ctrl-C, and SIGHUP from a terminal that
# closed (its default action killed each process on the spot, skipping the nodes' stream grace).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


# `kill -USR1 <pid>` writes every thread's Python stack to stderr (the pod's log): what a process
# that seems stuck is doing, without stopping it.
DUMP_STACKS_SIGNAL = signal.SIGUSR1


def dump_stacks_on_signal() -> None:
    """Dump every thread's stack on DUMP_STACKS_SIGNAL, from the signal handler itself, so it
    works even when no thread gives up the interpreter (its default action ends the process)."""
    faulthandler.register(DUMP_STACKS_SIGNAL, all_threads=True)


# Stop signals that came before the command installed its handlers, for handle_signals to hand on.
_early_signals: list[int] = []


def keep_early_stop_signals() -> Callable[[], None]:
    """Record SIGTERM and SIGHUP from now until the command's own handle_signals, which replays
    them. A long-running command imports for a second before it gets there, and the kernel drops
    a signal PID 1 (the cache in its container) has no handler for: a pod deleted as it started
    ran on until the kubelet's SIGKILL. (SIGINT already raises KeyboardInterrupt.)

    Returns what puts the handlers back as they were, for the command's end: run in a process
    that goes on (a test calling the CLI), a SIGTERM would otherwise be kept for ever."""
    kept = (signal.SIGTERM, signal.SIGHUP)
    before = {sig: signal.getsignal(sig) for sig in kept}
    handle_signals(lambda signum, _frame: _early_signals.append(signum), kept)

    def restore() -> None:
        for sig, handler in before.items():
            if handler is not None:  # None: set from outside Python, which cannot be put back
                signal.signal(sig, handler)
        _early_signals.clear()

    return restore


def handle_signals(handler: Callable[[int, object], object], signals: Iterable[int] = STOP_SIGNALS) -> None:
    """Install ``handler`` for ``signals``, except SIGHUP where it is already ignored: that is
    `nohup` (or a parent) asking this process to outlive its terminal, and children started
    from here inherit the ignore through exec, so the whole cache keeps running. Signals kept
    since keep_early_stop_signals are handed to ``handler`` now."""
    for sig in signals:
        if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
            continue
        signal.signal(sig, handler)
    while _early_signals:
        handler(_early_signals.pop(0), None)


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` that makes the child receive ``sig`` when this
    process dies, however it dies (Linux ``prctl(PR_SET_PDEATHSIG)``); None where unsupported.

    The signal follows the *thread* that starts the child: start children from the main thread.
    It may come more than once: a parent with several threads hands the child from each dying
    thread to the next, and the kernel signals it at each hand-over (pyarrow's pools alone make
    several). A child must take the repeats: torchrun's agent, interrupted again while it stops
    its ranks, leaves them running (hence ``end_with_parent``, in the ranks themselves).
    """
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        _set_parent_death_signal(prctl, sig, parent)

    return preexec


def end_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Have this process receive ``sig`` when its parent dies, as ``die_with_parent`` has it for a
    child we start: for a process started by another program, which cannot be asked (a torchrun
    rank, whose agent may die before it stops its ranks). Call it first thing: a parent that dies
    before the call goes unseen. Whether it is set (False where unsupported).
    """
    prctl = _prctl()
    if prctl is None:
        return False
    _set_parent_death_signal(prctl, sig, os.getppid())
    return True


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # looked up now, not in a forked child
    except (OSError, AttributeError):
        return None


def _set_parent_death_signal(prctl: Callable[..., int], sig: int, parent: int) -> None:
    prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    # The parent died before the prctl: nobody would send the signal then.
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def exit_now(code: int) -> NoReturn:
    """Exit with ``code`` through ``os._exit``, not the interpreter's shutdown, once the logs and
    the standard streams are flushed. Shutdown joins every executor thread (a read blocked on an
    object store that never answers held a process for ever) and runs pyarrow's S3 finalizer
    (which can hang under web-identity settings, apache/arrow#50188)."""
    import logging

    logging.shutdown()
    with contextlib.suppress(Exception):  # a closed or broken pipe must not stop the exit
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def exit_status(code: int) -> str:
    """How a child ended, in words: Popen gives a signal's end as its negated number ("-9")."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:  # a real-time signal has no name
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _send(proc: subprocess.Popen, sig: int, group: bool) -> None:
    with contextlib.suppress(ProcessLookupError):
        if group:
            os.killpg(proc.pid, sig)
        elif proc.poll() is None:
            proc.send_signal(sig)


def stop_processes(
    procs: Iterable[subprocess.Popen], grace: float, *, term_group: bool = False, kill_group: bool = False
) -> None:
    """Stop ``procs`` together: SIGTERM each, wait up to ``grace`` seconds for all of them, then
    SIGKILL what is left, and reap every one.

    ``term_group`` sends the SIGTERM to the process's whole group, ``kill_group`` the SIGKILL,
    which then also sweeps up anything left in the group after its leader exited. Both need a
    process started as a group leader (``start_new_session=True``); without them only the
    process itself is signalled (right for a process that stops its own children on SIGTERM,
    and the only choice for children that share their parent's group).
    Raises ``subprocess.TimeoutExpired`` if a process outlives even SIGKILL by ``grace``.
    """
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            _send(proc, signal.SIGTERM, term_group)
            # A stopped process (SIGSTOP, a shell's Ctrl-Z) holds the SIGTERM until it runs again:
            # without this it sat out the whole grace period before the SIGKILL.
            _send(proc, signal.SIGCONT, term_group)
    deadline = time.monotonic() + grace
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        if proc.poll() is None or kill_group:
            _send(proc, signal.SIGKILL, kill_group)
    # Reaped after every SIGKILL is sent: one process that outlives its SIGKILL (stuck in the
    # kernel) must not leave the ones after it unkilled.
    survivor = None
    for proc in procs:
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired as err:
            survivor = survivor or err
    if survivor is not None:
        raise survivor
