"""The cache over S3: a real `data-cache local` cluster reading an Iceberg table from moto server.

Every setting reaches the nodes the way it does in a pod: through the standard AWS env variables.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import os
import socket
import threading
import time
from collections.abc import Iterator

import pyarrow.compute as pc
import pytest

from kubeflow_data_cache.s3_settings import TRIMMED_SETTINGS
from kubeflow_data_cache.sample import SampleTable, create_sample_table
from tests.cache.conftest import S3Server, read_path_shards, run_data_cache
from tests.conftest import LocalCache, running_cache

BUCKET = "bucket"
ROWS, FILES = 2000, 3
FAILURE_TIMEOUT_SECONDS = 90.0
AWS_VARIABLES = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_PROFILE",
)


@pytest.fixture(autouse=True)
def _no_ambient_aws(monkeypatch):
    """Only the variables a test sets reach the cache (the caches inherit this process's env)."""
    for name in AWS_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def s3_tables(moto_s3: S3Server, tmp_path_factory) -> dict[str, SampleTable]:
    """``events``: the table the cache serves; ``broken``: a table with one data file deleted."""
    moto_s3.client().create_bucket(Bucket=BUCKET)
    catalog_db = tmp_path_factory.mktemp("s3-catalog") / "catalog.db"
    props = moto_s3.iceberg_properties()
    warehouse = f"s3://{BUCKET}/wh"
    tables = {
        name: create_sample_table(warehouse, rows, files, table_name=name, catalog_db=catalog_db, properties=props)
        for name, rows, files in (("events", ROWS, FILES), ("broken", 100, 1))
    }
    s3 = moto_s3.client()
    listing = s3.list_objects_v2(Bucket=BUCKET, Prefix="wh/demo/broken/data/")["Contents"]
    s3.delete_object(Bucket=BUCKET, Key=sorted(o["Key"] for o in listing)[0])
    return tables


def assert_every_row_once(table, rows: int) -> None:
    ids = sorted(table.column("id").to_pylist())
    assert ids == list(range(rows)), "each row of the table should be served exactly once"
    expected_text = pc.binary_join_element_wise("row-", pc.cast(table.column("id"), "string"), "")
    assert table.column("text").cast("string").equals(expected_text), "rows should arrive intact"


def failed_run(metadata_loc: str, env: dict[str, str]) -> tuple[int, str]:
    """Run `data-cache local` that must fail: its exit code and stderr, within a deadline."""
    cache = LocalCache(metadata_loc, data_nodes=1, env=env, args=("--startup-timeout", "60"))
    cache.wait_failure(timeout=FAILURE_TIMEOUT_SECONDS)
    return cache.proc.returncode, cache.stderr


@pytest.mark.slow
def test_reads_every_row_from_s3_with_standard_aws_env(moto_s3, s3_tables):
    table = s3_tables["events"]
    with running_cache(table.metadata_location, data_nodes=2, env=moto_s3.env()) as cache:
        assert_every_row_once(read_path_shards(cache.endpoint, total=3), ROWS)


@pytest.mark.slow
def test_reads_s3a_location_with_only_the_s3_specific_endpoint(moto_s3, s3_tables):
    """Two settings a Spark/Hadoop shop brings: an `s3a://` METADATA_LOC, and the endpoint given
    only as AWS_ENDPOINT_URL_S3 (the service-specific form)."""
    location = s3_tables["events"].metadata_location
    assert location.startswith("s3://")
    env = {k: v for k, v in moto_s3.env().items() if k != "AWS_ENDPOINT_URL"}
    env["AWS_ENDPOINT_URL_S3"] = moto_s3.endpoint
    with running_cache("s3a://" + location.removeprefix("s3://"), data_nodes=1, env=env) as cache:
        assert_every_row_once(read_path_shards(cache.endpoint, total=2), ROWS)


@pytest.mark.slow
def test_an_s3_compatible_store_needs_no_region(moto_s3, s3_tables):
    """MinIO's usual settings: an endpoint and keys, no region. Without one, pyiceberg asked public
    AWS where the bucket lives, from every process (seconds each, offline)."""
    env = {**moto_s3.env(), "AWS_REGION": "", "AWS_DEFAULT_REGION": ""}
    with running_cache(s3_tables["events"].metadata_location, data_nodes=1, env=env) as cache:
        assert_every_row_once(read_path_shards(cache.endpoint, total=1), ROWS)
        log = cache.read_stderr()
    assert "resolve region" not in log, log[-2000:]


@pytest.mark.slow
def test_an_endpoint_scheme_in_capitals_is_read_as_written(moto_s3, s3_tables):
    """`HTTP://host:port` passed the scheme check, but the S3 client took "HTTP" for a host."""
    env = {**moto_s3.env(), "AWS_ENDPOINT_URL": moto_s3.endpoint.replace("http://", "HTTP://")}
    with running_cache(s3_tables["events"].metadata_location, data_nodes=1, env=env) as cache:
        assert_every_row_once(read_path_shards(cache.endpoint, total=1), ROWS)


def test_the_string_sample_is_read_from_s3(moto_s3, tmp_path):
    """The head sizes string columns by a decoded sample: read from the store like any data file
    (page by page), not left to the fixed factor."""
    import uuid

    import pyarrow as pa

    from kubeflow_data_cache.plan import open_table, plan_table
    from kubeflow_data_cache.sample import make_catalog

    moto_s3.client().create_bucket(Bucket="sample-bucket")
    catalog = make_catalog("s3://sample-bucket/wh", tmp_path / "c.db", moto_s3.iceberg_properties())
    catalog.create_namespace("s")
    rows = 20_000  # UUIDs: ~300 KiB on disk in the sampled rows, past the sample's minimum
    data = pa.table({"id": pa.array(range(rows), pa.int64()), "key": [str(uuid.uuid4()) for _ in range(rows)]})
    catalog.create_table("s.keys", schema=data.schema).append(data)
    location = catalog.load_table("s.keys").metadata_location
    table = open_table(location, moto_s3.iceberg_properties())
    plan, _ = plan_table(table, location)
    (key_id,) = [f.field_id for f in table.schema().fields if f.name == "key"]
    assert set(plan.expansions) == {key_id} and 1 <= plan.expansions[key_id] < 2


def test_sample_table_writes_to_s3_with_the_standard_aws_env_and_leaves_no_catalog_behind(moto_s3, tmp_path):
    """Its catalog database went into the folder the command ran from; the metadata location is
    all the cache needs, and it serves the table."""
    moto_s3.client().create_bucket(Bucket="cli-bucket")
    env = {"PATH": "/usr/bin:/bin", **moto_s3.env()}
    made = run_data_cache(
        "sample-table", "--warehouse", "s3://cli-bucket/wh", "--rows", "500", "--files", "2", env=env, cwd=tmp_path
    )
    assert made.returncode == 0, made.stderr
    location = made.stdout.strip()
    assert location.startswith("s3://cli-bucket/wh/demo/events/metadata/") and location.endswith(".metadata.json")
    assert list(tmp_path.iterdir()) == []
    with running_cache(location, data_nodes=1, env=moto_s3.env()) as cache:
        assert_every_row_once(read_path_shards(cache.endpoint, 1), 500)


def test_sample_table_ends_after_its_error_with_web_identity_settings(moto_s3, tmp_path):
    """With IRSA's settings, pyarrow's S3 client hung for ever finalizing at exit (after the
    command had printed its error): the command leaves at once, as the cache's processes do."""
    token = tmp_path / "token"
    token.write_text("not-a-real-token")
    env = {
        "PATH": "/usr/bin:/bin",
        "AWS_ENDPOINT_URL": moto_s3.endpoint,
        "AWS_REGION": "us-east-1",
        "AWS_ROLE_ARN": "arn:aws:iam::123456789012:role/reader",
        "AWS_WEB_IDENTITY_TOKEN_FILE": str(token),
    }
    made = run_data_cache("sample-table", "--warehouse", "s3://no-such-bucket/wh", env=env, cwd=tmp_path, timeout=60)
    assert made.returncode == 2
    assert "error: cannot write the sample table under --warehouse 's3://no-such-bucket/wh'" in made.stderr


def test_footers_are_read_from_s3_by_their_manifest_size(moto_s3, tmp_path, caplog):
    """The head reads each footer in one request, the file's size taken from its manifest; a
    read that failed would only be logged, and values that compress far better than 4x would be
    estimated from the manifests alone."""
    import pyarrow as pa

    from kubeflow_data_cache.footer_floors import _footer, footer_expansions
    from kubeflow_data_cache.plan import open_table, scan_tasks
    from kubeflow_data_cache.sample import make_catalog

    moto_s3.client().create_bucket(Bucket="footer-bucket")
    catalog = make_catalog("s3://footer-bucket/wh", tmp_path / "c.db", moto_s3.iceberg_properties())
    catalog.create_namespace("s")
    rows = 5000
    padded = [f"{'x' * 1000}-{i}" for i in range(rows)]  # ~60x on disk
    data = pa.table({"id": pa.array(range(rows), pa.int64()), "text": padded})
    catalog.create_table("s.padded", schema=data.schema).append(data)
    location = catalog.load_table("s.padded").metadata_location
    table = open_table(location, moto_s3.iceberg_properties())
    tasks = scan_tasks(table, location)
    (text_id,) = [f.field_id for f in table.schema().fields if f.name == "text"]
    with caplog.at_level("INFO"):
        ratios = footer_expansions(table, tasks, {text_id})
    assert "could not read the footer" not in caplog.text
    assert ratios[text_id] > 20, ratios
    path, task = next(iter(tasks.items()))
    metadata, _ = _footer(table, path, task.file.file_size_in_bytes)  # the one-request path
    assert metadata.num_rows == rows


@pytest.fixture
def plain_http_port():
    """A plain-HTTP server that answers nothing useful: a store reached with the wrong scheme."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@contextlib.contextmanager
def _serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """An HTTP server on loopback answering with ``handler``: its http:// endpoint."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_https_endpoint_of_a_plain_http_store_is_named_with_the_fix(plain_http_port):
    """curl's "SSL connect error ... wrong version number" named neither the endpoint nor its setting."""
    endpoint = f"https://127.0.0.1:{plain_http_port}"
    env = {"AWS_ENDPOINT_URL_S3": endpoint, "AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "s"}
    code, stderr = failed_run("s3://bucket/wh/t/metadata/00001-a.metadata.json", env)
    assert code != 0
    assert f"cannot reach the object store at {endpoint} (AWS_ENDPOINT_URL_S3)" in stderr
    assert f"the store answered in plain HTTP: write AWS_ENDPOINT_URL_S3=http://127.0.0.1:{plain_http_port}" in stderr


def test_an_endpoint_nothing_listens_on_is_named_with_its_setting():
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "s"}
    code, stderr = failed_run("s3://bucket/wh/t/metadata/00001-a.metadata.json", env)
    assert code != 0
    assert f"cannot reach the object store at {endpoint} (AWS_ENDPOINT_URL)" in stderr
    assert "check that AWS_ENDPOINT_URL names the store's host and port" in stderr


class _MovedPermanently(http.server.BaseHTTPRequestHandler):
    """What AWS answers a request sent to another region's endpoint than the bucket's: 301, and
    for a HEAD no body, so the status is the only sign."""

    def do_HEAD(self):
        self.send_response(301)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD

    def log_message(self, *args):
        pass


def test_a_bucket_of_another_region_names_aws_region():
    """It said only "AWS Error UNKNOWN (HTTP status 301) ... No response body", naming no setting."""
    with _serving(_MovedPermanently) as endpoint:
        env = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_REGION": "us-west-2",
            "AWS_ACCESS_KEY_ID": "a",
            "AWS_SECRET_ACCESS_KEY": "s",
        }
        code, stderr = failed_run("s3://bucket/wh/t/metadata/00001-a.metadata.json", env)
    assert code == 1
    assert "the bucket is in another region than the one requests were sent to" in stderr, stderr[-2000:]
    assert "set AWS_REGION to the bucket's region" in stderr


@pytest.mark.parametrize("endpoint", [" http://127.0.0.1:9", "http://127.0.0.1:9\n"])
def test_an_endpoint_with_blanks_around_it_is_refused_naming_it(endpoint):
    """A ConfigMap made from a file keeps its newline: the S3 client's error, split over two log
    lines, named no setting; a leading blank read as a missing scheme."""
    code, stderr = failed_run("s3://bucket/wh/t/metadata/00001-a.metadata.json", {"AWS_ENDPOINT_URL": endpoint})
    assert code == 2  # a setting: refused by local before it starts a node
    assert f"AWS_ENDPOINT_URL={endpoint!r} has blanks or a line break around it" in stderr
    assert "set it to the URL alone, 'http://127.0.0.1:9'" in stderr


def test_wrong_bucket_fails_with_the_location_it_tried(moto_s3):
    location = "s3://no-such-bucket/wh/demo/events/metadata/00003-0a1b2c3d.metadata.json"
    code, stderr = failed_run(location, moto_s3.env())
    assert code != 0
    # A missing bucket reads as a missing key (a HEAD's 404 has no body): both are named.
    assert (
        f"METADATA_LOC {location!r} does not exist on the object store at {moto_s3.endpoint} (AWS_ENDPOINT_URL): "
        "point it at the table's current metadata.json, and check that the bucket 'no-such-bucket' is on that store "
        "and that AWS_ENDPOINT_URL names the store itself"
    ) in stderr


class _SlowStore:
    """A proxy in front of moto that waits ``delay`` seconds before answering each data file's
    GET (a store slower than the S3 client's default 3 s to start an answer), and counts the
    data files' bytes it passes on."""

    def __init__(self, upstream: str, delay: float):
        host, port = upstream.removeprefix("http://").split(":")
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command == "GET" and self.path.split("?")[0].endswith(".parquet"):
                    time.sleep(delay)
                    proxy.delayed += 1
                upstream_conn = http.client.HTTPConnection(host, int(port), timeout=60)
                upstream_conn.request(self.command, self.path, body=body, headers=dict(self.headers))
                answer = upstream_conn.getresponse()
                data = answer.read()
                if self.command == "GET" and self.path.split("?")[0].endswith(".parquet"):
                    proxy.parquet_bytes += len(data)
                self.send_response(answer.status)
                dropped = ("transfer-encoding", "connection") + (() if self.command == "HEAD" else ("content-length",))
                for name, value in answer.getheaders():
                    if name.lower() not in dropped:  # a HEAD's length is the object's
                        self.send_header(name, value)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                upstream_conn.close()

            do_GET = do_HEAD = do_PUT = do_POST = _forward

            def log_message(self, *args):
                pass

        self.delayed = self.parquet_bytes = 0
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.slow
def test_a_store_slower_than_the_default_request_timeout_loads_with_aws_timeout(moto_s3, s3_tables):
    """A store that took 5 s to start each answer failed every load ("Operation too slow ... the
    last 3 seconds"), and no setting could give it longer: AWS_TIMEOUT does."""
    store = _SlowStore(moto_s3.endpoint, delay=4.0)
    try:
        env = {**moto_s3.env(), "AWS_ENDPOINT_URL": store.endpoint, "AWS_TIMEOUT": "20s"}
        with running_cache(s3_tables["events"].metadata_location, data_nodes=1, env=env) as cache:
            assert_every_row_once(read_path_shards(cache.endpoint, total=1), ROWS)
        assert store.delayed >= FILES  # every data file came late
    finally:
        store.close()


def test_the_warm_up_read_fetches_one_column_of_the_smallest_file(moto_s3, s3_tables, tmp_path):
    """Each data node warms its Parquet reader while the cluster forms: one batch of every column
    fetched a whole row group from the store at each start (12 MB of a 48 MB table) and decoded
    it outside the load's memory budget."""
    from kubeflow_data_cache.plan import open_table, scan_tasks
    from kubeflow_data_cache.s3_settings import s3_properties_from_env
    from kubeflow_data_cache.store import warm_reader

    table = create_sample_table(
        f"s3://{BUCKET}/warm", 200_000, 1, catalog_db=tmp_path / "catalog.db", properties=moto_s3.iceberg_properties()
    )
    store = _SlowStore(moto_s3.endpoint, delay=0.0)
    try:
        opened = open_table(
            table.metadata_location, s3_properties_from_env({**moto_s3.env(), "AWS_ENDPOINT_URL": store.endpoint})
        )
        (task,) = scan_tasks(opened, table.metadata_location).values()
        before = store.parquet_bytes
        warm_reader(opened, task)
        fetched = store.parquet_bytes - before
    finally:
        store.close()
    assert 0 < fetched < task.file.file_size_in_bytes / 4, (fetched, task.file.file_size_in_bytes)


@pytest.mark.slow
def test_missing_data_file_fails_the_load_naming_the_file(moto_s3, s3_tables):
    code, stderr = failed_run(s3_tables["broken"].metadata_location, moto_s3.env())
    assert code != 0
    assert "cannot read data file s3://bucket/wh/demo/broken/data/" in stderr
    assert "it is gone, though the table's metadata names it" in stderr
    assert "point METADATA_LOC at the current metadata.json" in stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "bad",
    [
        pytest.param({"AWS_ACCESS_KEY_ID": "AKIAUNKNOWNKEY000000"}, id="unknown-key"),
        pytest.param({"AWS_SECRET_ACCESS_KEY": "not-the-secret"}, id="wrong-secret"),
    ],
)
def test_denied_read_names_the_credentials(moto_s3, s3_tables, bad):
    code, stderr = failed_run(s3_tables["events"].metadata_location, {**moto_s3.env(), **bad})
    assert code != 0
    assert "was denied" in stderr and "check the AWS credentials" in stderr
    assert "signed with the access key in AWS_ACCESS_KEY_ID; check that key's secret" in stderr
    secret = bad.get("AWS_SECRET_ACCESS_KEY", moto_s3.secret_key)
    assert secret not in stderr, "a secret key must never reach the logs"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("key", "said"),
    [
        # A policy that reaches the metadata but not the data files (a prefix scoped wrong).
        ("metadata_only", "cannot read data file s3://bucket/wh/demo/events/data/"),
        # The manifests are read between the metadata and the data files, from the same store:
        # their failures were passed on raw (ACCESS_DENIED during HeadObject), with no fix named.
        ("no_manifests", "reading its manifests, access was denied: check the AWS credentials"),
    ],
)
def test_a_denied_read_past_the_metadata_names_what_and_the_credentials(moto_s3, s3_tables, key, said):
    access, secret = getattr(moto_s3, key)
    env = {**moto_s3.env(), "AWS_ACCESS_KEY_ID": access, "AWS_SECRET_ACCESS_KEY": secret}
    code, stderr = failed_run(s3_tables["events"].metadata_location, env)
    assert code != 0
    assert said in stderr, stderr[-3000:]
    assert "signed with the access key in AWS_ACCESS_KEY_ID; check that key's secret and its policy" in stderr
    assert secret not in stderr


def test_a_profile_is_named_and_one_no_shared_file_defines_is_said_to_be_skipped(tmp_path):
    """The SDK skips a profile it cannot find and goes on down its chain, or sends requests
    unsigned: the 403 then blamed "the profile 'nosuch'" as if it existed without permission."""
    from kubeflow_data_cache.s3_settings import credential_source

    credentials, config = tmp_path / "credentials", tmp_path / "config"
    credentials.write_text("[team]\naws_access_key_id = AKIA1\naws_secret_access_key = s\n")
    config.write_text("[profile ops]\nregion = eu-west-1\n[default]\nregion = us-east-1\n")
    files = {"AWS_SHARED_CREDENTIALS_FILE": str(credentials), "AWS_CONFIG_FILE": str(config)}
    for profile in ("team", "ops", "default"):
        said = credential_source({**files, "AWS_PROFILE": profile})
        assert said == f"credentials from the profile {profile!r} of the shared AWS files"
    said = credential_source({**files, "AWS_PROFILE": "nosuch"})
    assert f"AWS_PROFILE='nosuch' is in none of the shared AWS files ({credentials}, {config})" in said
    assert "signed by the next credentials of the AWS chain (web identity, the instance role) or go unsigned" in said


def test_profiles_the_sdk_reads_are_not_said_to_be_missing(tmp_path, caplog):
    """The check refused what the SDK takes: a file with a byte that is not UTF-8 failed the load
    (UnicodeDecodeError), and a section given twice or a ~ in the path warned of a profile in use."""
    from kubeflow_data_cache.s3_settings import credential_source, s3_properties_from_env

    latin1 = tmp_path / "latin1"
    latin1.write_bytes(b"# caf\xe9\n[team]\naws_access_key_id = AKIA1\naws_secret_access_key = s\n")
    twice = tmp_path / "twice"
    twice.write_text("[team]\nregion = us-east-1\n[team]\nregion = eu-west-1\n")
    home = tmp_path / "home"
    (home / "creds").parent.mkdir()
    (home / "creds").write_text("[team]\naws_access_key_id = AKIA1\n")
    none = str(tmp_path / "none")
    cases = [
        {"AWS_SHARED_CREDENTIALS_FILE": str(latin1)},
        {"AWS_SHARED_CREDENTIALS_FILE": str(twice)},
        {"AWS_SHARED_CREDENTIALS_FILE": "~/creds", "HOME": str(home)},
    ]
    for files in cases:
        env = {"AWS_PROFILE": "team", "AWS_CONFIG_FILE": none, **files}
        with pytest.MonkeyPatch.context() as patch, caplog.at_level("WARNING"):
            patch.setenv("HOME", files.get("HOME", os.environ.get("HOME", "/")))
            caplog.clear()
            assert s3_properties_from_env(env) == {}
            assert credential_source(env) == "credentials from the profile 'team' of the shared AWS files", files
            assert caplog.records == [], files


def test_a_profile_no_shared_file_defines_is_logged_when_the_cache_starts(moto_s3, s3_tables, tmp_path):
    """What a review ran: AWS_PROFILE=nosuch and no keys; moto answers the unsigned request with a
    500 (S3 a 403), and nothing said the profile was never used."""
    env = {name: value for name, value in moto_s3.env().items() if not name.startswith("AWS_SECRET")}
    env.pop("AWS_ACCESS_KEY_ID")
    env |= {"AWS_PROFILE": "nosuch", "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}
    env["AWS_CONFIG_FILE"] = str(tmp_path / "none-either")
    code, stderr = failed_run(s3_tables["events"].metadata_location, env)
    assert code == 1
    assert "WARNING" in stderr and "AWS_PROFILE='nosuch' is in none of the shared AWS files" in stderr, stderr[-2000:]


@pytest.mark.parametrize(
    ("env", "says"),
    [
        (
            {"AWS_ACCESS_KEY_ID": "AKIA1", "AWS_SECRET_ACCESS_KEY": "s"},
            "signed with the access key in AWS_ACCESS_KEY_ID;",
        ),
        ({"AWS_ACCESS_KEY_ID": "AKIA1", "AWS_SESSION_TOKEN": "t"}, "AWS_ACCESS_KEY_ID with AWS_SESSION_TOKEN"),
        # A temporary key without its token: the store refuses it as it refuses a wrong secret.
        ({"AWS_ACCESS_KEY_ID": "ASIA1", "AWS_SECRET_ACCESS_KEY": "s"}, "a temporary key (ASIA...), which needs"),
        (
            {"AWS_ROLE_ARN": "arn:aws:iam::1:role/reader", "AWS_WEB_IDENTITY_TOKEN_FILE": "/var/run/token"},
            "web identity (IRSA) for role arn:aws:iam::1:role/reader",
        ),
        ({"AWS_CONTAINER_CREDENTIALS_FULL_URI": "http://169.254.170.23/v1"}, "container credentials endpoint"),
        ({}, "no AWS credentials are set in the environment"),
    ],
)
def test_the_credentials_in_play_are_named_never_their_values(env, says):
    """What a denied read adds to its error (the SDK's chain picks credentials silently)."""
    from kubeflow_data_cache.s3_settings import credential_source

    said = credential_source(env)
    assert says in said
    assert not {"s", "t", "AKIA1"} & set(said.replace(";", " ").split())


def test_a_web_identity_token_file_that_is_not_there_is_named(tmp_path):
    """The SDK skips web identity silently without its token: the denial then blamed the role."""
    from kubeflow_data_cache.s3_settings import credential_source

    role = {"AWS_ROLE_ARN": "arn:aws:iam::1:role/reader"}
    missing = credential_source({**role, "AWS_WEB_IDENTITY_TOKEN_FILE": str(tmp_path / "token")})
    assert f"AWS_WEB_IDENTITY_TOKEN_FILE={str(tmp_path / 'token')!r} does not exist, so the SDK skipped it" in missing
    (tmp_path / "token").write_text("jwt")
    present = credential_source({**role, "AWS_WEB_IDENTITY_TOKEN_FILE": str(tmp_path / "token")})
    assert "does not exist" not in present and "check that role's policy on the bucket" in present


def test_moto_refuses_wrong_credentials(moto_s3):
    """Guards the tests above: the S3 endpoint really checks the key (moto does not by default)."""
    from botocore.exceptions import ClientError

    wrong = S3Server(moto_s3.endpoint, "testing", "testing")
    with pytest.raises(ClientError, match="InvalidAccessKeyId"):
        wrong.client().list_buckets()
    assert isinstance(moto_s3.client().list_buckets()["Buckets"], list)


@pytest.mark.parametrize("variable", TRIMMED_SETTINGS)
def test_an_aws_setting_with_a_line_break_is_refused_naming_it_not_its_value(variable):
    """A Secret made with --from-file keeps the file's newline: the region's read "A region must be
    set" (of one that is), a key's the store's HTTP 500 or "access was denied", naming nothing."""
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "s"}
    env[variable] = "s3cr3t-value\n"
    code, stderr = failed_run("s3://bucket/wh/t/metadata/00001-a.metadata.json", env)
    assert code == 2  # a setting: refused by local before it starts a node
    assert f"{variable} has blanks or a line break around its value" in stderr
    assert f"set {variable} to the value alone" in stderr
    assert "s3cr3t-value" not in stderr  # keys among them: never echoed


class _WebConsole(http.server.BaseHTTPRequestHandler):
    """A service that answers every path with a page: MinIO's console (:9001) beside its S3 API (:9000)."""

    def do_GET(self):
        page = b"<!doctype html><html><body>Console</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(page)

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


def test_an_endpoint_that_answers_pages_is_named_beside_metadata_loc():
    """It said only that METADATA_LOC is not Iceberg table metadata ('Invalid JSON ...'), sending
    the reader to a location that was right, at a service that was not the store."""
    with _serving(_WebConsole) as endpoint:
        env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "s"}
        code, stderr = failed_run("s3://bucket/wh/t/metadata/00001-a.metadata.json", env)
    assert code == 1
    assert "is not Iceberg table metadata ('Invalid JSON" in stderr, stderr[-2000:]
    assert f"check that AWS_ENDPOINT_URL ({endpoint}) names the store's S3 API, not another service" in stderr


def test_under_local_a_store_that_never_answers_the_metadata_read_is_named_by_the_head():
    """A store that takes the connection and never answers (AWS_TIMEOUT raised for a slow one):
    local's deadline, started a moment before the head's, fired first and said only "not ready
    within 5s (planning the table scan ...)"; the head's own failure names the storage."""
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        env = {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{silent.getsockname()[1]}",
            "AWS_TIMEOUT": "600s",
            "AWS_ACCESS_KEY_ID": "a",
            "AWS_SECRET_ACCESS_KEY": "s",
        }
        cache = LocalCache(
            "s3://bucket/wh/t/metadata/00001-a.metadata.json", data_nodes=1, env=env, args=("--startup-timeout", "5")
        )
        stderr = cache.wait_failure(timeout=FAILURE_TIMEOUT_SECONDS)
    finally:
        silent.close()
    assert cache.proc.returncode == 1
    assert "planning the table scan did not finish within 5s" in stderr, stderr[-2000:]
    assert "its storage does not answer; check the location's scheme" in stderr
