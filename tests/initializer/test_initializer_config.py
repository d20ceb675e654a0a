"""The env contract: parsed once, defaults as the SDK's, every bad value named before any API call."""

from __future__ import annotations

from pathlib import Path

import pytest

from kubeflow_cache_initializer.config import load_config, parse_storage_uri
from kubeflow_cache_initializer.errors import ConfigError

from .support import MINIMAL, initializer_env


def test_the_minimal_env_gets_the_documented_defaults():
    cfg = load_config(MINIMAL)

    assert (cfg.schema_name, cfg.table_name) == ("sales", "orders")
    assert (cfg.cluster_size, cfg.data_nodes) == (3, 2)
    assert (cfg.head_cpu, cfg.head_mem, cfg.worker_cpu, cfg.worker_mem) == ("1", "1Gi", "2", "2Gi")
    assert cfg.iam_role is None
    assert cfg.ready_timeout_seconds == 600
    assert cfg.shared is False
    assert (cfg.cache_env, cfg.env_from_secrets) == ((), ())
    assert (cfg.health_port, cfg.namespace) == (8080, "team-a")
    assert cfg.token_secret == "data-cache-token"
    assert cfg.tls_secret == "data-cache-tls"


@pytest.mark.parametrize(
    ("value", "expected"), [("team-token", "team-token"), ("none", None), (" ", "data-cache-token")]
)
def test_the_token_secret_is_named_or_turned_off(value, expected):
    assert load_config({**MINIMAL, "CACHE_TOKEN_SECRET": value}).token_secret == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("team-tls", "team-tls"),
        ("tls.team-a", "tls.team-a"),
        ("none", None),
        (" ", "data-cache-tls"),
        ("", "data-cache-tls"),
    ],
)
def test_the_tls_secret_is_named_or_turned_off(value, expected):
    assert load_config({**MINIMAL, "CACHE_TLS_SECRET": value}).tls_secret == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [("minio-ca", "minio-ca"), ("none", None), ("", "data-cache-s3-ca")],
)
def test_the_s3_ca_configmap_is_named_or_turned_off(value, expected):
    assert load_config({**MINIMAL, "CACHE_S3_CA_CONFIGMAP": value}).s3_ca_configmap == expected


def test_the_namespace_comes_from_the_service_account_mount_unless_set(tmp_path: Path):
    mounted = tmp_path / "namespace"
    mounted.write_text("from-mount\n")
    without = {k: v for k, v in MINIMAL.items() if k != "NAMESPACE"}

    assert load_config(without, namespace_file=mounted).namespace == "from-mount"
    assert load_config({**without, "POD_NAMESPACE": "from-env"}, namespace_file=mounted).namespace == "from-env"
    with pytest.raises(ConfigError, match="`NAMESPACE` is required outside a pod"):
        load_config(without, namespace_file=tmp_path / "absent")


def test_aws_settings_are_forwarded_and_aws_secrets_are_not():
    cfg = load_config(
        {
            **MINIMAL,
            "AWS_REGION": "eu-west-1",
            "AWS_ENDPOINT_URL_S3": "http://minio:9000",
            "AWS_ACCESS_KEY_ID": "AKIA...",
            "AWS_SECRET_ACCESS_KEY": "secret",
            "AWS_SESSION_TOKEN": "token",
            "AWS_WEB_IDENTITY_TOKEN_FILE": "/var/run/secrets/eks.amazonaws.com/token",
            "CACHE_ENV_FROM_SECRET": "s3-credentials, flight-token",
        }
    )

    assert cfg.cache_env == (("AWS_ENDPOINT_URL_S3", "http://minio:9000"), ("AWS_REGION", "eu-west-1"))
    assert cfg.env_from_secrets == ("s3-credentials", "flight-token")
    assert cfg.image_pull_secrets == ()


def test_aws_variables_whose_names_say_they_hold_secrets_are_not_forwarded_but_named():
    """Copied as plain values, they were in the LeaderWorkerSet's spec, which `view` reads."""
    secrets = {"AWS_SECRET_KEY": "s", "AWS_ACCESS_KEY": "AKIA", "AWS_BEARER_TOKEN_BEDROCK": "t", "AWS_KEY": "k"}
    settings = {"AWS_REGION": "eu-west-1", "AWS_CA_BUNDLE": "/ca.pem", "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_KEYSPACES_ENDPOINT": "x", "AWS_KMS_KEY_ID": "alias/k", "AWS_KMS_KEY_ARN": "arn:aws:kms:x",
                "AWS_ENDPOINT_URL_SECRETS_MANAGER": "http://sm", "AWS_CREDENTIAL_PROFILES_FILE": "/f"}  # fmt: skip
    cfg = load_config({**MINIMAL, **secrets, **settings, "AWS_SESSION_TOKEN": "t",
                       "AWS_WEB_IDENTITY_TOKEN_FILE": "/var/run/token"})  # fmt: skip
    assert dict(cfg.cache_env) == settings
    # Named (never their values) in the warning given where nothing else brings the pods credentials.
    assert cfg.credentials_seen == tuple(sorted([*secrets, "AWS_SESSION_TOKEN"]))


def test_node_selector_and_tolerations_take_the_forms_admins_write():
    cfg = load_config(
        {
            **MINIMAL,
            "CACHE_NODE_SELECTOR": " pool = cache ,example.com/memory=high,empty=",
            "CACHE_TOLERATIONS": '{"key": "nvidia.com/gpu", "operator": "Exists"}',
        }
    )
    assert cfg.node_selector == (("pool", "cache"), ("example.com/memory", "high"), ("empty", ""))
    assert cfg.tolerations == ({"key": "nvidia.com/gpu", "operator": "Exists"},)
    as_json = load_config({**MINIMAL, "CACHE_NODE_SELECTOR": '{"pool": "cache"}', "CACHE_TOLERATIONS": "[]"})
    assert (as_json.node_selector, as_json.tolerations) == ((("pool", "cache"),), ())
    assert (load_config(MINIMAL).node_selector, load_config(MINIMAL).tolerations) == ((), ())


@pytest.mark.parametrize(
    ("tolerations", "why"),
    [
        ('[{"operator": "Equal", "value": "x"}]', "an empty key tolerates every taint and needs operator Exists"),
        ('[{"key": "a", "operator": "Exists", "value": "x"}]', "operator Exists takes no value"),
        ('[{"key": "a", "operator": "In"}]', "operator 'In' is not one of Equal, Exists"),
        ('[{"key": "a", "effect": "NoSchedule", "tolerationSeconds": 5}]', "applies to effect NoExecute only"),
        ('[{"key": "a", "effect": "NoExecute", "tolerationSeconds": "5"}]', "tolerationSeconds must be an integer"),
        # The API server's 422 came only at the LeaderWorkerSet's create, exit 1 and a retry.
        (
            '[{"key": "a", "effect": "NoExecute", "tolerationSeconds": 9223372036854775808}]',
            "tolerationSeconds 9223372036854775808 is past the API's 64-bit integer range",
        ),
        ('[{"key": "bad key"}]', "label key 'bad key'"),
        ('["a"]', "toleration 0 is not an object"),
        ('"a"', "not a list"),
    ],
)
def test_tolerations_are_checked_as_the_api_server_checks_them(tolerations, why):
    with pytest.raises(ConfigError, match="`CACHE_TOLERATIONS`") as err:
        load_config({**MINIMAL, "CACHE_TOLERATIONS": tolerations})
    assert why in str(err.value)


def test_the_smallest_cpu_amount_is_taken_and_metadata_locations_naming_a_file_are():
    """1m is the least Kubernetes schedules: as a float, 0.001 is larger than the Decimal 1m."""
    for cpu in ("1m", "0.001"):
        assert load_config({**MINIMAL, "HEAD_CPU": cpu, "WORKER_CPU": cpu}).head_cpu == cpu
    for location in ("s3://b/warehouse/t/metadata/v1.metadata.json", "s3a://b/m.json", "file:///w/m.json"):
        assert load_config({**MINIMAL, "METADATA_LOC": location}).metadata_loc == location
    # Schemes are case-insensitive (the SDK passes what users write; the upstream cache lowercases
    # them): the cache pods get them in lower case, the rest as written.
    for written, passed in (("S3://B/Key.json", "s3://B/Key.json"), ("File:///W/m.json", "file:///W/m.json")):
        assert load_config({**MINIMAL, "METADATA_LOC": written}).metadata_loc == passed


def test_storage_uri_parsing():
    assert parse_storage_uri("cache://my_schema/my-table.v2") == ("my_schema", "my-table.v2")
    for bad in ("s3://a/b", "cache://a", "cache://a/b/c", "cache:///b", "cache://a/"):
        with pytest.raises(ValueError):
            parse_storage_uri(bad)


BAD_INPUT = [
    ({"STORAGE_URI": "s3://bucket/table"}, "`STORAGE_URI` should be cache://<schema>/<table>", "'s3://bucket/table'"),
    ({"STORAGE_URI": "cache://only-schema"}, "`STORAGE_URI` should be cache://<schema>/<table>", "only-schema"),
    ({"STORAGE_URI": ""}, "`STORAGE_URI` is required: cache://<schema>/<table>", ""),
    ({"METADATA_LOC": ""}, "`METADATA_LOC` is required: the table's metadata.json", "s3://"),
    ({"METADATA_LOC": "http://x/m.json"}, "`METADATA_LOC` should be an s3://bucket/key, s3a://bucket/key", "http://x"),
    # A scheme alone, or a bucket without a key, only failed in the cache pods after they started.
    ({"METADATA_LOC": "s3://"}, "`METADATA_LOC` should be an s3://bucket/key, s3a://bucket/key or file:///path", ""),
    ({"METADATA_LOC": "s3a://bucket/"}, "`METADATA_LOC` should be an s3://bucket/key", "got 's3a://bucket/'"),
    ({"METADATA_LOC": "file://"}, "`METADATA_LOC` should be an s3://bucket/key", "got 'file://'"),
    ({"TRAIN_JOB_NAME": ""}, "`TRAIN_JOB_NAME` is required: the TrainJob's name", "DNS-1035"),
    ({"TRAIN_JOB_NAME": "Job_A"}, "`TRAIN_JOB_NAME` should be the TrainJob's name (a DNS-1035 label", "'Job_A'"),
    ({"TRAIN_JOB_NAME": "j" * 45}, "`TRAIN_JOB_NAME` should be at most 44 characters long", "jjjj"),
    ({"CACHE_IMAGE": ""}, "`CACHE_IMAGE` is required: the data cache image", "e.g."),
    ({"CLUSTER_SIZE": "zero"}, "`CLUSTER_SIZE` should be an integer >= 2 and <= 16385, got 'zero'", ""),
    ({"CLUSTER_SIZE": "1"}, "`CLUSTER_SIZE` should be an integer >= 2 and <= 16385, got '1'", ""),
    ({"CLUSTER_SIZE": "20000"}, "`CLUSTER_SIZE` should be an integer >= 2 and <= 16385, got '20000'", ""),
    # int() takes these as 10 and 3: read so, a typo would size the cache silently.
    ({"CLUSTER_SIZE": "1_0"}, "`CLUSTER_SIZE` should be an integer >= 2 and <= 16385, got '1_0'", ""),
    ({"CLUSTER_SIZE": "\u0663"}, "`CLUSTER_SIZE` should be an integer >= 2", ""),
    ({"CACHE_READY_TIMEOUT_SECONDS": "1_0"}, "`CACHE_READY_TIMEOUT_SECONDS` should be a number of seconds > 0", ""),
    # Valid quantities, but not CPU amounts anyone means: the pods stayed unschedulable for minutes.
    ({"WORKER_CPU": "500M"}, "`WORKER_CPU` should be a CPU amount in cores or millicores, such as 2", "'500M'"),
    ({"HEAD_CPU": "2Gi"}, "`HEAD_CPU` should be a CPU amount in cores or millicores", "'2Gi'"),
    ({"HEAD_CPU": "0"}, "`HEAD_CPU` should be at least 1m (a thousandth of a core) and at most 1024 cores", "'0'"),
    ({"WORKER_CPU": "2000"}, "`WORKER_CPU` should be at least 1m", "at most 1024 cores, got '2000'"),
    # Past any node: the pods stayed unschedulable until the grace ran out.
    ({"WORKER_MEM": "10000Ti"}, "`WORKER_MEM` should be at most 64Ti per pod (more than any node holds)", "'10000Ti'"),
    ({"HEAD_MEM": "1e20"}, "`HEAD_MEM` should be at most 64Ti per pod", "'1e20'"),
    ({"STORAGE_URI": "cache://a\n/b"}, "`STORAGE_URI` should be cache://<schema>/<table>", ""),
    ({"HEAD_MEM": "lots"}, "`HEAD_MEM` should be a Kubernetes quantity such as 512Mi, 4Gi or 8G, got 'lots'", ""),
    ({"WORKER_CPU": "-1"}, "`WORKER_CPU` should be a Kubernetes quantity", "'-1'"),
    ({"IAM_ROLE": "admin"}, "`IAM_ROLE` should be an IAM role ARN, arn:aws:iam::<account>:role/<name>", "'admin'"),
    # IAM names are ASCII: AWS would refuse to assume this role only once the pods start.
    (
        {"IAM_ROLE": "arn:aws:iam::123456789012:role/r\u00f4le"},
        "`IAM_ROLE` should be an IAM role ARN, arn:aws:iam::<account>:role/<name>",
        "",
    ),
    (
        {"READINESS_PERIOD_SECONDS": "0"},
        "`READINESS_PERIOD_SECONDS` should be an integer >= 1 and <= 2147483647, got '0'",
        "",
    ),
    ({"READINESS_INITIAL_DELAY_SECONDS": "soon"}, "`READINESS_INITIAL_DELAY_SECONDS` should be an integer >= 0", ""),
    (
        {"READINESS_TIMEOUT_SECONDS": "1.5"},
        "`READINESS_TIMEOUT_SECONDS` should be an integer >= 1 and <= 2147483647, got '1.5'",
        "",
    ),
    ({"READINESS_FAILURE_THRESHOLD": "-3"}, "`READINESS_FAILURE_THRESHOLD` should be an integer >= 1", ""),
    ({"CACHE_READY_TIMEOUT_SECONDS": "ten"}, "`CACHE_READY_TIMEOUT_SECONDS` should be a number of seconds > 0", ""),
    ({"CACHE_READY_TIMEOUT_SECONDS": "0"}, "`CACHE_READY_TIMEOUT_SECONDS` should be a number of seconds > 0", ""),
    # int32 in the API: accepted here, the LWS webhook refused the LeaderWorkerSet after the Service was made.
    (
        {"READINESS_PERIOD_SECONDS": "3000000000"},
        "`READINESS_PERIOD_SECONDS` should be an integer >= 1 and <= 2147483647",
        "",
    ),
    (
        {"READINESS_TIMEOUT_SECONDS": "99999999999999"},
        "`READINESS_TIMEOUT_SECONDS` should be an integer >= 1 and <=",
        "",
    ),
    # Past a thread's longest wait: the cache pods refused the startup deadline they were handed,
    # and a poll this long crashed the initializer with OverflowError.
    (
        {"CACHE_READY_TIMEOUT_SECONDS": "1e10"},
        "`CACHE_READY_TIMEOUT_SECONDS` should be a number of seconds > 0 and <= 9223372036",
        "",
    ),
    (
        {"CACHE_STATUS_POLL_SECONDS": "1e10"},
        "`CACHE_STATUS_POLL_SECONDS` should be a number of seconds >= 0.01 and <=",
        "'1e10'",
    ),
    # A poll this short asked the head's /status in a tight loop.
    ({"CACHE_STATUS_POLL_SECONDS": "1e-9"}, "`CACHE_STATUS_POLL_SECONDS` should be a number of seconds >= 0.01", ""),
    # Any such name failed every call as a TrainJob not found: exit 1, and a retry for nothing.
    ({"NAMESPACE": "Team_A"}, "`NAMESPACE` should be a namespace name (at most 63 lowercase letters", "'Team_A'"),
    ({"NAMESPACE": "a" * 64}, "`NAMESPACE` should be a namespace name", ""),
    ({"DATA_CACHE_SHARED": "maybe"}, "`DATA_CACHE_SHARED` should be one of true, 1, yes, on, false", "'maybe'"),
    ({"CACHE_TOKEN_SECRET": "Team_Token"}, "`CACHE_TOKEN_SECRET` should be a Secret name", "or none"),
    ({"CACHE_TLS_SECRET": "Team_TLS"}, "`CACHE_TLS_SECRET` should be a Secret name", "or none, got 'Team_TLS'"),
    ({"CACHE_S3_CA_CONFIGMAP": "My CA"}, "`CACHE_S3_CA_CONFIGMAP` should be a ConfigMap name", "got 'My CA'"),
    ({"CACHE_TLS_SECRET": "t" * 254}, "`CACHE_TLS_SECRET` should be a Secret name (a DNS-1123 subdomain)", "tttt"),
    ({"CACHE_ENV_FROM_SECRET": "S3 Creds"}, "`CACHE_ENV_FROM_SECRET` should be comma-separated Secret names", ""),
    (
        {"CACHE_IMAGE_PULL_SECRETS": "Reg_Creds"},
        "`CACHE_IMAGE_PULL_SECRETS` should be comma-separated Secret names",
        "",
    ),
    (
        {"CACHE_IMAGE_PULL_POLICY": "Sometimes"},
        "`CACHE_IMAGE_PULL_POLICY` should be Always or IfNotPresent or Never (or unset: Kubernetes' default), "
        "got 'Sometimes'",
        "",
    ),
    (
        {"CACHE_NODE_SELECTOR": "pool"},
        "`CACHE_NODE_SELECTOR` should be comma-separated key=value node labels, or a JSON object of them: "
        "'pool' is not key=value",
        "",
    ),
    ({"CACHE_NODE_SELECTOR": "pool=in memory"}, "`CACHE_NODE_SELECTOR` should be", "label value 'in memory'"),
    ({"CACHE_NODE_SELECTOR": '{"pool": true}'}, "`CACHE_NODE_SELECTOR` should be", "must be a string"),
    ({"CACHE_NODE_SELECTOR": "[1, 2]"}, "`CACHE_NODE_SELECTOR` should be", "a JSON value that is not an object"),
    ({"CACHE_TOLERATIONS": "dedicated=cache:NoSchedule"}, "`CACHE_TOLERATIONS` should be a JSON list", "valid JSON"),
    ({"CACHE_TOLERATIONS": '[{"key": "a", "efect": "NoSchedule"}]'}, "`CACHE_TOLERATIONS`", "unknown field(s) efect"),
    ({"CACHE_TOLERATIONS": '[{"key": "a", "effect": "NoLoad"}]'}, "`CACHE_TOLERATIONS`", "effect 'NoLoad'"),
    ({"CACHE_HEALTH_PORT": "50051"}, "`CACHE_HEALTH_PORT` should be a port other than the Flight port 50051", ""),
    ({"CACHE_HEALTH_PORT": "70000"}, "`CACHE_HEALTH_PORT` should be an integer >= 1 and <= 65535", ""),
]


@pytest.mark.parametrize(("change", "message", "also"), BAD_INPUT, ids=[next(iter(c)) for c, _, _ in BAD_INPUT])
def test_bad_input_exits_at_once_naming_the_variable_and_the_form(fake, run_initializer, change, message, also):
    code, error = run_initializer(initializer_env(None, **change))

    assert code == 2
    assert error.startswith("invalid configuration: ")
    assert message in error
    assert also in error
    assert "\n" not in error
    assert fake.calls == []  # checked before touching the API


def test_every_problem_is_reported_in_one_line(fake, run_initializer):
    code, error = run_initializer(initializer_env(None, CLUSTER_SIZE="x", HEAD_CPU="y", CACHE_IMAGE=""))

    assert code == 2
    assert error.count("`") == 6
    assert fake.calls == []
