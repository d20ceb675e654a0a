"""/ready, /live, /status and /metrics of a head and a data node run in-process on loopback."""

from __future__ import annotations

import json
import time

import pyarrow as pa
import pytest

from kubeflow_data_cache.config import build_config
from kubeflow_data_cache.errors import NotReadyError
from kubeflow_data_cache.node import DataNode
from kubeflow_data_cache.service import LOADING, READY, STOPPING, HealthServer, Lifecycle, Metrics
from tests.cache.inprocess import FLAGS, get, wait_for


def test_ready_reports_progress_then_ready(cluster, small_table):
    head, head_health, _, _ = cluster(small_table.metadata_location, with_node=False)
    # The head plans at once, then waits for its data node, reporting how many registered.
    code, body = wait_for(lambda: (r := get(head_health.port, "/ready")) and "registered" in r[1] and r)
    assert code == 503 and "0/1 data nodes registered (data node 0 not registered)" in body
    assert get(head_health.port, "/live") == (200, "ok\n")

    cfg = build_config("worker", {**FLAGS, "index": 0, "head": head.location}, env={})
    node = DataNode(cfg)
    node_health = HealthServer("127.0.0.1", 0, node.lifecycle, node.metrics, node.status).start()
    try:
        node.start_registering()
        wait_for(lambda: get(head_health.port, "/ready")[0] == 200)
        assert get(node_health.port, "/ready")[0] == 200
        status = json.loads(get(head_health.port, "/status")[1])
        assert status["state"] == "ready" and status["rows"] == small_table.rows
        assert status["nodes"][0]["state"] == "ready"
        metrics = get(node_health.port, "/metrics")[1]
        assert f"data_cache_loaded_rows {float(small_table.rows)}" in metrics
        assert "data_cache_resident_memory_bytes" in metrics
        assert get(head_health.port, "/nope")[0] == 404
    finally:
        node.stop()
        node_health.stop()


def watch_states(lifecycle: Lifecycle, states: list[str]):
    """Record each state ``lifecycle`` takes into ``states`` (polled every 2 ms) until the
    returned function is called."""
    import threading

    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if not states or states[-1] != lifecycle.state:
                states.append(lifecycle.state)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()

    def stop() -> None:
        done.set()
        watcher.join(5)

    return stop


def test_the_heads_state_only_moves_forward_and_ready_counts_registrations_while_it_plans(
    cluster, small_table, monkeypatch
):
    """It went waiting -> loading (planning) -> waiting (nodes) -> loading, and while it planned
    /ready did not say that a node had registered (planning on S3 can take a long time)."""
    import threading

    from kubeflow_data_cache.head import Head

    planned = threading.Event()
    plan = Head._plan
    monkeypatch.setattr(Head, "_plan", lambda self: planned.wait(30) and plan(self))
    head, head_health, _, _ = cluster(small_table.metadata_location, with_node=False)
    states = []
    stop_watching = watch_states(head.lifecycle, states)
    code, body = wait_for(lambda: (r := get(head_health.port, "/ready")) and "planning" in r[1] and r)
    assert (code, body) == (
        503,
        "waiting: planning the table scan; 0/1 data nodes registered (data node 0 not registered)\n",
    )
    cfg = build_config("worker", {**FLAGS, "index": 0, "head": head.location}, env={})
    node = DataNode(cfg)
    try:
        node.start_registering()
        wait_for(lambda: "1/1" in get(head_health.port, "/ready")[1])
        assert get(head_health.port, "/ready") == (503, "waiting: planning the table scan; 1/1 data nodes registered\n")
        planned.set()
        wait_for(lambda: head.lifecycle.state == READY)
    finally:
        stop_watching()
        node.stop()
    assert states == ["waiting", "loading", "ready"] or states == ["waiting", "ready"], states


def test_a_head_that_planned_before_its_nodes_registered_waits_then_loads(cluster, small_table):
    """The order that sent the state back: planned first (waiting -> loading), then waiting for
    the node (-> waiting), then loading again."""

    head, head_health, _, _ = cluster(small_table.metadata_location, with_node=False)
    states = []
    stop_watching = watch_states(head.lifecycle, states)
    wait_for(lambda: head.plan_seconds > 0)  # planned, and no node yet
    assert get(head_health.port, "/ready") == (503, "waiting: 0/1 data nodes registered (data node 0 not registered)\n")
    cfg = build_config("worker", {**FLAGS, "index": 0, "head": head.location}, env={})
    node = DataNode(cfg)
    try:
        node.start_registering()
        wait_for(lambda: head.lifecycle.state == READY)
    finally:
        stop_watching()
        node.stop()
    assert states in (["waiting", "loading", "ready"], ["waiting", "ready"]), states


def test_served_bytes_are_the_arrow_bytes_the_client_receives(cluster, small_table):
    """In order, shuffled or filtered, the same rows count the bytes the client gets: gathers and
    filters gave string columns an all-valid bitmap that Flight does not send, counted served."""
    import pyarrow.flight as flight

    head, _head_health, _node, node_health = cluster(small_table.metadata_location)
    wait_for(lambda: head.lifecycle.state == "ready")
    client = flight.FlightClient(head.location)

    def served() -> float:
        metrics = get(node_health.port, "/metrics")[1]
        return float(
            next(line.split()[1] for line in metrics.splitlines() if line.startswith("data_cache_served_bytes_total "))
        )

    for request in ({}, {"shuffle": True, "seed": 3}, {"filter": "id >= 0"}):
        before = served()
        info = client.get_flight_info(flight.FlightDescriptor.for_command(json.dumps(request)))
        received = sum(
            chunk.data.nbytes
            for ep in info.endpoints
            for chunk in flight.FlightClient(ep.locations[0]).do_get(ep.ticket)
        )
        assert served() - before == received, request


def test_load_error_is_the_ready_reason(cluster, tmp_path):
    head, head_health, _node, _node_health = cluster(str(tmp_path / "missing.metadata.json"))
    wait_for(lambda: head.lifecycle.state == "failed")
    code, body = get(head_health.port, "/ready")
    assert code == 503 and "does not exist" in body
    status = json.loads(get(head_health.port, "/status")[1])
    assert status["state"] == "failed" and "METADATA_LOC" in status["error"]


def test_served_rows_are_counted(cluster, small_table):
    import pyarrow.flight as flight

    head, head_health, _node, node_health = cluster(small_table.metadata_location)
    wait_for(lambda: head.lifecycle.state == "ready")
    client = flight.FlightClient(head.location)
    info = client.get_flight_info(flight.FlightDescriptor.for_path("0", "1"))
    rows = sum(flight.FlightClient(ep.locations[0]).do_get(ep.ticket).read_all().num_rows for ep in info.endpoints)
    assert rows == small_table.rows
    metrics = get(node_health.port, "/metrics")[1]
    assert f"data_cache_served_rows_total {float(rows)}" in metrics
    assert 'data_cache_requests_total{action="",method="DoGet"} 1.0' in metrics
    head_metrics = get(head_health.port, "/metrics")[1]
    assert 'data_cache_requests_total{action="",method="GetFlightInfo"} 1.0' in head_metrics
    # Which table each scraped pod caches (SCHEMA_NAME.TABLE_NAME; the defaults here).
    assert 'data_cache_info{role="head",table="default.table"} 1.0' in head_metrics
    assert 'data_cache_info{role="data-node",table="default.table"} 1.0' in metrics
    # Every call is timed, once, on the role that answered it.
    assert 'data_cache_request_seconds_count{action="",method="GetFlightInfo"} 1.0' in head_metrics
    assert 'data_cache_request_seconds_count{action="",method="DoGet"} 1.0' in metrics
    assert 'data_cache_request_seconds_bucket{action="",le="+Inf",method="DoGet"} 1.0' in metrics
    # A refused call is timed as well.
    with pytest.raises(pa.ArrowInvalid, match="out of range"):
        client.get_flight_info(flight.FlightDescriptor.for_path("5", "1"))
    head_metrics = get(head_health.port, "/metrics")[1]
    assert 'data_cache_request_seconds_count{action="",method="GetFlightInfo"} 2.0' in head_metrics
    # ListFlights answers with a FlightInfo, but it is one call: counted and timed as ListFlights only.
    assert len(list(client.list_flights())) == 1
    head_metrics = get(head_health.port, "/metrics")[1]
    assert 'data_cache_requests_total{action="",method="ListFlights"} 1.0' in head_metrics
    assert 'data_cache_request_seconds_count{action="",method="ListFlights"} 1.0' in head_metrics
    assert 'data_cache_requests_total{action="",method="GetFlightInfo"} 2.0' in head_metrics
    assert 'data_cache_request_seconds_count{action="",method="GetFlightInfo"} 2.0' in head_metrics
    # ListActions was counted only when refused for its token, never when served.
    assert {a.type for a in client.list_actions()} >= {"status"}
    head_metrics = get(head_health.port, "/metrics")[1]
    assert 'data_cache_requests_total{action="",method="ListActions"} 1.0' in head_metrics
    # No *_created series beside each counter (they doubled a scrape); the process's own are there.
    assert "_created" not in head_metrics + metrics
    for name in ("process_start_time_seconds", "process_cpu_seconds_total", "process_open_fds"):
        assert f"\n{name} " in head_metrics, name


def test_calls_are_labelled_with_the_action_they_carry(cluster, small_table):
    """The cache's own calls (the head's load, count and status polls, a node's register) were
    counted with readers' under method="DoAction", and one reader's bad filter counted as an
    error on every data node too: the ``action`` label tells them apart."""
    import pyarrow.flight as flight

    from kubeflow_data_cache.protocol import ShardRequest

    head, _head_health, node, _node_health = cluster(small_table.metadata_location)
    wait_for(lambda: head.lifecycle.state == "ready")
    client = flight.FlightClient(head.location)
    with pytest.raises(pa.ArrowInvalid, match="no_such_column"):
        client.get_flight_info(flight.FlightDescriptor.for_command(ShardRequest(filter="no_such_column > 1").to_json()))
    with pytest.raises(pa.ArrowNotImplementedError):
        list(client.do_action(flight.Action("made-up-by-a-client", b"")))
    on_head, on_node = head.metrics.registry.get_sample_value, node.metrics.registry.get_sample_value
    assert (
        on_head("data_cache_errors_total", {"method": "GetFlightInfo", "action": "", "code": "INVALID_ARGUMENT"}) == 1
    )
    assert on_head("data_cache_errors_total", {"method": "DoAction", "action": "other", "code": "UNIMPLEMENTED"}) == 1
    assert on_head("data_cache_requests_total", {"method": "DoAction", "action": "register"}) >= 1
    assert on_node("data_cache_requests_total", {"method": "DoAction", "action": "load"}) == 1
    assert (
        on_node("data_cache_errors_total", {"method": "DoAction", "action": "count", "code": "INVALID_ARGUMENT"}) == 1
    )
    assert on_node("data_cache_errors_total", {"method": "DoAction", "action": "", "code": "INVALID_ARGUMENT"}) is None


def test_the_gauges_follow_what_ready_and_status_say(cluster, small_table):
    """ready, rows_loaded and bytes_loaded were set on events and drifted: a node kept
    data_cache_ready 1 after SIGTERM (its /ready 503), and a node given a new assignment kept
    counting its old rows while /status said 0."""
    from kubeflow_data_cache.service import LOADING, STOPPING

    head, head_health, node, node_health = cluster(small_table.metadata_location)
    wait_for(lambda: head.lifecycle.state == "ready")
    metrics = get(node_health.port, "/metrics")[1]
    assert "data_cache_ready 1.0" in metrics and f"data_cache_loaded_rows {float(small_table.rows)}" in metrics
    assert f"data_cache_loaded_bytes {float(node.store.nbytes)}" in metrics

    node.store, node.filters = None, None  # as a new assignment leaves it (node._start_load)
    node.lifecycle.set(LOADING, "reading data files")
    metrics = get(node_health.port, "/metrics")[1]
    assert "data_cache_ready 0.0" in metrics and "data_cache_loaded_rows 0.0" in metrics
    assert "data_cache_loaded_bytes 0.0" in metrics

    head.lifecycle.set(STOPPING, "shutting down")  # what SIGTERM does (runner.serve)
    assert get(head_health.port, "/ready")[0] == 503
    assert "data_cache_ready 0.0" in get(head_health.port, "/metrics")[1]


def test_nodes_report_their_load_without_waiting_for_the_poll(cluster, small_table, monkeypatch):
    """A node re-registers the moment its load ends, which wakes the head: with the fallback
    poll stretched to a minute, the head is still ready within seconds."""
    import kubeflow_data_cache.head as head_module

    monkeypatch.setattr(head_module, "LOAD_POLL_SECONDS", 60.0)
    _, head_health, _, _ = cluster(small_table.metadata_location)
    wait_for(lambda: get(head_health.port, "/ready")[0] == 200, timeout=30)
    assert json.loads(get(head_health.port, "/status")[1])["rows"] == small_table.rows


def test_a_node_that_cannot_register_says_why_on_ready():
    from tests.conftest import free_port

    head = f"grpc://127.0.0.1:{free_port()}"  # nothing listens there
    node = DataNode(build_config("worker", {**FLAGS, "index": 0, "head": head}, env={}))
    health = HealthServer("127.0.0.1", 0, node.lifecycle, node.metrics, node.status).start()
    try:
        node.start_registering()
        code, body = wait_for(lambda: (r := get(health.port, "/ready")) and "cannot register" in r[1] and r)
        assert code == 503 and f"cannot register with the head at {head} yet" in body
    finally:
        node.stop()
        health.stop()


def test_a_node_pointed_at_a_flight_server_that_is_no_head_fails_at_once():
    """Another data node's port, say: "action 'register' is not implemented" was retried to the
    startup deadline (600 s) and then reported as a head it "could not reach"."""
    import pyarrow.flight as flight

    from kubeflow_data_cache.service import FAILED

    other = flight.FlightServerBase("grpc://127.0.0.1:0")
    head = f"grpc://127.0.0.1:{other.port}"
    node = DataNode(build_config("worker", {**FLAGS, "index": 0, "head": head, "startup_timeout": 600}, env={}))
    try:
        node.start_registering()
        wait_for(lambda: node.lifecycle.state == FAILED, timeout=30)
        assert f"data node 0: {head} answers Flight but is not a data cache head" in node.lifecycle.detail
        assert "point --head (or LWS_LEADER_ADDRESS and FLIGHT_PORT) at the head's Flight port" in node.lifecycle.detail
    finally:
        node.stop()
        other.shutdown()


def test_a_load_that_ends_during_shutdown_leaves_the_node_stopping():
    """SIGTERM sets `stopping` (/ready 503) while a load may still be running: its end must not
    turn the node back to ready for the rest of the shutdown's grace."""
    lifecycle = Lifecycle()
    lifecycle.set(LOADING, "loading")
    lifecycle.set(STOPPING, "shutting down")
    lifecycle.set(READY, "1,000 rows")
    assert (lifecycle.state, lifecycle.detail) == (STOPPING, "shutting down")
    with pytest.raises(NotReadyError):
        lifecycle.require_ready()


def test_a_connection_that_never_sends_its_request_is_closed(monkeypatch):
    """The health port takes no token: a client that connects and says nothing (or half a request
    line) is dropped after the request timeout instead of holding a server thread for ever."""
    import socket

    from kubeflow_data_cache import service

    monkeypatch.setattr(service, "HEALTH_REQUEST_TIMEOUT_SECONDS", 0.5)
    server = HealthServer("127.0.0.1", 0, Lifecycle(), Metrics("head"), dict).start()
    try:
        for sent in (b"", b"GET /rea"):
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as idle:
                idle.sendall(sent)
                assert idle.recv(1024) == b"", "the server closes the connection"  # not a socket timeout
        assert get(server.port, "/live") == (200, "ok\n")
    finally:
        server.stop()


def test_a_client_that_trickles_its_request_is_closed_at_the_request_deadline(monkeypatch):
    """A byte every 0.2 s passes every per-read timeout (0.5 s): the whole request has the same
    bound, so such a client cannot hold a server thread for ever either."""
    import socket

    from kubeflow_data_cache import service

    monkeypatch.setattr(service, "HEALTH_REQUEST_TIMEOUT_SECONDS", 0.5)
    server = HealthServer("127.0.0.1", 0, Lifecycle(), Metrics("head"), dict).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as slow:
            started = time.monotonic()
            closed = False
            for byte in b"GET /live HTTP/1.0\r\nX-Slow: " + b"a" * 200:
                try:
                    slow.sendall(bytes([byte]))
                except OSError:  # the server shut the connection: a reset on send
                    closed = True
                    break
                time.sleep(0.2)
                if time.monotonic() - started > 5:
                    break
            if not closed:
                slow.settimeout(5)
                try:
                    closed = slow.recv(1024) == b""
                except OSError:
                    closed = True
            assert closed, "the connection outlived its request deadline"
            assert time.monotonic() - started < 3
        assert get(server.port, "/live") == (200, "ok\n")
    finally:
        server.stop()


def test_a_flood_of_idle_connections_holds_no_threads_and_probes_are_answered():
    """2,000 connections that sent nothing held 3,385 threads on a data node (one per connection,
    and a timer each); when they closed together its threads, Flight's too, stalled for seconds,
    and the head's status poll timed out. Idle connections now cost no thread, past MAX_WAITING
    the longest waiting is closed, and a probe is answered throughout."""
    import socket
    import threading

    from kubeflow_data_cache import health_http

    server = HealthServer("127.0.0.1", 0, Lifecycle(), Metrics("head"), dict).start()
    idle: list[socket.socket] = []
    try:
        assert get(server.port, "/live") == (200, "ok\n")
        threads_before = threading.active_count()
        for _ in range(health_http.MAX_WAITING + 100):
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=10))
        started = time.monotonic()
        assert get(server.port, "/live") == (200, "ok\n")
        assert time.monotonic() - started < 2, "a probe waited behind the idle connections"
        assert threading.active_count() <= threads_before + health_http.ANSWER_THREADS
        # Once the longest waiting has waited long enough, a new connection closes it; the
        # newest still wait.
        time.sleep(health_http.CLOSE_AFTER_WAITING_SECONDS + 0.2)
        idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=10))
        idle[0].settimeout(5)
        assert idle[0].recv(1) == b""
        idle[-1].settimeout(0.2)
        with pytest.raises(TimeoutError):
            idle[-1].recv(1)
        for sock in idle:
            sock.close()
        assert get(server.port, "/live") == (200, "ok\n")
    finally:
        for sock in idle:
            sock.close()
        server.stop()


def test_a_burst_of_new_connections_does_not_close_one_whose_request_is_not_read_yet(monkeypatch):
    """A probe accepted just before a burst, its request not yet read, was the longest waiting
    and closed for the burst's first connection past MAX_WAITING. A connection is closed for a
    newer one only once it has waited CLOSE_AFTER_WAITING_SECONDS (or at MAX_WAITING_BURST)."""
    import socket

    from kubeflow_data_cache import health_http

    monkeypatch.setattr(health_http, "MAX_WAITING", 4)
    monkeypatch.setattr(health_http, "MAX_WAITING_BURST", 16)
    server = HealthServer("127.0.0.1", 0, Lifecycle(), Metrics("head"), dict).start()
    burst: list[socket.socket] = []
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as probe:
            burst += [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(8)]
            time.sleep(0.2)  # all accepted: the probe is the longest waiting
            probe.sendall(b"GET /live HTTP/1.0\r\n\r\n")
            assert probe.recv(1024).startswith(b"HTTP/1.0 200 OK")
        # Past the burst's bound the oldest goes whatever its age.
        burst += [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(16)]
        burst[0].settimeout(5)
        assert burst[0].recv(1) == b""
    finally:
        for sock in burst:
            sock.close()
        server.stop()


def test_probes_are_answered_ahead_of_slow_answers_and_a_burst_of_requests_is_queued():
    """Slow /status answers held every answering thread, and /live went unanswered for 10 s; and
    a burst of 300 real requests at once had 24 closed unanswered."""
    import concurrent.futures
    import threading

    from kubeflow_data_cache import health_http

    slow = threading.Event()

    def status() -> dict:
        if slow.is_set():
            time.sleep(2)
        else:
            time.sleep(0.02)
        return {}

    server = HealthServer("127.0.0.1", 0, Lifecycle(), Metrics("head"), status).start()
    try:
        with concurrent.futures.ThreadPoolExecutor(300) as pool:
            codes = list(pool.map(lambda _: get(server.port, "/status")[0], range(300)))
        assert codes == [200] * 300
        slow.set()
        with concurrent.futures.ThreadPoolExecutor(health_http.ANSWER_THREADS) as pool:
            held = [pool.submit(get, server.port, "/status") for _ in range(health_http.ANSWER_THREADS)]
            time.sleep(0.3)  # every answering thread is in a slow /status now
            started = time.monotonic()
            assert get(server.port, "/live") == (200, "ok\n")
            assert get(server.port, "/ready")[0] == 503
            assert time.monotonic() - started < 1, "the probes waited behind /status"
            assert [f.result()[0] for f in held] == [200] * health_http.ANSWER_THREADS
    finally:
        server.stop()


def test_past_the_queue_a_request_is_told_busy_and_a_failing_answer_is_a_500(monkeypatch):
    import concurrent.futures
    import threading
    import urllib.error
    import urllib.request

    from kubeflow_data_cache import health_http

    monkeypatch.setattr(health_http, "MAX_QUEUED", 2)
    slow, fail = threading.Event(), threading.Event()

    def status() -> dict:
        if fail.is_set():
            raise RuntimeError("status failed mid-reload")
        slow.wait(10)
        return {}

    def busy_answer() -> tuple[int, str | None, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/status", timeout=5) as answer:
                return answer.status, None, answer.read()
        except urllib.error.HTTPError as err:
            return err.code, err.headers["Retry-After"], err.read()

    server = HealthServer("127.0.0.1", 0, Lifecycle(), Metrics("head"), status).start()
    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        queued = [pool.submit(get, server.port, "/status") for _ in range(2)]
        time.sleep(0.3)
        assert busy_answer() == (503, "1", b"busy: too many requests wait for an answer; retry shortly\n")
        assert get(server.port, "/live") == (200, "ok\n")  # probes are never busy
        slow.set()
        assert [f.result()[0] for f in queued] == [200, 200]
        fail.set()
        assert get(server.port, "/status") == (500, "the answer failed; the process logged why\n")
    finally:
        slow.set()
        pool.shutdown()
        server.stop()


def test_an_answer_the_client_does_not_read_in_time_is_dropped_at_the_deadline(monkeypatch):
    """It stayed in the kernel's buffers, the connection open, past the deadline (an 8 MB one)."""
    import socket

    from kubeflow_data_cache import service

    monkeypatch.setattr(service, "HEALTH_REQUEST_TIMEOUT_SECONDS", 0.5)
    big = {"x": "a" * 8_000_000}
    server = HealthServer("127.0.0.1", 0, Lifecycle(), Metrics("head"), lambda: big).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            client.sendall(b"GET /status HTTP/1.0\r\n\r\n")
            time.sleep(2)  # not reading, past the deadline
            received = 0
            try:
                while chunk := client.recv(1 << 20):
                    received += len(chunk)
            except ConnectionResetError:
                pass
        assert received < 8_000_000
        assert get(server.port, "/live") == (200, "ok\n")
    finally:
        server.stop()


def test_stopping_with_connections_open_logs_no_errors(caplog):
    import socket

    server = HealthServer("127.0.0.1", 0, Lifecycle(), Metrics("head"), dict).start()
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(20)]
    assert get(server.port, "/live") == (200, "ok\n")  # the idle ones are accepted by now
    server.stop()
    for sock in idle:
        sock.close()
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []


def test_a_health_server_that_cannot_start_raises_why():
    from kubeflow_data_cache.health_http import LoopHTTPServer, listening_socket

    sock = listening_socket("127.0.0.1", 0)
    server = LoopHTTPServer(sock, type("Handler", (__import__("http.server").server.BaseHTTPRequestHandler,), {}), 1.0)
    sock.close()
    with pytest.raises(OSError):
        server.start()


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
def test_other_methods_are_not_allowed_naming_the_ones_that_are(method):
    """They were answered 501 "Unsupported method", an HTML page."""
    import http.client

    server = HealthServer("127.0.0.1", 0, Lifecycle(), Metrics("head"), dict).start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request(method, "/ready", body=b"x")
        response = conn.getresponse()
        assert (response.status, response.getheader("Allow")) == (405, "GET, HEAD")
        assert response.read() == b"method not allowed: use GET (or HEAD)\n"
        conn.close()
        assert get(server.port, "/live") == (200, "ok\n")
    finally:
        server.stop()


def test_head_requests_get_the_status_and_headers_without_a_body():
    """`curl -I` and uptime checkers send HEAD: it was answered 501."""
    import http.client

    lifecycle = Lifecycle()
    server = HealthServer("127.0.0.1", 0, lifecycle, Metrics("head"), dict).start()
    try:
        for path, status in (("/live", 200), ("/ready", 503), ("/metrics", 200), ("/nope", 404)):
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            conn.request("HEAD", path)
            response = conn.getresponse()
            assert response.status == status, path
            assert int(response.getheader("Content-Length")) > 0 and response.read() == b""
            conn.close()
        lifecycle.set(READY, "")
        assert get(server.port, "/ready") == (200, "ready\n")  # GET still has its body
    finally:
        server.stop()
