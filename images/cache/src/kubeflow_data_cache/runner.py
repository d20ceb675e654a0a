"""Run one head or data node process until SIGTERM, or until its load fails."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from pathlib import Path
from typing import NoReturn

import pyarrow as pa

from kubeflow_data_cache.config import NodeConfig, claim_port, host_port, label
from kubeflow_data_cache.constants import SHUTDOWN_GRACE_SECONDS, TERMINATION_LOG
from kubeflow_data_cache.errors import ConfigError
from kubeflow_data_cache.head import Head
from kubeflow_data_cache.node import DataNode
from kubeflow_data_cache.processes import dump_stacks_on_signal, exit_now, handle_signals
from kubeflow_data_cache.service import STOPPING, HealthServer

log = logging.getLogger(__name__)

# How often the main thread looks for a stop signal or a failed load.
STOP_POLL_SECONDS = 0.2
# How often a stopping process looks whether its open streams have finished.
DRAIN_POLL_SECONDS = 0.05
# What the Flight server's own shutdown gets at least, its streams finished just at the deadline.
SHUTDOWN_FLOOR_SECONDS = 1.0


def _write_termination_log(path: str | None, message: str) -> None:
    """Kubernetes shows this file as the container's termination message (kubectl describe).
    ``path``: TERMINATION_LOG, written wherever it is; None for the kubelet's default path."""
    if path is None:
        path = TERMINATION_LOG
        if not Path(path).exists():
            # The kubelet mounts the default path into every container. Outside one (`data-cache
            # local`, a node run by hand) it is absent, and a process that may write /dev (root)
            # made it there, each failed run overwriting the last: the log line is enough then.
            return
    # Not in a container, or the path is read-only: the log line is enough then.
    with contextlib.suppress(OSError):
        Path(path).write_text(message[:4000])


def _start_servers(cfg: NodeConfig) -> tuple[Head | DataNode, HealthServer]:
    """The Flight and health servers, or a ConfigError naming the port that cannot be bound."""
    # Also for port 0 (whatever port is free, as `local` starts its nodes): a host this machine
    # cannot bind is named as the host, not as a port to change.
    claim_port(cfg.bind_host, cfg.flight_port, label("FLIGHT_PORT", "--port"), label("BIND_HOST", "--host"))
    try:
        server = Head(cfg) if cfg.role == "head" else DataNode(cfg)
    except pa.ArrowException as err:  # taken between the check and the bind, or refused by gRPC
        raise ConfigError(
            f"the Flight server could not listen on {host_port(cfg.bind_host, cfg.flight_port)} ({err}): "
            f"pick another port with {label('FLIGHT_PORT', '--port')}"
        ) from None
    try:
        health = HealthServer(cfg.bind_host, cfg.health_port, server.lifecycle, server.metrics, server.status)
    except OSError as err:
        server.stop()
        raise ConfigError(
            f"the health server could not listen on {host_port(cfg.bind_host, cfg.health_port)} "
            f"({err.strerror or err}): "
            f"pick another port with {label('HEALTH_PORT', '--health-port')}"
        ) from None
    return server, health.start()


def run_node(cfg: NodeConfig) -> NoReturn:
    server, health = _start_servers(cfg)
    log.info(
        "%s serving Flight at %s (bind %s), health at :%d%s",
        cfg.role,
        server.location,
        host_port(cfg.bind_host, server.port),
        health.port,
        # Said where there is none: an optional Secret without its `token` key leaves the
        # variable unset, and the cache serves anyone who reaches its port without a word.
        ", token required"
        if cfg.token
        else ", no token: any client that reaches it reads the table (DATA_CACHE_TOKEN)",
    )
    # The handler only appends to a list: a Python handler runs in the main thread between two
    # bytecodes, and threading.Event.set() there could wait for ever on the Event's own lock,
    # taken by the very wait() it interrupted.
    signals: list[int] = []
    handle_signals(lambda signum, _: signals.append(signum))

    def stop_wait(seconds: float) -> bool:
        """Sleep until a stop signal or for ``seconds``; whether a stop was asked for."""
        until = time.monotonic() + seconds
        while not signals and (left := until - time.monotonic()) > 0:
            time.sleep(min(STOP_POLL_SECONDS, left))
        return bool(signals)

    dump_stacks_on_signal()
    if cfg.role == "head":
        server.start()
    else:
        server.start_registering()
    code = 0
    while not signals:
        # Woken at once by a failure, not at the next poll: a data node whose load passed its
        # memory margin mid-decode writes its termination message before the kernel may kill it.
        if server.lifecycle.failed_event.wait(STOP_POLL_SECONDS):
            error = server.lifecycle.error or "unknown error"
            _write_termination_log(cfg.termination_log, error)
            # The reason itself was logged once, when it failed (Lifecycle.fail).
            log.info("exiting in %gs; /ready and /status give the reason meanwhile", cfg.failure_grace)
            stop_wait(cfg.failure_grace)  # keep /ready and /status answering with the reason meanwhile
            code = 1
            break
    # Exit through os._exit whatever happens below, not through interpreter shutdown: that
    # joins every executor thread, and a read blocked on storage (an object store that never
    # answers; it cannot be cancelled) would hold the process for ever, as would the server's
    # own teardown with streams still open.
    if signals:  # in the pod's log: why it stopped
        log.info("%s stopping on %s", cfg.role, signal.Signals(signals[0]).name)
    try:
        # Readiness goes first, so no new reader is sent here. While open streams finish, the
        # Flight server still answers: `status` says stopping (to the head's supervision too) and
        # a new read is refused as not ready, not met with a refused connection. Then the server
        # waits for its calls, but a reader that stopped reading mid-stream would hold it for
        # ever: the whole of it is bounded.
        server.lifecycle.set(STOPPING, "shutting down")
        deadline = time.monotonic() + SHUTDOWN_GRACE_SECONDS

        def hurried() -> bool:
            # A Ctrl-C after the stop began: the operator will not wait for the streams. (SIGTERM
            # after a Ctrl-C is `local` stopping its nodes, which should drain as asked.)
            return signal.SIGINT in signals[1:]

        if open_streams := server.open_streams():
            log.info(
                "waiting up to %.0fs for %d open stream(s) to finish%s",
                SHUTDOWN_GRACE_SECONDS,
                open_streams,
                " (Ctrl-C again to stop now)" if signals[:1] == [signal.SIGINT] else "",
            )
        while server.open_streams() and time.monotonic() < deadline and not hurried():
            time.sleep(DRAIN_POLL_SECONDS)
        stopper = threading.Thread(target=server.stop, name="shutdown", daemon=True)
        stopper.start()
        floor = time.monotonic() + SHUTDOWN_FLOOR_SECONDS
        while stopper.is_alive() and time.monotonic() < (floor if hurried() else max(floor, deadline)):
            stopper.join(DRAIN_POLL_SECONDS)
        health.stop()
        if stopper.is_alive():
            log.warning(
                "streams still open after %.0fs%s; exiting without them",
                SHUTDOWN_GRACE_SECONDS - (deadline - time.monotonic()),
                " (Ctrl-C again)" if hurried() else "",
            )
    except BaseException:
        log.exception("shutting down")
        code = code or 1
    finally:
        exit_now(code)
