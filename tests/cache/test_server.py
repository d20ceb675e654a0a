"""The Flight protocol against real `data-cache local` clusters on loopback."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.flight as flight
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyiceberg.table import StaticTable

from kubeflow_data_cache.errors import server_message
from kubeflow_data_cache.protocol import TICKET_SIGNATURE_FIELD, ShardRequest, Ticket, ticket_signature
from kubeflow_data_cache.sample import sample_batch
from tests.cache.conftest import read_descriptor
from tests.conftest import TEST_CLUSTER_KEY, running_cache


def read_path_shard(endpoint: str, index: int, total: int) -> tuple[flight.FlightInfo, pa.Table]:
    """Exactly what an upstream client does: PATH [index, total], then DoGet on each endpoint."""
    return read_descriptor(endpoint, flight.FlightDescriptor.for_path(str(index), str(total)))


def read_cmd_shard(endpoint: str, req: ShardRequest) -> tuple[flight.FlightInfo, pa.Table]:
    return read_descriptor(endpoint, flight.FlightDescriptor.for_command(req.to_json()))


def action(endpoint: str, name: str, body: bytes = b"") -> list[bytes]:
    return [r.body.to_pybytes() for r in flight.FlightClient(endpoint).do_action(flight.Action(name, body))]


@pytest.mark.parametrize("total", [1, 3, 7])
def test_upstream_client_reads_every_row_exactly_once(small_cache, small_table, total):
    ids = []
    for i in range(total):
        info, table = read_path_shard(small_cache.endpoint, i, total)
        assert info.total_records == table.num_rows
        ids += table.column("id").to_pylist()
    assert sorted(ids) == list(range(small_table.rows))


def test_flight_info_carries_schema_rows_and_bytes(small_cache):
    info, table = read_path_shard(small_cache.endpoint, 0, 2)
    assert info.schema == table.schema
    assert info.schema.names == ["id", "feature_a", "feature_b", "label", "flag", "text", "embedding"]
    assert info.total_records == 5000
    # The estimate comes from the nodes' real Arrow sizes.
    assert 0.5 * table.nbytes <= info.total_bytes <= 2 * table.nbytes


@pytest.mark.parametrize(
    "req",
    [
        # Slices that start mid-chunk at odd rows: rebased string offsets, bitmaps off a byte.
        ShardRequest(shard=1, num_shards=3, batch_size=777),
        ShardRequest(shard=0, num_shards=2, batch_size=4096),
        ShardRequest(shard=2, num_shards=3, shuffle=True, seed=1, batch_size=500),  # gathers
    ],
    ids=["slices-odd", "slices", "gathers"],
)
def test_every_column_arrives_intact(small_cache, small_table, req):
    """Every value of every column (strings, booleans, lists included) is what the table holds."""
    _, table = read_cmd_shard(small_cache.endpoint, req)
    assert table.num_rows > 0
    expected = sample_batch(0, small_table.rows).take(pa.array(table.column("id").to_pylist()))
    for name in table.schema.names:
        assert table.column(name).to_pylist() == expected.column(name).to_pylist(), name


def test_shuffled_epochs_cover_every_row_in_different_orders(small_cache, small_table):
    orders = []
    for epoch in (0, 1):
        ids = []
        for s in range(3):
            req = ShardRequest(shard=s, num_shards=3, shuffle=True, seed=5, epoch=epoch, block_size=64)
            ids += read_cmd_shard(small_cache.endpoint, req)[1].column("id").to_pylist()
        assert sorted(ids) == list(range(small_table.rows))
        orders.append(ids)
    assert orders[0] != orders[1]


def test_projection_filter_and_batch_size(small_cache):
    req = ShardRequest(columns=["label", "id"], filter="label = 3 AND id < 5000", batch_size=100)
    info, table = read_cmd_shard(small_cache.endpoint, req)
    assert table.schema.names == ["label", "id"]
    assert set(table.column("label").to_pylist()) == {3}
    assert sorted(table.column("id").to_pylist()) == list(range(3, 5000, 10))
    assert info.total_records == 500
    reader = flight.FlightClient(info.endpoints[0].locations[0].uri.decode()).do_get(info.endpoints[0].ticket)
    assert max(chunk.data.num_rows for chunk in reader) <= 100


def test_flight_info_bytes_of_a_narrow_projection_are_not_rounded_away(small_cache):
    """The bytes per row were rounded before multiplying: a bool column (an eighth of a byte a
    row) reported 0 bytes, and every projection lost its fraction of a byte per row."""
    req = ShardRequest(columns=["flag"], filter="id < 80")
    info, table = read_cmd_shard(small_cache.endpoint, req)
    assert info.total_records == table.num_rows == 80
    assert info.total_bytes == 10  # 80 bits: the column's share of the nodes' Arrow bytes


def test_filtered_even_split(small_cache):
    counts = []
    for s in range(3):
        req = ShardRequest(shard=s, num_shards=3, filter="flag", even="drop", shuffle=True)
        counts.append(read_cmd_shard(small_cache.endpoint, req)[1].num_rows)
    assert counts == [5000 // 3] * 3


def assert_no_server_traceback(err: Exception) -> None:
    """What any Flight client reads of a refusal: the reason, without the server's frames (its
    source files and lines came after ". Detail: Python exception: Traceback")."""
    assert "Traceback" not in str(err) and 'File "' not in str(err), str(err)
    assert "Detail: Python exception: InvalidArgument" in str(err) or "Python exception: Unimplemented" in str(err)


@pytest.mark.parametrize(
    ("descriptor", "message"),
    [
        (flight.FlightDescriptor.for_path("3", "3"), "shard index 3 is out of range"),
        (flight.FlightDescriptor.for_path("a", "3"), "two decimal integers"),
        # int() would read these as 10 shards, 0 and 1: a typo must not pick another split.
        (flight.FlightDescriptor.for_path("0", "1_0"), "two decimal integers"),
        (flight.FlightDescriptor.for_path(" 0 ", "1"), "two decimal integers"),
        (flight.FlightDescriptor.for_path("0", "+1"), "two decimal integers"),
        (flight.FlightDescriptor.for_path("0", str(10**30)), "'num_shards' should be <= 1048576"),
        # One request must not make the head sort a billion-row block, nor many requests at once
        # compute million-row end blocks each (64 ranks took a head to 1.1 GiB).
        (
            flight.FlightDescriptor.for_command(b'{"shuffle": true, "block_size": 33554432}'),
            "'block_size' should be <=",
        ),
        (
            flight.FlightDescriptor.for_command(b'{"shuffle": true, "block_size": 65537}'),
            "'block_size' should be <= 65536, got 65537",
        ),
        (flight.FlightDescriptor.for_path("1"), "[shard_index, shard_count]"),
        (flight.FlightDescriptor.for_command(b"{nope"), "not valid JSON"),
        (flight.FlightDescriptor.for_command(b'{"shards": 2}'), "unknown shard request field"),
        (flight.FlightDescriptor.for_command(b'{"columns": ["nope"]}'), "unknown column(s) ['nope']"),
        (flight.FlightDescriptor.for_command(b'{"filter": "nope = 1"}'), "invalid filter"),
        (flight.FlightDescriptor.for_command(b'{"even": "sometimes"}'), "'even' should be one of"),
        # Refused by the head, before any data node sees it: 12,000 ORs killed every node (SIGSEGV).
        (
            flight.FlightDescriptor.for_command(
                json.dumps({"filter": " OR ".join(f"id = {i}" for i in range(12_000))}).encode()
            ),
            "'filter' is 156886 characters, more than 65536",
        ),
        (
            flight.FlightDescriptor.for_command(json.dumps({"columns": [f"c{i}" for i in range(40_000)]}).encode()),
            "'columns' names more than 16384 columns",
        ),
    ],
)
def test_bad_descriptors_are_invalid_argument(small_cache, descriptor, message):
    with pytest.raises(pa.ArrowInvalid, match=None) as err:
        flight.FlightClient(small_cache.endpoint).get_flight_info(descriptor)
    assert message in str(err.value)
    assert_no_server_traceback(err.value)
    # The cache still serves whole.
    assert read_path_shard(small_cache.endpoint, 0, 1)[1].num_rows == 10_000


@pytest.mark.parametrize(
    ("predicate", "node_says"),
    [
        ("text = 'see message: x' AND nope > 1", "No field named nope"),  # a message-like literal
        ("random() > 0.5", "whose value changes between calls"),  # refused by the node's own check
    ],
)
def test_a_refused_filter_reaches_the_client_whole_and_once(small_cache, predicate, node_says):
    """The data node that judged the filter says why; the head passes that on as it was said:
    from its start, and without the node's Python traceback in front of the head's own."""
    descriptor = flight.FlightDescriptor.for_command(json.dumps({"filter": predicate}).encode())
    with pytest.raises(pa.ArrowInvalid) as err:
        flight.FlightClient(small_cache.endpoint).get_flight_info(descriptor)
    message = server_message(err.value)
    assert message.startswith(f"invalid filter {predicate!r}: ")
    assert node_says in message
    assert_no_server_traceback(err.value)  # neither the head's nor the node's


@pytest.mark.parametrize(
    ("request_body", "reason"),
    [
        # gRPC refuses trailers past 16 KiB and Flight sends the message twice: an 8 KiB filter
        # quoted back whole reached the client as "Stream removed", without the reason.
        ({"filter": "id IN (" + ", ".join(map(str, range(2000))) + ") AND lable = 3"}, "No field named lable"),
        ({"columns": [f"no_such_column_{i:04}" * 4 for i in range(200)]}, "unknown column(s) ['no_such_column_0000"),
        ({"shard": "9" * 9000}, "'shard' should be an integer, got '99999"),
    ],
)  # fmt: skip
def test_a_refusal_of_a_long_request_says_why_in_a_few_lines(small_cache, request_body, reason):
    descriptor = flight.FlightDescriptor.for_command(json.dumps(request_body).encode())
    assert len(descriptor.command) > 8000
    with pytest.raises(pa.ArrowInvalid) as err:
        flight.FlightClient(small_cache.endpoint).get_flight_info(descriptor)
    message = server_message(err.value)
    assert reason in message and "characters)" in message  # the value, cut, with its length
    assert len(message) < 1000


def test_a_number_past_its_bound_is_quoted_cut(small_cache):
    """One that parses (under Python's 4,300 digits) but is past its bound was quoted whole, to
    the 4,000-character cap."""
    descriptor = flight.FlightDescriptor.for_command(json.dumps({"num_shards": 10**3999}).encode())
    with pytest.raises(pa.ArrowInvalid) as err:
        flight.FlightClient(small_cache.endpoint).get_flight_info(descriptor)
    message = server_message(err.value)
    assert "'num_shards' should be <= " in message and "(4000 characters)" in message
    assert len(message) < 1000


def test_an_unknown_action_with_a_long_name_is_quoted_cut(small_cache):
    """A 100,000-character action name came back whole, to the 4,000-character cap."""
    client = flight.FlightClient(small_cache.endpoint)
    node = flight.FlightClient(read_path_shard(small_cache.endpoint, 0, 1)[0].endpoints[0].locations[0].uri.decode())
    for server in (client, node):
        with pytest.raises(pa.ArrowNotImplementedError) as err:
            list(server.do_action(flight.Action("a" * 100_000, b"")))
        message = server_message(err.value)
        assert "characters) is not implemented" in message and len(message) < 1000, message[:300]
    client.close()
    node.close()


def test_a_request_past_16_mib_is_refused_before_it_is_parsed(small_cache):
    """Six 256 MiB descriptors parsed at once took a head from 140 MiB to 2.4 GiB (its default
    limit is 1 GiB): a descriptor, a ticket or an action body past 16 MiB is refused by its size."""
    huge = json.dumps({"x" * (17 << 20): 1}).encode()
    head = flight.FlightClient(small_cache.endpoint)
    node = flight.FlightClient(read_path_shard(small_cache.endpoint, 0, 1)[0].endpoints[0].locations[0].uri.decode())
    calls = {
        "shard request": lambda: head.get_flight_info(flight.FlightDescriptor.for_command(huge)),
        "ticket": lambda: node.do_get(flight.Ticket(huge)).read_all(),
        "body of action 'count'": lambda: list(node.do_action(flight.Action("count", huge))),
        "body of action 'register'": lambda: list(head.do_action(flight.Action("register", huge))),
    }
    for what, call in calls.items():
        with pytest.raises(pa.ArrowInvalid) as err:
            call()
        message = server_message(err.value)
        assert message.startswith(f"the {what} is {len(huge)} bytes, more than 16777216: "), message[:300]
        assert_no_server_traceback(err.value)
    head.close()
    node.close()
    assert read_path_shard(small_cache.endpoint, 0, 1)[1].num_rows == 10_000


def _signed(body: dict) -> bytes:
    """A ticket's JSON object, signed as the head of a LocalCache signs it."""
    return json.dumps({**body, TICKET_SIGNATURE_FIELD: ticket_signature(body, TEST_CLUSTER_KEY)}).encode()


def test_bad_and_stale_tickets(small_cache):
    info, _ = read_path_shard(small_cache.endpoint, 0, 1)
    node = flight.FlightClient(info.endpoints[0].locations[0].uri.decode())
    with pytest.raises(pa.ArrowInvalid, match="malformed ticket") as malformed:
        node.do_get(flight.Ticket(b"garbage")).read_all()
    assert_no_server_traceback(malformed.value)
    ticket = Ticket.from_json(info.endpoints[0].ticket.ticket)
    # Signed with the cluster key, as the head signs them: the node's checks behind the signature.
    stale = Ticket("other-load", ticket.node, ticket.offset, ticket.node_rows, ticket.total, ticket.request)
    with pytest.raises(pa.ArrowInvalid, match="stale ticket: issued for data node"):
        node.do_get(flight.Ticket(stale.to_json(TEST_CLUSTER_KEY))).read_all()
    # Another node's ticket: with nodes of equal size this node would serve its own rows under
    # the other's offset, other rows than the head counted, without a word.
    other = Ticket(ticket.generation, 1 - ticket.node, ticket.offset, ticket.node_rows, ticket.total, ticket.request)
    with pytest.raises(pa.ArrowInvalid, match=f"stale ticket: issued for data node {1 - ticket.node} "):
        node.do_get(flight.Ticket(other.to_json(TEST_CLUSTER_KEY))).read_all()
    # A ticket expecting other rows on this node than it holds (a reload with another share).
    moved = Ticket(ticket.generation, ticket.node, ticket.offset, ticket.node_rows + 1, ticket.total, ticket.request)
    with pytest.raises(pa.ArrowInvalid, match=f"stale ticket: it expects {ticket.node_rows + 1} rows on this node"):
        node.do_get(flight.Ticket(moved.to_json(TEST_CLUSTER_KEY))).read_all()
    # Forged numbers and versions are refused as bad requests, not failed inside the stream.
    body = json.loads(info.endpoints[0].ticket.ticket)
    for change, refusal in (
        ({"offset": 10**18}, f"places {ticket.node_rows} rows at {10**18}"),
        ({"order": 7}, "shuffled order 7 is not the one this node streams"),
        ({"v": 1.0}, "ticket protocol version 1.0 is not supported"),
        ({"v": True}, "ticket protocol version True is not supported"),
        # A row space larger than the table's: it sized the node's shuffle order at will (2**41
        # rows in blocks of 2**20: 121 MiB and 0.55 s per seed, before any memory guard).
        (
            {"total": 2**41, "request": {**body["request"], "shuffle": True, "block_size": 2**16}},
            f"in a space of {2**41} rows, more than the table's 10000",
        ),
        # Past int64: an OverflowError deep in the stream (INTERNAL, a traceback logged) before.
        ({"offset": 10**30, "total": 10**30 + ticket.node_rows}, "'offset' should be <= 9223372036854775807"),
        ({"total": 2**63, "node_rows": 0}, "'total' should be <= 9223372036854775807"),
    ):
        with pytest.raises(pa.ArrowInvalid) as refused:
            node.do_get(flight.Ticket(_signed({**body, **change}))).read_all()
        assert refusal in str(refused.value)
        assert_no_server_traceback(refused.value)
    # The server survives all of it.
    assert read_path_shard(small_cache.endpoint, 0, 1)[1].num_rows == 10_000


def test_node_count_action_needs_a_filter(cluster, small_table):
    """The head's internal `count` call on a data node: a missing or empty filter is refused,
    not read as the predicate "None". (A cache with no cluster key: `local`'s nodes, which have
    one, count only for a caller holding it: test_internal_actions.py.)"""
    from tests.cache.inprocess import wait_for

    head, _, node, _ = cluster(small_table.metadata_location)
    wait_for(lambda: head.lifecycle.state == "ready")
    for body in (b"", b"{}", b'{"filter": ""}', b'{"filter": 3}'):
        with pytest.raises(pa.ArrowInvalid, match="count needs"):
            action(node.location, "count", body)
    counted = json.loads(action(node.location, "count", b'{"filter": "id >= 0"}')[0])
    # Beside the matches, their nulls and list lengths (the readers' checks before a first batch).
    assert counted == {"rows": small_table.rows, "null_counts": {}, "list_lengths": {"embedding": [4, 4]}}


def test_unknown_calls_are_unimplemented(small_cache):
    with pytest.raises(pa.ArrowNotImplementedError, match="not implemented") as unknown:
        action(small_cache.endpoint, "drop-everything")
    assert_no_server_traceback(unknown.value)
    info, _ = read_path_shard(small_cache.endpoint, 0, 1)
    node = info.endpoints[0].locations[0].uri.decode()
    for location in (small_cache.endpoint, node):  # each says why, on every role
        client = flight.FlightClient(location)
        writer, _ = client.do_put(flight.FlightDescriptor.for_path("x"), pa.schema([("a", pa.int64())]))
        with pytest.raises(pa.ArrowNotImplementedError, match="DoPut is not supported: the cache serves"):
            writer.close()
        writer, reader = client.do_exchange(flight.FlightDescriptor.for_path("x"))
        with pytest.raises(pa.ArrowNotImplementedError, match="DoExchange is not supported"):
            reader.read_all()


def test_status_list_flights_and_schema(small_cache, small_table):
    status = json.loads(action(small_cache.endpoint, "status")[0])
    assert status["state"] == "ready" and status["rows"] == small_table.rows
    assert [n["rows"] for n in status["nodes"]] == [5000, 5000]
    # Which snapshot it serves: that of METADATA_LOC, whether or not the table moved on since.
    snapshot = StaticTable.from_metadata(small_table.metadata_location).current_snapshot()
    assert status["metadata_location"] == small_table.metadata_location
    assert status["snapshot_id"] == snapshot.snapshot_id
    assert all(n["resident_bytes"] > 0 for n in status["nodes"])
    # Data nodes load through the pool allocator.py picks (unless the environment names one).
    try:
        pa.jemalloc_memory_pool()
        wanted = os.environ.get("ARROW_DEFAULT_MEMORY_POOL", "jemalloc")
    except NotImplementedError:  # a build without jemalloc keeps its default
        wanted = pa.default_memory_pool().backend_name
    assert [n["memory_pool"] for n in status["nodes"]] == [wanted, wanted]
    client = flight.FlightClient(small_cache.endpoint)
    (listed,) = list(client.list_flights())
    assert listed.total_records == small_table.rows
    schema = client.get_schema(flight.FlightDescriptor.for_command(b'{"columns": ["id"]}')).schema
    assert schema.names == ["id"]
    filtered = flight.FlightDescriptor.for_command(b'{"columns": ["id"], "filter": "id < 3"}')
    assert client.get_schema(filtered).schema.names == ["id"]
    # What GetFlightInfo refuses, GetSchema refuses too: the schema of a request that cannot be read.
    with pytest.raises(pa.ArrowInvalid, match="invalid filter 'nope > 1': .*No field named nope"):
        client.get_schema(flight.FlightDescriptor.for_command(b'{"filter": "nope > 1"}'))


def test_more_nodes_than_files_and_more_shards_than_rows(table_factory):
    table = table_factory(5, 2)
    with running_cache(table.metadata_location, data_nodes=4) as cache:
        ids = []
        for i in range(8):
            info, part = read_path_shard(cache.endpoint, i, 8)
            if part.num_rows == 0:
                assert info.total_records == 0 and not info.endpoints  # empty shard, not an error
            ids += part.column("id").to_pylist()
        assert sorted(ids) == [0, 1, 2, 3, 4]


def test_empty_table_is_ready_and_serves_nothing(table_factory):
    table = table_factory(0, 1)
    with running_cache(table.metadata_location, data_nodes=2) as cache:
        info, part = read_path_shard(cache.endpoint, 0, 1)
        assert info.total_records == 0 and part.num_rows == 0
        assert info.schema.names[0] == "id"
        info, part = read_cmd_shard(cache.endpoint, ShardRequest(filter="id < 10"))
        assert info.total_records == 0 and part.num_rows == 0
        # A bad filter is refused as it would be once the table has rows, not accepted for now.
        with pytest.raises(pa.ArrowInvalid, match="No field named nosuch"):
            read_cmd_shard(cache.endpoint, ShardRequest(filter="nosuch > 1"))


@pytest.fixture(scope="module")
def odd_cache(table_factory):
    table = table_factory(2503, 4, with_text=False)
    with running_cache(table.metadata_location, data_nodes=3) as cache:
        yield cache, table


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shards=st.integers(1, 9), shuffle=st.booleans(), seed=st.integers(0, 1000), epoch=st.integers(0, 5))
def test_property_real_cluster_exactly_once(odd_cache, shards, shuffle, seed, epoch):
    cache, table = odd_cache
    ids = []
    for s in range(shards):
        req = ShardRequest(shard=s, num_shards=shards, shuffle=shuffle, seed=seed, epoch=epoch, block_size=50)
        info, part = read_cmd_shard(cache.endpoint, req)
        assert info.total_records == part.num_rows
        ids += part.column("id").to_pylist()
    assert sorted(ids) == list(range(table.rows))


@pytest.mark.parametrize(
    "descriptor",
    [
        flight.FlightDescriptor.for_path("1" * 5000, "2"),
        flight.FlightDescriptor.for_command(b'{"shard": ' + b"9" * 5000 + b"}"),
        flight.FlightDescriptor.for_command(b"[" * 100_000 + b"]" * 100_000),
    ],
)
def test_requests_too_large_to_parse_are_invalid_not_internal_errors(small_cache, descriptor):
    """Digits past Python's int limit, or nesting past its recursion limit: a bad request."""
    client = flight.FlightClient(small_cache.endpoint)
    with pytest.raises(pa.ArrowInvalid):
        client.get_flight_info(descriptor)
    client.close()
