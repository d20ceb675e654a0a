"""TLS from a Kubernetes TLS Secret's folder, as the initializer and the runtime mount it.

The cache pods and the trainers mount the namespace's `data-cache-tls` Secret as an optional
volume: its files when it exists, an empty folder when not. The certificate names `data-cache`
(pod IPs are not known in advance), so every client checks that name instead of the address it
dials. Real processes on loopback, a real CA and a leaf certificate that names no address.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from kubeflow_data_cache.client import CacheClient
from kubeflow_data_cache.config import build_config
from kubeflow_data_cache.dataset import DataCacheDataset, default_endpoint, default_tls_root_certs
from kubeflow_data_cache.errors import CacheUnavailableError, ConfigError
from tests.cache.conftest import make_tls_secret_folder
from tests.cache.inprocess import FLAGS
from tests.conftest import LocalCache

ROWS, FILES = 3000, 3
SERVER_NAME = "data-cache"


@pytest.fixture(scope="module")
def secret_folder(tmp_path_factory) -> Path:
    """What a cache pod sees: tls.crt (naming only data-cache), tls.key and the CA's ca.crt."""
    return make_tls_secret_folder(tmp_path_factory.mktemp("tls") / "secret", SERVER_NAME)


@pytest.fixture(scope="module")
def trainer_folder(secret_folder, tmp_path_factory) -> Path:
    """What a trainer pod sees: the runtime mounts ca.crt and tls.crt only, never the key."""
    folder = tmp_path_factory.mktemp("trainer-tls")
    for name in ("ca.crt", "tls.crt"):
        shutil.copy(secret_folder / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def secret_cache(table_factory, secret_folder) -> Iterator[tuple[LocalCache, str]]:
    table = table_factory(ROWS, FILES)
    env = {"DATA_CACHE_TLS_DIR": str(secret_folder), "DATA_CACHE_TLS_SERVER_NAME": SERVER_NAME}
    cache = LocalCache(table.metadata_location, data_nodes=2, env=env)
    try:
        ready = cache.wait_ready()
        yield cache, ready.removeprefix("READY ")
    finally:
        cache.stop()


@pytest.fixture()
def no_tls_env(monkeypatch):
    for name in ("DATA_CACHE_TLS_DIR", "DATA_CACHE_TLS_SERVER_NAME", "DATA_CACHE_ENDPOINT", "TRAIN_JOB_NAME"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.slow
def test_a_cache_on_a_secret_folder_serves_a_trainer_set_up_by_env_alone(
    secret_cache, trainer_folder, monkeypatch, no_tls_env
):
    """Head and data nodes formed over TLS, checking the CA-signed certificate against
    data-cache (their addresses, 127.0.0.1, are not in it); a trainer with the runtime's two
    variables reads every row once."""
    _, location = secret_cache
    assert location.startswith("grpc+tls://127.0.0.1:")
    monkeypatch.setenv("DATA_CACHE_TLS_DIR", str(trainer_folder))
    monkeypatch.setenv("DATA_CACHE_TLS_SERVER_NAME", SERVER_NAME)
    dataset = DataCacheDataset(location, batch_size=500, columns=["id"], shuffle=True)
    ids = [i for batch in dataset for i in batch["id"].tolist()]
    assert sorted(ids) == list(range(ROWS))
    dataset.close()


@pytest.mark.slow
def test_without_the_server_name_the_handshake_fails_at_once_naming_it(secret_cache, trainer_folder):
    _, location = secret_cache
    ca = (trainer_folder / "ca.crt").read_bytes()
    with pytest.raises(CacheUnavailableError, match="TLS handshake .* is not in peer certificate.* as tls_server_name"):
        CacheClient(location, tls_root_certs=ca, deadline_seconds=60).status()
    # The same client with the name reads the status: the certificate and CA were right.
    with CacheClient(location, tls_root_certs=ca, tls_server_name=SERVER_NAME, deadline_seconds=60) as client:
        assert client.status()["state"] == "ready"


@pytest.mark.slow
def test_an_empty_secret_folder_serves_plaintext_and_says_so(table_factory, tmp_path):
    """No Secret in the namespace: the optional volume is an empty folder, the cache serves as
    before, and its log says why a TLS reader would be told it does not serve TLS."""
    table = table_factory(ROWS, FILES)
    env = {"DATA_CACHE_TLS_DIR": str(tmp_path), "DATA_CACHE_TLS_SERVER_NAME": SERVER_NAME}
    cache = LocalCache(table.metadata_location, data_nodes=1, env=env)
    try:
        assert cache.wait_ready() == f"READY grpc://127.0.0.1:{cache.port}"
        with CacheClient(cache.endpoint, deadline_seconds=30) as client:
            assert client.status()["rows"] == ROWS
    finally:
        cache.stop()
    assert "holds no tls.crt or tls.key: serving Flight without TLS" in cache.stderr


def _head_config(env: dict[str, str], **flags) -> object:
    return build_config("head", {**FLAGS, "metadata_loc": "/tmp/t/metadata.json", "data_nodes": 1, **flags}, env=env)


def test_a_secret_folder_with_a_certificate_and_no_key_is_refused_naming_both(secret_folder, tmp_path):
    shutil.copy(secret_folder / "tls.crt", tmp_path / "tls.crt")
    with pytest.raises(
        ConfigError, match=r"DATA_CACHE_TLS_DIR.* holds tls.crt but no tls.key: a TLS Secret needs both"
    ):
        _head_config({"DATA_CACHE_TLS_DIR": str(tmp_path)})


def test_an_expired_certificate_is_refused_at_start(tmp_path):
    """The head served on with it, its data nodes retried their registration to the startup
    deadline, and readers were told to pass the certificate authority they passed."""
    folder = make_tls_secret_folder(tmp_path / "secret", SERVER_NAME, expired=True)
    with pytest.raises(ConfigError, match=r"tls.crt'?: the certificate expired on .*: renew it"):
        _head_config({"DATA_CACHE_TLS_DIR": str(folder)})


def test_a_certificate_without_the_server_name_peers_check_is_refused_at_start(secret_folder):
    with pytest.raises(
        ConfigError, match=r"the certificate names data-cache, not `DATA_CACHE_TLS_SERVER_NAME` .*'cache.team-a'"
    ):
        _head_config({"DATA_CACHE_TLS_DIR": str(secret_folder), "DATA_CACHE_TLS_SERVER_NAME": "cache.team-a"})
    with pytest.raises(ConfigError, match=r"not `DATA_CACHE_TLS_SERVER_NAME` \(--tls-server-name\) 'other'"):
        _head_config({"DATA_CACHE_TLS_DIR": str(secret_folder)}, tls_server_name="other")


def test_a_server_name_that_is_an_address_matches_the_certificates_address(self_signed_cert):
    """gRPC matches an address given as the server name against the certificate's IP entries:
    the start-up check compared DNS names only, and refused a certificate every peer accepted."""
    flags = {"tls_cert": str(self_signed_cert.cert_file), "tls_key": str(self_signed_cert.key_file)}
    assert _head_config({}, **flags, tls_server_name="127.0.0.1").tls.server_name == "127.0.0.1"
    with pytest.raises(ConfigError, match=r"the certificate names localhost, 127\.0\.0\.1, not .*'10\.0\.0\.1'"):
        _head_config({}, **flags, tls_server_name="10.0.0.1")
    # As gRPC matches them: the usual form of an IPv6 address, not another spelling of it.
    from kubeflow_data_cache.config import _same_address

    assert _same_address("0:0:0:0:0:0:0:1", "::1") and _same_address("::1", "[::1]")
    assert not _same_address("::1", "0:0:0:0:0:0:0:1") and not _same_address("::1", "0::1")


@pytest.mark.parametrize(
    ("pattern", "name", "matches"),
    [
        ("data-cache", "DATA-CACHE", True),
        ("data-cache.", "data-cache", True),
        ("*.team-a.svc", "cache.team-a.svc", True),
        ("*.team-a.svc", "a.cache.team-a.svc", False),  # one label only
        ("*.team-a.svc", "team-a.svc", False),
        ("data-cache", "data-cache-2", False),
    ],
)
def test_certificate_names_match_as_peers_match_them(pattern, name, matches):
    from kubeflow_data_cache.config import _name_matches

    assert _name_matches(pattern, name) is matches


def test_an_unreadable_ca_file_in_the_folder_is_one_line_not_a_traceback(secret_folder, monkeypatch):
    """A ca.crt the process may not read raised PermissionError, a traceback and exit 1, where an
    unreadable key gave one line naming it. (Refused as OpenSSL refuses it: a test run as root
    reads any file.)"""
    import ssl

    def unreadable(self, cafile=None, **kwargs):
        if str(cafile).endswith("ca.crt"):
            raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", unreadable)
    with pytest.raises(ConfigError, match=r"DATA_CACHE_TLS_DIR.* cannot read .*ca\.crt': Permission denied"):
        _head_config({"DATA_CACHE_TLS_DIR": str(secret_folder)})


def test_a_secret_folder_that_is_not_there_is_refused(tmp_path):
    """A typo in the path would otherwise read as "no Secret" and serve plaintext."""
    with pytest.raises(ConfigError, match="is not a folder: point it at where the TLS Secret is mounted"):
        _head_config({"DATA_CACHE_TLS_DIR": str(tmp_path / "nope")})


def test_a_folder_and_a_certificate_together_are_refused(secret_folder):
    env = {"DATA_CACHE_TLS_DIR": str(secret_folder), "DATA_CACHE_TLS_CERT": str(secret_folder / "tls.crt")}
    with pytest.raises(ConfigError, match="set either `DATA_CACHE_TLS_DIR`.* not both"):
        _head_config(env)


def test_certificate_flags_override_the_env_folder(secret_folder, self_signed_cert):
    """Cache pods have DATA_CACHE_TLS_DIR set: --tls-cert and --tls-key replace it, as flags
    replace env settings, instead of failing as 'both set'."""
    flags = {"tls_cert": str(self_signed_cert.cert_file), "tls_key": str(self_signed_cert.key_file)}
    cfg = _head_config({"DATA_CACHE_TLS_DIR": str(secret_folder)}, **flags)
    assert cfg.tls.certificates == [(self_signed_cert.cert_file.read_bytes(), self_signed_cert.key_file.read_bytes())]


def test_a_folder_makes_peers_trust_its_ca_and_check_the_server_name(secret_folder):
    cfg = _head_config({"DATA_CACHE_TLS_DIR": str(secret_folder), "DATA_CACHE_TLS_SERVER_NAME": SERVER_NAME})
    assert cfg.scheme == "grpc+tls"
    assert cfg.tls.root_certs == (secret_folder / "ca.crt").read_bytes()
    assert cfg.tls.server_name == SERVER_NAME
    assert cfg.tls.certificates == [
        ((secret_folder / "tls.crt").read_bytes(), (secret_folder / "tls.key").read_bytes())
    ]


def test_a_server_name_that_is_no_dns_name_is_refused(no_tls_env, monkeypatch):
    with pytest.raises(ConfigError, match="DATA_CACHE_TLS_SERVER_NAME.* should be the DNS name"):
        _head_config({"DATA_CACHE_TLS_SERVER_NAME": "data cache"})
    with pytest.raises(ValueError, match="tls_server_name should be the DNS name"):
        DataCacheDataset("grpc+tls://h:1", tls_server_name="https://data-cache")
    monkeypatch.setenv("DATA_CACHE_TLS_SERVER_NAME", "data-cache/")
    with pytest.raises(ConfigError, match="DATA_CACHE_TLS_SERVER_NAME should be the DNS name"):
        DataCacheDataset("grpc+tls://h:1")


def test_the_trainer_trusts_the_ca_where_the_folder_has_one_else_the_certificate(secret_folder, tmp_path):
    assert default_tls_root_certs({"DATA_CACHE_TLS_DIR": str(secret_folder)}) == (secret_folder / "ca.crt").read_bytes()
    shutil.copy(secret_folder / "tls.crt", tmp_path / "tls.crt")  # kubectl create secret tls: no ca.crt
    assert default_tls_root_certs({"DATA_CACHE_TLS_DIR": str(tmp_path)}) == (secret_folder / "tls.crt").read_bytes()
    assert default_tls_root_certs({}) is None
    (tmp_path / "tls.crt").write_text("not a certificate")
    with pytest.raises(ConfigError, match="holds no PEM certificate; check the TLS Secret"):
        default_tls_root_certs({"DATA_CACHE_TLS_DIR": str(tmp_path)})


def test_a_trainer_without_the_secret_reads_plaintext(tmp_path, no_tls_env, monkeypatch):
    """The runtime's optional volume is an empty folder where the namespace has no TLS Secret."""
    monkeypatch.setenv("DATA_CACHE_TLS_DIR", str(tmp_path))
    monkeypatch.setenv("TRAIN_JOB_NAME", "job")
    dataset = DataCacheDataset()
    assert dataset.tls_root_certs is None
    assert dataset.endpoint == "grpc://job-cache-service:50051"


def test_a_trainer_with_the_secret_dials_the_job_cache_over_tls(trainer_folder, no_tls_env, monkeypatch):
    monkeypatch.setenv("DATA_CACHE_TLS_DIR", str(trainer_folder))
    monkeypatch.setenv("DATA_CACHE_TLS_SERVER_NAME", SERVER_NAME)
    monkeypatch.setenv("TRAIN_JOB_NAME", "job")
    dataset = DataCacheDataset()
    assert dataset.endpoint == "grpc+tls://job-cache-service:50051"
    assert dataset.tls_root_certs == (trainer_folder / "ca.crt").read_bytes()
    assert dataset.tls_server_name == SERVER_NAME
    # An endpoint given outright is used as given.
    assert default_endpoint({"DATA_CACHE_ENDPOINT": "grpc://elsewhere:1"}, tls=True) == "grpc://elsewhere:1"
