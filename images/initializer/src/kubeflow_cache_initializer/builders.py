"""Pure builders: the objects the initializer sends, from the config alone (no API calls).

Unshared, the cache is `{TRAIN_JOB_NAME}-cache` (ServiceAccount and LeaderWorkerSet). Shared
(`DATA_CACHE_SHARED=true`), it is `data-cache-<hash of metadata location, schema, table>`, so
every TrainJob of the namespace that asks for the same table finds the same cache. Either way
each TrainJob gets its own Service `{TRAIN_JOB_NAME}-cache-service` to the cache's head.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import secrets
from dataclasses import dataclass

from kubeflow_cache_initializer import constants as c
from kubeflow_cache_initializer.config import Config
from kubeflow_cache_initializer.kube import LEADER_WORKER_SETS, SECRETS, SERVICE_ACCOUNTS, SERVICES


@dataclass(frozen=True)
class CacheNames:
    """The names of what the initializer creates for one TrainJob."""

    cache: str  # the LeaderWorkerSet, its ServiceAccount and the pods' instance label
    service: str

    @property
    def flight_url(self) -> str:
        return f"grpc://{self.service}:{c.FLIGHT_PORT}"


def shared_cache_name(metadata_loc: str, schema_name: str, table_name: str) -> str:
    """A stable, short name for the cache of one table: `data-cache-<10 hex chars>`."""
    key = "\0".join((metadata_loc, schema_name, table_name)).encode()
    return c.SHARED_NAME_PREFIX + hashlib.sha256(key).hexdigest()[: c.SHARED_HASH_CHARS]


def cache_names(cfg: Config) -> CacheNames:
    if cfg.shared:
        cache = shared_cache_name(cfg.metadata_loc, cfg.schema_name, cfg.table_name)
    else:
        cache = cfg.train_job_name + c.CACHE_NAME_SUFFIX
    return CacheNames(cache=cache, service=cfg.train_job_name + c.SERVICE_NAME_SUFFIX)


def owner_reference(owner: dict, controller: bool) -> dict:
    """A reference to ``owner`` (the TrainJob; a cache, for its key Secret), so that deleting it
    deletes what references it."""
    ref = {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
    }
    if controller:
        ref["controller"] = True
    return ref


def cache_labels(cfg: Config, component: str | None = None) -> dict[str, str]:
    labels = {
        c.LABEL_NAME: c.APP_NAME,
        c.LABEL_INSTANCE: cache_names(cfg).cache,
        c.LABEL_MANAGED_BY: c.MANAGED_BY,
    }
    if component:
        labels[c.LABEL_COMPONENT] = component
    return labels


def head_selector(cfg: Config) -> dict[str, str]:
    """The label selector of the cache's head pod (what each TrainJob's Service points at)."""
    return {c.LABEL_NAME: c.APP_NAME, c.LABEL_INSTANCE: cache_names(cfg).cache, c.LABEL_COMPONENT: c.COMPONENT_HEAD}


def pods_selector(cfg: Config) -> str:
    """The cache's pods. The instance label alone is not enough: Helm gives every pod of a release
    `app.kubernetes.io/instance: <release>`, and a release may be called what the cache is."""
    return f"{c.LABEL_NAME}={c.APP_NAME},{c.LABEL_INSTANCE}={cache_names(cfg).cache}"


def table_annotations(cfg: Config) -> dict[str, str]:
    """Which table a cache holds: checked before a shared cache is adopted."""
    return {
        c.ANNOTATION_METADATA_LOC: cfg.metadata_loc,
        c.ANNOTATION_TABLE: f"{cfg.schema_name}.{cfg.table_name}",
        c.ANNOTATION_SHARED: str(cfg.shared).lower(),
    }


def _metadata(cfg: Config, name: str, owners: list[dict], annotations: dict[str, str] | None = None) -> dict:
    meta = {"name": name, "namespace": cfg.namespace, "labels": cache_labels(cfg), "ownerReferences": owners}
    if annotations:
        meta["annotations"] = annotations
    return meta


def build_service_account(cfg: Config, owners: list[dict]) -> dict:
    """The cache pods' ServiceAccount; with the EKS role annotation only when `IAM_ROLE` is set."""
    annotations = table_annotations(cfg)
    if cfg.iam_role:
        annotations |= {c.EKS_ROLE_ARN_ANNOTATION: cfg.iam_role, c.EKS_STS_REGIONAL_ANNOTATION: "true"}
    return {
        "apiVersion": SERVICE_ACCOUNTS.api_version,
        "kind": SERVICE_ACCOUNTS.kind,
        "metadata": _metadata(cfg, cache_names(cfg).cache, owners, annotations),
        "automountServiceAccountToken": False,
    }


def build_service(cfg: Config, owners: list[dict]) -> dict:
    """`{TRAIN_JOB_NAME}-cache-service`: Flight (50051) and health ports of the cache's head."""
    return {
        "apiVersion": SERVICES.api_version,
        "kind": SERVICES.kind,
        "metadata": _metadata(cfg, cache_names(cfg).service, owners),
        "spec": {
            "type": "ClusterIP",
            "selector": head_selector(cfg),
            # The head stays behind its Service while not ready. Degraded (a data node down or
            # reloading), it answers readers UNAVAILABLE naming the node, and they retry; dropped
            # from the endpoints, their new connections were refused, blaming the head or the
            # endpoint. Trainers start only once the LeaderWorkerSet is available (the wait), so
            # nothing reads a cache still loading through it but a retry.
            "publishNotReadyAddresses": True,
            "ports": [
                {
                    "name": c.FLIGHT_PORT_NAME,
                    "port": c.FLIGHT_PORT,
                    "targetPort": c.FLIGHT_PORT_NAME,
                    "protocol": "TCP",
                },
                {
                    "name": c.HEALTH_PORT_NAME,
                    "port": cfg.health_port,
                    "targetPort": c.HEALTH_PORT_NAME,
                    "protocol": "TCP",
                },
            ],
        },
    }


def _cache_env(cfg: Config, key_secret: str | None) -> list[dict]:
    env = [
        {"name": "METADATA_LOC", "value": cfg.metadata_loc},
        {"name": "SCHEMA_NAME", "value": cfg.schema_name},
        {"name": "TABLE_NAME", "value": cfg.table_name},
        {"name": "FLIGHT_PORT", "value": str(c.FLIGHT_PORT)},
        {"name": "HEALTH_PORT", "value": str(cfg.health_port)},
        # As given (a float): truncating made 0.5 read as 0, which the cache pods refuse.
        {"name": "DATA_CACHE_STARTUP_TIMEOUT_SECONDS", "value": repr(cfg.ready_timeout_seconds)},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {
            "name": "MEMORY_LIMIT",
            "valueFrom": {"resourceFieldRef": {"containerName": c.CACHE_CONTAINER, "resource": "limits.memory"}},
        },
        # The container's CPUs (rounded up to whole ones), which size a node's parallel reads and
        # so the head's memory estimate: a cgroup v1 node shows the pod no quota, and the cache
        # counted every CPU of the machine (96 readers for a 2-CPU pod).
        {
            "name": "LOAD_THREADS",
            "valueFrom": {
                "resourceFieldRef": {"containerName": c.CACHE_CONTAINER, "resource": "limits.cpu", "divisor": "1"}
            },
        },
    ]
    if key_secret is not None:
        env.append(cluster_key_env(key_secret))
    if cfg.token_secret is not None:
        env.append(token_env(cfg.token_secret))
    if cfg.tls_secret is not None:
        env += tls_env()
    if cfg.s3_ca_configmap is not None:
        env.append({"name": c.S3_CA_DIR_ENV, "value": c.S3_CA_MOUNT_PATH})
    return env + [{"name": name, "value": value} for name, value in cfg.cache_env]


def _http_probe(path: str, initial: int, period: int, timeout: int, failures: int) -> dict:
    return {
        "httpGet": {"path": path, "port": c.HEALTH_PORT_NAME},
        "initialDelaySeconds": initial,
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def _pod_template(
    cfg: Config, component: str, args: tuple[str, ...], cpu: str, memory: str, key_secret: str | None
) -> dict:
    r = cfg.readiness
    container = {
        "name": c.CACHE_CONTAINER,
        "image": cfg.cache_image,
        "args": list(args),
        "env": _cache_env(cfg, key_secret),
        "ports": [
            {"name": c.FLIGHT_PORT_NAME, "containerPort": c.FLIGHT_PORT, "protocol": "TCP"},
            {"name": c.HEALTH_PORT_NAME, "containerPort": cfg.health_port, "protocol": "TCP"},
        ],
        "resources": {"requests": {"cpu": cpu, "memory": memory}, "limits": {"cpu": cpu, "memory": memory}},
        "readinessProbe": _http_probe(
            c.READY_PATH, r.initial_delay_seconds, r.period_seconds, r.timeout_seconds, r.failure_threshold
        ),
        "livenessProbe": _http_probe(
            c.LIVE_PATH,
            c.LIVENESS_INITIAL_DELAY_SECONDS,
            c.LIVENESS_PERIOD_SECONDS,
            c.LIVENESS_TIMEOUT_SECONDS,
            c.LIVENESS_FAILURE_THRESHOLD,
        ),
        # No runAsUser/runAsGroup/fsGroup: the image's numeric USER runs (runAsNonRoot checks it),
        # and platforms that assign their own IDs (OpenShift's restricted SCC) refuse fixed ones.
        "securityContext": {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationMessagePath": c.TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [{"name": c.TMP_VOLUME, "mountPath": c.TMP_MOUNT_PATH}],
    }
    if cfg.image_pull_policy is not None:  # else the API server's default for the image's tag
        container["imagePullPolicy"] = cfg.image_pull_policy
    volumes = [{"name": c.TMP_VOLUME, "emptyDir": {}}]
    if cfg.tls_secret is not None:
        container["volumeMounts"].append(tls_volume_mount())
        volumes.append(tls_volume(cfg.tls_secret))
    if cfg.s3_ca_configmap is not None:
        container["volumeMounts"].append({"name": c.S3_CA_VOLUME, "mountPath": c.S3_CA_MOUNT_PATH, "readOnly": True})
        volumes.append(s3_ca_volume(cfg.s3_ca_configmap))
    if cfg.env_from_secrets:
        container["envFrom"] = [{"secretRef": {"name": secret}} for secret in cfg.env_from_secrets]
    pod = {
        "metadata": {"labels": cache_labels(cfg, component)},
        "spec": {
            "serviceAccountName": cache_names(cfg).cache,
            "automountServiceAccountToken": False,
            "securityContext": {
                "runAsNonRoot": True,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [container],
            "volumes": volumes,
        },
    }
    if cfg.health_port < c.UNPRIVILEGED_PORT_START:
        # The cache runs as a non-root user with no capabilities: a port below 1024 needs the
        # kernel told to let it bind there (a safe, per-pod sysctl), or the pod fails to start
        # on runtimes that keep the kernel's default (containerd before 2.0). A cache adopted
        # with a higher port later keeps the sysctl (drift repair merges, never removes): it
        # only lets the pod bind lower ports, which it does not do.
        pod["spec"]["securityContext"]["sysctls"] = [
            {"name": "net.ipv4.ip_unprivileged_port_start", "value": str(cfg.health_port)}
        ]
    if cfg.image_pull_secrets:  # a private registry holds the cache image
        pod["spec"]["imagePullSecrets"] = [{"name": secret} for secret in cfg.image_pull_secrets]
    if cfg.node_selector:  # placement.py: the pool the admin keeps for cache pods
        pod["spec"]["nodeSelector"] = dict(cfg.node_selector)
    if cfg.tolerations:
        pod["spec"]["tolerations"] = [dict(t) for t in cfg.tolerations]
    return pod


def build_leader_worker_set(cfg: Config, owners: list[dict], key_secret: str | None = None) -> dict:
    """One group of `CLUSTER_SIZE` pods: the leader runs `data-cache head`, the workers `data-cache worker`.

    With ``key_secret`` (new_key_secret_name) every pod reads DATA_CACHE_CLUSTER_KEY from that
    Secret (build_cluster_key_secret): only pods holding the key can register as the cache's
    data nodes or tell them what to load, and it is not written in the pod spec, which anyone
    with `view` on the namespace can read.
    """
    return {
        "apiVersion": LEADER_WORKER_SETS.api_version,
        "kind": LEADER_WORKER_SETS.kind,
        "metadata": _metadata(cfg, cache_names(cfg).cache, owners, table_annotations(cfg)),
        "spec": {
            "replicas": 1,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": cfg.cluster_size,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": _pod_template(
                    cfg, c.COMPONENT_HEAD, c.HEAD_ARGS, cfg.head_cpu, cfg.head_mem, key_secret
                ),
                "workerTemplate": _pod_template(
                    cfg, c.COMPONENT_WORKER, c.WORKER_ARGS, cfg.worker_cpu, cfg.worker_mem, key_secret
                ),
            },
        },
    }


def new_cluster_key() -> str:
    """A fresh random key for one cache (not pure: each call differs)."""
    return secrets.token_urlsafe(c.CLUSTER_KEY_BYTES)


def new_key_secret_name(cfg: Config) -> str:
    """A new name for the Secret of one cache's key: `<cache>-key-<8 hex>` (not pure).

    Drawn per LeaderWorkerSet, not fixed per cache: a cache deleted and made again (a retried
    initializer after a failed start) must not find the old cache's Secret under its name, which
    the garbage collector deletes a moment later, once it sees its owner gone.
    """
    return f"{cache_names(cfg).cache}{c.KEY_SECRET_INFIX}{secrets.token_hex(c.KEY_SECRET_SUFFIX_BYTES)}"


def cluster_key_env(key_secret: str) -> dict:
    return {
        "name": c.CLUSTER_KEY_ENV,
        "valueFrom": {"secretKeyRef": {"name": key_secret, "key": c.KEY_SECRET_DATA_KEY}},
    }


def token_env(token_secret: str) -> dict:
    """DATA_CACHE_TOKEN from the namespace's token Secret, where it exists.

    Optional: without the Secret (or its `token` key) the kubelet leaves the variable unset and
    the cache serves without a token, as before; with it, the cache refuses readers without the
    token, and the runtime's trainers read the same Secret the same way. An `envFrom` Secret's
    DATA_CACHE_TOKEN (CACHE_ENV_FROM_SECRET) still applies where this Secret is missing: env
    entries win over envFrom only where they are set.
    """
    ref = {"name": token_secret, "key": c.TOKEN_SECRET_DATA_KEY, "optional": True}
    return {"name": c.TOKEN_ENV, "valueFrom": {"secretKeyRef": ref}}


def tls_volume(tls_secret: str) -> dict:
    """The namespace's TLS Secret as a pod volume, where it exists.

    Optional, like the token: without the Secret the kubelet mounts an empty folder and the cache
    serves plaintext; with it, the folder holds tls.crt and tls.key (and ca.crt, cert-manager's)
    and the cache serves TLS. No `items`: the cache needs every key, the private one too.
    The initializer never reads the Secret, so it needs no `get` on Secrets for this.
    """
    return {"name": c.TLS_VOLUME, "secret": {"secretName": tls_secret, "optional": True}}


def s3_ca_volume(configmap: str) -> dict:
    """The namespace's ConfigMap of the object store's CA as a pod volume, where it exists.

    Optional, like the TLS Secret: without it the folder is empty and the cache trusts the
    image's CAs; with it, the cache trusts the ConfigMap's ``ca.crt`` for S3 (DATA_CACHE_S3_CA_DIR).
    """
    return {"name": c.S3_CA_VOLUME, "configMap": {"name": configmap, "optional": True}}


def tls_volume_mount() -> dict:
    return {"name": c.TLS_VOLUME, "mountPath": c.TLS_MOUNT_PATH, "readOnly": True}


def tls_env() -> list[dict]:
    """Where the cache looks for its certificate, and the name it is issued for.

    Both are set whether or not the Secret exists: the folder's content, not the env, decides
    between TLS and plaintext, so a Secret created later takes effect with the next cache.
    """
    return [
        {"name": c.TLS_DIR_ENV, "value": c.TLS_MOUNT_PATH},
        {"name": c.TLS_SERVER_NAME_ENV, "value": c.TLS_SERVER_NAME},
    ]


def build_cluster_key_secret(cfg: Config, name: str, lws: dict, key: str) -> dict:
    """The Secret holding a cache's key, owned by its LeaderWorkerSet (``lws``, as the API holds it).

    Owned by the LeaderWorkerSet, not the TrainJob: a shared cache outlives the TrainJob that
    made it, and its key must live exactly as long as it. Immutable: the key never changes.
    """
    return {
        "apiVersion": SECRETS.api_version,
        "kind": SECRETS.kind,
        "metadata": _metadata(cfg, name, [owner_reference(lws, controller=True)]),
        "type": "Opaque",
        "immutable": True,
        "data": {c.KEY_SECRET_DATA_KEY: base64.b64encode(key.encode()).decode()},
    }


def _templates(lws: dict) -> list[dict]:
    spec = lws.get("spec", {}).get("leaderWorkerTemplate", {})
    return [spec[name] for name in ("leaderTemplate", "workerTemplate") if name in spec]


def cluster_key_entry(lws: dict) -> dict | None:
    """The DATA_CACHE_CLUSTER_KEY env entry of a LeaderWorkerSet's pods, or None.

    A reference to a Secret (key_secret_of); a cache made by an initializer of before the Secret
    has the key itself as its value; one of before the key has none.
    """
    for template in _templates(lws):
        for container in template.get("spec", {}).get("containers", []):
            for var in container.get("env") or []:
                if var.get("name") == c.CLUSTER_KEY_ENV:
                    return var
    return None


def _group_template(lws: dict | None) -> dict:
    """A LeaderWorkerSet's `leaderWorkerTemplate` as read back from the API, or {}."""
    return ((lws or {}).get("spec") or {}).get("leaderWorkerTemplate") or {}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def group_size_of(lws: dict | None) -> int | None:
    """How many pods a LeaderWorkerSet's group has (a shared cache another TrainJob made keeps
    its own CLUSTER_SIZE), or None where it does not say."""
    size = _group_template(lws).get("size")
    return size if _is_int(size) and size > 0 else None


def health_port_of(lws: dict | None) -> int | None:
    """The port of a LeaderWorkerSet's head /status (its leader's `health` port: a shared cache
    another TrainJob made keeps its own CACHE_HEALTH_PORT), or None where it does not say."""
    template = _group_template(lws).get("leaderTemplate") or {}
    for container in (template.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            number = port.get("containerPort")
            if port.get("name") == c.HEALTH_PORT_NAME and _is_int(number):
                return number
    return None


def key_secret_of(lws: dict) -> str | None:
    """The Secret a LeaderWorkerSet's pods read their cluster key from, or None."""
    entry = cluster_key_entry(lws) or {}
    return ((entry.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name")


def with_cluster_key_entry(lws: dict, entry: dict | None) -> dict:
    """A copy of a built LeaderWorkerSet whose pods get ``entry`` as their cluster key (in the
    place of theirs, so the env lists compare equal), or no key at all when ``entry`` is None."""
    out = copy.deepcopy(lws)
    for template in _templates(out):
        for container in template["spec"]["containers"]:
            env = container["env"]
            at = [i for i, var in enumerate(env) if var["name"] == c.CLUSTER_KEY_ENV]
            if entry is None:
                container["env"] = [var for var in env if var["name"] != c.CLUSTER_KEY_ENV]
            elif at:
                env[at[0]] = copy.deepcopy(entry)
            else:
                env.append(copy.deepcopy(entry))
    return out
