"""Fixtures for the cache suites: an S3 endpoint (moto server), a self-signed certificate, and the
upstream-style reader every end-to-end test uses to check what a cache serves."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from tests.cache.inprocess import cluster  # noqa: F401 (a fixture, shared with every cache test)
from tests.conftest import free_port, json_from_a_fresh_process
from tests.tls_certs import self_signed_pems, tls_secret_pems

DATA_CACHE_TIMEOUT_SECONDS = 90

MOTO_START_TIMEOUT_SECONDS = 30.0
MOTO_STOP_TIMEOUT_SECONDS = 10.0
MOTO_REGION = "us-east-1"


def table_in_files(tmp_path: Path, data: pa.Table, files: int = 1) -> str:
    """``data`` as a fresh Iceberg table ``s.t`` in a local warehouse under ``tmp_path``, appended
    in ``files`` equal parts (one data file each); its metadata location."""
    from kubeflow_data_cache.sample import make_catalog

    catalog = make_catalog(str(tmp_path / "wh"), tmp_path / "c.db")
    catalog.create_namespace("s")
    table = catalog.create_table("s.t", schema=data.schema)
    for part in range(files):
        table.append(data.slice(part * data.num_rows // files, data.num_rows // files))
    return catalog.load_table("s.t").metadata_location


def held_and_estimated(location: str) -> tuple[dict[str, int], dict[str, int]]:
    """Per column: what one node holding the whole table holds, and what the plan estimated."""
    from kubeflow_data_cache.plan import assign_rows, open_table, plan_table
    from kubeflow_data_cache.store import NodeStore

    t = open_table(location)
    plan, tasks = plan_table(t, location)
    (a,) = assign_rows(plan, 1)
    held = NodeStore.load(t, tasks, plan.schema, list(a.pieces), 1, None, plan.expansions).column_bytes
    estimated = {name: sum(f.column_bytes[i] for f in plan.files) for i, name in enumerate(plan.schema.names)}
    return held, estimated


def pool_peak_in_a_fresh_process(
    location: str, setup: str, read: str, also: str, decode_threads: int | None = None
) -> dict:
    """Run ``read`` as a data node would, in a fresh interpreter with the table planned and
    ``setup`` done; its Arrow pool's peak above where it started (everything the read held at
    once), with the figures of the ``also`` dict expression. ``decode_threads``: pyarrow's CPU
    threads (None: this machine's)."""
    script = (
        "import json, sys, pyarrow as pa\n"
        f"if {decode_threads!r}: pa.set_cpu_count({decode_threads!r})\n"
        "from kubeflow_data_cache.plan import assign_rows, open_table, plan_table\n"
        "from kubeflow_data_cache.store import NodeStore, read_piece\n"
        "t = open_table(sys.argv[1]); plan, tasks = plan_table(t, sys.argv[1])\n"
        f"{setup}\n"
        "pool = pa.default_memory_pool(); before = pool.bytes_allocated()\n"
        f"{read}\n"
        f"print(json.dumps({{'peak': pool.max_memory() - before, **{also}}}))\n"
    )
    return json_from_a_fresh_process(script, location)


def read_descriptor(
    location: str,
    descriptor: flight.FlightDescriptor,
    options: flight.FlightCallOptions | None = None,
    tls_root_certs: bytes | None = None,
) -> tuple[flight.FlightInfo, pa.Table]:
    """What an upstream client does for one flight: GetFlightInfo on the head, then DoGet on each
    endpoint's own location. Returns the FlightInfo and the rows (an empty table for no endpoints)."""
    kwargs = {"tls_root_certs": tls_root_certs} if tls_root_certs else {}
    options = options or flight.FlightCallOptions()
    info = flight.FlightClient(location, **kwargs).get_flight_info(descriptor, options)
    tables = [
        flight.FlightClient(endpoint.locations[0].uri.decode(), **kwargs).do_get(endpoint.ticket, options).read_all()
        for endpoint in info.endpoints
    ]
    return info, (pa.concat_tables(tables) if tables else info.schema.empty_table())


def read_path_shards(
    location: str,
    total: int = 1,
    options: flight.FlightCallOptions | None = None,
    tls_root_certs: bytes | None = None,
) -> pa.Table:
    """Every shard the way an upstream client reads it (PATH [i, total]); all rows of all shards."""
    return pa.concat_tables(
        read_descriptor(location, flight.FlightDescriptor.for_path(str(i), str(total)), options, tls_root_certs)[1]
        for i in range(total)
    )


@dataclass(frozen=True)
class S3Server:
    """A moto S3 endpoint that checks signatures: only ``access_key``/``secret_key`` are accepted."""

    endpoint: str
    access_key: str
    secret_key: str
    region: str = MOTO_REGION
    metadata_only: tuple[str, str] | None = None  # a key denied the tables' data files
    no_manifests: tuple[str, str] | None = None  # a key denied the tables' manifests

    def env(self) -> dict[str, str]:
        """The standard AWS settings a cache pod would get."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
        }

    def iceberg_properties(self) -> dict[str, str]:
        return {
            "s3.endpoint": self.endpoint,
            "s3.access-key-id": self.access_key,
            "s3.secret-access-key": self.secret_key,
            "s3.region": self.region,
        }

    def client(self, service: str = "s3"):
        import boto3

        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
        )


def _wait_listening(port: int, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + MOTO_START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"moto_server did not listen on {port} within {MOTO_START_TIMEOUT_SECONDS:.0f}s")


# The only IAM calls moto lets through unauthenticated: three per user that _bootstrap_iam makes.
BOOTSTRAP_IAM_CALLS = 9
ALLOW_S3 = {"Effect": "Allow", "Action": "s3:*", "Resource": "*"}
# A reader whose policy reaches tables' metadata but not their data files (a policy scoped to
# the wrong prefix): what the cache sees when one data file's GetObject is refused.
DENY_DATA_FILES = {"Effect": "Deny", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::*/data/*"}
# One that reaches the metadata.json but not the manifests (Avro files) it names.
DENY_MANIFESTS = {"Effect": "Deny", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::*.avro"}


def _bootstrap_iam(endpoint: str) -> dict[str, tuple[str, str]]:
    """Create the IAM users whose keys S3 accepts: `data-cache` (all of S3), `metadata-only`
    (denied the data files) and `no-manifests` (denied the manifests); their (access key, secret key)."""
    import boto3

    iam = boto3.client(
        "iam",
        endpoint_url=endpoint,
        region_name=MOTO_REGION,
        aws_access_key_id="bootstrap",
        aws_secret_access_key="bootstrap",
    )
    keys = {}
    users = (
        ("data-cache", [ALLOW_S3]),
        ("metadata-only", [ALLOW_S3, DENY_DATA_FILES]),
        ("no-manifests", [ALLOW_S3, DENY_MANIFESTS]),
    )
    for user, statements in users:
        iam.create_user(UserName=user)
        key = iam.create_access_key(UserName=user)["AccessKey"]
        policy = {"Version": "2012-10-17", "Statement": statements}
        iam.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=json.dumps(policy))
        keys[user] = (key["AccessKeyId"], key["SecretAccessKey"])
    return keys


@pytest.fixture(scope="session")
def moto_s3(tmp_path_factory) -> Iterator[S3Server]:
    """``moto_server`` on a free loopback port with IAM enforcement on, so wrong credentials are
    refused as on AWS (moto accepts any key otherwise)."""
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    moto = Path(sys.executable).with_name("moto_server")
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(moto), "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(BOOTSTRAP_IAM_CALLS)},
        )
    try:
        _wait_listening(port, proc, log)
        endpoint = f"http://127.0.0.1:{port}"
        keys = _bootstrap_iam(endpoint)
        yield S3Server(
            endpoint, *keys["data-cache"], metadata_only=keys["metadata-only"], no_manifests=keys["no-manifests"]
        )
    finally:
        stop_moto(proc)


def stop_moto(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=MOTO_STOP_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass(frozen=True)
class Certificate:
    cert_file: Path
    key_file: Path

    @property
    def pem(self) -> bytes:
        return self.cert_file.read_bytes()

    def env(self) -> dict[str, str]:
        return {"DATA_CACHE_TLS_CERT": str(self.cert_file), "DATA_CACHE_TLS_KEY": str(self.key_file)}


def make_cert(folder: Path, ip: str, dns: str) -> Certificate:
    """A self-signed certificate for ``ip`` and ``dns``: server certificate and root of trust."""
    cert_pem, key_pem = self_signed_pems(ip, dns)
    cert_file, key_file = folder / "tls.crt", folder / "tls.key"
    cert_file.write_bytes(cert_pem)
    key_file.write_bytes(key_pem)
    return Certificate(cert_file, key_file)


def make_tls_secret_folder(folder: Path, dns: str, expired: bool = False) -> Path:
    """A TLS Secret's folder as a pod mounts it: ``tls.crt`` naming only ``dns`` (past its end
    where ``expired``), ``tls.key`` and the signing CA's ``ca.crt`` (tests/tls_certs.py)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, pem in tls_secret_pems(dns, expired).items():
        (folder / name).write_bytes(pem)
    return folder


@pytest.fixture(scope="session")
def self_signed_cert(tmp_path_factory) -> Certificate:
    """A self-signed certificate for 127.0.0.1 and localhost: server certificate and root of trust."""
    return make_cert(tmp_path_factory.mktemp("tls"), "127.0.0.1", "localhost")


def run_data_cache(
    *args: str, env: dict | None = None, timeout: float = DATA_CACHE_TIMEOUT_SECONDS, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """`data-cache ARGS` in a fresh interpreter (``env`` None: this process's environment)."""
    return subprocess.run(
        [sys.executable, "-m", "kubeflow_data_cache", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
    )
