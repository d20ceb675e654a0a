"""Bearer token and TLS on every Flight call, head and data nodes alike, with real processes."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from kubeflow_data_cache.client import CacheClient
from kubeflow_data_cache.config import build_config
from kubeflow_data_cache.errors import CacheUnavailableError
from kubeflow_data_cache.security import MAX_TOKEN_CHARS, TokenAuthFactory
from tests.cache.conftest import Certificate, make_cert, read_path_shards, run_data_cache
from tests.conftest import LocalCache, running_cache

DO_GET = SimpleNamespace(method=flight.FlightMethod.DO_GET)  # what a middleware is told of a call

TOKEN = "s3cr3t-T0ken-5f2b9c"
ROWS, FILES = 3000, 3
CALL_TIMEOUT_SECONDS = 10.0


def bearer(token: str | None) -> flight.FlightCallOptions:
    headers = [(b"authorization", f"Bearer {token}".encode())] if token is not None else []
    return flight.FlightCallOptions(headers=headers, timeout=CALL_TIMEOUT_SECONDS)


def drain_stderr(cache: LocalCache) -> str:
    """What the cache's processes wrote to stderr so far, read without stopping them."""
    return cache.read_stderr()


def command_lines_containing(needle: str) -> list[str]:
    """Every process on this machine whose command line holds ``needle`` (ps shows them to anyone)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            raw = cmdline.read_bytes()
        except OSError:
            continue
        if needle.encode() in raw:
            found.append(raw.replace(b"\0", b" ").decode(errors="replace"))
    return found


@pytest.fixture()
def no_ambient_secrets(monkeypatch):
    for name in (
        "DATA_CACHE_TOKEN",
        "DATA_CACHE_TOKEN_FILE",
        "DATA_CACHE_TLS_CERT",
        "DATA_CACHE_TLS_KEY",
        "DATA_CACHE_TLS_DIR",
    ):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def token_cache(table_factory) -> Iterator[LocalCache]:
    table = table_factory(ROWS, FILES)
    cache = LocalCache(table.metadata_location, data_nodes=2, env={"DATA_CACHE_TOKEN": TOKEN})
    try:
        cache.wait_ready()
        yield cache
    finally:
        cache.stop()


HEAD_CALLS = {
    "GetFlightInfo": lambda c, o: c.get_flight_info(flight.FlightDescriptor.for_path("0", "1"), o),
    "GetSchema": lambda c, o: c.get_schema(flight.FlightDescriptor.for_path("0", "1"), o),
    "ListFlights": lambda c, o: list(c.list_flights(options=o)),
    "DoAction status": lambda c, o: list(c.do_action(flight.Action("status", b""), o)),
}
# pyarrow's client raises a plain OSError for a failed GetSchema (it skips the Flight status mapping);
# the status underneath is still UNAUTHENTICATED.
REFUSED = {"GetSchema": OSError}


@pytest.mark.slow
@pytest.mark.parametrize("token", [None, "wrong-token", ""], ids=["no-header", "wrong", "empty"])
@pytest.mark.parametrize("call", HEAD_CALLS)
def test_head_refuses_calls_without_the_right_token(token_cache, call, token):
    refused = REFUSED.get(call, flight.FlightUnauthenticatedError)
    with pytest.raises(refused, match=r"missing or wrong bearer token.*Unauthenticated"):
        HEAD_CALLS[call](flight.FlightClient(token_cache.endpoint), bearer(token))


@pytest.mark.slow
@pytest.mark.parametrize("token", [None, "wrong-token"], ids=["no-header", "wrong"])
def test_data_nodes_refuse_doget_and_actions_without_the_right_token(token_cache, token):
    """A ticket is no credential: a data node checks the token itself."""
    info = flight.FlightClient(token_cache.endpoint).get_flight_info(
        flight.FlightDescriptor.for_path("0", "1"), bearer(TOKEN)
    )
    assert len(info.endpoints) == 2
    for endpoint in info.endpoints:
        node = flight.FlightClient(endpoint.locations[0].uri.decode())
        with pytest.raises(flight.FlightUnauthenticatedError):
            node.do_get(endpoint.ticket, bearer(token)).read_all()
        with pytest.raises(flight.FlightUnauthenticatedError):
            list(node.do_action(flight.Action("status", b""), bearer(token)))
        # The same ticket with the token is served: the refusal above was the token's doing.
        assert node.do_get(endpoint.ticket, bearer(TOKEN)).read_all().num_rows > 0


@pytest.mark.slow
def test_right_token_reads_every_row_once(token_cache):
    ids = read_path_shards(token_cache.endpoint, total=3, options=bearer(TOKEN)).column("id").to_pylist()
    assert sorted(ids) == list(range(ROWS))


@pytest.mark.slow
def test_token_stays_out_of_logs_and_command_lines(token_cache):
    assert command_lines_containing(TOKEN) == [], "a token on a command line is visible to every user (ps)"
    # Refused calls are what a leaky server would echo back into its log.
    with pytest.raises(flight.FlightUnauthenticatedError):
        flight.FlightClient(token_cache.endpoint).get_flight_info(
            flight.FlightDescriptor.for_path("0", "1"), bearer(TOKEN + "-wrong")
        )
    logs = drain_stderr(token_cache)
    assert "token required" in logs, "the nodes' start-up lines should be in the captured stderr"
    assert TOKEN not in logs


@pytest.mark.slow
def test_token_file_is_read_and_its_token_never_logged(table_factory, tmp_path, no_ambient_secrets):
    table = table_factory(ROWS, FILES)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")  # a mounted Secret often ends with a newline
    cache = LocalCache(table.metadata_location, data_nodes=1, env={"DATA_CACHE_TOKEN_FILE": str(token_file)})
    try:
        cache.wait_ready()
        with pytest.raises(flight.FlightUnauthenticatedError):
            read_path_shards(cache.endpoint, options=bearer(None))
        ids = read_path_shards(cache.endpoint, total=2, options=bearer(TOKEN)).column("id").to_pylist()
        assert sorted(ids) == list(range(ROWS))
    finally:
        cache.stop()
    assert "token required" in cache.stderr
    assert TOKEN not in cache.stderr


def test_a_cache_without_a_token_says_so_as_it_starts(small_cache):
    """An optional Secret without its `token` key leaves DATA_CACHE_TOKEN unset: the cache served
    everyone who reached its port, and its log said nothing of it."""
    assert "no token: any client that reaches it reads the table (DATA_CACHE_TOKEN)" in small_cache.read_stderr()


# --- TLS -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_cache(table_factory, self_signed_cert: Certificate) -> Iterator[tuple[LocalCache, str]]:
    """A TLS cache and the location its READY line announced."""
    table = table_factory(ROWS, FILES)
    cache = LocalCache(table.metadata_location, data_nodes=2, env=self_signed_cert.env())
    try:
        ready = cache.wait_ready()
        yield cache, ready.removeprefix("READY ")
    finally:
        cache.stop()


@pytest.mark.slow
def test_tls_cache_announces_and_advertises_tls_locations(tls_cache, self_signed_cert):
    cache, location = tls_cache
    assert location == f"grpc+tls://127.0.0.1:{cache.port}"
    client = flight.FlightClient(location, tls_root_certs=self_signed_cert.pem)
    info = client.get_flight_info(flight.FlightDescriptor.for_path("0", "1"), bearer(None))
    uris = [loc.uri.decode() for ep in info.endpoints for loc in ep.locations]
    assert len(uris) == 2
    assert all(uri.startswith("grpc+tls://127.0.0.1:") for uri in uris), uris
    # The data nodes registered with the head over TLS, at TLS locations.
    status = json.loads(next(iter(client.do_action(flight.Action("status", b""), bearer(None)))).body.to_pybytes())
    assert [n["location"] for n in status["nodes"]] == uris


@pytest.mark.slow
def test_tls_client_with_the_root_certificate_reads_every_row(tls_cache, self_signed_cert):
    _, location = tls_cache
    ids = read_path_shards(location, total=3, tls_root_certs=self_signed_cert.pem).column("id").to_pylist()
    assert sorted(ids) == list(range(ROWS))


@pytest.mark.slow
def test_plaintext_and_untrusting_clients_are_refused(tls_cache, self_signed_cert):
    cache, location = tls_cache
    info = flight.FlightClient(location, tls_root_certs=self_signed_cert.pem).get_flight_info(
        flight.FlightDescriptor.for_path("0", "1"), bearer(None)
    )
    node_location = info.endpoints[0].locations[0].uri.decode()
    for plain in (cache.endpoint, node_location.replace("grpc+tls://", "grpc://")):
        with pytest.raises(flight.FlightUnavailableError):
            list(flight.FlightClient(plain).do_action(flight.Action("status", b""), bearer(None)))
    # TLS without our root certificate: the self-signed certificate is not trusted by default.
    with pytest.raises(flight.FlightUnavailableError):
        flight.FlightClient(location).get_flight_info(flight.FlightDescriptor.for_path("0", "1"), bearer(None))
    with pytest.raises(flight.FlightUnavailableError):
        flight.FlightClient(node_location).do_get(info.endpoints[0].ticket, bearer(None)).read_all()


def test_a_client_that_does_not_trust_the_certificate_fails_at_once_naming_the_fix(tls_cache):
    """A certificate that does not verify stays so: no retrying until the deadline."""
    _, location = tls_cache
    started = time.monotonic()
    with pytest.raises(CacheUnavailableError, match="TLS handshake with the cache .* as tls_root_certs"):
        CacheClient(location, deadline_seconds=60).status()
    assert time.monotonic() - started < 30


def test_a_plaintext_client_on_a_tls_cache_is_told_to_use_grpc_tls_at_once(tls_cache, self_signed_cert):
    """Its calls fail as "Socket closed", as a cache still starting would: they were retried to
    the deadline (120 s by default), which then named no TLS. The head and a data node alike."""
    cache, location = tls_cache
    with CacheClient(location, tls_root_certs=self_signed_cert.pem) as trusting:
        node = trusting.status()["nodes"][0]["location"]
    for plain in (cache.endpoint, node.replace("grpc+tls://", "grpc://")):
        started = time.monotonic()
        with (
            CacheClient(cache.endpoint, deadline_seconds=60) as plaintext,
            pytest.raises(
                CacheUnavailableError, match=rf"the cache at {plain} serves TLS, and status was sent in plaintext"
            ),
        ):
            plaintext.status(plain)
        assert time.monotonic() - started < 30


def test_the_tls_question_takes_no_longer_than_its_timeout_in_all(monkeypatch):
    """The connect and the handshake each had the whole timeout: twice it, at worst (a connect
    slowed by a dropped SYN, then a server that never answers)."""
    import socket as sockets

    from kubeflow_data_cache import security

    connect = sockets.create_connection

    def slow_connect(address, timeout):
        time.sleep(0.8)  # a SYN retransmitted, say
        return connect(address, timeout)

    monkeypatch.setattr(security.socket, "create_connection", slow_connect)
    with sockets.socket() as silent:  # listens, and never answers a byte (a frozen server)
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        started = time.monotonic()
        assert security.speaks_tls(f"grpc://127.0.0.1:{silent.getsockname()[1]}", timeout=1.0) is None
        assert time.monotonic() - started < 1.4


def test_a_tls_client_on_a_plaintext_cache_is_told_to_use_grpc(small_cache):
    tls_endpoint = small_cache.endpoint.replace("grpc://", "grpc+tls://")
    with pytest.raises(CacheUnavailableError, match="does not serve TLS .*use a grpc:// endpoint"):
        CacheClient(tls_endpoint, deadline_seconds=60).status()


def test_root_certificates_that_are_not_pem_are_refused_at_construction(self_signed_cert):
    # A bundle with non-ASCII comments between its certificates is fine (gRPC reads it).
    bundle = "# Issuer: CN=Főtanúsítvány\n".encode() + self_signed_cert.pem
    CacheClient("grpc+tls://h:1", tls_root_certs=bundle).close()
    CacheClient("grpc+tls://h:1", tls_root_certs=bytearray(bundle)).close()
    for bad in (b"garbage", "not bytes either"):
        with pytest.raises(ValueError, match="tls_root_certs should be PEM certificates"):
            CacheClient("grpc+tls://h:1", tls_root_certs=bad)


@pytest.mark.parametrize(
    ("header", "accepted"),
    [
        (f"Bearer {TOKEN}", True),
        (f"bearer {TOKEN}", True),  # the scheme name is case-insensitive (RFC 7235)
        (f"BEARER {TOKEN}", True),
        (f"Basic {TOKEN}", False),
        (f"Bearer{TOKEN}", False),
        (f"Bearer {TOKEN.upper()}", False),  # the token itself is exact
        ("Bearer ", False),
    ],
)
def test_the_auth_scheme_is_case_insensitive_and_the_token_exact(header, accepted):
    factory = TokenAuthFactory(TOKEN)
    if accepted:
        assert factory.start_call(DO_GET, {"authorization": [header]}) is None
    else:
        with pytest.raises(flight.FlightUnauthenticatedError):
            factory.start_call(DO_GET, {"authorization": [header]})


@pytest.mark.parametrize(
    ("headers", "said"), [({}, "no bearer token"), ({"authorization": ["Bearer x"]}, "a wrong bearer token")]
)
def test_a_refused_token_is_said_missing_or_wrong_never_shown(headers, said, caplog):
    """Which tells a client not given the token from one holding an old one (a rotation)."""
    with pytest.raises(flight.FlightUnauthenticatedError):
        TokenAuthFactory(TOKEN).start_call(DO_GET, headers)
    assert [r.getMessage() for r in caplog.records] == [f"refused a DoGet call with {said}"]


def test_calls_refused_for_the_token_are_counted_and_logged_at_most_once_a_minute(small_table, caplog):
    """A refusal never reaches the handlers that count errors; the auth check counts it instead,
    so a misconfigured token or a probe shows on /metrics. And says so in the log (trainers
    refused after a rotated token left it silent), without the token, at most once a minute."""
    from kubeflow_data_cache.config import build_config
    from kubeflow_data_cache.head import Head
    from tests.cache.inprocess import FLAGS

    head = Head(build_config("head", {**FLAGS, "metadata_loc": small_table.metadata_location, "data_nodes": 1,
                                      "token": TOKEN}, env={}))  # fmt: skip
    try:
        client = flight.FlightClient(head.location)
        for _ in range(3):
            with pytest.raises(flight.FlightUnauthenticatedError):
                client.get_flight_info(flight.FlightDescriptor.for_path("0", "1"), bearer("wrong-token"))
        with pytest.raises(flight.FlightUnauthenticatedError):
            list(client.do_action(flight.Action("status", b""), bearer(None)))
        sample = head.metrics.registry.get_sample_value
        assert (
            sample("data_cache_errors_total", {"method": "GetFlightInfo", "action": "", "code": "UNAUTHENTICATED"}) == 3
        )
        assert sample("data_cache_errors_total", {"method": "DoAction", "action": "", "code": "UNAUTHENTICATED"}) == 1
        # Requests too: errors / requests is an error rate, never above 1.
        assert sample("data_cache_requests_total", {"method": "GetFlightInfo", "action": ""}) == 3
        assert sample("data_cache_requests_total", {"method": "DoAction", "action": ""}) == 1
        client.close()
        said = [r.getMessage() for r in caplog.records if r.name == "kubeflow_data_cache.security"]
        assert said == ["refused a GetFlightInfo call with a wrong bearer token"]
        assert all(r.levelname == "WARNING" for r in caplog.records if r.name == "kubeflow_data_cache.security")
    finally:
        head.stop()


def test_local_names_the_tls_error_when_its_certificate_does_not_cover_the_nodes(small_table, tmp_path):
    """A certificate whose names leave out the address the nodes use: nothing connects, and
    `local` said only "head not answering yet" at its deadline; then gRPC's reason, at the
    deadline. Now the data node fails at once, naming the name and the fix."""
    elsewhere = make_cert(tmp_path, "10.9.9.9", "elsewhere.example")
    result = run_data_cache(
        *("local", "--metadata-loc", small_table.metadata_location, "--data-nodes", "1", "--port", "0"),
        *("--startup-timeout", "60"),
        env={**os.environ, **elsewhere.env()},
        timeout=90,
    )
    assert result.returncode == 1
    assert "data node 0 exited with code 1 before the cache was ready" in result.stderr
    line = next(ln for ln in result.stderr.splitlines() if "the head's certificate at" in ln)
    assert "does not carry the name checked" in line and "Peer name 127.0.0.1 is not in peer certificate" in line
    assert "set DATA_CACHE_TLS_SERVER_NAME to a name it carries" in line


def test_every_channel_to_a_cache_process_caps_the_reconnect_backoff(monkeypatch):
    """gRPC waits up to 120 s between attempts to reconnect a channel whose peer was down: a node
    restarted at its address after a long outage went unseen by the head for 35 s (and nodes by a
    restarted head for 30 s) until the wait was capped. Internal and reader channels both cap it;
    a reader's own channel options still win."""
    from kubeflow_data_cache import security
    from kubeflow_data_cache.security import RECONNECT_BACKOFF_MAX_MS, client_for

    made: list[dict] = []

    class Recording:
        def __init__(self, location, **kwargs):
            made.append(kwargs)

        def close(self):
            pass

    monkeypatch.setattr(security.flight, "FlightClient", Recording)
    client_for("grpc://127.0.0.1:1")
    with CacheClient("grpc://127.0.0.1:1") as reader:
        reader._release(reader._acquire("grpc://127.0.0.1:2"))
    with CacheClient("grpc://127.0.0.1:1", generic_options=[("grpc.max_reconnect_backoff_ms", 9000)]) as reader:
        reader._release(reader._acquire("grpc://127.0.0.1:2"))
    options = [dict(kwargs["generic_options"]) for kwargs in made]
    assert RECONNECT_BACKOFF_MAX_MS <= 5000
    assert [o["grpc.max_reconnect_backoff_ms"] for o in options] == [RECONNECT_BACKOFF_MAX_MS] * 2 + [9000]


def test_a_tls_head_refuses_a_data_node_registering_at_a_plain_location(self_signed_cert, small_table):
    """The head sends its load (token and cluster key) and every reader's DoGet to where a node
    registered: a plain location beside a TLS head would carry them, and the rows, in clear (a
    node pod started before the TLS Secret existed, say)."""
    from kubeflow_data_cache.config import build_config
    from kubeflow_data_cache.head import Head
    from tests.cache.inprocess import FLAGS

    flags = {
        **FLAGS,
        "metadata_loc": small_table.metadata_location,
        "data_nodes": 1,
        "tls_cert": str(self_signed_cert.cert_file),
        "tls_key": str(self_signed_cert.key_file),
    }
    head = Head(build_config("head", flags, env={"DATA_CACHE_CLUSTER_KEY": "k3y-Zq"}))
    head.start()
    try:
        client = flight.FlightClient(head.location, tls_root_certs=self_signed_cert.pem)
        body = {"index": 0, "location": "grpc://127.0.0.1:1", "cluster_key": "k3y-Zq"}
        with pytest.raises(pa.ArrowInvalid, match=r"this head serves TLS .* registered at 'grpc://127\.0\.0\.1:1'"):
            list(client.do_action(flight.Action("register", json.dumps(body).encode()), bearer(None)))
        assert head.registered == {}
    finally:
        head.stop()


def _failed_registration(head_flags: dict, node_flags_for) -> tuple[str, str, dict]:
    """Start a head, then a data node whose flags ``node_flags_for(head port)`` gives, and wait
    (30 s at most, its own deadline being 600 s) for the node to fail: (the head's port, the
    node's reason, what the head registered)."""
    from kubeflow_data_cache.head import Head
    from kubeflow_data_cache.node import DataNode
    from kubeflow_data_cache.service import FAILED
    from tests.cache.inprocess import FLAGS, wait_for

    head = Head(build_config("head", {**FLAGS, "data_nodes": 1, **head_flags}, env={}))
    head.start()
    node = None
    try:
        port = head.location.rsplit(":", 1)[1]
        node = DataNode(
            build_config("worker", {**FLAGS, "index": 0, "startup_timeout": 600, **node_flags_for(port)}, env={})
        )
        node.start_registering()
        wait_for(lambda: node.lifecycle.state == FAILED, timeout=30)
        return port, node.lifecycle.detail, dict(head.registered)
    finally:
        head.stop()
        if node is not None:
            node.stop()


@pytest.mark.parametrize("tls_side", ["head", "node"])
def test_a_data_node_whose_head_speaks_the_other_protocol_says_so_at_once(self_signed_cert, small_table, tls_side):
    """Head and node dial each other with their own scheme: a pod group whose TLS Secret reached
    only some pods failed every handshake, and the node retried to its deadline (600 s) saying
    "Socket closed" or "wrong version number", and nothing of TLS."""
    tls = {"tls_cert": str(self_signed_cert.cert_file), "tls_key": str(self_signed_cert.key_file)}
    scheme = "grpc+tls" if tls_side == "node" else "grpc"  # the node dials with its own scheme
    port, detail, registered = _failed_registration(
        {"metadata_loc": small_table.metadata_location, **(tls if tls_side == "head" else {})},
        lambda port: {"head": f"{scheme}://127.0.0.1:{port}", **(tls if tls_side == "node" else {})},
    )
    head_says, node_says = ("serves TLS", "does not") if tls_side == "head" else ("does not serve TLS", "does")
    assert f"the head at {scheme}://127.0.0.1:{port} {head_says} and this data node {node_says}" in detail
    assert "every pod of a cache serves TLS or none does" in detail
    assert registered == {}


def test_a_data_node_that_refuses_the_heads_certificate_fails_at_once(self_signed_cert, small_table, tmp_path):
    """Head and node with certificates from two Secrets (each trusting its own): the node
    retried its registration to its startup deadline (600 s), where no retry changes a
    certificate."""
    other = make_cert(tmp_path, "127.0.0.1", "localhost")
    head_tls = {"tls_cert": str(self_signed_cert.cert_file), "tls_key": str(self_signed_cert.key_file)}
    port, detail, registered = _failed_registration(
        {"metadata_loc": small_table.metadata_location, **head_tls},
        lambda port: {
            "head": f"grpc+tls://127.0.0.1:{port}",
            "tls_cert": str(other.cert_file),
            "tls_key": str(other.key_file),
        },
    )
    assert f"the head's certificate at grpc+tls://127.0.0.1:{port} does not verify" in detail
    assert "certificate verify failed" in detail
    assert registered == {}


def test_certificates_to_trust_with_a_plaintext_endpoint_are_refused(self_signed_cert, small_cache, monkeypatch):
    """They were not used: the token and rows went in clear, without a word."""
    from kubeflow_data_cache.dataset import DataCacheDataset

    for make in (CacheClient, DataCacheDataset):
        with pytest.raises(ValueError, match=r"tls_root_certs is given, but endpoint grpc://h:1 is plaintext"):
            make("grpc://h:1", tls_root_certs=self_signed_cert.pem)
    # From the environment (the runtime mounts the Secret for every trainer): said, not refused,
    # and the plaintext cache read as before.
    monkeypatch.setenv("DATA_CACHE_TLS_DIR", str(self_signed_cert.cert_file.parent))
    monkeypatch.setenv("DATA_CACHE_ENDPOINT", small_cache.endpoint)
    with pytest.warns(
        UserWarning, match=rf"holds the cache's certificate, but DATA_CACHE_ENDPOINT {small_cache.endpoint}"
    ):
        dataset = DataCacheDataset(batch_size=1000, columns=["id"])
    assert sum(len(batch["id"]) for batch in dataset) == 10_000


def test_a_reader_told_of_an_expired_certificate_is_not_sent_for_another_ca(tmp_path):
    """The certificate authority was right; the hint said to pass one."""
    from tests.cache.conftest import make_tls_secret_folder

    folder = make_tls_secret_folder(tmp_path, "data-cache", expired=True)
    server = flight.FlightServerBase(
        "grpc+tls://127.0.0.1:0",
        tls_certificates=[((folder / "tls.crt").read_bytes(), (folder / "tls.key").read_bytes())],
    )
    try:
        location = f"grpc+tls://127.0.0.1:{server.port}"
        client = CacheClient(location, tls_root_certs=(folder / "ca.crt").read_bytes(), tls_server_name="data-cache")
        with client, pytest.raises(CacheUnavailableError, match="the cache's certificate has expired: renew it"):
            client.status()
    finally:
        server.shutdown()


def test_a_tls_reader_refuses_a_plain_data_node_location_before_dialing_it():
    """Whatever the head's answer says, a reader that asked for TLS never sends its token or
    reads rows in clear."""
    from kubeflow_data_cache.errors import DataCacheError
    from kubeflow_data_cache.protocol import ShardRequest

    client = CacheClient("grpc+tls://127.0.0.1:1", token=TOKEN)
    endpoint = flight.FlightEndpoint(b"ticket", ["grpc://127.0.0.1:2"])
    with pytest.raises(DataCacheError, match="sent data node location grpc://127.0.0.1:2, which is not TLS") as refused:
        next(client.read_endpoint(ShardRequest(), endpoint))
    assert TOKEN not in str(refused.value)
    client.close()


@pytest.mark.parametrize("content", ["s3cr3t\n", "  s3cr3t\r\n", "\ts3cr3t \n\n"])
def test_a_token_files_surrounding_whitespace_is_not_part_of_the_token(tmp_path, content):
    """Secrets made from files end in a newline, one edited on Windows in CR LF, some with spaces:
    the token is what is between them, as readers given the same file send it."""
    from kubeflow_data_cache.dataset import default_token
    from kubeflow_data_cache.security import load_token

    token_file = tmp_path / "token"
    token_file.write_bytes(content.encode())
    assert load_token(None, str(token_file)) == "s3cr3t"
    assert default_token({"DATA_CACHE_TOKEN_FILE": str(token_file)}) == "s3cr3t"


@pytest.mark.slow
def test_the_longest_token_taken_serves_every_call_and_a_longer_one_is_refused_at_start(
    small_table, tmp_path, no_ambient_secrets
):
    """gRPC refuses a call whose headers pass 8 KiB at random, past 16 KiB always: a 7,900-character
    token failed the load, 8,050 let the cache say READY and then failed its readers. Such a
    token is refused at start, naming the limit; the longest one taken works for every call."""
    longest = "t" * MAX_TOKEN_CHARS
    with running_cache(small_table.metadata_location, data_nodes=2, env={"DATA_CACHE_TOKEN": longest}) as cache:
        for _ in range(3):
            ids = read_path_shards(cache.endpoint, total=3, options=bearer(longest)).column("id").to_pylist()
            assert sorted(ids) == list(range(small_table.rows))
        with CacheClient(cache.endpoint, token=longest) as client:
            assert client.status()["state"] == "ready"
    token_file = tmp_path / "token"
    token_file.write_text(longest + "t")
    for env in ({"DATA_CACHE_TOKEN": longest + "t"}, {"DATA_CACHE_TOKEN_FILE": str(token_file)}):
        result = run_data_cache(
            "local", "--metadata-loc", small_table.metadata_location, env={**os.environ, **env}, timeout=60
        )
        assert result.returncode == 2, result.stderr
        assert f"is {MAX_TOKEN_CHARS + 1} characters long, more than {MAX_TOKEN_CHARS}" in result.stderr
        assert longest not in result.stderr
    with pytest.raises(ValueError, match="more than 6144"):
        CacheClient("grpc://127.0.0.1:1", token=longest + "t")


@pytest.mark.parametrize("content", [b"\xff\xfes3cr3t", b"tok\x80en"])
def test_a_token_file_that_is_not_text_is_refused_without_quoting_it(tmp_path, content):
    from kubeflow_data_cache.dataset import default_token
    from kubeflow_data_cache.errors import ConfigError
    from kubeflow_data_cache.security import load_token

    token_file = tmp_path / "token"
    token_file.write_bytes(content)
    for load in (
        lambda: load_token(None, str(token_file)),
        lambda: default_token({"DATA_CACHE_TOKEN_FILE": str(token_file)}),
    ):
        with pytest.raises(ConfigError, match="is not text: a token is printable ASCII") as refused:
            load()
        assert "0xff" not in str(refused.value) and "0x80" not in str(refused.value)


def test_a_token_file_setting_that_is_empty_is_refused_not_taken_as_no_auth():
    from kubeflow_data_cache.dataset import default_token
    from kubeflow_data_cache.errors import ConfigError
    from kubeflow_data_cache.security import load_token

    for empty in ("", "  "):
        with pytest.raises(ConfigError, match="DATA_CACHE_TOKEN_FILE is set but empty"):
            load_token(None, empty)
        with pytest.raises(ConfigError, match="DATA_CACHE_TOKEN_FILE is set but empty"):
            default_token({"DATA_CACHE_TOKEN_FILE": empty})
    assert load_token(None, None) is None and default_token({}) is None


def test_a_cluster_key_that_cannot_be_encoded_is_a_wrong_key_not_a_server_error():
    from kubeflow_data_cache.security import key_matches

    assert key_matches("k3y", "\ud800") is False
    assert key_matches("k3y", "k3y") is True
    assert key_matches("k3y", None) is False


def test_a_head_without_the_token_its_data_nodes_require_says_so(small_table):
    """Data nodes that require a token the head lacks (they register with a head that takes any):
    the head failed naming neither the node nor that the token missing was its own. (A head with
    another token refuses the nodes' registration, and the nodes say so.)"""
    from kubeflow_data_cache.head import Head
    from kubeflow_data_cache.node import DataNode
    from tests.cache.inprocess import FLAGS, wait_for

    flags = {**FLAGS, "metadata_loc": small_table.metadata_location, "data_nodes": 1}
    head = Head(build_config("head", flags, env={}))
    head.start()
    node = None
    try:
        flags = {**FLAGS, "index": 0, "head": head.location}
        node = DataNode(build_config("worker", flags, env={"DATA_CACHE_TOKEN": "the-nodes-token"}))
        node.start_registering()
        detail = wait_for(lambda: "refused the head's token" in head.lifecycle.detail and head.lifecycle.detail)
        assert f"data node 0 at {node.location} refused the head's token (this head has none)" in detail
        assert "give the head and every data node the same DATA_CACHE_TOKEN" in detail
        assert "the-nodes-token" not in detail
    finally:
        head.stop()
        if node is not None:
            node.stop()


def test_the_tls_question_reads_no_ca_bundle(monkeypatch, self_signed_cert):
    """A data node asks it after every failed registration, mostly while its head is still
    starting: reading the system's CA bundle each time (~40 ms of CPU) took CPU from the head's
    start-up, for a certificate check the question turns off. Asked of a TLS server, a plaintext
    one and a closed port, it answers each without reading it."""
    import socket as sockets
    import ssl
    import threading

    from kubeflow_data_cache import security

    def no_bundle(*args, **kwargs):
        raise AssertionError("the TLS question read the system's CA bundle")

    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(self_signed_cert.cert_file, self_signed_cert.key_file)
    monkeypatch.setattr(ssl, "create_default_context", no_bundle)
    monkeypatch.setattr(ssl.SSLContext, "load_default_certs", no_bundle)
    monkeypatch.setattr(ssl.SSLContext, "set_default_verify_paths", no_bundle)

    def answer(listener: sockets.socket, tls: bool) -> None:
        conn, _ = listener.accept()
        with conn:
            if tls:
                with server_context.wrap_socket(conn, server_side=True) as secure:
                    secure.recv(1)  # until the client closes
            else:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")  # answers, not in TLS

    for tls, expected in ((True, True), (False, False)):
        with sockets.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            thread = threading.Thread(target=answer, args=(listener, tls), daemon=True)
            thread.start()
            assert security.speaks_tls(f"grpc://127.0.0.1:{listener.getsockname()[1]}", timeout=5.0) is expected
            thread.join(5)
    with sockets.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: refused
        assert security.speaks_tls(f"grpc://127.0.0.1:{port}", timeout=1.0) is None
