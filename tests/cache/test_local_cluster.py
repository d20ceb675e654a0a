"""`data-cache local` owns what it reports and what it starts: it never reports READY for a cache
it did not start, and its nodes do not outlive it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from kubeflow_data_cache.client import CacheClient
from kubeflow_data_cache.constants import SHUTDOWN_GRACE_SECONDS
from kubeflow_data_cache.memory import available_cpus
from kubeflow_data_cache.processes import DUMP_STACKS_SIGNAL
from tests.cache.conftest import read_path_shards
from tests.cache.test_config_errors import assert_one_line_error
from tests.conftest import LocalCache

DEADLINE = 60


def gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE  # exited, its exit code not yet collected
    except psutil.NoSuchProcess:
        return True


def test_a_port_another_cache_serves_is_refused_not_reported_ready(small_cache, small_table):
    """A second `local` on a running cache's port used to print READY for the first one."""
    started = time.monotonic()
    cmd = [sys.executable, "-m", "kubeflow_data_cache", "local", "--metadata-loc", small_table.metadata_location]
    result = subprocess.run(
        [*cmd, "--port", str(small_cache.port)],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        env=os.environ,
    )
    assert "READY" not in result.stdout
    assert_one_line_error(result, f"port {small_cache.port}", "already in use", "--port")
    assert time.monotonic() - started < 30  # refused before any node starts


_HOLD_PORT = """
import sys
from kubeflow_data_cache import local
print(local._reserve(int(sys.argv[1])), flush=True)
sys.stdin.read()  # a `local` whose head is still importing, its --port not bound yet
"""


def test_a_port_another_local_is_starting_on_is_refused_at_once(small_table):
    """A second `local` given the same --port while the first's head was still starting found it
    free too (nothing bound it yet), and printed READY for the first's cache, its own table unread."""
    from tests.conftest import free_port

    port = free_port()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_PORT, str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "True"
        cmd = [sys.executable, "-m", "kubeflow_data_cache", "local", "--metadata-loc", small_table.metadata_location]
        result = subprocess.run([*cmd, "--port", str(port)], capture_output=True, text=True, timeout=DEADLINE)
    finally:
        holder.stdin.close()
        holder.wait(30)
    assert result.returncode == 2 and "READY" not in result.stdout
    assert_one_line_error(
        result, f"port {port} is taken by another `data-cache local` that is still starting", "--port"
    )


def test_a_status_from_a_head_this_local_did_not_start_is_refused(small_cache, small_table):
    """The port's check passes, then another cache binds it before our head does: its "ready"
    was taken for ours. A head's status names its process, and local takes only its own head's."""
    import json

    import pyarrow.flight as flight

    from kubeflow_data_cache import protocol
    from kubeflow_data_cache.local import LocalCluster

    with contextlib.closing(flight.FlightClient(small_cache.endpoint)) as client:
        (answer,) = client.do_action(flight.Action(protocol.ACTION_STATUS, b""))
    status = json.loads(answer.body.to_pybytes())
    heads = [c.pid for c in psutil.Process(small_cache.proc.pid).children() if " head " in " ".join(c.cmdline())]
    assert [status["pid"]] == heads  # the head's own process
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cluster = LocalCluster(small_table.metadata_location, 1, small_cache.port)
        cluster.procs.append(("head", ours))
        try:
            cluster._check_ours(status)
        except RuntimeError as err:
            refusal = str(err)
        else:
            raise AssertionError("a foreign head's status was taken as ours")
        assert refusal.startswith(
            f"another cache answers at grpc://127.0.0.1:{small_cache.port} (process {status['pid']}"
        )
        assert refusal.endswith("not the head this `local` started: pick another port with --port")
        cluster._check_ours({**status, "pid": ours.pid})  # our own head's answer passes
        # Nor one without a pid (a data node's, an older head's): named, not a KeyError.
        with pytest.raises(RuntimeError, match=r"\(process unknown, table"):
            cluster._check_ours({"role": "data-node", "state": "ready"})
    finally:
        ours.kill()
        ours.wait()


def test_port_0_picks_a_free_port_and_names_it(table_factory):
    table = table_factory(2000, 1)
    # The later --port 0 wins over the one LocalCache passes.
    cache = LocalCache(table.metadata_location, 1, args=("--port", "0", "--startup-timeout", "30"))
    try:
        location = cache.wait_ready(timeout=DEADLINE).split()[1]
        assert not location.endswith(":0")
        assert read_path_shards(location).num_rows == 2000
    finally:
        cache.stop()


def test_the_head_and_each_node_say_once_what_they_load_as_the_load_starts(table_factory):
    """A pod's log showed "registered", then nothing until ready or failed: on a long S3 load,
    nothing said what was under way."""
    table = table_factory(3000, 3)
    cache = LocalCache(table.metadata_location, 2)
    try:
        cache.wait_ready(timeout=DEADLINE)
        log = cache.read_stderr()
    finally:
        cache.stop()
    started = [line for line in log.splitlines() if ": loading snapshot " in line]
    assert len(started) == 1 and " head INFO " in started[0], log[-3000:]
    assert re.search(
        r"loading snapshot \d+: 3000 rows in 3 data file\(s\), about [\d.]+ MiB in memory, on 2", started[0]
    )
    for node, rows in ((0, "0-1500"), (1, "1500-3000")):
        said = [line for line in log.splitlines() if f"data node {node} loading rows " in line]
        assert len(said) == 1 and f"loading rows {rows} (1500 rows) from " in said[0], log[-3000:]


def test_the_table_names_given_to_local_reach_every_process(table_factory):
    """Without them, a cache of demo.events reported itself as default.table."""
    table = table_factory(2000, 1)
    cache = LocalCache(table.metadata_location, 2, args=("--schema-name", "demo", "--table-name", "events"))
    try:
        cache.wait_ready(timeout=DEADLINE)
        with CacheClient(cache.endpoint) as client:
            head = client.status()
            assert head["table"] == "demo.events"
            for node in head["nodes"]:
                assert client.status(node["location"])["table"] == "demo.events"
    finally:
        cache.stop()


def test_the_log_level_given_to_local_reaches_every_process(table_factory):
    """`data-cache --log-level DEBUG local` set only local's own level: the head and the nodes,
    which do the work, stayed at INFO."""
    table = table_factory(2000, 1)
    # The env says WARNING, which the processes inherit: the flag overrides it for all of them.
    cache = LocalCache(table.metadata_location, 1, env={"LOG_LEVEL": "WARNING"}, options=("--log-level", "DEBUG"))
    try:
        cache.wait_ready(timeout=DEADLINE)
    finally:
        cache.stop()
    lines = cache.stderr.splitlines()
    assert any(" node-0 DEBUG " in line for line in lines), cache.stderr[-3000:]
    assert any(" head INFO " in line for line in lines), cache.stderr[-3000:]  # the head logs nothing at DEBUG


def test_nodes_stop_when_local_is_sigkilled(table_factory):
    """Nobody is left to stop the nodes: each gets SIGTERM from the kernel (PR_SET_PDEATHSIG)."""
    cache = LocalCache(table_factory(2000, 1).metadata_location, 2)
    try:
        cache.wait_ready()
        nodes = psutil.Process(cache.proc.pid).children()
        assert len(nodes) == 3  # the head and two data nodes
        cache.proc.send_signal(signal.SIGKILL)
        cache.proc.wait(timeout=DEADLINE)
        deadline = time.monotonic() + DEADLINE
        while not all(gone(node) for node in nodes) and time.monotonic() < deadline:
            time.sleep(0.1)
        stuck = [node for node in nodes if not gone(node)]
        for node in stuck:  # what it is doing: every thread's stack, to the shared stderr
            with contextlib.suppress(psutil.Error):
                node.send_signal(DUMP_STACKS_SIGNAL)
        time.sleep(1 if stuck else 0)
        assert not stuck, (
            f"still running {DEADLINE}s after `local` was killed: {[(n.pid, n.cmdline()) for n in stuck]}\n"
            f"{cache.read_stderr()[-6000:]}"
        )
    finally:
        cache.stop()  # SIGKILL to its whole session sweeps up whatever is left


def _stalled_reader(cache: LocalCache):
    """A reader and the stream it stopped reading after one chunk (the node's writer blocks on
    flow control): hold both, as a stream let go of is cancelled; close the reader when done."""
    import pyarrow.flight as flight

    # bdp_probe off: gRPC would otherwise grow the window until the whole stream is buffered.
    options = [("grpc.http2.bdp_probe", 0)]
    info = flight.FlightClient(cache.endpoint).get_flight_info(flight.FlightDescriptor.for_path("0", "1"))
    reader = flight.FlightClient(info.endpoints[0].locations[0].uri.decode(), generic_options=options)
    stream = reader.do_get(info.endpoints[0].ticket)
    stream.read_chunk()
    return reader, stream


def _child(cache: LocalCache, role: str) -> psutil.Process:
    """The `local`'s head (``"head"``) or its only data node (``"worker"``)."""
    (child,) = [p for p in psutil.Process(cache.proc.pid).children() if f" {role} " in " ".join(p.cmdline())]
    return child


def test_a_stalled_reader_lets_the_nodes_end_their_own_grace_under_sigterm(table_factory):
    """SIGTERM to `local` while a reader holds a stream it stopped reading: the node waits out
    its own grace for streams, says so and exits 0; `local` must not SIGKILL it first."""
    cache = LocalCache(table_factory(200_000, 2).metadata_location, 1)
    try:
        cache.wait_ready()
        reader, _stream = _stalled_reader(cache)
        started = time.monotonic()
        cache.proc.send_signal(signal.SIGTERM)
        assert cache.proc.wait(timeout=SHUTDOWN_GRACE_SECONDS + 30) == 0
        assert time.monotonic() - started >= SHUTDOWN_GRACE_SECONDS - 1
        log = cache.read_stderr()
        assert "exiting without them" in log
        assert "waiting up to 10s for 1 open stream(s) to finish" in log
        # The head stops at once; the node, draining, went on trying to register with it.
        assert "cannot register with the head" not in log, log[-3000:]
        reader.close()
    finally:
        cache.stop()


@pytest.mark.parametrize("first", ["ctrl-c", "sigterm"])
def test_ctrl_c_again_ends_the_wait_for_a_stalled_reader(table_factory, first):
    """A second Ctrl-C was recorded and ignored: the terminal waited out the whole grace (also
    after a `kill`, then a Ctrl-C)."""
    cache = LocalCache(table_factory(200_000, 2).metadata_location, 1)
    try:
        cache.wait_ready()
        reader, _stream = _stalled_reader(cache)
        started = time.monotonic()
        if first == "ctrl-c":
            os.killpg(cache.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole group
            _wait_logged(cache, "waiting up to 10s for 1 open stream(s) to finish (Ctrl-C again to stop now)")
        else:
            cache.proc.send_signal(signal.SIGTERM)  # `local` alone; it stops its nodes with SIGTERM
            _wait_logged(cache, "waiting up to 10s for 1 open stream(s) to finish\n")
        os.killpg(cache.proc.pid, signal.SIGINT)
        assert cache.proc.wait(timeout=SHUTDOWN_GRACE_SECONDS + 30) == 0
        assert time.monotonic() - started < SHUTDOWN_GRACE_SECONDS - 3, cache.read_stderr()[-3000:]
        reader.close()
    finally:
        cache.stop()


def test_a_data_node_killed_by_sigkill_is_named_with_the_likely_cause(table_factory):
    """Said as "was killed by SIGKILL" alone, though nothing of ours sends it: the OOM killer does."""
    cache = LocalCache(table_factory(2000, 1).metadata_location, 1)
    try:
        cache.wait_ready()
        _child(cache, "worker").kill()
        assert cache.proc.wait(timeout=DEADLINE) == 1
        assert (
            "data node 0 was killed by SIGKILL (as the kernel's OOM killer ends a process: if it ran out of memory, "
            "spread the table over more --data-nodes, or give each one more with --memory-limit); stopping the cache"
        ) in cache.read_stderr()
    finally:
        cache.stop()


def _wait_logged(cache: LocalCache, text: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while text not in cache.read_stderr():
        assert time.monotonic() < deadline, f"{text!r} not logged: {cache.read_stderr()[-3000:]}"
        time.sleep(0.2)


def test_local_says_when_the_serving_cache_degrades_and_when_it_recovers(table_factory):
    """A frozen data node or head after READY left the terminal silent, every read refused."""
    cache = LocalCache(table_factory(2000, 1).metadata_location, 1)
    try:
        cache.wait_ready()
        node, head = _child(cache, "worker"), _child(cache, "head")
        node.suspend()
        _wait_logged(cache, "WARNING kubeflow_data_cache.local: cache degraded: ")
        node.resume()
        _wait_logged(cache, "INFO kubeflow_data_cache.local: cache ready again: ")
        head.suspend()
        _wait_logged(cache, "the head has not answered for ")
        head.resume()
        _wait_logged(cache, "the head answers again")
        assert cache.proc.poll() is None  # still serving: it says so, it does not stop
    finally:
        cache.stop()


def test_the_watch_ends_quietly_when_the_head_says_it_is_stopping(monkeypatch, caplog):
    """A Ctrl-C reaches the head as well as local: the head's "stopping" could come before local's
    own loop ended the watch, which then warned "cache stopping" on every Ctrl-C."""
    import threading
    from types import SimpleNamespace

    from kubeflow_data_cache import local

    answers = iter([{"state": "ready", "detail": "2000 rows"}, {"state": "stopping", "detail": "shutting down"}])
    asked = []

    def head_status(client):
        asked.append(1)
        return next(answers)

    cluster = SimpleNamespace(
        tls=SimpleNamespace(client_for=lambda location: None), head_location="grpc://h:1", head_status=head_status
    )
    monkeypatch.setattr(local, "WATCH_SECONDS", 0.01)
    watch = threading.Thread(target=local.watch_head, args=(cluster, threading.Event()), daemon=True)
    watch.start()
    watch.join(10)
    assert not watch.is_alive() and len(asked) == 2  # ended at the head's "stopping", asking no more
    assert "cache stopping" not in caplog.text


def test_sigusr1_dumps_every_threads_stack_and_keeps_serving(table_factory):
    """An operator's view into a process that seems stuck (`kill -USR1`), which leaves it running."""
    cache = LocalCache(table_factory(2000, 1).metadata_location, 1)
    try:
        location = cache.wait_ready().split()[1]
        head = next(p for p in psutil.Process(cache.proc.pid).children() if "head" in p.cmdline())
        head.send_signal(DUMP_STACKS_SIGNAL)
        deadline = time.monotonic() + DEADLINE
        while "Current thread" not in cache.read_stderr() and time.monotonic() < deadline:
            time.sleep(0.1)
        dump = cache.read_stderr()
        assert "Current thread" in dump and "Thread 0x" in dump, dump[-3000:]
        assert "run_node" in dump  # the main thread's Python stack, waiting for a signal to stop
        assert read_path_shards(location).num_rows == 2000
        # `local` itself too: USR1's default action ended it, and it stopped the whole cache.
        cache.proc.send_signal(DUMP_STACKS_SIGNAL)
        deadline = time.monotonic() + DEADLINE
        while "run_local" not in cache.read_stderr() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "run_local" in cache.read_stderr()
        assert cache.proc.poll() is None
        assert read_path_shards(location).num_rows == 2000
    finally:
        cache.stop()


def test_local_started_with_stderr_closed_still_serves(table_factory):
    """`data-cache local ... 2>&-`: every process failed at start-up with nothing said (logging
    and faulthandler had no stderr) and `local` exited 1; the logs now go to /dev/null."""
    cache = LocalCache(table_factory(2000, 1).metadata_location, 1, preexec=lambda: os.close(2))
    try:
        location = cache.wait_ready(timeout=DEADLINE).split()[1]
        assert read_path_shards(location).num_rows == 2000
        cache.proc.send_signal(signal.SIGTERM)
        assert cache.proc.wait(timeout=DEADLINE) == 0
    finally:
        cache.stop()


def test_a_closed_stdout_stops_local_with_one_line_not_a_traceback(table_factory):
    """Whoever started `local` stopped reading before READY: a BrokenPipeError traceback before."""
    cache = LocalCache(table_factory(2000, 1).metadata_location, 1)
    try:
        cache.proc.stdout.close()
        assert cache.proc.wait(timeout=DEADLINE) == 1
        err = cache.read_stderr()
        assert "stdout is closed" in err and "the READY line could not be written" in err, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
    finally:
        cache.stop()


def test_sighup_to_the_process_group_stops_every_process_in_order(table_factory):
    """A closed terminal's SIGHUP reaches `local`, the head and the nodes at once. Its default
    action killed each on the spot (`local` exited -1, the nodes without their stream grace)."""
    cache = LocalCache(table_factory(2000, 1).metadata_location, 1)
    try:
        cache.wait_ready()
        nodes = psutil.Process(cache.proc.pid).children()
        os.killpg(cache.proc.pid, signal.SIGHUP)  # its own session and group (LocalCache)
        assert cache.proc.wait(timeout=DEADLINE) == 0
        _, alive = psutil.wait_procs(nodes, timeout=DEADLINE)
        assert not alive
        err = cache.read_stderr()
        assert "head stopping on SIGHUP" in err and "worker stopping on SIGHUP" in err, err[-3000:]
    finally:
        cache.stop()


def _ignore_sighup() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def test_under_nohup_a_closed_terminal_leaves_every_process_serving(table_factory):
    """`nohup data-cache local ...` asks the cache to outlive its terminal: SIGHUP ignored on
    start stays ignored in `local` and in the nodes it starts (they inherit it through exec)."""
    table = table_factory(2000, 2)
    cache = LocalCache(table.metadata_location, 2, preexec=_ignore_sighup)
    try:
        location = cache.wait_ready().split()[1]
        nodes = psutil.Process(cache.proc.pid).children()
        assert len(nodes) == 3
        os.killpg(cache.proc.pid, signal.SIGHUP)
        # Several of the nodes' signal polls (runner.STOP_POLL_SECONDS) and `local`'s own loop.
        time.sleep(1.5)
        assert cache.proc.poll() is None, cache.read_stderr()[-3000:]
        assert not [node.cmdline() for node in nodes if gone(node)]
        assert read_path_shards(location).num_rows == table.rows
        assert "stopping on SIGHUP" not in cache.read_stderr()
        assert cache.stop() == 0  # SIGTERM still stops it the ordinary way
    finally:
        cache.stop()


def test_the_nodes_ports_are_drawn_below_the_ephemeral_range_skipping_taken_ones(monkeypatch):
    """Picked by binding port 0, a node's port was one the OS then handed to an outgoing
    connection before the node bound it: the head failed "Address already in use" in a CI run."""
    import socket

    from kubeflow_data_cache import local

    with socket.socket() as listener:  # something listening where the scan starts
        for port in local.LOCAL_PORTS:
            try:
                listener.bind(("127.0.0.1", port))
            except OSError:
                continue
            break
        listener.listen()
        held = listener.getsockname()[1]
        start = local.LOCAL_PORTS.index(held)
        monkeypatch.setattr(local.secrets, "randbelow", lambda n: start)
        ports = local._free_ports("127.0.0.1", 5, taken={held + 1})
    assert len(set(ports)) == 5 and all(p in local.LOCAL_PORTS for p in ports), ports
    assert held not in ports and held + 1 not in ports
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", ports[0]))  # free, as handed out


_DRAW_AND_HOLD = """
import sys
from kubeflow_data_cache import local
local.secrets.randbelow = lambda n: int(sys.argv[1])  # both draws scan from the same start
print(",".join(map(str, local._free_ports("127.0.0.1", 8, set()))), flush=True)
sys.stdin.read()  # a `local` lives on, its nodes about to bind
"""


def test_two_locals_drawing_at_once_never_hand_out_the_same_port():
    """Two `local`s started together (parallel test workers) scanned the same free ports before
    either's nodes bound them, and one head failed "port 16953 on 0.0.0.0 is already in use" in a
    fresh-clone CI run. A port handed out stays locked to its `local` until that one exits."""
    import secrets

    from kubeflow_data_cache import local

    start = str(secrets.randbelow(len(local.LOCAL_PORTS) - 100))
    children, drawn = [], []
    try:
        for _ in range(2):
            child = subprocess.Popen(
                [sys.executable, "-c", _DRAW_AND_HOLD, start], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            children.append(child)
            drawn.append(set(map(int, child.stdout.readline().split(","))))
    finally:
        for child in children:
            child.stdin.close()
            child.wait(30)
    assert len(drawn[0]) == len(drawn[1]) == 8, drawn
    assert not drawn[0] & drawn[1], drawn
    # Once the first has exited, its ports are free to hand out again.
    again = subprocess.run(
        [sys.executable, "-c", _DRAW_AND_HOLD, start], input="", capture_output=True, text=True, timeout=30
    )
    assert set(map(int, again.stdout.split(","))) & drawn[0], (again.stdout, drawn)


def test_a_local_removes_its_port_lock_files_as_it_exits(table_factory, tmp_path):
    """The lock folder kept an empty file for every port ever handed out: 5,000 on this machine."""
    locks = tmp_path / "data-cache-local-ports"
    cache = LocalCache(table_factory(1000, 1).metadata_location, data_nodes=2, env={"TMPDIR": str(tmp_path)})
    try:
        cache.wait_ready()
        held = sorted(p.name for p in locks.iterdir())
        assert len(held) == 6, held  # the head's two ports, and a Flight and a health port per data node
    finally:
        assert cache.stop() == 0
    assert list(locks.iterdir()) == []


def test_a_lock_taken_on_a_file_its_holder_removed_meanwhile_is_not_a_reservation(tmp_path, monkeypatch):
    """A holder removes its file while it still holds the lock; one who opened the file before
    that and locked it after holds a lock on a file no one else will open: not the port."""
    import fcntl

    from kubeflow_data_cache import local

    monkeypatch.setattr(local, "PORT_LOCK_DIR", tmp_path)
    monkeypatch.setattr(local, "_port_locks", [])
    real_flock = fcntl.flock

    def holder_lets_go_first(fd, operation):
        (tmp_path / "12345.lock").unlink()  # the holder's release_ports, between our open and lock
        return real_flock(fd, operation)

    monkeypatch.setattr(local.fcntl, "flock", holder_lets_go_first)
    assert local._reserve(12345) is False
    monkeypatch.setattr(local.fcntl, "flock", real_flock)
    assert local._reserve(12345) is True  # a fresh file, locked: the port is ours
    local.release_ports()
    assert list(tmp_path.iterdir()) == []


def test_a_child_forked_from_a_local_leaves_its_parents_port_locks(tmp_path, monkeypatch):
    """A forked child that exits normally ran the inherited atexit hook and removed the files its
    parent still held: another `local` could then take the same port."""
    from kubeflow_data_cache import local

    monkeypatch.setattr(local, "PORT_LOCK_DIR", tmp_path)
    assert local._reserve(12346) is True
    try:
        pid = os.fork()
        if pid == 0:  # the child: what a normal exit runs
            code = 0
            try:
                local.release_ports()
            except BaseException:
                code = 1
            os._exit(code)
        assert os.waitpid(pid, 0)[1] == 0
        assert (tmp_path / "12346.lock").exists()
        assert local._reserve(12346) is False  # still ours: no one else takes it
    finally:
        local.release_ports()
    assert list(tmp_path.iterdir()) == []


def _flag(cmdline: list[str], flag: str) -> str:
    return cmdline[cmdline.index(flag) + 1]


def test_local_gives_its_nodes_the_startup_timeout_and_load_threads_of_its_environment(table_factory):
    """local passes its nodes these settings as flags, which beat the env: its own values (300 s,
    a share of the CPUs) ignored an exported DATA_CACHE_STARTUP_TIMEOUT_SECONDS or LOAD_THREADS
    without a word."""
    table = table_factory(2000, 1)
    # "+3" as the nodes' own parsing reads it: 3 (local once took it, then gave the CPU share).
    env = {"DATA_CACHE_STARTUP_TIMEOUT_SECONDS": "45", "LOAD_THREADS": "+3"}
    cache = LocalCache(table.metadata_location, 2, env=env)
    try:
        cache.wait_ready(timeout=DEADLINE)
        nodes = [child.cmdline() for child in psutil.Process(cache.proc.pid).children()]
        assert len(nodes) == 3, nodes
        assert {_flag(cmd, "--startup-timeout") for cmd in nodes} == {"45.0"}
        assert [_flag(cmd, "--load-threads") for cmd in nodes if "worker" in cmd] == ["3", "3"]
    finally:
        cache.stop()
    # The flag still wins over the env, and without either each node gets its share of the CPUs.
    cache = LocalCache(table.metadata_location, 2, env={**env, "LOAD_THREADS": ""}, args=("--startup-timeout", "50"))
    try:
        cache.wait_ready(timeout=DEADLINE)
        nodes = [child.cmdline() for child in psutil.Process(cache.proc.pid).children()]
        assert {_flag(cmd, "--startup-timeout") for cmd in nodes} == {"50.0"}
        share = str(max(1, available_cpus() // 2))
        assert [_flag(cmd, "--load-threads") for cmd in nodes if "worker" in cmd] == [share, share]
    finally:
        cache.stop()
