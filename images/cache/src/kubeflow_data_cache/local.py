"""`data-cache local`: a head and N data nodes as separate processes on this machine."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.flight as flight

from kubeflow_data_cache import constants, protocol
from kubeflow_data_cache.config import (
    check_advertise_host,
    check_metadata_location,
    claim_port,
    host_port,
    int_setting,
    label,
    port_setting,
    seconds_setting,
    tls_config,
)
from kubeflow_data_cache.errors import ConfigError, first_line
from kubeflow_data_cache.load_progress import slow_read_seconds, waiting_reads
from kubeflow_data_cache.memory import LOCAL_ENV, local_load_threads, parse_bytes
from kubeflow_data_cache.processes import (
    die_with_parent,
    dump_stacks_on_signal,
    exit_status,
    handle_signals,
    stop_processes,
)
from kubeflow_data_cache.s3_settings import checked_ca_bundle, s3_properties_from_env
from kubeflow_data_cache.security import (
    CLUSTER_KEY_ENV,
    TLS_DIR_ENV,
    TLS_SERVER_NAME_ENV,
    call_options,
    load_cluster_key,
    load_token,
)

log = logging.getLogger(__name__)

# The nodes' own grace for open streams, then time to exit: a node that is SIGKILLed at the end
# of that grace cannot log which streams it left.
STOP_GRACE_SECONDS = constants.SHUTDOWN_GRACE_SECONDS + 5.0
# Shorter than a pod's (constants.STARTUP_TIMEOUT_SECONDS): someone is waiting at a terminal.
LOCAL_STARTUP_TIMEOUT_SECONDS = 300.0
# While the cache loads, a detail whose numbers alone change (rows read, a stalled read's age)
# is logged at most this often.
PROGRESS_LOG_SECONDS = 5.0
# How long the head may refuse connections (it is starting) before its error joins the progress line.
HEAD_UNANSWERED_DETAIL_SECONDS = 3.0
# Past the startup deadline, how long `local` still waits for an answering head to fail by its
# own deadline, which starts once the head has imported (a second or more after ours).
HEAD_DEADLINE_GRACE_SECONDS = 10.0


# Bind addresses that mean "every interface": no client can connect to them by that name.
WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


# Data node processes `local` starts on one machine: each is an interpreter (~130 MiB before
# its rows) with two ports.
MAX_LOCAL_DATA_NODES = 256


# Ports handed to the nodes, which bind them a moment later: drawn from below the kernel's
# ephemeral range (ip_local_port_range, 32768-60999 by default), not by binding port 0. A port the
# OS picks for port 0 is one it hands to any outgoing connection too, and one taken so between
# the pick and the node's bind failed the head in a CI run ("the health server could not listen
# on 127.0.0.1:46285 (Address already in use)").
LOCAL_PORTS = range(10000, 20000)
# Each port a `local` hands out is also locked (flock on a file named after it here) for the
# life of that `local`: two started at once (parallel test workers) each found the same ports
# free, since neither's nodes had bound them yet, and one's head then failed to bind ("port
# 16953 on 0.0.0.0 is already in use", in a fresh-clone CI run). The lock ends with the process.
PORT_LOCK_DIR = Path(tempfile.gettempdir()) / "data-cache-local-ports"
_port_locks: list[tuple[int, Path]] = []  # this process's lock files, open until it exits


def _reserve(port: int) -> bool:
    """Lock ``port`` for this process; False where another `local` holds it. Where no lock file
    can be opened (a read-only temp folder), True: the bind check alone stands."""
    path = PORT_LOCK_DIR / f"{port}.lock"
    try:
        PORT_LOCK_DIR.mkdir(exist_ok=True)
        with contextlib.suppress(OSError):  # every user's `local`s share it (the umask narrows mkdir's mode)
            os.chmod(PORT_LOCK_DIR, 0o1777)
        # Read-only is enough for flock, so another user's lock file (0644) is taken as well.
        fd = os.open(path, os.O_CREAT | os.O_RDONLY, 0o644)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # Its holder removes the file as it lets go (release_ports): a lock taken on a file
        # removed meanwhile guards nothing, since the next `local` makes a new one.
        if os.fstat(fd).st_ino != os.stat(path).st_ino:
            raise OSError("the lock file was removed by its last holder")
    except OSError:
        os.close(fd)
        return False
    _port_locks.append((fd, path))
    return True


def release_ports() -> None:
    """Remove this process's lock files, each while still holding its lock, then let go: the
    folder kept one empty file for every port ever handed out (thousands, on a CI machine). A
    `local` killed outright leaves its files, which the next ones take over as before."""
    while _port_locks:
        fd, path = _port_locks.pop()
        with contextlib.suppress(OSError):  # another user's file in the sticky folder stays
            path.unlink()
        os.close(fd)


atexit.register(release_ports)
# A child forked from a `local` (os.fork, then a normal exit) inherits the list and the atexit
# hook: it would remove the files its parent still holds, and another `local` could take them.
os.register_at_fork(after_in_child=_port_locks.clear)


def _free_ports(host: str, count: int, taken: set[int]) -> list[int]:
    """``count`` distinct free ports of LOCAL_PORTS on ``host``, none of them in ``taken`` or
    handed out by another `local` still running, scanned from a random start."""
    claim_port(host, 0, label("--port"), label("--host"))  # a host that cannot be bound, named
    ports: list[int] = []
    start = secrets.randbelow(len(LOCAL_PORTS))
    for k in range(len(LOCAL_PORTS)):
        if len(ports) == count:
            break
        port = LOCAL_PORTS[(start + k) % len(LOCAL_PORTS)]
        if port in taken:
            continue
        try:
            claim_port(host, port, label("--port"), label("--host"))
        except ConfigError:  # something listens there
            continue
        if _reserve(port):
            ports.append(port)
    if len(ports) < count:
        raise ConfigError(f"found {len(ports)} of the {count} free ports needed on {host}; start fewer data nodes")
    return ports


def _reserve_given(port: int, flag: str) -> None:
    if not _reserve(port):
        raise ConfigError(
            f"port {port} is taken by another `data-cache local` that is still starting: pick another port with {flag}"
        )


def _child_preexec(die_with_parent: Callable[[], None] | None) -> Callable[[], None]:
    """Each node's ``preexec_fn``: die with us, and ignore the terminal's Ctrl-C until its own
    handlers are in (runner.run_node): the SIGINT that reaches the whole process group otherwise
    interrupted the nodes' imports, printing their tracebacks. We stop them with SIGTERM. SIGHUP
    is left as exec leaves it: ignored under `nohup` (and run_node keeps it so), else the default
    action, which ends a node still in its imports without a word (we stop on it too)."""

    def preexec() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if die_with_parent is not None:
            die_with_parent()

    return preexec


def _node_cmd(role: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "kubeflow_data_cache", role, *args]


class LocalCluster:
    def __init__(
        self,
        metadata_loc: str,
        data_nodes: int,
        port: int,
        host: str = "127.0.0.1",
        memory_limit: str | None = None,
        startup_timeout: float | None = None,
        extra_args: tuple[str, ...] = (),
        advertise_host: str | None = None,
        health_port: int = 0,
    ):
        # Checked before any process starts: a bad value would otherwise show only as a node's exit code.
        self.port = port_setting(label("--port"), port, constants.FLIGHT_PORT)
        self.health_port = port_setting(label("--health-port"), health_port, 0)
        # The settings local passes its nodes as flags are taken from the env it was started with
        # when their flag is not given, as a node would take them: passing local's own values
        # instead ignored an exported DATA_CACHE_STARTUP_TIMEOUT_SECONDS or LOAD_THREADS unsaid.
        if startup_timeout is None:
            self.startup_timeout = seconds_setting(
                label("DATA_CACHE_STARTUP_TIMEOUT_SECONDS", "--startup-timeout"),
                os.environ.get("DATA_CACHE_STARTUP_TIMEOUT_SECONDS"),
                LOCAL_STARTUP_TIMEOUT_SECONDS,
            )
        else:
            self.startup_timeout = seconds_setting(label("--startup-timeout"), startup_timeout, 0.0)
        # Read as the nodes read it (config.int_setting), so a value local takes they take too.
        given = int_setting(label("LOAD_THREADS"), os.environ.get("LOAD_THREADS"), 0, minimum=1)
        self.load_threads = given or local_load_threads(data_nodes)
        given, limit_name, limit = memory_limit, "--memory-limit", 0
        if memory_limit:
            limit = parse_bytes(memory_limit, "`--memory-limit`")
        elif os.environ.get("MEMORY_LIMIT", "").strip():
            # The nodes inherit it: unchecked here, a bad one showed only as "data node 0 exited
            # with code 2", the reason in that node's log.
            given, limit_name = (
                os.environ["MEMORY_LIMIT"],
                "MEMORY_LIMIT (from the environment; --memory-limit overrides it)",
            )
            limit = parse_bytes(given, "`MEMORY_LIMIT` (from the environment; --memory-limit overrides it)")
        if 0 < limit <= constants.BASELINE_MEMORY_BYTES:
            # No row fits beside the interpreter: refused after the whole cluster started and
            # planned, in the memory check's words, which named no flag.
            raise ConfigError(
                f"{limit_name} {given} leaves a data node no room for rows: "
                f"each keeps {constants.BASELINE_MEMORY_BYTES >> 20} MiB for its interpreter; give each more than "
                "that (--memory-limit 1Gi), or 0 for this machine's own limit"
            )
        if not metadata_loc.strip():
            raise ConfigError(
                "--metadata-loc is empty: give the table's metadata.json (s3://, s3a://, file:// or a path)"
            )
        check_metadata_location(metadata_loc)
        self.metadata_loc, self.data_nodes, self.host = metadata_loc, data_nodes, host
        loopback = WILDCARD_HOSTS.get(host.strip("[]"))  # set for a wildcard bind only
        if advertise_host is not None and not advertise_host.strip():
            raise ConfigError("--advertise-host is empty: give the name or address readers reach this machine at")
        if advertise_host is not None:
            check_advertise_host(advertise_host, label("--advertise-host"))
        # What readers are told (the READY line, the data nodes' endpoints). A wildcard bind is no
        # address to connect to: the machine's name stands for it, as in a pod without POD_IP.
        self.advertise_host = advertise_host or (socket.gethostname() if loopback else host)
        # How this process and the nodes reach the head: on this machine, so loopback for a wildcard.
        self.reach_host = loopback or host
        self.memory_limit = memory_limit
        self.extra_args = extra_args
        self.procs: list[tuple[str, subprocess.Popen]] = []
        # The nodes read these settings from the env they inherit; we need them to poll the head.
        env = os.environ
        self.token = load_token(env.get("DATA_CACHE_TOKEN"), env.get("DATA_CACHE_TOKEN_FILE"))
        # Checked here as the nodes check them: refused by the nodes, each of them printed the
        # same line and local then said "head exited with code 2" (or, for an S3 setting, failed
        # the load after starting them all).
        load_cluster_key(env.get(CLUSTER_KEY_ENV))
        checked_ca_bundle(env)
        s3_properties_from_env(env, warn=False)
        self.tls = tls_config(
            env.get("DATA_CACHE_TLS_CERT"),
            env.get("DATA_CACHE_TLS_KEY"),
            env.get(TLS_DIR_ENV),
            env.get(TLS_SERVER_NAME_ENV),
            flags=False,
        )
        self.scheme = self.tls.scheme

    @property
    def location(self) -> str:
        """The head's address for readers (the READY line)."""
        return f"{self.scheme}://{host_port(self.advertise_host, self.port)}"

    @property
    def head_location(self) -> str:
        """The head's address for the processes on this machine: ours and the data nodes'."""
        return f"{self.scheme}://{host_port(self.reach_host, self.port)}"

    @property
    def health_url(self) -> str:
        """The head's /ready, /live and /metrics, as readers reach them."""
        return f"http://{host_port(self.advertise_host, self.health_port)}"

    def start(self) -> None:
        # A taken port is refused now: the head would fail to bind it while wait_ready talked to
        # whatever listens there, and another cache there answers "ready". Port 0 becomes a free
        # port picked here, so that the READY line can name it.
        self.port = claim_port(self.host, self.port, label("--port"), label("--host"))
        # Locked as the nodes' ports are: a second `local` given the same --port a moment later
        # found it free too (the first's head still importing), and its READY named the first's cache.
        _reserve_given(self.port, "--port")
        if self.health_port:
            if self.health_port == self.port:
                raise ConfigError(f"--health-port {self.health_port} is also --port: give the head two ports")
            claim_port(self.host, self.health_port, label("--health-port"), label("--host"))
            _reserve_given(self.health_port, "--health-port")
        # The nodes' memory refusal names our flags; each node gets SIGTERM if we die, even by SIGKILL.
        env = {**os.environ, LOCAL_ENV: "1"}
        # `data-cache --log-level X local` sets this process's level: the nodes, which do the work, too.
        env["LOG_LEVEL"] = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        # Head and nodes prove themselves to each other with a key no reader holds (security.py).
        env.setdefault(CLUSTER_KEY_ENV, secrets.token_urlsafe(24))
        preexec = _child_preexec(die_with_parent())
        # Every port is picked here, none left to the processes' own bind(0): a node binding port
        # 0 while the head, still importing, had yet to bind its port could be handed that very
        # port, and the head then failed on it. Picked ports differ from the head's and each other.
        ports = _free_ports(self.host, 2 * self.data_nodes + 1, taken={self.port, self.health_port})
        flight_ports, health_ports = ports[: self.data_nodes], ports[self.data_nodes :]
        self.health_port = self.health_port or health_ports[-1]
        common = ["--host", self.host, "--advertise-host", self.advertise_host, "--failure-grace", "1"]
        common += ["--startup-timeout", str(self.startup_timeout), *self.extra_args]
        head = _node_cmd("head", "--metadata-loc", self.metadata_loc, "--data-nodes", str(self.data_nodes))
        head += ["--port", str(self.port), "--health-port", str(self.health_port), *common]
        # The nodes log to stderr; stdout is ours alone, for the one READY line (a node holding it
        # open also kept `data-cache local ... | head -1`'s pipe open after we were gone).
        self.procs.append(("head", subprocess.Popen(head, env=env, preexec_fn=preexec, stdout=subprocess.DEVNULL)))
        for k in range(self.data_nodes):
            worker = _node_cmd(
                "worker", "--index", str(k), "--head", self.head_location, "--port", str(flight_ports[k])
            )
            worker += ["--health-port", str(health_ports[k]), *common]
            worker += ["--metadata-loc", self.metadata_loc, "--load-threads", str(self.load_threads)]
            if self.memory_limit:
                worker += ["--memory-limit", self.memory_limit]
            node = subprocess.Popen(worker, env=env, preexec_fn=preexec, stdout=subprocess.DEVNULL)
            self.procs.append((f"data node {k}", node))

    def _dead(self) -> str | None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                # Nothing of ours sends SIGKILL: the kernel's OOM killer is the usual sender.
                hint = (
                    " (as the kernel's OOM killer ends a process: if it ran out of memory, spread the table over "
                    "more --data-nodes, or give each one more with --memory-limit)"
                    if proc.returncode == -signal.SIGKILL
                    else ""
                )
                return f"{name} {exit_status(proc.returncode)}{hint}"
        return None

    def wait_ready(self, should_stop=lambda: False) -> dict:
        """Poll the head's status until ready; raise with the reason on failure or deadline."""
        client = self.tls.client_for(self.head_location)
        deadline = time.monotonic() + self.startup_timeout
        last_detail = None
        last_shape, last_logged = None, 0.0
        unanswered_since: float | None = None
        while True:
            # First: a Ctrl-C reaches the whole process group, and a node past its start catches
            # it and exits 0 on its own, which would otherwise read as a node that died.
            if should_stop():
                raise StoppedBeforeReady()
            # Before asking the head: a status from a port whose head is gone is not ours.
            dead = self._dead()
            if dead:
                raise RuntimeError(f"{dead} before the cache was ready")
            try:
                status = self.head_status(client)
            except flight.FlightUnauthenticatedError as err:
                raise RuntimeError(f"the head refused our token: {err}") from None
            except Exception as err:
                # After a few seconds, why: a TLS name mismatch shows only here (a head still
                # starting refuses connections, not worth showing at every start).
                unanswered_since = unanswered_since or time.monotonic()
                why = (
                    f": {first_line(err)}"
                    if time.monotonic() - unanswered_since >= HEAD_UNANSWERED_DETAIL_SECONDS
                    else ""
                )
                status = {"state": "starting", "detail": f"head not answering yet{why}"}
            else:
                unanswered_since = None
                self._check_ours(status)
            if status.get("state") == "ready":
                return status
            if should_stop():
                raise StoppedBeforeReady()
            if status.get("state") == "failed":
                raise RuntimeError(status.get("error") or "the load failed")
            if status.get("detail") != last_detail:
                last_detail = status.get("detail")
                # A new state or wording at once; only counts and ages changed: every few seconds.
                shape = (status.get("state"), re.sub(r"\d+", "#", last_detail or ""))
                if shape != last_shape or time.monotonic() - last_logged >= PROGRESS_LOG_SECONDS:
                    log.info("cache %s: %s", status.get("state"), last_detail)
                    last_shape, last_logged = shape, time.monotonic()
            # The head's own deadline, started a moment after ours, fails with what it knows
            # (a store that does not answer, which call waits): worth a few seconds more where
            # the head still answers, as ours said only what it was doing.
            grace = HEAD_DEADLINE_GRACE_SECONDS if unanswered_since is None else 0.0
            if time.monotonic() > deadline + grace:
                # The head's detail names the reads waiting SLOW_READ_SECONDS or more; at the
                # deadline the younger ones are worth naming too.
                nodes = ((n["index"], n) for n in status.get("nodes", []))
                reads = waiting_reads(nodes, at_least=0, below=slow_read_seconds())
                why = "; ".join(filter(None, [last_detail, reads]))
                raise RuntimeError(f"the cache was not ready within {self.startup_timeout:g}s ({why})")
            time.sleep(0.1)

    def head_status(self, client: flight.FlightClient) -> dict:
        """The head's `status` answer, asked with our token and a 5 s deadline."""
        raw = list(client.do_action(flight.Action(protocol.ACTION_STATUS, b""), call_options(self.token, 5)))
        return json.loads(raw[0].body.to_pybytes())

    def _check_ours(self, status: dict) -> None:
        """Refuse an answer from a head this `local` did not start: one that took the port
        between our check and our head's bind (ours then fails to bind it)."""
        head = self.procs[0][1]
        if status.get("pid") != head.pid:
            raise RuntimeError(
                f"another cache answers at {self.head_location} (process {status.get('pid', 'unknown')}, table "
                f"{status.get('metadata_location')!r}), not the head this `local` started: pick another port with --port"
            )

    def stop(self) -> None:
        # The nodes share this process's group: signal each one, never the group.
        stop_processes((proc for _, proc in self.procs), STOP_GRACE_SECONDS)


# After READY, how often `local` asks its head how the cache is, and how long the head may not
# answer before that is logged: a frozen head or data node was never reported, the terminal
# silent while every read failed.
WATCH_SECONDS = 5.0
UNANSWERED_WARN_SECONDS = 15.0


def watch_head(cluster: LocalCluster, stopped: threading.Event) -> None:
    """Log each change of the serving cache's state: degraded and back, or a head that stops
    answering and answers again (the processes' exits are the main loop's)."""
    client = cluster.tls.client_for(cluster.head_location)
    last_state, silent_since, warned = "ready", None, False
    while not stopped.wait(WATCH_SECONDS):
        try:
            status = cluster.head_status(client)
        except Exception as err:
            if stopped.is_set():
                return
            silent_since = silent_since or time.monotonic()
            if not warned and time.monotonic() - silent_since >= UNANSWERED_WARN_SECONDS:
                log.warning(
                    "the head has not answered for %.0fs (readers are refused meanwhile): %s",
                    time.monotonic() - silent_since,
                    first_line(err),
                )
                warned = True
            continue
        # A Ctrl-C reaches the head too: its "stopping" may come before our main loop ends this.
        if stopped.is_set() or status.get("state") == "stopping":
            return
        if warned:
            log.info("the head answers again")
        silent_since, warned = None, False
        state = status.get("state")
        if state != last_state:
            if state == "ready":
                log.info("cache ready again: %s", status.get("detail"))
            else:
                log.warning("cache %s: %s", state, status.get("error") or status.get("detail"))
            last_state = state


class StoppedBeforeReady(Exception):
    """SIGTERM or Ctrl-C while the cache loads: a stop asked for, not a failure."""


def run_local(cluster: LocalCluster) -> int:
    stopping = {"signal": None}

    def on_signal(signum, _frame):
        stopping["signal"] = signum

    watching = threading.Event()  # set: the watch of the serving cache ends
    handle_signals(on_signal)
    dump_stacks_on_signal()  # as each node does: USR1's default action would end `local`, and the cache
    try:
        cluster.start()  # inside the try: nodes started before a failure are stopped too
        status = cluster.wait_ready(lambda: stopping["signal"] is not None)
        for node in status.get("nodes", []):
            log.info(
                "data node %d: %d rows, %.1f MiB, loaded in %ss",
                node["index"],
                node["rows"],
                node["bytes"] / 2**20,
                node.get("load_seconds"),
            )
        log.info("the head's /ready, /live, /status and /metrics: %s", cluster.health_url)
        try:
            print(f"READY {cluster.location}", flush=True)
        except OSError as err:  # BrokenPipeError: whoever started us stopped reading
            # Nothing else is written there; /dev/null keeps the exit's own flush from failing too.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            log.error("stdout is closed (%s): the READY line could not be written; stopping the cache", err)
            return 1
        threading.Thread(target=watch_head, args=(cluster, watching), name="watch-head", daemon=True).start()
        while stopping["signal"] is None:
            dead = cluster._dead()
            if dead and stopping["signal"] is None:  # not a node that exited on the same Ctrl-C
                log.error("%s; stopping the cache", dead)
                return 1
            time.sleep(0.2)
        return 0
    except StoppedBeforeReady:
        log.info("stopped by a signal before the cache was ready")
        return 0  # as a stop while serving: the operator asked for it
    except RuntimeError as err:
        if stopping["signal"] is not None:  # whatever it was, the operator asked to stop meanwhile
            log.info("stopped by a signal before the cache was ready (%s)", err)
            return 0
        log.error("cache failed: %s", err)
        # A node that refused its settings (exit 2, its error line printed) is a settings error of ours.
        return 2 if any(proc.returncode == 2 for _, proc in cluster.procs) else 1
    finally:
        watching.set()
        cluster.stop()
