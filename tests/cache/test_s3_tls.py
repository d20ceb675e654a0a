"""The cache over an object store that speaks TLS with a private CA (moto server with a
certificate from a test CA), as MinIO or Ceph behind an internal CA would.

The table is written in a child process: the S3 client reads SSL_CERT_FILE once per process,
and this one's must stay as the other tests need it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cache.conftest import (
    DATA_CACHE_TIMEOUT_SECONDS,
    MOTO_REGION,
    _wait_listening,
    read_path_shards,
    run_data_cache,
    stop_moto,
)
from tests.conftest import LocalCache, free_port
from tests.tls_certs import tls_secret_pems

ROWS = 3000
KEYS = {"AWS_ACCESS_KEY_ID": "tls-test", "AWS_SECRET_ACCESS_KEY": "tls-test-secret", "AWS_REGION": MOTO_REGION}

_WRITE_TABLE = """
import sys
from pathlib import Path
from kubeflow_data_cache.sample import create_sample_table
endpoint, catalog, rows = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
props = {"s3.endpoint": endpoint, "s3.access-key-id": "tls-test", "s3.secret-access-key": "tls-test-secret",
         "s3.region": "us-east-1"}
print(create_sample_table("s3://tls-bucket/wh", rows, 2, catalog_db=catalog, properties=props).metadata_location)
"""


@dataclass(frozen=True)
class TlsStore:
    endpoint: str
    ca_dir: Path  # holds ca.crt, as the data-cache-s3-ca ConfigMap's volume does
    metadata_location: str

    def env(self, **extra: str) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, **KEYS, **extra}


@pytest.fixture(scope="module")
def tls_store(tmp_path_factory) -> Iterator[TlsStore]:
    import boto3

    folder = tmp_path_factory.mktemp("s3-tls")
    for name, pem in tls_secret_pems("localhost").items():  # tls.crt names localhost; ca.crt signed it
        (folder / name).write_bytes(pem)
    ca_dir = folder / "ca"
    ca_dir.mkdir()
    (ca_dir / "ca.crt").write_bytes((folder / "ca.crt").read_bytes())
    port = free_port()
    log = folder / "moto.log"
    moto = Path(sys.executable).with_name("moto_server")
    cmd = [str(moto), "-H", "127.0.0.1", "-p", str(port), "-c", str(folder / "tls.crt"), "-k", str(folder / "tls.key")]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_listening(port, proc, log)
        endpoint = f"https://localhost:{port}"
        s3 = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name=MOTO_REGION,
            aws_access_key_id=KEYS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=KEYS["AWS_SECRET_ACCESS_KEY"],
            verify=str(ca_dir / "ca.crt"),
        )
        s3.create_bucket(Bucket="tls-bucket")
        env = {**os.environ, "SSL_CERT_FILE": str(ca_dir / "ca.crt")}
        writer = [sys.executable, "-c", _WRITE_TABLE, endpoint, str(folder / "catalog.db"), str(ROWS)]
        written = subprocess.run(
            writer, env=env, capture_output=True, text=True, timeout=DATA_CACHE_TIMEOUT_SECONDS, check=True
        )
        yield TlsStore(endpoint, ca_dir, written.stdout.strip())
    finally:
        stop_moto(proc)


@pytest.fixture(autouse=True)
def _no_ambient_trust(monkeypatch):
    """Only the CA a test gives reaches the cache (the caches inherit this process's env)."""
    for name in ("SSL_CERT_FILE", "AWS_CA_BUNDLE", "DATA_CACHE_S3_CA_DIR", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)


def test_the_stores_ca_in_the_mounted_folder_is_trusted(tls_store):
    """What the initializer mounts from the namespace's data-cache-s3-ca ConfigMap."""
    cache = LocalCache(tls_store.metadata_location, 1, env=tls_store.env(DATA_CACHE_S3_CA_DIR=str(tls_store.ca_dir)))
    try:
        location = cache.wait_ready().split()[1]
        assert sorted(read_path_shards(location).column("id").to_pylist()) == list(range(ROWS))
    finally:
        cache.stop()


def test_aws_ca_bundle_is_trusted(tls_store):
    cache = LocalCache(
        tls_store.metadata_location, 1, env=tls_store.env(AWS_CA_BUNDLE=str(tls_store.ca_dir / "ca.crt"))
    )
    try:
        location = cache.wait_ready().split()[1]
        assert read_path_shards(location).num_rows == ROWS
    finally:
        cache.stop()


def test_an_untrusted_store_fails_naming_the_fix(tls_store, tmp_path):
    """Without the CA (or with an empty folder: a namespace without the ConfigMap) the load fails
    with the certificate error and the two ways to give the CA."""
    cache = LocalCache(tls_store.metadata_location, 1, env=tls_store.env(DATA_CACHE_S3_CA_DIR=str(tmp_path)))
    try:
        assert cache.proc.wait(timeout=DATA_CACHE_TIMEOUT_SECONDS) == 1
        err = cache.read_stderr()
        assert "the object store's certificate is not trusted" in err, err[-3000:]
        assert "AWS_CA_BUNDLE, or on Kubernetes a ConfigMap `data-cache-s3-ca` with key `ca.crt`" in err
    finally:
        cache.stop()


def test_a_missing_aws_ca_bundle_stops_the_cache_at_start(tls_store, tmp_path):
    cache = LocalCache(tls_store.metadata_location, 1, env=tls_store.env(AWS_CA_BUNDLE=str(tmp_path / "gone.pem")))
    try:
        assert cache.proc.wait(timeout=DATA_CACHE_TIMEOUT_SECONDS) == 2
        assert "is not a file: give the path of the store's CA certificate(s)" in cache.read_stderr()
    finally:
        cache.stop()


def test_a_certificate_for_another_name_is_named_as_such_not_as_an_untrusted_ca(tls_store):
    """Reached at 127.0.0.1, a store whose certificate names only localhost: with its CA given,
    the error said to give the CA."""
    port = tls_store.endpoint.rsplit(":", 1)[1]
    env = tls_store.env(AWS_CA_BUNDLE=str(tls_store.ca_dir / "ca.crt"), AWS_ENDPOINT_URL=f"https://127.0.0.1:{port}")
    cache = LocalCache(tls_store.metadata_location, 1, env=env)
    try:
        assert cache.proc.wait(timeout=DATA_CACHE_TIMEOUT_SECONDS) == 1
        err = cache.read_stderr()
        assert "the object store's certificate does not name the host it was reached at" in err, err[-3000:]
        assert "reach the store by a name its certificate carries (in AWS_ENDPOINT_URL)" in err
        assert "give the store's CA" not in err
    finally:
        cache.stop()


def test_an_ssl_cert_file_set_by_hand_is_named_when_it_hides_the_stores_ca(tls_store):
    """SSL_CERT_FILE (a base image may set it) wins over AWS_CA_BUNDLE: that was silent, and the
    failure then said to set AWS_CA_BUNDLE, which was set."""
    system = "/etc/ssl/certs/ca-certificates.crt"
    if not os.path.isfile(system):
        pytest.skip(f"no system CA bundle at {system}")
    env = tls_store.env(AWS_CA_BUNDLE=str(tls_store.ca_dir / "ca.crt"), SSL_CERT_FILE=system)
    cache = LocalCache(tls_store.metadata_location, 1, env=env)
    try:
        assert cache.proc.wait(timeout=DATA_CACHE_TIMEOUT_SECONDS) == 1
        err = cache.read_stderr()
        assert f"SSL_CERT_FILE='{system}' is set, so the object store's CA in" in err, err[-3000:]
        assert f"SSL_CERT_FILE='{system}' is the CA file in use, and it wins over AWS_CA_BUNDLE" in err
    finally:
        cache.stop()


@pytest.mark.parametrize("where", ["AWS_CA_BUNDLE", "DATA_CACHE_S3_CA_DIR"])
def test_a_ca_file_that_holds_no_certificate_stops_the_cache_at_start(tls_store, tmp_path, where):
    """curl's "error adding trust anchors" (curlCode 77) was reported as a store that cannot be reached."""
    (tmp_path / "ca.crt").write_text("not a certificate\n")
    value = str(tmp_path / "ca.crt") if where == "AWS_CA_BUNDLE" else str(tmp_path)
    cache = LocalCache(tls_store.metadata_location, 1, env=tls_store.env(**{where: value}))
    try:
        assert cache.proc.wait(timeout=DATA_CACHE_TIMEOUT_SECONDS) == 2
        err = cache.read_stderr()
        assert "holds no PEM certificate (no -----BEGIN CERTIFICATE----- line)" in err, err[-3000:]
        assert "cannot reach" not in err
    finally:
        cache.stop()


@pytest.mark.parametrize("where", ["AWS_CA_BUNDLE", "DATA_CACHE_S3_CA_DIR"])
def test_a_ca_given_that_did_not_sign_the_stores_certificate_is_named_as_given(tls_store, tmp_path, where):
    """The given CA became SSL_CERT_FILE, and the failure then blamed an SSL_CERT_FILE the user
    never set, "winning over" the very setting they had given."""
    (tmp_path / "ca.crt").write_bytes(tls_secret_pems("localhost")["ca.crt"])  # another CA
    value = str(tmp_path / "ca.crt") if where == "AWS_CA_BUNDLE" else str(tmp_path)
    cache = LocalCache(tls_store.metadata_location, 1, env=tls_store.env(**{where: value}))
    try:
        assert cache.proc.wait(timeout=DATA_CACHE_TIMEOUT_SECONDS) == 1
        err = cache.read_stderr()
        source = "AWS_CA_BUNDLE" if where == "AWS_CA_BUNDLE" else "the `data-cache-s3-ca` ConfigMap"
        assert f"the CA given in {source} ('{tmp_path / 'ca.crt'}') did not sign the store's certificate" in err, err[
            -3000:
        ]
        assert "SSL_CERT_FILE=" not in err
    finally:
        cache.stop()


@pytest.mark.parametrize("where", ["AWS_CA_BUNDLE", "DATA_CACHE_S3_CA_DIR", None])
def test_sample_table_trusts_the_stores_ca_as_the_cache_does(tls_store, tmp_path, where):
    """`data-cache sample-table` writes to a store behind a private CA given the way the cache
    is given it; without it, the error names the fix. It ignored both, so a table the cache
    would read could not be written, with curl's words alone."""
    given = {"AWS_CA_BUNDLE": str(tls_store.ca_dir / "ca.crt"), "DATA_CACHE_S3_CA_DIR": str(tls_store.ca_dir)}
    env = {"PATH": os.environ["PATH"], **tls_store.env(**({where: given[where]} if where else {}))}
    made = run_data_cache("sample-table", "--warehouse", "s3://tls-bucket/cli", "--rows", "100", env=env, cwd=tmp_path)
    if where:
        assert made.returncode == 0, made.stderr
        assert made.stdout.strip().startswith("s3://tls-bucket/cli/")
    else:
        assert made.returncode == 2
        assert "the object store's certificate is not trusted" in made.stderr, made.stderr
        assert "AWS_CA_BUNDLE" in made.stderr
