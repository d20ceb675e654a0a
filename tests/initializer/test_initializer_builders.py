"""The objects the initializer sends, built from config alone, and valid against the pinned schemas."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from kubeflow_cache_initializer.builders import (
    build_cluster_key_secret,
    build_leader_worker_set,
    build_service,
    build_service_account,
    cache_names,
    cluster_key_entry,
    key_secret_of,
    new_cluster_key,
    new_key_secret_name,
    shared_cache_name,
    with_cluster_key_entry,
)
from kubeflow_cache_initializer.config import MAX_INT32, load_config
from tests.cache.conftest import make_tls_secret_folder

from .object_schemas import ObjectInvalid, validate_sent_object
from .support import MINIMAL

OWNER = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "name": "job-a", "uid": "u-1"}
FULL = {
    **MINIMAL,
    "CLUSTER_SIZE": "5",
    "HEAD_CPU": "500m",
    "HEAD_MEM": "512Mi",
    "WORKER_CPU": "4",
    "WORKER_MEM": "16Gi",
    "IAM_ROLE": "arn:aws:iam::123456789012:role/cache-reader",
    "READINESS_INITIAL_DELAY_SECONDS": "7",
    "READINESS_PERIOD_SECONDS": "3",
    "READINESS_TIMEOUT_SECONDS": "2",
    "READINESS_FAILURE_THRESHOLD": "9",
    "AWS_REGION": "eu-west-1",
    "AWS_SECRET_ACCESS_KEY": "never-in-a-pod-spec",
    "CACHE_ENV_FROM_SECRET": "s3-credentials",
    "CACHE_IMAGE_PULL_SECRETS": "registry-a, registry-b",
    "CACHE_IMAGE_PULL_POLICY": "always",
    "CACHE_NODE_SELECTOR": "node.kubernetes.io/pool=cache, topology.kubernetes.io/zone=eu-west-1a",
    "CACHE_TOLERATIONS": '[{"key": "dedicated", "operator": "Equal", "value": "cache", "effect": "NoSchedule"},'
    ' {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30}]',
}


def _container(lws: dict, template: str) -> dict:
    (container,) = lws["spec"]["leaderWorkerTemplate"][template]["spec"]["containers"]
    return container


def _env(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def _tls_mount(container: dict) -> dict:
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "data-cache-tls"]
    return mount


def _kubelet_env(container: dict, root: Path, secret_files: dict[str, bytes] | None = None) -> dict[str, str]:
    """The container's literal env as its process sees it, the TLS Secret's mount made under
    ``root``: the kubelet mounts an optional Secret's files, or an empty folder where it is missing."""
    mount_path = _tls_mount(container)["mountPath"]
    folder = root / mount_path.lstrip("/")
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in (secret_files or {}).items():
        (folder / name).write_bytes(data)
    env = {k: v for k, v in _env(container).items() if isinstance(v, str)}
    return {k: str(folder) if v == mount_path else v for k, v in env.items()}


def test_the_leader_worker_set_runs_one_head_and_cluster_size_minus_one_data_nodes():
    lws = build_leader_worker_set(load_config(FULL), [OWNER])
    template = lws["spec"]["leaderWorkerTemplate"]

    assert lws["metadata"]["name"] == "job-a-cache"
    assert (lws["spec"]["replicas"], template["size"]) == (1, 5)
    head, worker = _container(lws, "leaderTemplate"), _container(lws, "workerTemplate")
    assert (head["name"], head["args"], worker["name"], worker["args"]) == ("cache", ["head"], "cache", ["worker"])
    assert head["resources"] == {
        "requests": {"cpu": "500m", "memory": "512Mi"},
        "limits": {"cpu": "500m", "memory": "512Mi"},
    }
    assert worker["resources"]["limits"] == {"cpu": "4", "memory": "16Gi"}
    assert {p["name"]: p["containerPort"] for p in worker["ports"]} == {"flight": 50051, "health": 8080}
    assert worker["readinessProbe"] == {
        "httpGet": {"path": "/ready", "port": "health"},
        "initialDelaySeconds": 7,
        "periodSeconds": 3,
        "timeoutSeconds": 2,
        "failureThreshold": 9,
    }
    assert worker["livenessProbe"]["httpGet"] == {"path": "/live", "port": "health"}
    assert template["leaderTemplate"]["metadata"]["labels"]["app.kubernetes.io/component"] == "head"
    assert template["workerTemplate"]["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"


def test_cache_pods_pull_with_the_image_pull_secrets_only_when_given():
    lws = build_leader_worker_set(load_config(FULL), [OWNER])
    for template in ("leaderTemplate", "workerTemplate"):
        spec = lws["spec"]["leaderWorkerTemplate"][template]["spec"]
        assert spec["imagePullSecrets"] == [{"name": "registry-a"}, {"name": "registry-b"}]
    plain = build_leader_worker_set(load_config(MINIMAL), [OWNER])
    assert "imagePullSecrets" not in plain["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]


def test_cache_containers_take_the_pull_policy_only_when_given():
    # Spelled as the API server spells it, whatever the case given: it refuses `always`.
    lws = build_leader_worker_set(load_config(FULL), [OWNER])
    assert [_container(lws, t)["imagePullPolicy"] for t in ("leaderTemplate", "workerTemplate")] == ["Always"] * 2
    # Unset: the API server's default for the tag (Always for :latest), as before.
    plain = build_leader_worker_set(load_config(MINIMAL), [OWNER])
    assert "imagePullPolicy" not in _container(plain, "workerTemplate")


def test_cache_pods_go_where_the_node_selector_and_tolerations_allow_only_when_given():
    lws = build_leader_worker_set(load_config(FULL), [OWNER])
    for template in ("leaderTemplate", "workerTemplate"):
        spec = lws["spec"]["leaderWorkerTemplate"][template]["spec"]
        assert spec["nodeSelector"] == {
            "node.kubernetes.io/pool": "cache",
            "topology.kubernetes.io/zone": "eu-west-1a",
        }
        assert spec["tolerations"] == [
            {"key": "dedicated", "operator": "Equal", "value": "cache", "effect": "NoSchedule"},
            {
                "key": "node.kubernetes.io/unreachable",
                "operator": "Exists",
                "effect": "NoExecute",
                "tolerationSeconds": 30,
            },
        ]
    plain = build_leader_worker_set(load_config(MINIMAL), [OWNER])["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    assert "nodeSelector" not in plain["spec"] and "tolerations" not in plain["spec"]


def test_cache_pods_get_the_table_their_address_their_memory_and_s3_settings_but_no_secret_values():
    lws = build_leader_worker_set(load_config(FULL), [OWNER])

    for template in ("leaderTemplate", "workerTemplate"):
        container = _container(lws, template)
        env = _env(container)
        assert env["METADATA_LOC"] == MINIMAL["METADATA_LOC"]
        assert (env["SCHEMA_NAME"], env["TABLE_NAME"]) == ("sales", "orders")
        assert (env["FLIGHT_PORT"], env["HEALTH_PORT"]) == ("50051", "8080")
        assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["MEMORY_LIMIT"] == {"resourceFieldRef": {"containerName": "cache", "resource": "limits.memory"}}
        # Whole CPUs, rounded up: where cgroup v1 shows no quota the cache counted the machine's.
        limit = {"containerName": "cache", "resource": "limits.cpu", "divisor": "1"}
        assert env["LOAD_THREADS"] == {"resourceFieldRef": limit}
        assert env["AWS_REGION"] == "eu-west-1"
        assert "AWS_SECRET_ACCESS_KEY" not in env
        assert container["envFrom"] == [{"secretRef": {"name": "s3-credentials"}}]
    assert "never-in-a-pod-spec" not in str(lws)


@pytest.mark.parametrize("timeout", ["0.5", "1.9", "600", "86400", "9223372036"])  # the last: the most accepted
def test_the_cache_pods_accept_the_env_they_are_given(timeout, tmp_path):
    """The contract between the two packages: the cache's own config parser takes the pods' env
    (with what Kubernetes and LWS fill in), and its startup deadline is the initializer's. In a
    namespace without a TLS Secret the mount is an empty folder: plaintext, and no error."""
    from kubeflow_data_cache.config import build_config

    lws = build_leader_worker_set(load_config({**FULL, "CACHE_READY_TIMEOUT_SECONDS": timeout}), [OWNER])
    filled = {"POD_IP": "10.0.0.7", "MEMORY_LIMIT": str(16 << 30), "LWS_LEADER_ADDRESS": "job-a-cache-0.job-a-cache",
              "LOAD_THREADS": "3"}  # fmt: skip
    for template, role, lws_env in [
        ("leaderTemplate", "head", {"LWS_GROUP_SIZE": "5"}),
        ("workerTemplate", "worker", {"LWS_WORKER_INDEX": "3"}),
    ]:
        env = _kubelet_env(_container(lws, template), tmp_path / template)
        cfg = build_config(role, {}, {**env, **filled, **lws_env})
        assert cfg.startup_timeout == float(timeout)
        assert cfg.scheme == "grpc"
        assert (cfg.metadata_loc, cfg.flight_port, cfg.memory_limit) == (MINIMAL["METADATA_LOC"], 50051, 16 << 30)
        assert cfg.data_nodes == 4 if role == "head" else cfg.node_index == 2
        assert cfg.load_threads == 3


def test_cache_pods_run_restricted():
    lws = build_leader_worker_set(load_config(MINIMAL), [OWNER])

    for template in ("leaderTemplate", "workerTemplate"):
        pod = lws["spec"]["leaderWorkerTemplate"][template]["spec"]
        security = _container(lws, template)["securityContext"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert security["runAsNonRoot"] is True
        # The image's numeric USER runs: fixed IDs would be refused where the platform assigns
        # them (OpenShift's restricted SCC).
        assert not {"runAsUser", "runAsGroup"} & set(security)
        assert not {"runAsUser", "runAsGroup", "fsGroup"} & set(pod["securityContext"])
        assert security["readOnlyRootFilesystem"] is True
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"] == {"drop": ["ALL"]}
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        assert pod["serviceAccountName"] == "job-a-cache"
        assert {"name": "tmp", "emptyDir": {}} in pod["volumes"]
        assert {"name": "tmp", "mountPath": "/tmp"} in _container(lws, template)["volumeMounts"]


@pytest.mark.parametrize("port, sysctl", [("8080", None), ("1024", None), ("80", "80"), ("1", "1")])
def test_a_health_port_below_1024_gets_the_sysctl_that_lets_a_non_root_pod_bind_it(port, sysctl):
    """The cache runs without capabilities: on runtimes that keep the kernel's default, port 80
    needs net.ipv4.ip_unprivileged_port_start (a safe sysctl) lowered to it, or the pod fails."""
    lws = build_leader_worker_set(load_config({**MINIMAL, "CACHE_HEALTH_PORT": port}), [OWNER])
    for template in ("leaderTemplate", "workerTemplate"):
        sysctls = lws["spec"]["leaderWorkerTemplate"][template]["spec"]["securityContext"].get("sysctls")
        expected = [{"name": "net.ipv4.ip_unprivileged_port_start", "value": sysctl}] if sysctl else None
        assert sysctls == expected
    validate_sent_object(lws)


def test_the_service_account_has_the_eks_role_only_when_iam_role_is_set():
    with_role = build_service_account(load_config(FULL), [OWNER])
    without = build_service_account(load_config(MINIMAL), [OWNER])

    assert with_role["metadata"]["annotations"]["eks.amazonaws.com/role-arn"] == FULL["IAM_ROLE"]
    assert not any(k.startswith("eks.amazonaws.com/") for k in without["metadata"]["annotations"])


def test_the_service_points_flight_and_health_at_the_head_only():
    cfg = load_config(FULL)
    service = build_service(cfg, [OWNER])
    lws = build_leader_worker_set(cfg, [OWNER])
    labels = {
        t: lws["spec"]["leaderWorkerTemplate"][t]["metadata"]["labels"] for t in ("leaderTemplate", "workerTemplate")
    }

    assert service["metadata"]["name"] == "job-a-cache-service"
    assert [(p["name"], p["port"]) for p in service["spec"]["ports"]] == [("flight", 50051), ("health", 8080)]
    selector = service["spec"]["selector"].items()
    assert all(labels["leaderTemplate"].get(k) == v for k, v in selector)
    assert not all(labels["workerTemplate"].get(k) == v for k, v in selector)
    # A degraded head answers its readers why (a node down) rather than vanish from the Service.
    assert service["spec"]["publishNotReadyAddresses"] is True


def test_shared_names_depend_on_the_table_only():
    shared = load_config({**MINIMAL, "DATA_CACHE_SHARED": "true"})
    other_job = load_config({**MINIMAL, "DATA_CACHE_SHARED": "true", "TRAIN_JOB_NAME": "job-b", "CLUSTER_SIZE": "9"})

    assert cache_names(shared).cache == cache_names(other_job).cache
    assert cache_names(shared).cache == shared_cache_name(MINIMAL["METADATA_LOC"], "sales", "orders")
    assert cache_names(other_job).service == "job-b-cache-service"
    assert cache_names(shared).cache.startswith("data-cache-") and len(cache_names(shared).cache) == 21
    names = {
        shared_cache_name(MINIMAL["METADATA_LOC"], "sales", "returns"),
        shared_cache_name("s3://elsewhere/m.json", "sales", "orders"),
        shared_cache_name(MINIMAL["METADATA_LOC"], "sales", "orders"),
    }
    assert len(names) == 3


@pytest.mark.parametrize(
    "env", [MINIMAL, FULL, {**FULL, "DATA_CACHE_SHARED": "true"}], ids=["minimal", "full", "shared"]
)
def test_every_object_is_valid_against_the_pinned_schemas(env):
    cfg = load_config(env)
    for obj in (
        build_service_account(cfg, [OWNER]),
        build_leader_worker_set(cfg, [OWNER]),
        build_service(cfg, [OWNER]),
    ):
        validate_sent_object(obj)


def test_the_validator_rejects_what_the_api_server_would_prune_or_refuse():
    """Guards the guard: an unknown container field and a wrong type both fail."""
    lws = build_leader_worker_set(load_config(MINIMAL), [OWNER])
    _container(lws, "workerTemplate")["readinessGate"] = True
    with pytest.raises(ObjectInvalid, match="readinessGate"):
        validate_sent_object(lws)
    service = build_service(load_config(MINIMAL), [OWNER])
    service["spec"]["ports"][0]["port"] = "50051"
    with pytest.raises(ObjectInvalid, match="port"):
        validate_sent_object(service)
    # An int32 field past its range: the LWS webhook's decoding refuses it.
    lws = build_leader_worker_set(load_config(MINIMAL), [OWNER])
    _container(lws, "workerTemplate")["readinessProbe"]["periodSeconds"] = 1 << 31
    with pytest.raises(ObjectInvalid, match="int32"):
        validate_sent_object(lws)


def test_the_largest_readiness_settings_accepted_are_valid_probe_fields():
    settings = ("INITIAL_DELAY_SECONDS", "PERIOD_SECONDS", "TIMEOUT_SECONDS", "FAILURE_THRESHOLD")
    env = {**MINIMAL, **{f"READINESS_{name}": str(MAX_INT32) for name in settings}}
    lws = build_leader_worker_set(load_config(env), [OWNER])
    validate_sent_object(lws)
    assert _container(lws, "workerTemplate")["readinessProbe"]["periodSeconds"] == MAX_INT32


def test_head_and_data_nodes_read_the_same_cluster_key_from_the_caches_secret_and_the_cache_takes_it(tmp_path):
    """The key is in a Secret the pod templates point at, never in the pod spec itself."""
    cfg = load_config(FULL)
    key, name = new_cluster_key(), new_key_secret_name(cfg)
    assert key != new_cluster_key() and len(key) >= 32
    assert name.startswith("job-a-cache-key-") and name != new_key_secret_name(cfg)
    lws = build_leader_worker_set(cfg, [OWNER], name)
    assert key_secret_of(lws) == name and "value" not in cluster_key_entry(lws)
    created = {**lws, "metadata": {**lws["metadata"], "uid": "lws-uid"}}  # as the API answers the create
    secret = build_cluster_key_secret(cfg, name, created, key)
    validate_sent_object(secret)
    assert secret["metadata"]["name"] == name and secret["immutable"] is True
    (owner,) = secret["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("LeaderWorkerSet", "job-a-cache", "lws-uid")
    assert key not in str(lws)
    from kubeflow_data_cache.config import build_config

    filled = {"POD_IP": "10.0.0.7", "LWS_LEADER_ADDRESS": "job-a-cache-0.job-a-cache"}
    for template, role, lws_env in [
        ("leaderTemplate", "head", {"LWS_GROUP_SIZE": "5"}),
        ("workerTemplate", "worker", {"LWS_WORKER_INDEX": "3"}),
    ]:
        env = _env(_container(lws, template))
        ref = env.pop("DATA_CACHE_CLUSTER_KEY")["secretKeyRef"]
        assert ref["name"] == name
        # What the kubelet puts in the container's env from the Secret, read by the cache.
        from_secret = base64.b64decode(secret["data"][ref["key"]]).decode()
        plain = _kubelet_env(_container(lws, template), tmp_path / template)
        config = build_config(role, {}, {**plain, **filled, **lws_env, "DATA_CACHE_CLUSTER_KEY": from_secret})
        assert config.cluster_key == key
    assert cluster_key_entry(build_leader_worker_set(cfg, [OWNER])) is None


def test_cache_pods_read_the_reader_token_from_the_namespaces_secret_where_it_is():
    """Optional, so a namespace without the Secret still starts its caches (without a token)."""
    for env, secret in [({}, "data-cache-token"), ({"CACHE_TOKEN_SECRET": "team-token"}, "team-token")]:
        lws = build_leader_worker_set(load_config({**MINIMAL, **env}), [OWNER])
        for template in ("leaderTemplate", "workerTemplate"):
            ref = _env(_container(lws, template))["DATA_CACHE_TOKEN"]["secretKeyRef"]
            assert ref == {"name": secret, "key": "token", "optional": True}
    lws = build_leader_worker_set(load_config({**MINIMAL, "CACHE_TOKEN_SECRET": "none"}), [OWNER])
    assert "DATA_CACHE_TOKEN" not in _env(_container(lws, "leaderTemplate"))


TLS_DIR = "/etc/data-cache/tls"


def test_cache_pods_mount_the_namespaces_tls_secret_where_it_is():
    """Optional and read by the kubelet, never by the initializer (no `get` on Secrets): a
    namespace without the Secret still starts its caches, in plaintext. No `items`: the cache
    needs tls.key, and cert-manager's ca.crt comes through where the Secret has one."""
    for env, secret in [({}, "data-cache-tls"), ({"CACHE_TLS_SECRET": "team-tls"}, "team-tls")]:
        lws = build_leader_worker_set(load_config({**FULL, **env}), [OWNER])
        for template in ("leaderTemplate", "workerTemplate"):
            pod = lws["spec"]["leaderWorkerTemplate"][template]["spec"]
            volumes = [v for v in pod["volumes"] if v["name"] == "data-cache-tls"]
            assert volumes == [{"name": "data-cache-tls", "secret": {"secretName": secret, "optional": True}}]
            container = _container(lws, template)
            assert _tls_mount(container) == {"name": "data-cache-tls", "mountPath": TLS_DIR, "readOnly": True}
            env_vars = _env(container)
            assert (env_vars["DATA_CACHE_TLS_DIR"], env_vars["DATA_CACHE_TLS_SERVER_NAME"]) == (TLS_DIR, "data-cache")
            # The /tmp emptyDir the read-only root needs is still there beside it.
            assert {"name": "tmp", "emptyDir": {}} in pod["volumes"]
        validate_sent_object(lws)


def test_cache_tls_secret_none_mounts_no_secret_and_sets_no_tls_env():
    lws = build_leader_worker_set(
        load_config({**FULL, "CACHE_TLS_SECRET": "none", "CACHE_S3_CA_CONFIGMAP": "none"}), [OWNER]
    )
    for template in ("leaderTemplate", "workerTemplate"):
        pod = lws["spec"]["leaderWorkerTemplate"][template]["spec"]
        assert pod["volumes"] == [{"name": "tmp", "emptyDir": {}}]
        assert _container(lws, template)["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
        assert not [name for name in _env(_container(lws, template)) if name.startswith("DATA_CACHE_TLS")]
    assert TLS_DIR not in str(lws) and "data-cache-tls" not in str(lws)
    validate_sent_object(lws)


S3_CA_DIR = "/etc/data-cache/s3-ca"


def test_cache_pods_mount_the_namespaces_s3_ca_configmap_where_it_is():
    """The object store's CA, as the TLS Secret: an optional ConfigMap volume the kubelet fills
    where the ConfigMap exists; `none` mounts none and sets nothing."""
    for env, configmap in [({}, "data-cache-s3-ca"), ({"CACHE_S3_CA_CONFIGMAP": "minio-ca"}, "minio-ca")]:
        lws = build_leader_worker_set(load_config({**FULL, **env}), [OWNER])
        for template in ("leaderTemplate", "workerTemplate"):
            pod = lws["spec"]["leaderWorkerTemplate"][template]["spec"]
            volumes = [v for v in pod["volumes"] if v["name"] == "data-cache-s3-ca"]
            assert volumes == [{"name": "data-cache-s3-ca", "configMap": {"name": configmap, "optional": True}}]
            container = _container(lws, template)
            mounts = [m for m in container["volumeMounts"] if m["name"] == "data-cache-s3-ca"]
            assert mounts == [{"name": "data-cache-s3-ca", "mountPath": S3_CA_DIR, "readOnly": True}]
            assert _env(container)["DATA_CACHE_S3_CA_DIR"] == S3_CA_DIR
        validate_sent_object(lws)
    lws = build_leader_worker_set(load_config({**FULL, "CACHE_S3_CA_CONFIGMAP": "none"}), [OWNER])
    assert S3_CA_DIR not in str(lws) and "data-cache-s3-ca" not in str(lws)


def test_cache_pods_trust_the_store_ca_the_configmap_gives_and_only_then(tmp_path):
    """The other half: the folder the kubelet mounts (ca.crt where the ConfigMap exists, empty
    where not) becomes the S3 client's trust, through the cache's own start-up step."""
    from kubeflow_data_cache.s3_settings import trust_aws_ca_bundle

    lws = build_leader_worker_set(load_config(FULL), [OWNER])
    container = _container(lws, "workerTemplate")
    for files, trusted in [
        ({}, None),
        ({"ca.crt": b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"}, "ca.crt"),
    ]:
        folder = tmp_path / str(len(files)) / S3_CA_DIR.lstrip("/")
        folder.mkdir(parents=True)
        for name, data in files.items():
            (folder / name).write_bytes(data)
        env = {k: (str(folder) if v == S3_CA_DIR else v) for k, v in _env(container).items() if isinstance(v, str)}
        trust_aws_ca_bundle(env)
        assert env.get("SSL_CERT_FILE") == (str(folder / trusted) if trusted else None)


def test_cache_pods_serve_tls_where_the_namespace_has_the_secret(tmp_path):
    """The other half of the contract: what the kubelet mounts from a `kubernetes.io/tls` Secret
    turns the cache's own config to TLS, checked under the name the certificate carries."""
    from kubeflow_data_cache.config import build_config

    lws = build_leader_worker_set(load_config(FULL), [OWNER])
    filled = {"POD_IP": "10.0.0.7", "MEMORY_LIMIT": str(16 << 30), "LWS_LEADER_ADDRESS": "job-a-cache-0.job-a-cache"}
    secret = make_tls_secret_folder(tmp_path / "secret", "data-cache")
    files = {path.name: path.read_bytes() for path in secret.iterdir()}
    for template, role, lws_env in [
        ("leaderTemplate", "head", {"LWS_GROUP_SIZE": "5"}),
        ("workerTemplate", "worker", {"LWS_WORKER_INDEX": "3"}),
    ]:
        env = _kubelet_env(_container(lws, template), tmp_path / template, files)
        cfg = build_config(role, {}, {**env, **filled, **lws_env})
        assert cfg.scheme == "grpc+tls", template
        assert cfg.tls.server_name == "data-cache"


def test_a_kept_cluster_key_takes_the_place_of_the_new_one_and_none_removes_it():
    cfg = load_config(FULL)
    lws = build_leader_worker_set(cfg, [OWNER], "job-a-cache-key-new")
    for old in (
        {"name": "DATA_CACHE_CLUSTER_KEY", "value": "old-key"},
        cluster_key_entry(build_leader_worker_set(cfg, [OWNER], "job-a-cache-key-old")),
    ):
        kept = with_cluster_key_entry(lws, old)
        names = [e["name"] for e in _container(lws, "workerTemplate")["env"]]
        assert [e["name"] for e in _container(kept, "workerTemplate")["env"]] == names  # same place: no drift
        assert cluster_key_entry(kept) == old and key_secret_of(lws) == "job-a-cache-key-new"
    gone = with_cluster_key_entry(lws, None)
    assert cluster_key_entry(gone) is None and key_secret_of(gone) is None
    assert "DATA_CACHE_CLUSTER_KEY" not in str(gone)
