"""After ready, the head keeps watching its data nodes: a lost node makes it not ready, naming
the node, until a replacement has reloaded the rows."""

from __future__ import annotations

import json
import threading
import time

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from kubeflow_data_cache import head as head_module
from kubeflow_data_cache import node as node_module
from kubeflow_data_cache.config import build_config
from kubeflow_data_cache.node import DataNode
from kubeflow_data_cache.protocol import ShardRequest
from kubeflow_data_cache.service import HealthServer
from tests.cache.inprocess import FLAGS, get, wait_for


def total_records(head) -> int:
    info = flight.FlightClient(head.location).get_flight_info(flight.FlightDescriptor.for_path("0", "1"))
    return info.total_records


def test_a_lost_data_node_makes_the_head_unready_until_it_is_back(cluster, small_table, monkeypatch):
    monkeypatch.setattr(head_module, "SUPERVISE_POLL_SECONDS", 0.2)
    head, head_health, node, node_health = cluster(small_table.metadata_location)
    wait_for(lambda: get(head_health.port, "/ready")[0] == 200)
    assert total_records(head) == small_table.rows
    lost_at = node.location

    node.stop()
    node_health.stop()
    _, body = wait_for(lambda: (r := get(head_health.port, "/ready"))[0] == 503 and r)
    assert "degraded" in body and f"data node 0 ({lost_at}) unreachable" in body
    degraded = get(head_health.port, "/metrics")[1]
    # What the head holds is what /status says: not the whole table while its only node is gone.
    assert json.loads(get(head_health.port, "/status")[1])["rows"] == 0
    assert "data_cache_ready 0.0" in degraded and "data_cache_loaded_rows 0.0" in degraded
    with pytest.raises(flight.FlightUnavailableError, match=r"data node 0 .* unreachable"):
        total_records(head)

    # The pod comes back (a new process: new port, no rows) and re-registers; the head reloads it.
    replacement = DataNode(build_config("worker", {**FLAGS, "index": 0, "head": head.location}, env={}))
    replacement_health = HealthServer("127.0.0.1", 0, replacement.lifecycle, replacement.metrics, replacement.status)
    replacement_health.start()
    try:
        replacement.start_registering()
        wait_for(lambda: get(head_health.port, "/ready")[0] == 200)
        serving = get(head_health.port, "/metrics")[1]
        assert "data_cache_ready 1.0" in serving and f"data_cache_loaded_rows {float(small_table.rows)}" in serving
        assert total_records(head) == small_table.rows
        endpoint = (
            flight.FlightClient(head.location)
            .get_flight_info(flight.FlightDescriptor.for_command(ShardRequest().to_json()))
            .endpoints[0]
        )
        assert endpoint.locations[0].uri.decode() == replacement.location
    finally:
        replacement.stop()
        replacement_health.stop()


def _lose_the_node(cluster, small_table, monkeypatch):
    """A ready cluster whose one data node is gone (the head degraded), with supervision's polls
    then slowed to a minute: what happens next comes from registrations, not from polling."""
    monkeypatch.setattr(head_module, "SUPERVISE_POLL_SECONDS", 0.2)
    head, head_health, node, node_health = cluster(small_table.metadata_location)
    wait_for(lambda: get(head_health.port, "/ready")[0] == 200)
    node.stop()
    node_health.stop()
    wait_for(lambda: get(head_health.port, "/ready")[0] == 503)
    monkeypatch.setattr(head_module, "SUPERVISE_POLL_SECONDS", 60.0)
    time.sleep(0.5)  # the round under way ends; the next one waits 60 s
    return head, head_health, node


def test_a_replacement_is_reloaded_and_the_head_ready_at_once_not_at_the_next_polls(cluster, small_table, monkeypatch):
    """The replacement's registration, and its report once loaded, each start a supervision round:
    the head was degraded up to two polls (5 s each) longer than the reload itself."""
    head, head_health, _ = _lose_the_node(cluster, small_table, monkeypatch)
    replacement = DataNode(build_config("worker", {**FLAGS, "index": 0, "head": head.location}, env={}))
    try:
        replacement.start_registering()
        wait_for(lambda: get(head_health.port, "/ready")[0] == 200, timeout=15)
        assert total_records(head) == small_table.rows
    finally:
        replacement.stop()


def test_a_node_back_at_the_same_address_is_reloaded_at_once(cluster, small_table, monkeypatch):
    """A container restarted in place (after an OOM kill, say) comes back at its old address. The
    head's channel to it was still backing off from the outage, so the round its registration
    started found it "unreachable", and it waited for the next poll (5 s) to be sent its rows."""
    from urllib.parse import urlsplit

    monkeypatch.setattr(head_module, "SUPERVISE_POLL_SECONDS", 0.2)
    head, head_health, node, node_health = cluster(small_table.metadata_location)
    wait_for(lambda: get(head_health.port, "/ready")[0] == 200)
    port = urlsplit(node.location).port
    node.stop()
    node_health.stop()
    wait_for(lambda: get(head_health.port, "/ready")[0] == 503)
    time.sleep(3.0)  # polls every 0.2 s meanwhile: the channel's reconnect backoff grows past a second
    monkeypatch.setattr(head_module, "SUPERVISE_POLL_SECONDS", 60.0)
    monkeypatch.setattr(node_module, "REGISTER_INTERVAL_SECONDS", 60.0)  # and no heartbeat starts another
    time.sleep(0.5)  # the round under way ends; the next one waits 60 s
    replacement = DataNode(build_config("worker", {**FLAGS, "index": 0, "head": head.location, "port": port}, env={}))
    try:
        assert replacement.location == node.location
        replacement.start_registering()
        wait_for(lambda: get(head_health.port, "/ready")[0] == 200, timeout=15)
        assert total_records(head) == small_table.rows
    finally:
        replacement.stop()


def test_a_reload_whose_send_failed_but_was_taken_serves_once_the_node_holds_its_rows(
    cluster, small_table, monkeypatch
):
    """The send's error (its deadline passed as the node took the rows) was kept until the round
    after the node reported them loaded: the head stayed degraded a poll (5 s) longer."""
    head, head_health, _ = _lose_the_node(cluster, small_table, monkeypatch)
    send = head._send_load

    def sent_but_timed_out(index: int) -> None:
        send(index)
        raise flight.FlightTimedOutError("Deadline Exceeded")

    monkeypatch.setattr(head, "_send_load", sent_but_timed_out)
    replacement = DataNode(build_config("worker", {**FLAGS, "index": 0, "head": head.location}, env={}))
    try:
        replacement.start_registering()
        wait_for(lambda: get(head_health.port, "/ready")[0] == 200, timeout=15)
    finally:
        replacement.stop()


def test_heartbeats_of_a_serving_node_start_no_supervision_round(cluster, small_table, monkeypatch):
    """Every node re-registers every REGISTER_INTERVAL_SECONDS; a round for each would poll every
    node N times as often as SUPERVISE_POLL_SECONDS says."""
    import re

    monkeypatch.setattr(node_module, "REGISTER_INTERVAL_SECONDS", 0.1)
    monkeypatch.setattr(head_module, "SUPERVISE_POLL_SECONDS", 0.2)
    head, head_health, _, node_health = cluster(small_table.metadata_location)
    wait_for(lambda: get(head_health.port, "/ready")[0] == 200)
    time.sleep(0.5)  # a round has seen the node serving
    monkeypatch.setattr(head_module, "SUPERVISE_POLL_SECONDS", 60.0)
    time.sleep(0.5)  # the round under way ends; the next one waits 60 s

    def status_polls() -> float:
        metrics = get(node_health.port, "/metrics")[1]
        return float(
            re.search(r'^data_cache_requests_total\{action="status",method="DoAction"\} (\S+)$', metrics, re.M)[1]
        )

    registrations = head.metrics.requests.labels(method="DoAction", action="register")
    before, heartbeats = status_polls(), registrations._value.get()
    time.sleep(2.0)
    assert registrations._value.get() - heartbeats >= 5  # the node kept registering
    assert status_polls() == before


def test_a_data_node_the_head_refuses_fails_at_once_with_the_reason(cluster, small_table):
    """A wrong index is final: retrying it until the startup deadline (600 s in a pod) only hides it."""
    head, _, _, _ = cluster(small_table.metadata_location, with_node=False)
    cfg = build_config("worker", {**FLAGS, "index": 3, "head": head.location, "startup_timeout": 600}, env={})
    node = DataNode(cfg)
    try:
        node.start_registering()
        wait_for(lambda: node.lifecycle.failed_event.is_set(), timeout=20)
        error = node.lifecycle.error
        assert "refused to register it: data node index 3 is out of range [0, 1)" in error
        assert "this head expects 1 data node(s)" in error
        assert "Traceback" not in error and "Detail:" not in error
    finally:
        node.stop()


def test_a_data_node_that_cannot_reach_its_head_says_why_in_its_log(monkeypatch, caplog):
    """On Kubernetes a probe's /ready body reaches no log, and the deadline is minutes away: the
    node's own log names the head and the error while it keeps trying, not only at the end."""
    import logging

    monkeypatch.setattr(node_module, "REGISTER_WARN_AFTER_SECONDS", 0.3)
    monkeypatch.setattr(node_module, "REGISTER_WARN_EVERY_SECONDS", 60.0)
    cfg = build_config("worker", {**FLAGS, "index": 0, "head": "grpc://127.0.0.1:1", "startup_timeout": 600}, env={})
    node = DataNode(cfg)
    warned = lambda: [r for r in caplog.records if r.levelno == logging.WARNING and "cannot register" in r.message]  # noqa: E731
    try:
        with caplog.at_level(logging.WARNING, logger="kubeflow_data_cache.node"):
            node.start_registering()
            wait_for(lambda: warned(), timeout=20)
            (record,) = warned()
            assert "grpc://127.0.0.1:1" in record.message and "gives up in" in record.message
            assert "onnect" in record.message  # the connection error itself
            assert not node.lifecycle.failed_event.is_set()  # still trying
    finally:
        node.stop()


def test_an_index_taken_by_a_data_node_that_still_answers_is_refused(cluster, small_table):
    """A second worker started with the same index, or a caller re-pointing an index elsewhere,
    would take the slot in turns and send readers to it; the node that answers keeps it."""
    head, head_health, node, _ = cluster(small_table.metadata_location)
    wait_for(lambda: get(head_health.port, "/ready")[0] == 200)
    hijack = flight.Action("register", json.dumps({"index": 0, "location": "grpc://127.0.0.1:1"}).encode())
    with pytest.raises(pa.ArrowInvalid, match=rf"data node index 0 is taken: the data node at {node.location} still"):
        list(flight.FlightClient(head.location).do_action(hijack))
    duplicate = DataNode(build_config("worker", {**FLAGS, "index": 0, "head": head.location}, env={}))
    try:
        duplicate.start_registering()
        wait_for(lambda: duplicate.lifecycle.failed_event.is_set(), timeout=20)
        assert "two data nodes were started with the same index" in duplicate.lifecycle.error
    finally:
        duplicate.stop()
    assert head.registered[0]["location"] == node.location
    assert get(head_health.port, "/ready")[0] == 200


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"memory_limit": "lots"}, "'memory_limit' should be a byte count or null"),
        ({"memory_limit": -1}, "'memory_limit' should be a byte count or null"),
        ({"load_threads": 0}, "'load_threads' should be an integer >= 1"),
        # Coerced before: "None" and "5" were kept as locations, "0" and True as index 0.
        (
            {"location": None},
            "'location' \\(a grpc:// or grpc\\+tls:// URI with a host and a port\\), got index 0 and location None",
        ),
        ({"location": 5}, "got index 0 and location 5"),
        ({"location": "127.0.0.1:7000"}, "location '127.0.0.1:7000'"),
        ({"index": "0"}, "'index' \\(an integer\\).*got index '0'"),
        ({"index": True}, "got index True"),
        # A newline in the location would have forged lines in the head's log; an unclosed [ was
        # an INTERNAL error with urllib's traceback.
        ({"location": "grpc://127.0.0.1:1/\n2026-01-01 head INFO forged"}, "got index 0 and location"),
        ({"location": "grpc://[::1:47003"}, "location 'grpc://\\[::1:47003'"),
    ],
)
def test_a_malformed_registration_is_refused_by_name(cluster, small_table, body, message):
    head, _, _, _ = cluster(small_table.metadata_location, with_node=False)
    action = flight.Action("register", json.dumps({"index": 0, "location": "grpc://127.0.0.1:1", **body}).encode())
    with pytest.raises(pa.ArrowInvalid, match=message):
        list(flight.FlightClient(head.location).do_action(action))
    assert head.registered == {}


def test_planning_that_never_returns_fails_at_the_startup_deadline(small_table, monkeypatch):
    """Reading METADATA_LOC can block for ever (storage that accepts and never answers); the head
    must still fail at its deadline, not sit in `planning` with /ready saying nothing is wrong."""
    never = threading.Event()
    monkeypatch.setattr(head_module.Head, "_plan", lambda self: never.wait())
    flags = {**FLAGS, "metadata_loc": small_table.metadata_location, "data_nodes": 1, "startup_timeout": 1.5}
    head = head_module.Head(build_config("head", flags, env={}))
    try:
        head.start()
        wait_for(lambda: head.lifecycle.failed_event.is_set(), timeout=15)
        assert "planning the table scan did not finish within 1.5s" in head.lifecycle.error
        assert small_table.metadata_location in head.lifecycle.error
    finally:
        never.set()
        head.stop()


def test_a_filter_count_a_data_node_cannot_answer_is_unavailable_naming_it(cluster, small_table):
    """Before the supervisor notices a lost node, a new filter's count fails on it: UNAVAILABLE
    (retryable) naming the node, and counted under its real gRPC status."""
    head, head_health, node, _ = cluster(small_table.metadata_location)
    wait_for(lambda: get(head_health.port, "/ready")[0] == 200)
    lost_at = node.location
    node.stop()
    request = ShardRequest(filter="id < 100").to_json()
    with pytest.raises(flight.FlightUnavailableError, match=rf"data node 0 \({lost_at}\) did not count"):
        flight.FlightClient(head.location).get_flight_info(flight.FlightDescriptor.for_command(request))
    metrics = get(head_health.port, "/metrics")[1]
    assert 'data_cache_errors_total{action="",code="UNAVAILABLE",method="GetFlightInfo"} 1.0' in metrics
    assert 'code="FLIGHT"' not in metrics


def test_a_data_node_whose_head_went_away_before_its_load_says_so(small_table, monkeypatch):
    """Registered, then the head is gone before it sends the node its rows: /ready names the head
    it cannot reach, not 'waiting for the cluster to form'; and forgets that once it answers."""
    never = threading.Event()
    monkeypatch.setattr(head_module.Head, "_plan", lambda self: never.wait())
    monkeypatch.setattr(node_module, "REGISTER_INTERVAL_SECONDS", 0.2)
    flags = {**FLAGS, "metadata_loc": small_table.metadata_location, "data_nodes": 1}
    head = head_module.Head(build_config("head", flags, env={}))
    head.start()
    node = DataNode(build_config("worker", {**FLAGS, "index": 0, "head": head.location}, env={}))
    try:
        node.start_registering()
        wait_for(lambda: 0 in head.registered)
        assert node.lifecycle.detail == "waiting for the cluster to form"
        never.set()
        head.stop()
        wait_for(lambda: f"cannot register with the head at {head.location} yet" in node.lifecycle.detail)
        assert node.lifecycle.state == "waiting"
    finally:
        never.set()
        node.stop()


def test_a_node_that_never_answers_its_assignment_is_named_as_frozen(small_table, monkeypatch):
    """A node that registered, then froze (SIGSTOP, a hung pod): the load call times out, and the
    cache's failure names the node and what to check, not gRPC's bare "Deadline Exceeded"."""
    flags = {**FLAGS, "metadata_loc": small_table.metadata_location, "data_nodes": 1, "startup_timeout": 30}
    head = head_module.Head(build_config("head", flags, env={}))
    node = DataNode(build_config("worker", {**FLAGS, "index": 0, "head": head.location}, env={}))

    def frozen(self, node_index):  # what the call raises at its RPC_TIMEOUT_SECONDS
        raise flight.FlightTimedOutError("Flight returned timeout error, with message: Deadline Exceeded")

    monkeypatch.setattr(head_module.Head, "_send_load", frozen)
    head.start()
    node.start_registering()
    try:
        wait_for(lambda: head.lifecycle.state == "failed", timeout=30)
        assert f"data node 0 at {node.location} did not answer its assignment within 10s" in head.lifecycle.error
        assert "frozen or overloaded" in head.lifecycle.error
    finally:
        node.stop()
        head.stop()


@pytest.mark.parametrize("trouble", ["hangs", "refuses"])
def test_a_reload_that_never_finishes_fails_the_head_at_the_startup_deadline(
    small_table, table_factory, monkeypatch, caplog, trouble
):
    """A data node restarted after the cache was ready, whose reload then hangs (storage that
    stopped answering) or which refuses its rows each time (started with another METADATA_LOC):
    the head was degraded for good. The reload gets the startup deadline, as the first load does;
    then the head fails, naming the node and why, and exits for the group to restart."""
    monkeypatch.setattr(head_module, "SUPERVISE_POLL_SECONDS", 0.2)
    monkeypatch.setattr(node_module, "REGISTER_INTERVAL_SECONDS", 0.1)
    caplog.set_level("ERROR", logger="kubeflow_data_cache.node")
    caplog.set_level("WARNING", logger="kubeflow_data_cache.head")
    flags = {**FLAGS, "metadata_loc": small_table.metadata_location, "data_nodes": 1, "startup_timeout": 3}
    head = head_module.Head(build_config("head", flags, env={}))
    nodes = []

    def start_node(**flags) -> DataNode:
        flags = {**FLAGS, "index": 0, "head": head.location, "startup_timeout": 3, **flags}
        nodes.append(DataNode(build_config("worker", flags, env={})))
        nodes[-1].start_registering()
        return nodes[-1]

    never = threading.Event()
    head.start()
    try:
        start_node()
        wait_for(lambda: head.lifecycle.state == "ready", timeout=30)
        nodes[0].stop()
        # At another port: the head takes it as moved, and sends it its rows again.
        if trouble == "hangs":
            monkeypatch.setattr(node_module.NodeStore, "load", staticmethod(lambda *args, **kwargs: never.wait()))
            start_node()
        else:
            other = start_node(metadata_loc=table_factory(2000, 1).metadata_location)
        wait_for(lambda: head.lifecycle.state == "degraded", timeout=15)
        if trouble == "refuses":
            # Said at once, on both sides, not only when the head gives up.
            wait_for(
                lambda: "sending data node 0 its rows failed: load: this data node serves" in head.lifecycle.detail
            )
            assert "give the head and its data nodes the same METADATA_LOC" in head.lifecycle.detail
            wait_for(lambda: other.lifecycle.detail.startswith("refused the head's assignment: load: this data"))
            # And it stays said through the node's heartbeats (one every 0.1 s here), logged once.
            for _ in range(10):
                time.sleep(0.1)
                assert other.lifecycle.detail.startswith("refused the head's assignment: "), other.lifecycle.detail
            refusals = [r for r in caplog.records if r.getMessage().startswith("refused the head's assignment")]
            assert len(refusals) == 1, [r.getMessage() for r in refusals]
            # The head, trying again each poll (0.2 s here), says each once too: it logged both
            # lines every poll until the deadline.
            said = [r.getMessage() for r in caplog.records if r.name == "kubeflow_data_cache.head"]
            assert sum(m.startswith("data node 0 restarted; sending") for m in said) == 1, said
            assert sum(m.startswith("could not reload data node 0: load: this data") for m in said) == 1, said
        wait_for(lambda: head.lifecycle.state == "failed", timeout=15)
        error = head.lifecycle.error
        assert "data node 0 (grpc://127.0.0.1:" in error
        assert "restarted and did not hold its rows again within 3s of being sent them" in error
        if trouble == "hangs":
            assert "of being sent them (loading)" in error
        else:
            assert "sending them last failed: load: this data node serves the table at" in error
    finally:
        never.set()
        for node in nodes:
            node.stop()
        head.stop()


def test_a_reload_that_fails_fails_the_head_at_once_with_the_nodes_reason(small_table, monkeypatch):
    """As in the first load: the head waited out the startup deadline, by when the node had
    exited, and its error said "unreachable: Connection refused", the store's trouble lost."""
    monkeypatch.setattr(head_module, "SUPERVISE_POLL_SECONDS", 0.2)
    flags = {**FLAGS, "metadata_loc": small_table.metadata_location, "data_nodes": 1, "startup_timeout": 600}
    head = head_module.Head(build_config("head", flags, env={}))
    nodes = []

    def start_node() -> DataNode:
        nodes.append(DataNode(build_config("worker", {**FLAGS, "index": 0, "head": head.location}, env={})))
        nodes[-1].start_registering()
        return nodes[-1]

    def store_gone(*args, **kwargs):
        raise OSError("the object store stopped answering")

    head.start()
    try:
        start_node()
        wait_for(lambda: head.lifecycle.state == "ready", timeout=30)
        nodes[0].stop()
        monkeypatch.setattr(node_module.NodeStore, "load", staticmethod(store_gone))
        start_node()
        wait_for(lambda: head.lifecycle.state == "failed", timeout=30)  # not at the 600 s deadline
        assert "data node 0 (grpc://127.0.0.1:" in head.lifecycle.error
        assert "failed to load its rows again: " in head.lifecycle.error
        assert "the object store stopped answering" in head.lifecycle.error
    finally:
        for node in nodes:
            node.stop()
        head.stop()


def test_a_node_that_stays_unreachable_fails_the_head_at_the_startup_deadline(small_table, monkeypatch):
    """A data node gone once serving, and not back (its process frozen, its Flight calls hung
    while its /live answers; a pod that stays Pending): the head stayed degraded for good, with
    nothing in Kubernetes to restart the group. It now gets the startup deadline, as a reload
    does; then the head fails, naming the node, and exits for the group to be recreated."""
    monkeypatch.setattr(head_module, "SUPERVISE_POLL_SECONDS", 0.2)
    flags = {**FLAGS, "metadata_loc": small_table.metadata_location, "data_nodes": 1, "startup_timeout": 2}
    head = head_module.Head(build_config("head", flags, env={}))
    node = DataNode(build_config("worker", {**FLAGS, "index": 0, "head": head.location}, env={}))
    head.start()
    try:
        node.start_registering()
        wait_for(lambda: head.lifecycle.state == "ready", timeout=30)
        lost_at = node.location
        node.stop()
        wait_for(lambda: head.lifecycle.state == "degraded", timeout=15)
        time.sleep(1)
        assert head.lifecycle.state == "degraded"  # not before the deadline
        wait_for(lambda: head.lifecycle.state == "failed", timeout=15)
        error = head.lifecycle.error
        assert f"data node 0 ({lost_at}) has not served its rows for 2s (unreachable: " in error
        assert "the head exits so that the group is recreated" in error
    finally:
        node.stop()
        head.stop()


def test_a_node_gone_between_registering_and_its_assignment_is_followed_to_its_replacement(small_table):
    """A data node that registered and then died before the head sent its rows failed the whole
    load 3 s later, blamed on a wrong advertised address; its replacement, registering elsewhere a
    moment after, now gets the assignment."""
    from kubeflow_data_cache.head import Head
    from tests.conftest import free_port

    head = Head(build_config("head", {**FLAGS, "metadata_loc": small_table.metadata_location, "data_nodes": 1}, env={}))
    head.start()
    replacement = None
    try:
        gone = f"grpc://127.0.0.1:{free_port()}"  # registered there, and nothing answers any more
        body = json.dumps({"index": 0, "location": gone}).encode()
        list(flight.FlightClient(head.location).do_action(flight.Action("register", body)))
        wait_for(lambda: head.plan is not None, timeout=30)  # planned: sending the assignment now
        time.sleep(5)  # past the old 3 s of tries
        assert head.lifecycle.state != "failed", head.lifecycle.detail
        replacement = DataNode(build_config("worker", {**FLAGS, "index": 0, "head": head.location}, env={}))
        replacement.start_registering()
        wait_for(lambda: head.lifecycle.state == "ready", timeout=30)
        assert total_records(head) == small_table.rows
    finally:
        head.stop()
        if replacement is not None:
            replacement.stop()


def test_a_node_that_never_answers_where_it_registered_fails_the_load_naming_both_causes(small_table, monkeypatch):
    from kubeflow_data_cache.head import Head
    from tests.conftest import free_port

    monkeypatch.setattr(head_module, "LOAD_UNREACHABLE_SECONDS", 2.0)
    head = Head(build_config("head", {**FLAGS, "metadata_loc": small_table.metadata_location, "data_nodes": 1}, env={}))
    head.start()
    try:
        gone = f"grpc://127.0.0.1:{free_port()}"
        list(
            flight.FlightClient(head.location).do_action(
                flight.Action("register", json.dumps({"index": 0, "location": gone}).encode())
            )
        )
        wait_for(lambda: head.lifecycle.state == "failed", timeout=30)
        assert f"data node 0 registered at {gone} but has not answered there for 2s" in head.lifecycle.detail
        assert "must be reachable from the head, or the node stopped and did not come back" in head.lifecycle.detail
    finally:
        head.stop()


def test_a_replacement_takes_the_index_of_a_node_that_is_stopping(cluster, small_table):
    """SIGTERM leaves a data node answering through its streams' grace (up to 10 s), as data
    node 0 but stopping: a replacement started meanwhile was refused as a duplicate, failed for
    good, and the head stayed degraded once the old one was gone."""
    from kubeflow_data_cache.service import STOPPING

    head, head_health, node, _ = cluster(small_table.metadata_location)
    wait_for(lambda: get(head_health.port, "/ready")[0] == 200)
    node.lifecycle.set(STOPPING, "shutting down")  # what the runner does on SIGTERM
    replacement = DataNode(build_config("worker", {**FLAGS, "index": 0, "head": head.location}, env={}))
    try:
        replacement.start_registering()
        wait_for(lambda: head.registered[0]["location"] == replacement.location, timeout=20)
        node.stop()
        wait_for(lambda: replacement.lifecycle.state == "ready", timeout=30)
        assert not replacement.lifecycle.failed_event.is_set()
        wait_for(lambda: get(head_health.port, "/ready")[0] == 200, timeout=30)
        assert total_records(head) == small_table.rows
    finally:
        replacement.stop()


def test_a_node_the_head_cannot_send_its_rows_is_named_while_it_tries(small_table):
    """Every node registered, one of them gone: the head tries it for LOAD_UNREACHABLE_SECONDS.
    Meanwhile it said "waiting: 2/2 data nodes registered", every node waiting with no error,
    and logged nothing; now it is loading, naming the node it cannot reach."""
    from kubeflow_data_cache.head import Head
    from tests.conftest import free_port

    head = Head(build_config("head", {**FLAGS, "metadata_loc": small_table.metadata_location, "data_nodes": 1}, env={}))
    head.start()
    try:
        gone = f"grpc://127.0.0.1:{free_port()}"
        body = json.dumps({"index": 0, "location": gone}).encode()
        list(flight.FlightClient(head.location).do_action(flight.Action("register", body)))
        wait_for(lambda: "has not answered for" in head.lifecycle.detail, timeout=30)
        assert head.lifecycle.state == "loading"
        assert f"sending data node 0 its rows: {gone} has not answered for" in head.lifecycle.detail
        (status,) = head.status()["nodes"]
        assert status["state"] == "unreachable" and status["error"]
    finally:
        head.stop()


def test_a_registered_node_whose_head_is_gone_before_its_rows_gives_up(small_table, monkeypatch):
    """Registered, then its head went away for good before sending rows: the node waited for ever
    (the startup deadline stopped at registration). It now gives up as long after, naming why."""
    never = threading.Event()
    monkeypatch.setattr(head_module.Head, "_plan", lambda self: never.wait())
    monkeypatch.setattr(node_module, "REGISTER_INTERVAL_SECONDS", 0.2)
    head = head_module.Head(
        build_config("head", {**FLAGS, "metadata_loc": small_table.metadata_location, "data_nodes": 1}, env={})
    )
    head.start()
    node = DataNode(build_config("worker", {**FLAGS, "index": 0, "head": head.location, "startup_timeout": 3}, env={}))
    try:
        node.start_registering()
        wait_for(lambda: 0 in head.registered)
        time.sleep(3)  # past the deadline counted from the node's start: registered, it waits on
        assert not node.lifecycle.failed_event.is_set()
        never.set()
        head.stop()
        wait_for(lambda: node.lifecycle.failed_event.is_set(), timeout=20)
        assert f"the head at {head.location} registered this data node and then did not answer for 3s" in (
            node.lifecycle.error
        )
    finally:
        never.set()
        node.stop()
