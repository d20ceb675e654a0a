"""Bad settings end in one clear line naming the setting and the fix, and exit 2: never a
traceback, never a setting that silently turns a deadline or a budget off."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kubeflow_data_cache.config import build_config
from kubeflow_data_cache.errors import ConfigError
from tests.cache.conftest import run_data_cache

DEADLINE = 60
HEAD = {"metadata_loc": "x", "data_nodes": 1, "host": "127.0.0.1", "port": 0, "health_port": 0}


def data_cache(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    # No METADATA_LOC / LWS_* / LOG_LEVEL from the outer environment.
    return run_data_cache(*args, env={"PATH": "/usr/bin:/bin", **(env or {})}, timeout=DEADLINE, cwd=cwd)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in errors[0]


@pytest.fixture
def listening():
    """A port something already listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        ({"port": 70000}, {}, "`FLIGHT_PORT` (--port) should be a port number from 0 to 65535, got 70000"),
        # Either side of the range gets the same message.
        (
            {"port": None},
            {"FLIGHT_PORT": "-1"},
            "`FLIGHT_PORT` (--port) should be a port number from 0 to 65535, got -1",
        ),
        ({"health_port": None}, {"HEALTH_PORT": "99999"}, "`HEALTH_PORT` (--health-port) should be a port number"),
        ({"startup_timeout": float("nan")}, {}, "(--startup-timeout) should be a finite number of seconds > 0"),
        ({}, {"DATA_CACHE_STARTUP_TIMEOUT_SECONDS": "inf"}, "`DATA_CACHE_STARTUP_TIMEOUT_SECONDS` (--startup-timeout)"),
        ({}, {"DATA_CACHE_FAILURE_GRACE_SECONDS": "nan"}, "`DATA_CACHE_FAILURE_GRACE_SECONDS` (--failure-grace)"),
        # Past what a thread can wait: the failed node's grace raised OverflowError when it came.
        ({"failure_grace": "1e10"}, {}, "(--failure-grace) should be at most 9223372036 seconds, got '1e10'"),
        # The head kept a list of every missing index: 10**12 grew to GBs and never reached its deadline.
        ({"data_nodes": "1000000000000"}, {}, "`DATA_NODES` (--data-nodes) should be <= 16384"),
        ({"data_nodes": ""}, {"LWS_GROUP_SIZE": "16386"}, "`LWS_GROUP_SIZE` should be <= 16385"),
        # int() reads any script's digits: an Arabic-Indic three was port 3.
        ({"port": None}, {"FLIGHT_PORT": "\u0663"}, "`FLIGHT_PORT` (--port) should be an integer"),
        ({"metadata_loc": "s3://[bucket/t/metadata/1.json"}, {}, "is not a valid URI: Invalid IPv6 URL"),
        # Named as the env variable alone, it sent a user who had passed the flag looking for an env.
        ({"memory_limit": "2GB"}, {}, "`MEMORY_LIMIT` (--memory-limit) should be a byte count"),
    ],
)
def test_out_of_range_settings_are_refused(flags, env, message):
    with pytest.raises(ConfigError) as err:
        build_config("head", {**HEAD, **flags}, env=env)
    assert message in str(err.value)


def test_an_empty_data_nodes_is_unset_as_every_other_setting():
    """Not 1 data node: the head in a LeaderWorkerSet of 5 would have planned the whole table for
    node 0 and left three idle."""
    flags = {**HEAD, "data_nodes": None}
    assert build_config("head", flags, env={"DATA_NODES": "", "LWS_GROUP_SIZE": "5"}).data_nodes == 4


def test_a_data_node_on_port_0_is_told_to_name_its_head_port():
    """A node dials the LWS leader on its own Flight port; on port 0 it dialed ``leader:0`` and
    only ever said the head did not answer."""
    lws = {"LWS_LEADER_ADDRESS": "cache-0.cache", "LWS_WORKER_INDEX": "1"}
    with pytest.raises(ConfigError) as err:
        build_config("worker", {"metadata_loc": "x", "port": 0}, env=lws)
    assert "pass --head grpc://cache-0.cache:50051" in str(err.value)
    # A fixed port, or an explicit head, is what a LeaderWorkerSet or `local` gives.
    assert (
        build_config("worker", {"metadata_loc": "x", "port": 6000}, env=lws).head_location
        == "grpc://cache-0.cache:6000"
    )
    explicit = {"metadata_loc": "x", "port": 0, "head": "grpc://127.0.0.1:7000"}
    assert build_config("worker", explicit, env=lws).head_location == "grpc://127.0.0.1:7000"


def test_a_token_flag_overrides_the_env_token_file_and_the_other_way_round(tmp_path):
    """A token and a token file are one setting given two ways: a flag replaces both env values,
    rather than failing as 'both set'."""
    token_file = tmp_path / "token"
    token_file.write_text("from-the-file\n")
    env = {"DATA_CACHE_TOKEN": "from-the-env"}
    assert build_config("head", {**HEAD, "token_file": str(token_file)}, env=env).token == "from-the-file"
    env = {"DATA_CACHE_TOKEN_FILE": str(token_file)}
    assert build_config("head", {**HEAD, "token": "from-the-flag"}, env=env).token == "from-the-flag"
    with pytest.raises(ConfigError, match="not both"):  # both ways at one level is still refused
        build_config("head", HEAD, env={"DATA_CACHE_TOKEN": "a", "DATA_CACHE_TOKEN_FILE": str(token_file)})


def test_a_token_flag_is_warned_about_without_its_value(caplog, tmp_path):
    """Any local user reads a process's arguments (ps): the env or a file keeps the token out."""
    token_file = tmp_path / "token"
    token_file.write_text("from-the-file\n")
    build_config("head", {**HEAD, "token_file": str(token_file)}, env={"DATA_CACHE_TOKEN": "from-the-env"})
    assert "process list" not in caplog.text
    build_config("head", {**HEAD, "token": "s3cr3t-flag"}, env={})
    assert "--token is visible to every user of this machine in the process list" in caplog.text
    assert "DATA_CACHE_TOKEN or --token-file" in caplog.text and "s3cr3t-flag" not in caplog.text


def test_a_memory_limit_below_one_byte_is_refused_but_0_means_the_cgroup_limit():
    with pytest.raises(
        ConfigError, match=r"`MEMORY_LIMIT` \(--memory-limit\) '0.5' is less than one byte: give a size such as 4Gi"
    ):
        build_config("head", HEAD, env={"MEMORY_LIMIT": "0.5"})
    # Kubernetes' resourceFieldRef gives 0 when the container has no limit: not an error.
    assert build_config("head", HEAD, env={"MEMORY_LIMIT": "0"}).memory_limit != 0


def test_garbage_certificate_is_named(tmp_path, self_signed_cert):
    garbage = tmp_path / "tls.crt"
    garbage.write_text("not a certificate\n")
    flags = {**HEAD, "tls_cert": str(garbage), "tls_key": str(self_signed_cert.key_file)}
    with pytest.raises(ConfigError, match=r"`DATA_CACHE_TLS_CERT` \(--tls-cert\) '.*tls.crt' holds no PEM certificate"):
        build_config("head", flags, env={})


def test_key_of_another_certificate_is_named(tmp_path, self_signed_cert):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    other = tmp_path / "other.key"
    other.write_bytes(
        ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    flags = {**HEAD, "tls_cert": str(self_signed_cert.cert_file), "tls_key": str(other)}
    with pytest.raises(ConfigError, match=r"`DATA_CACHE_TLS_KEY` \(--tls-key\) '.*other.key' is not .* private key"):
        build_config("head", flags, env={})
    # The matching pair still loads.
    assert build_config("head", {**flags, "tls_key": str(self_signed_cert.key_file)}, env={}).tls


def test_garbage_key_file_is_one_line_not_a_grpc_traceback(tmp_path, self_signed_cert):
    garbage = tmp_path / "tls.key"
    garbage.write_text("not a key\n")
    result = data_cache(
        *("head", "--metadata-loc", "x", "--data-nodes", "1", "--port", "0", "--health-port", "0"),
        *("--tls-cert", str(self_signed_cert.cert_file), "--tls-key", str(garbage)),
    )
    assert_one_line_error(result, "DATA_CACHE_TLS_KEY", "tls.key")


@pytest.mark.parametrize(
    ("args", "env", "fragments"),
    [
        (["head", "--port", "70000"], {}, ["`FLIGHT_PORT` (--port)", "0 to 65535"]),
        (["head", "--port", "0"], {"HEALTH_PORT": "99999"}, ["`HEALTH_PORT` (--health-port)"]),
        (["head", "--startup-timeout", "nan"], {}, ["--startup-timeout", "finite"]),
        (["--log-level", "foo", "head"], {}, ["`LOG_LEVEL` (--log-level)", "DEBUG, INFO, WARNING, ERROR, CRITICAL"]),
        (["head"], {"LOG_LEVEL": "verbose"}, ["`LOG_LEVEL`", "'verbose'"]),
        (["local", "--port", "70000"], {}, ["`--port`", "0 to 65535"]),
        (["local", "--startup-timeout", "inf"], {}, ["`--startup-timeout`", "finite"]),
        (["local", "--memory-limit", "0.5"], {}, ["`--memory-limit`", "less than one byte"]),
        # An address no interface holds, with port 0 (as `local` starts its nodes): the host is the fix.
        (["head", "--port", "0", "--health-port", "0", "--host", "192.0.2.7"], {}, ["`BIND_HOST` (--host)"]),
        # A Secret made from a file that ends in a newline: every call's header failed, and the
        # cache never formed (the deadline, then "head not answering").
        (["head", "--port", "0"], {"DATA_CACHE_TOKEN": "tok\n"}, ["DATA_CACHE_TOKEN", "trailing newline"]),
        (["local"], {"DATA_CACHE_TOKEN": "tok\n"}, ["DATA_CACHE_TOKEN", "line break"]),
    ],
)
def test_bad_values_exit_2_with_one_line(args, env, fragments):
    node = ["--metadata-loc", "x"] + (["--data-nodes", "1"] if "head" in args else [])
    result = data_cache(*args, *node, env=env)
    assert_one_line_error(result, *fragments)


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        # Planning would only have failed at its deadline.
        (["head", "--data-nodes", "1", "--metadata-loc", "gs://b/t/metadata/1.json"], ["gs:// store is not supported"]),
        (["local", "--metadata-loc", "abfs://c@a/t/metadata/1.json"], ["abfs:// store is not supported"]),
        # A scheme or a bucket alone: a load error once the cluster had formed.
        (["head", "--data-nodes", "1", "--metadata-loc", "s3://"], ["'s3://' names no file", "s3://bucket/path/to"]),
        (["local", "--metadata-loc", "s3a://warehouse/"], ["names no file", "s3a://bucket/path/to/metadata.json"]),
        (["local", "--metadata-loc", "file://"], ["'file://' names no file", "file:///path/to/metadata.json"]),
        # A data node that could not dial its head waited for ever.
        (["worker", "--index", "0", "--head", "127.0.0.1:50051"], ["grpc:// (or grpc+tls://) URI with a port"]),
        (["worker", "--index", "0", "--head", "grpc://head"], ["URI with a port", "'grpc://head'"]),
        (["worker", "--index", "0", "--head", "grpc://[::1:50051"], ["URI with a port", "'grpc://[::1:50051'"]),
        (["worker", "--index", "0", "--head", "grpc://bad host:50051"], ["URI with a port", "'grpc://bad host:50051'"]),
        # Taken as they came, these failed the load later, blamed on a data node ("refused its
        # assignment: Cannot parse URI"), or a port read as an IPv6 address ("[127.0.0.1:5000]").
        (
            ["worker", "--index", "0", "--head", "grpc://127.0.0.1:1", "--advertise-host", "bad host"],
            ["`POD_IP` (--advertise-host) should be the host name or IP address", "got 'bad host'"],
        ),
        (
            ["head", "--data-nodes", "1", "--metadata-loc", "x", "--advertise-host", "127.0.0.1:5000"],
            ["`POD_IP` (--advertise-host)", "(no scheme, no port), got '127.0.0.1:5000'"],
        ),
        # Arrow cannot parse a URI with an IPv6 zone id: the load failed, "Cannot parse URI".
        (
            ["local", "--metadata-loc", "x", "--host", "::1", "--advertise-host", "fe80::1%lo"],
            ["`--advertise-host` should be the host name or IP address", "got 'fe80::1%lo'"],
        ),
        (
            ["local", "--metadata-loc", "x", "--advertise-host", "10.0.0.7:5000"],
            ["`--advertise-host` should be the host name or IP address", "got '10.0.0.7:5000'"],
        ),
        # Two ports a node: the free-port search looped for ever past what the OS has.
        (["local", "--metadata-loc", "x", "--data-nodes", "100000"], ["--data-nodes should be from 1 to 256"]),
    ],
)
def test_locations_the_cache_cannot_use_exit_2_at_once(args, fragments):
    assert_one_line_error(data_cache(*args), *fragments)


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["--memory-limit", "1Ki"], {}, "--memory-limit 1Ki leaves a data node no room for rows"),
        (["--memory-limit", "400Mi"], {}, "--memory-limit 400Mi leaves a data node no room for rows"),
        ([], {"MEMORY_LIMIT": "256Mi"}, "MEMORY_LIMIT (from the environment; --memory-limit overrides it) 256Mi"),
    ],
)
def test_local_refuses_a_memory_limit_no_row_fits_under_before_starting(args, env, says):
    """1Ki started the whole cluster and failed after planning, naming no flag."""
    result = data_cache("local", "--metadata-loc", "/nonexistent/metadata.json", "--port", "0", *args, env=env)
    assert_one_line_error(result, says, "each keeps 400 MiB for its interpreter; give each more than that")
    assert "exited with code" not in result.stderr


def test_local_checks_a_memory_limit_its_nodes_would_inherit_from_the_environment():
    """Unchecked, a bad MEMORY_LIMIT showed only as "data node 0 exited with code 2"."""
    result = data_cache("local", "--metadata-loc", "x", env={"MEMORY_LIMIT": "2GB"})
    assert_one_line_error(result, "`MEMORY_LIMIT` (from the environment; --memory-limit overrides it)", "'2GB'")


def test_a_config_error_is_printed_once():
    result = data_cache("head", "--data-nodes", "1")
    assert_one_line_error(result, "`METADATA_LOC` is required")
    assert result.stderr.count("METADATA_LOC` is required") == 1


def test_flight_port_in_use_names_the_port(listening):
    result = data_cache("head", "--metadata-loc", "x", "--data-nodes", "1", "--port", str(listening))
    assert_one_line_error(result, f"port {listening}", "already in use", "`FLIGHT_PORT` (--port)")


def test_a_privileged_port_is_named_as_the_port_to_change_not_the_host():
    """EACCES on port 80 said "check --host", the one setting that was right."""
    import shutil

    # Run without the capability to bind it (root here has it, as a pod's root may not).
    drop = ["setpriv", "--bounding-set=-net_bind_service", "--inh-caps=-net_bind_service"] if os.geteuid() == 0 else []
    if drop and shutil.which("setpriv") is None:
        pytest.skip("running as root, and setpriv is not here to drop CAP_NET_BIND_SERVICE")
    cmd = [*drop, sys.executable, "-m", "kubeflow_data_cache", "local", "--metadata-loc", "/x/metadata.json"]
    result = subprocess.run(
        [*cmd, "--port", "80"], capture_output=True, text=True, timeout=DEADLINE, env={"PATH": "/usr/bin:/bin"}
    )
    assert_one_line_error(
        result, "cannot listen on 127.0.0.1:80 (Permission denied): ports below 1024 need root or CAP_NET_BIND_SERVICE",
        "pick a port of 1024 or more with `--port`",
    )  # fmt: skip


def test_health_port_in_use_names_the_port(listening):
    args = ("--port", "0", "--health-port", str(listening), "--host", "127.0.0.1")
    head = data_cache("head", "--metadata-loc", "x", "--data-nodes", "1", *args)
    assert_one_line_error(head, f"127.0.0.1:{listening}", "`HEALTH_PORT` (--health-port)")
    worker = data_cache("worker", "--index", "0", "--head", "grpc://127.0.0.1:1", *args)
    assert_one_line_error(worker, f"127.0.0.1:{listening}", "`HEALTH_PORT` (--health-port)")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--files", "0"], "argument --files: should be >= 1, got 0"),
        (["--rows", "-5"], "argument --rows: should be >= 0, got -5"),
    ],
)
def test_sample_table_refuses_counts_that_cannot_work(tmp_path, args, says):
    """They ended in a traceback (ValueError) and exit 1."""
    result = data_cache("sample-table", "--warehouse", str(tmp_path / "wh"), *args)
    assert result.returncode == 2 and says in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("warehouse", ["", "  "])
def test_sample_table_refuses_an_empty_warehouse_and_writes_nothing(tmp_path, warehouse):
    """An empty --warehouse is the current folder: the table and its catalog went there, unasked."""
    assert_one_line_error(
        data_cache("sample-table", "--warehouse", warehouse, cwd=tmp_path),
        "the warehouse is empty: give a folder (or s3://bucket/prefix)",
    )
    assert list(tmp_path.iterdir()) == []


def test_sample_table_names_a_warehouse_it_cannot_write(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert_one_line_error(
        data_cache("sample-table", "--warehouse", str(blocker)),
        f"cannot write the sample table under --warehouse '{blocker}'",
    )


def test_sample_table_that_cannot_print_says_the_table_is_written_not_that_the_warehouse_failed(tmp_path):
    """Its output to a full disk (or a closed pipe) read as the warehouse not being writable."""
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "kubeflow_data_cache", "sample-table", "--warehouse", str(tmp_path / "wh")],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=DEADLINE,
            env={"PATH": "/usr/bin:/bin"},
        )
    assert done.returncode == 1
    assert "error: wrote the table, but could not print its metadata location" in done.stderr, done.stderr
    assert "cannot write the sample table" not in done.stderr
    assert list((tmp_path / "wh" / "demo" / "events" / "metadata").glob("*.metadata.json"))


def test_sample_table_writes_a_warehouse_with_a_space_in_one_folder_and_refuses_uri_syntax(tmp_path):
    """Written as a percent-escaped URI, a table under "my wh" went to a literal "my%20wh" folder
    (pyiceberg does not decode it) beside its catalog in "my wh"; '#' split the path the same way."""
    warehouse = tmp_path / "my wh"
    result = data_cache("sample-table", "--warehouse", str(warehouse), "--rows", "100", "--files", "2")
    assert result.returncode == 0, result.stderr
    location = result.stdout.strip()
    assert location == f"file://{warehouse}/" + location.split(" wh/", 1)[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my wh"]
    assert len(list((warehouse / "demo" / "events" / "data").glob("*.parquet"))) == 2
    for odd in ("a#b", "what?", "p%41"):
        assert_one_line_error(
            data_cache("sample-table", "--warehouse", str(tmp_path / odd)),
            f"the warehouse folder '{tmp_path / odd}' holds one of # ? %",
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my wh"]


def test_local_help_describes_every_flag():
    result = subprocess.run(
        [sys.executable, "-m", "kubeflow_data_cache", "local", "--help"],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=True,
    )
    text = " ".join(result.stdout.split("options:", 1)[1].split())  # after the usage line; unwrapped
    for flag, help_text in [
        ("--metadata-loc METADATA_LOC", "the table's metadata.json"),
        ("--data-nodes DATA_NODES", "(default 2)"),
        ("--port PORT", "(default 50051; 0 picks a free one)"),
        ("--host HOST", "(default 127.0.0.1)"),
        ("--startup-timeout STARTUP_TIMEOUT", "(env DATA_CACHE_STARTUP_TIMEOUT_SECONDS, default 300)"),
    ]:
        assert f"{flag} " in text and help_text in text.split(f"{flag} ", 1)[1].split(" --")[0], flag


def test_local_exits_2_when_its_nodes_refuse_their_settings():
    """A setting only the nodes check (here a flag local hands them as given) is still a settings
    error: local exits 2 as its nodes did, after their error line, not 1 as for a failed load."""
    script = (
        "import sys\n"
        "from kubeflow_data_cache.local import LocalCluster, run_local\n"
        "cluster = LocalCluster('/nonexistent/metadata.json', 1, 0, extra_args=('--failure-grace', '-1'))\n"
        "sys.exit(run_local(cluster))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "error: `DATA_CACHE_FAILURE_GRACE_SECONDS` (--failure-grace)" in result.stderr
    assert "exited with code 2" in result.stderr


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"LOAD_THREADS": "zero"}, "`LOAD_THREADS` should be an integer, got 'zero'"),
        ({"LOAD_THREADS": "0"}, "`LOAD_THREADS` should be >= 1, got 0"),
        ({"LOAD_THREADS": " "}, "`LOAD_THREADS` should be an integer, got ' '"),  # as a node reads it
        ({"DATA_CACHE_STARTUP_TIMEOUT_SECONDS": "-5"}, "`DATA_CACHE_STARTUP_TIMEOUT_SECONDS` (--startup-timeout)"),
        # Each node printed these once (the line twice for one node) and local said "exited with code 2".
        ({"DATA_CACHE_CLUSTER_KEY": ""}, "DATA_CACHE_CLUSTER_KEY is set but empty"),
        ({"AWS_CA_BUNDLE": "/nonexistent/ca.pem"}, "AWS_CA_BUNDLE='/nonexistent/ca.pem' is not a file"),
        # This one failed the load, with exit code 1, after every node had started.
        ({"AWS_ENDPOINT_URL": "minio:9000"}, "AWS_ENDPOINT_URL='minio:9000' has no scheme"),
    ],
)
def test_local_refuses_a_bad_setting_it_hands_its_nodes_before_starting_them(env, fragment):
    """local takes these from its environment for its nodes: it checks them itself, at once."""
    result = data_cache("local", "--metadata-loc", "/nonexistent/metadata.json", "--port", "0", env=env)
    assert_one_line_error(result, fragment)
    assert "exited with code" not in result.stderr


def test_ctrl_c_before_a_commands_handlers_are_in_exits_130_without_a_traceback(monkeypatch):
    """`local` imports pyarrow before it installs its handlers: a Ctrl-C then printed a traceback."""
    from kubeflow_data_cache import cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_main", interrupted)
    assert cli.main(["local", "--metadata-loc", "x"]) == 130


def test_the_cli_run_in_a_process_leaves_its_signal_handlers_as_they_were(monkeypatch, capsys):
    """head, worker and local keep a SIGTERM that comes while they import; a caller that goes on
    (a test, an embedding program) would otherwise keep that handler and never stop on SIGTERM."""
    import signal

    from kubeflow_data_cache import cli

    monkeypatch.delenv("METADATA_LOC", raising=False)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    assert cli.main(["head", "--data-nodes", "1"]) == 2  # no METADATA_LOC: refused after the handlers went in
    assert "`METADATA_LOC` is required" in capsys.readouterr().err
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_version_names_the_package_version():
    """What an admin checks first in a cache image: `data-cache --version`, as cache-initializer has."""
    import importlib.metadata

    from kubeflow_data_cache import __version__

    assert __version__ == importlib.metadata.version("kubeflow-data-cache"), "pyproject.toml and __init__ disagree"
    result = subprocess.run(
        [sys.executable, "-m", "kubeflow_data_cache", "--version"], capture_output=True, text=True, timeout=DEADLINE
    )
    assert result.returncode == 0 and result.stdout.strip() == f"data-cache {__version__}"
