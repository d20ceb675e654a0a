"""The head and its data nodes prove themselves to each other (DATA_CACHE_CLUSTER_KEY), and a
data node loads only its own table: no other caller, reader or not, can change what it serves."""

from __future__ import annotations

import json
from collections.abc import Iterator
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from kubeflow_data_cache.config import build_config, same_table_location
from kubeflow_data_cache.dataset import DataCacheDataset
from kubeflow_data_cache.errors import ConfigError
from kubeflow_data_cache.head import Head
from kubeflow_data_cache.node import DataNode
from kubeflow_data_cache.protocol import TICKET_SIGNATURE_FIELD, ShardRequest, ticket_signature, with_skip
from tests.cache.conftest import run_data_cache
from tests.cache.inprocess import FLAGS, wait_for
from tests.conftest import LocalCache, running_cache

KEY = "k3y-of-the-cluster-7Qx"
ROWS, OTHER_ROWS = 1200, 777


@pytest.fixture(scope="module")
def keyed_cache(table_factory) -> Iterator[LocalCache]:
    cache = LocalCache(table_factory(ROWS, 2).metadata_location, data_nodes=2, env={"DATA_CACHE_CLUSTER_KEY": KEY})
    try:
        cache.wait_ready()
        yield cache
    finally:
        cache.stop()


def action(location: str, kind: str, body: dict) -> list[bytes]:
    with flight.connect(location) as client:
        results = client.do_action(flight.Action(kind, json.dumps(body).encode()), flight.FlightCallOptions(timeout=10))
        return [r.body.to_pybytes() for r in results]


def status(location: str) -> dict:
    return json.loads(b"".join(action(location, "status", {})))


def load_body(metadata_location: str, rows: int, key: str | None) -> dict:
    body = {
        "generation": "not-the-heads",
        "metadata_location": metadata_location,
        "snapshot_id": None,
        "global_start": 0,
        "global_stop": rows,
        "pieces": [],
    }
    return body if key is None else {**body, "cluster_key": key}


def ids(endpoint: str) -> list[int]:
    return sorted(i for batch in DataCacheDataset(endpoint, columns=["id"]) for i in batch["id"].tolist())


@pytest.mark.parametrize("key", [None, "a-guess"], ids=["no key", "wrong key"])
def test_a_data_node_refuses_a_load_without_the_cluster_key(keyed_cache, table_factory, key):
    node = status(keyed_cache.endpoint)["nodes"][0]["location"]
    other = table_factory(OTHER_ROWS, 1).metadata_location
    with pytest.raises(pa.ArrowInvalid, match="load: the cluster key is missing or wrong.*DATA_CACHE_CLUSTER_KEY"):
        action(node, "load", load_body(other, 0, key))
    assert status(node)["state"] == "ready"
    assert ids(keyed_cache.endpoint) == list(range(ROWS)), "the node still serves its own rows"


def test_a_data_node_loads_only_the_table_it_was_given_even_with_the_key(keyed_cache, table_factory):
    """Holding the key is not enough to point a node at another table (a confused deputy: it would
    read whatever its storage credentials reach, and serve it)."""
    node = status(keyed_cache.endpoint)["nodes"][1]["location"]
    other = table_factory(OTHER_ROWS, 1).metadata_location
    with pytest.raises(pa.ArrowInvalid, match=r"serves the table at .*\(its METADATA_LOC\), not .*same METADATA_LOC"):
        action(node, "load", load_body(other, 0, KEY))
    assert status(node)["state"] == "ready"
    assert ids(keyed_cache.endpoint) == list(range(ROWS))


@pytest.mark.parametrize("key", [None, "a-guess"], ids=["no key", "wrong key"])
def test_the_head_refuses_a_registration_without_the_cluster_key(keyed_cache, key):
    """Who registers decides where readers are sent: a stranger must not take a node's place."""
    before = [n["location"] for n in status(keyed_cache.endpoint)["nodes"]]
    body = {"index": 0, "location": "grpc://127.0.0.1:9", "load_threads": 1}
    if key is not None:
        body["cluster_key"] = key
    with pytest.raises(pa.ArrowInvalid, match="register: the cluster key is missing or wrong"):
        action(keyed_cache.endpoint, "register", body)
    assert [n["location"] for n in status(keyed_cache.endpoint)["nodes"]] == before
    assert ids(keyed_cache.endpoint) == list(range(ROWS))


def test_a_data_node_with_another_key_fails_naming_the_setting(small_table):
    flags = {**FLAGS, "metadata_loc": small_table.metadata_location}
    head = Head(build_config("head", {**flags, "data_nodes": 1}, env={"DATA_CACHE_CLUSTER_KEY": "key-one-Zq"}))
    head.start()
    node = DataNode(
        build_config(
            "worker", {**flags, "index": 0, "head": head.location}, env={"DATA_CACHE_CLUSTER_KEY": "key-two-Zq"}
        )
    )
    try:
        node.start_registering()
        wait_for(lambda: node.lifecycle.error, timeout=30)
        assert "refused to register it" in node.lifecycle.error
        assert "DATA_CACHE_CLUSTER_KEY" in node.lifecycle.error
        assert "key-one-Zq" not in node.lifecycle.error and "key-two-Zq" not in node.lifecycle.error
        assert head.registered == {}
    finally:
        node.stop()
        head.stop()


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("DATA_CACHE_TOKEN", "", "is set but empty"),
        ("DATA_CACHE_TOKEN", "  ", "is set but empty"),
        ("DATA_CACHE_TOKEN", " tok3n", "starts or ends with a space"),
        ("DATA_CACHE_CLUSTER_KEY", "", "is set but empty"),
        ("DATA_CACHE_CLUSTER_KEY", "k3y ", "starts or ends with a space"),
        ("DATA_CACHE_CLUSTER_KEY", "k3y\n", "holds a line break"),
    ],
)
def test_a_secret_set_empty_or_padded_is_refused_not_taken_as_no_auth(name, value, says):
    """A Secret key that exists but is empty would have turned auth off without a word."""
    flags = {**FLAGS, "metadata_loc": "/tmp/t/metadata.json", "data_nodes": 1}
    with pytest.raises(ConfigError, match=rf"{name} {says}"):
        build_config("head", flags, env={name: value})


def test_the_cli_exits_2_on_an_empty_cluster_key(tmp_path):
    done = run_data_cache(
        "head",
        "--metadata-loc",
        str(tmp_path / "metadata.json"),
        "--data-nodes",
        "1",
        env={"PATH": "/usr/bin:/bin", "DATA_CACHE_CLUSTER_KEY": ""},
    )
    assert done.returncode == 2
    assert "DATA_CACHE_CLUSTER_KEY is set but empty" in done.stderr


def test_local_gives_its_nodes_a_key_of_its_own(small_table):
    """No DATA_CACHE_CLUSTER_KEY in its env: `local` draws one, so its head refuses a stranger,
    and signs its tickets with it."""
    body = {"index": 0, "location": "grpc://127.0.0.1:9", "load_threads": 1}
    with running_cache(small_table.metadata_location, data_nodes=1, cluster_key=None) as cache:
        with pytest.raises(pa.ArrowInvalid, match="register: the cluster key is missing or wrong"):
            action(cache.endpoint, "register", body)
        (endpoint,) = _flight_info(cache.endpoint).endpoints
        assert TICKET_SIGNATURE_FIELD in json.loads(endpoint.ticket.ticket)
        with pytest.raises(pa.ArrowInvalid, match="the ticket is not signed by this cache's head"):
            _read(endpoint, _resigned(endpoint, "a-guess"))


def _flight_info(endpoint: str, request: ShardRequest | None = None) -> flight.FlightInfo:
    with flight.connect(endpoint) as client:
        descriptor = flight.FlightDescriptor.for_command((request or ShardRequest()).to_json())
        return client.get_flight_info(descriptor)


def _read(endpoint: flight.FlightEndpoint, ticket: bytes) -> pa.Table:
    with flight.connect(endpoint.locations[0].uri.decode()) as node:
        return node.do_get(flight.Ticket(ticket), flight.FlightCallOptions(timeout=30)).read_all()


def _resigned(endpoint: flight.FlightEndpoint, key: str | None, **change) -> bytes:
    """The endpoint's ticket with ``change`` made, signed with ``key`` (None: unsigned)."""
    body = {k: v for k, v in json.loads(endpoint.ticket.ticket).items() if k != TICKET_SIGNATURE_FIELD}
    body |= change
    if key is not None:
        body[TICKET_SIGNATURE_FIELD] = ticket_signature(body, key)
    return json.dumps(body).encode()


def test_a_data_node_serves_only_the_tickets_its_head_signed(keyed_cache):
    """A reader (the token is all it holds) cannot make a ticket up: a node evaluated any
    predicate a forged ticket carried, one the head never checked, for any row numbers."""
    request = ShardRequest(filter="id < 600", columns=("id",))
    endpoints = _flight_info(keyed_cache.endpoint, request).endpoints
    assert sum(_read(e, e.ticket.ticket).num_rows for e in endpoints) == 600
    endpoint = endpoints[0]
    head_body = json.loads(endpoint.ticket.ticket)
    for forged in (
        _resigned(endpoint, None),  # the signature left out
        _resigned(endpoint, "a-guess"),  # signed with another key
        # The head's signature kept, with another predicate, or other row numbers.
        json.dumps({**head_body, "request": {**head_body["request"], "filter": "id >= 0"}}).encode(),
        json.dumps({**head_body, "rows": head_body["rows"] - 1}).encode(),
    ):
        with pytest.raises(pa.ArrowInvalid, match="the ticket is not signed by this cache's head") as refused:
            _read(endpoint, forged)
        assert "Traceback" not in str(refused.value)
    # A stale ticket (another load's, as of an earlier cache here with another key) is stale
    # first: its reader asks the head again, where refused as unsigned its read failed.
    stale = _resigned(endpoint, "an-earlier-caches-key", generation="an-earlier-load")
    with pytest.raises(pa.ArrowInvalid, match="stale ticket: issued for data node"):
        _read(endpoint, stale)
    # What a client may change, its skip (a resume), is outside the signature.
    assert _read(endpoint, with_skip(endpoint.ticket.ticket, 7)).num_rows == endpoint_rows(endpoint) - 7
    # Said in the node's log, with the caller, once for the spell (not once per call).
    refusals = [
        line for line in keyed_cache.read_stderr().splitlines() if "refused a ticket its head did not sign" in line
    ]
    assert len(refusals) == 1 and "from ipv4:127.0.0.1:" in refusals[0], refusals


def endpoint_rows(endpoint: flight.FlightEndpoint) -> int:
    return json.loads(endpoint.ticket.ticket)["rows"]


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("file:///tmp/wh/t/metadata/v1.metadata.json", "/tmp/wh/t/metadata/v1.metadata.json", True),
        ("/tmp/wh/./t/metadata/v1.metadata.json", "/tmp/wh/t/metadata/v1.metadata.json", True),
        ("s3a://bucket/t/metadata/v1.metadata.json", "s3://bucket/t/metadata/v1.metadata.json", True),
        ("s3://bucket/t/metadata/v1.metadata.json", "s3://bucket/t/metadata/v2.metadata.json", False),
        ("s3://bucket/t/metadata/v1.metadata.json", "s3://other/t/metadata/v1.metadata.json", False),
        ("/tmp/wh/t/metadata/v1.metadata.json", "/tmp/wh/u/metadata/v1.metadata.json", False),
    ],
)
def test_spellings_of_one_metadata_location_are_the_same_table(a, b, same):
    assert same_table_location(a, b) is same
    assert same_table_location(b, a) is same


def test_a_head_and_a_node_given_two_spellings_of_one_location_form_a_cache(small_table):
    """Hand-started processes: file:///x for the head, /x for the node."""
    location = small_table.metadata_location
    assert location.startswith("file://")
    flags = {**FLAGS, "metadata_loc": location}
    head = Head(build_config("head", {**flags, "data_nodes": 1}, env={}))
    head.start()
    plain = urlsplit(location).path
    node = DataNode(build_config("worker", {**flags, "metadata_loc": plain, "index": 0, "head": head.location}, env={}))
    try:
        node.start_registering()
        wait_for(lambda: head.lifecycle.state == "ready" or head.lifecycle.error, timeout=60)
        assert head.lifecycle.state == "ready", head.lifecycle.error
    finally:
        node.stop()
        head.stop()


def test_a_node_given_another_table_than_its_head_fails_the_cache_naming_both(small_table, table_factory):
    other = table_factory(OTHER_ROWS, 1).metadata_location
    flags = {**FLAGS, "metadata_loc": small_table.metadata_location}
    head = Head(build_config("head", {**flags, "data_nodes": 1}, env={}))
    head.start()
    node = DataNode(build_config("worker", {**flags, "metadata_loc": other, "index": 0, "head": head.location}, env={}))
    try:
        node.start_registering()
        wait_for(lambda: head.lifecycle.error, timeout=60)
        error = head.lifecycle.error
        assert "data node 0 at" in error and "refused its assignment" in error
        assert "give the head and its data nodes the same METADATA_LOC" in error
        assert "Traceback" not in error
    finally:
        node.stop()
        head.stop()


def test_a_node_without_metadata_loc_keeps_to_the_table_of_its_first_load(small_table, table_factory):
    flags = {**FLAGS, "metadata_loc": small_table.metadata_location}
    head = Head(build_config("head", {**flags, "data_nodes": 1}, env={}))
    head.start()
    node = DataNode(build_config("worker", {**FLAGS, "index": 0, "head": head.location}, env={}))
    try:
        node.start_registering()
        wait_for(lambda: head.lifecycle.state == "ready", timeout=60)
        other = table_factory(OTHER_ROWS, 1).metadata_location
        with pytest.raises(pa.ArrowInvalid, match=r"its first load's; it has no METADATA_LOC"):
            action(node.location, "load", load_body(other, 0, None))
        assert node.lifecycle.state == "ready"
        assert node.store.num_rows == small_table.rows
    finally:
        node.stop()
        head.stop()
