"""Pure builders for every object the kind suite applies, and pure checks on what it reads back.

Nothing here talks to a cluster: the offline tests validate these objects against the pinned
schemas, and the kind suite applies exactly the same dicts.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

# Tool pins: the kind release whose node image hack/kind-config.yaml names (kind only supports the
# node images of its own release), and the kubectl used when none is on PATH.
KIND_VERSION = "v0.27.0"
KUBECTL_VERSION = "v1.32.2"
KIND_CONFIG = REPO / "hack" / "kind-config.yaml"
IMAGES_SCRIPT = REPO / "hack" / "e2e-images.sh"
DEFAULT_CLUSTER_NAME = "kubeflow-data-cache-e2e"
# kind's own rule for a cluster name (`kind create cluster` refuses any other).
KIND_CLUSTER_NAME_RE = re.compile(r"[a-z0-9.-]+")


def cluster_name(env: Mapping[str, str] = os.environ) -> str:
    """The kind cluster the suite makes and uses: KIND_CLUSTER_NAME (which hack/e2e-images.sh
    reads too), else DEFAULT_CLUSTER_NAME. Two runs on one Docker host, each with its own name,
    no longer reuse, or delete, each other's cluster."""
    name = env.get("KIND_CLUSTER_NAME") or DEFAULT_CLUSTER_NAME
    if not KIND_CLUSTER_NAME_RE.fullmatch(name):
        raise ValueError(
            f"KIND_CLUSTER_NAME={name!r} is not a kind cluster name: use lower-case letters, digits, '.' and '-'"
        )
    return name


# Locally built images: a registry host that resolves nowhere, so a pod can only run what was loaded.
IMAGE_REGISTRY = "kind.local/kubeflow-data-cache"
IMAGE_TAG = "e2e"
CACHE_IMAGE = f"{IMAGE_REGISTRY}/cache:{IMAGE_TAG}"
INITIALIZER_IMAGE = f"{IMAGE_REGISTRY}/initializer:{IMAGE_TAG}"
TRAINER_IMAGE = f"{IMAGE_REGISTRY}/trainer-e2e:{IMAGE_TAG}"
UPSTREAM_REGISTRY = "ghcr.io/kubeflow-data-cache"
UPSTREAM_IMAGE_RE = re.compile(
    r"ghcr\.io/kubeflow-data-cache/(cache|initializer)(?::[\w.\-]+)?(?:@sha256:[0-9a-f]{64})?"
)

# The table writer Job's own deadline: under the suite's wait for it (conftest.TABLE_WRITE_TIMEOUT).
WRITER_DEADLINE_SECONDS = 540

RUNTIME_NAME = "torch-distributed-with-cache"
TRAINER_SCRIPT = "/app/e2e_train.py"
SYSTEM_NAMESPACE = "kubeflow-system"
# Where the kustomize overlay installs LeaderWorkerSet (as upstream does); the chart uses SYSTEM_NAMESPACE.
LWS_NAMESPACE = "lws-system"
PART_OF = {"app.kubernetes.io/part-of": "kubeflow-data-cache-e2e"}

# MinIO: a single-node S3 store inside the cluster; throwaway credentials for a throwaway cluster.
# quay.io: Docker Hub stopped serving minio/minio (every tag) in September 2026; MinIO still
# publishes the same release tags on quay.io.
MINIO_IMAGE = "quay.io/minio/minio:RELEASE.2025-04-22T22-12-26Z"
MINIO_NAME = "minio"
MINIO_PORT = 9000
S3_ACCESS_KEY = "e2e-access-key"
S3_SECRET_KEY = "e2e-secret-key-not-a-secret"
S3_REGION = "us-east-1"
S3_SECRET_NAME = "minio-credentials"
# The readers' token: a Secret of the namespace under the name the runtime's trainers and the
# initializer's cache pods both read it from (optionally), which turns token auth on there.
READER_TOKEN_SECRET = "data-cache-token"
READER_TOKEN = "e2e-reader-token-not-a-secret"
# Flight over TLS: a kubernetes.io/tls Secret of the namespace under the name both sides mount it
# from (optionally), its certificate naming the one name they check it for. The kustomize
# install's namespace has it, the Helm install's not, so the suite runs both transports.
TLS_SECRET = "data-cache-tls"
TLS_SERVER_NAME = "data-cache"
BUCKET = "warehouse"
WRITER_NAME = "e2e-table-writer"
WRITER_SCRIPT = HERE / "table_writer.py"


@dataclass(frozen=True)
class TableSpec:
    schema: str = "e2e"
    name: str = "events"
    rows: int = 10_000
    files: int = 4

    @property
    def storage_uri(self) -> str:
        return f"cache://{self.schema}/{self.name}"


TABLE = TableSpec()


def s3_endpoint(namespace: str) -> str:
    return f"http://{MINIO_NAME}.{namespace}.svc.cluster.local:{MINIO_PORT}"


def _env(pairs: dict[str, str]) -> list[dict[str, str]]:
    return [{"name": k, "value": v} for k, v in pairs.items()]


def s3_settings(namespace: str) -> dict[str, str]:
    """Where MinIO is: the standard AWS variables that are not secrets (the initializer forwards
    these to the cache pods as they are)."""
    return {"AWS_ENDPOINT_URL": s3_endpoint(namespace), "AWS_REGION": S3_REGION}


def s3_credentials() -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": S3_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY}


def s3_env(namespace: str) -> dict[str, str]:
    """Every AWS variable the writer reads, credentials included (its own pod, its own env)."""
    return {**s3_settings(namespace), **s3_credentials()}


def s3_credentials_secret(namespace: str) -> dict[str, Any]:
    """The credentials as a user hands them to the cache: a Secret named in CACHE_ENV_FROM_SECRET,
    whose keys become the cache pods' env (the initializer never forwards AWS_ACCESS_KEY_ID or
    AWS_SECRET_ACCESS_KEY from its own env)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": S3_SECRET_NAME, "namespace": namespace, "labels": PART_OF},
        "type": "Opaque",
        "stringData": s3_credentials(),
    }


def reader_token_secret(namespace: str) -> dict[str, Any]:
    """The namespace's reader token, as docs/install.md has an admin create it."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": READER_TOKEN_SECRET, "namespace": namespace, "labels": PART_OF},
        "type": "Opaque",
        "stringData": {"token": READER_TOKEN},
    }


def tls_secret(namespace: str, pems: dict[str, bytes]) -> dict[str, Any]:
    """The namespace's Flight TLS Secret, as docs/install.md has an admin (or cert-manager) make
    it: ``tls.crt``, ``tls.key`` and ``ca.crt`` (tests/tls_certs.py makes them)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": TLS_SECRET, "namespace": namespace, "labels": PART_OF},
        "type": "kubernetes.io/tls",
        "stringData": {name: pem.decode() for name, pem in sorted(pems.items())},
    }


# Run in the head pod (`kubectl exec`, the cache image's Python) with the head's host:port as its
# argument. Says which transport the pod's own TLS folder (DATA_CACHE_TLS_DIR, as the initializer
# mounts the namespace's Secret) calls for, and over TLS whether a plaintext client is refused;
# then asks for the table without a token, and with the pod's own DATA_CACHE_TOKEN. One line
# each, parsed by the test.
ACCESS_PROBE = """
import os
import sys
from pathlib import Path

import pyarrow.flight as flight

address = sys.argv[1]
within = flight.FlightCallOptions(timeout=10)  # a cache that stops answering fails the probe, not hangs it
folder = Path(os.environ.get("DATA_CACHE_TLS_DIR") or "/nonexistent")
if (folder / "tls.crt").is_file():
    ca = folder / "ca.crt" if (folder / "ca.crt").is_file() else folder / "tls.crt"
    name = os.environ.get("DATA_CACHE_TLS_SERVER_NAME")
    client = flight.FlightClient(f"grpc+tls://{address}", tls_root_certs=ca.read_bytes(), override_hostname=name)
    print("transport: tls")
    try:
        list(flight.FlightClient(f"grpc://{address}").list_flights(options=within))
        print("plaintext: served")
    except flight.FlightError:
        print("plaintext: refused")
else:
    client = flight.FlightClient(f"grpc://{address}")
    print("transport: plaintext")
try:
    list(client.list_flights(options=within))
    print("without token: served")
except flight.FlightUnauthenticatedError:
    print("without token: refused")
token = os.environ.get("DATA_CACHE_TOKEN")
if token is None:
    print("with token: no DATA_CACHE_TOKEN in the pod")
else:
    options = flight.FlightCallOptions(timeout=10, headers=[(b"authorization", f"Bearer {token}".encode())])
    print(f"with token: {len(list(client.list_flights(options=options)))} table(s)")
"""


def _restricted_security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def minio_objects(namespace: str) -> list[dict[str, Any]]:
    labels = {"app.kubernetes.io/name": MINIO_NAME, **PART_OF}
    container = {
        "name": MINIO_NAME,
        "image": MINIO_IMAGE,
        "args": ["server", "/data"],
        "env": _env({"MINIO_ROOT_USER": S3_ACCESS_KEY, "MINIO_ROOT_PASSWORD": S3_SECRET_KEY}),
        "ports": [{"name": "s3", "containerPort": MINIO_PORT}],
        "readinessProbe": {"httpGet": {"path": "/minio/health/ready", "port": MINIO_PORT}, "periodSeconds": 2},
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        # Test infrastructure, run as the upstream image expects (root); our own images run restricted.
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": MINIO_NAME, "namespace": namespace, "labels": labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app.kubernetes.io/name": MINIO_NAME}},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [container],
                    "volumes": [{"name": "data", "emptyDir": {}}],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": MINIO_NAME, "namespace": namespace, "labels": labels},
        "spec": {
            "selector": {"app.kubernetes.io/name": MINIO_NAME},
            "ports": [{"name": "s3", "port": MINIO_PORT, "targetPort": MINIO_PORT}],
        },
    }
    return [deployment, service, s3_credentials_secret(namespace)]


def table_writer_objects(namespace: str, table: TableSpec = TABLE, image: str = CACHE_IMAGE) -> list[dict[str, Any]]:
    """A ConfigMap holding tests/e2e/table_writer.py and a Job that runs it in the cache image."""
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": WRITER_NAME, "namespace": namespace, "labels": PART_OF},
        "data": {"table_writer.py": WRITER_SCRIPT.read_text()},
    }
    env = {
        **s3_env(namespace),
        "WAREHOUSE": f"s3://{BUCKET}/iceberg",
        "TABLE_SCHEMA": table.schema,
        "TABLE_NAME": table.name,
        "TABLE_ROWS": str(table.rows),
        "TABLE_FILES": str(table.files),
        "CATALOG_DB": "/work/catalog.db",
    }
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": WRITER_NAME, "namespace": namespace, "labels": PART_OF},
        "spec": {
            "backoffLimit": 2,
            # Under the suite's wait for it (TABLE_WRITE_TIMEOUT, 600 s): a hung writer then fails
            # as the Job's DeadlineExceeded, with its logs dumped, not as a bare wait timeout.
            "activeDeadlineSeconds": WRITER_DEADLINE_SECONDS,
            "template": {
                "metadata": {"labels": PART_OF},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "writer",
                            "image": image,
                            "imagePullPolicy": "IfNotPresent",
                            "command": ["python", "/scripts/table_writer.py"],
                            "env": _env(env),
                            "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
                            "securityContext": _restricted_security_context(),
                            "volumeMounts": [
                                {"name": "script", "mountPath": "/scripts", "readOnly": True},
                                {"name": "work", "mountPath": "/work"},
                            ],
                        }
                    ],
                    "volumes": [
                        {"name": "script", "configMap": {"name": WRITER_NAME}},
                        {"name": "work", "emptyDir": {}},
                    ],
                },
            },
        },
    }
    return [config_map, job]


def parse_metadata_location(log: str) -> str:
    """The writer prints ``METADATA_LOC=<uri>`` on its own line; the last one wins."""
    found = re.findall(r"^METADATA_LOC=(\S+)$", log, flags=re.MULTILINE)
    if not found:
        raise ValueError(f"no METADATA_LOC= line in the table writer's log:\n{log[-2000:]}")
    return found[-1]


def train_job(
    name: str,
    namespace: str,
    metadata_loc: str,
    *,
    table: TableSpec = TABLE,
    data_nodes: int = 2,
    trainer_nodes: int = 2,
    shared: bool = False,
    ready_timeout_s: int = 300,
) -> dict[str, Any]:
    """A TrainJob shaped the way the Kubeflow SDK's ``DataCacheInitializer`` builds one.

    The SDK puts ``CLUSTER_SIZE`` (data nodes + head) and ``METADATA_LOC`` first, then the
    optional fields upper-cased. Where MinIO is rides along as the standard AWS variables; its
    credentials, as docs/initializer.md asks, in the Secret named by ``CACHE_ENV_FROM_SECRET``.
    """
    env = {
        "CLUSTER_SIZE": str(data_nodes + 1),
        "METADATA_LOC": metadata_loc,
        "HEAD_CPU": "100m",
        "HEAD_MEM": "512Mi",
        "WORKER_CPU": "100m",
        "WORKER_MEM": "768Mi",
        "CACHE_READY_TIMEOUT_SECONDS": str(ready_timeout_s),
        "CACHE_ENV_FROM_SECRET": S3_SECRET_NAME,
        **s3_settings(namespace),
    }
    if shared:
        env["DATA_CACHE_SHARED"] = "true"
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": name, "namespace": namespace, "labels": PART_OF},
        "spec": {
            "runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime", "name": RUNTIME_NAME},
            "initializer": {"dataset": {"storageUri": table.storage_uri, "env": _env(env)}},
            "trainer": {
                "image": TRAINER_IMAGE,
                "command": ["torchrun", TRAINER_SCRIPT],
                "numNodes": trainer_nodes,
                "numProcPerNode": 1,
                "resourcesPerNode": {"requests": {"cpu": "100m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
            },
        },
    }


def retarget_images(obj: Any, mapping: dict[str, str]) -> tuple[Any, int]:
    """Replace every upstream image reference (image fields and env values alike) in a rendered tree.

    ``mapping`` is component -> local image (``{"cache": ..., "initializer": ...}``). Returns the
    new tree and the number of strings changed.
    """
    count = 0

    def swap(match: re.Match[str]) -> str:
        return mapping[match.group(1)]

    def walk(node: Any) -> Any:
        nonlocal count
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, str):
            new = UPSTREAM_IMAGE_RE.sub(swap, node)
            count += new != node
            return new
        return node

    return walk(obj), count


def split_for_apply(objs: list[dict[str, Any]]) -> tuple[list[dict], list[dict], list[dict]]:
    """CRDs first, then everything else, then the runtimes (their webhook needs the manager up)."""
    runtimes = {"ClusterTrainingRuntime", "TrainingRuntime"}
    crds = [o for o in objs if o.get("kind") == "CustomResourceDefinition"]
    late = [o for o in objs if o.get("kind") in runtimes]
    rest = [o for o in objs if o.get("kind") != "CustomResourceDefinition" and o.get("kind") not in runtimes]
    return crds, rest, late


@dataclass(frozen=True)
class RankResult:
    rank: int
    world: int
    rows: int
    unique: int
    id_sum: int
    id_sq_sum: int
    endpoint: str = ""  # the cache the rank read from, as DataCacheDataset resolved it


RESULT_RE = re.compile(
    r"E2E_RESULT rank=(\d+) world=(\d+) rows=(\d+) unique=(\d+) id_sum=(-?\d+) id_sq_sum=(-?\d+) endpoint=(\S+)",
)


def parse_results(log: str) -> list[RankResult]:
    """Every ``E2E_RESULT`` line the trainer script printed (images/trainer-e2e/e2e_train.py)."""
    return [RankResult(*map(int, m.groups()[:-1]), m.group(7)) for m in RESULT_RE.finditer(log)]


def check_exactly_once(results: list[RankResult], rows: int, world: int) -> list[str]:
    """Problems with the claim "the ranks together saw ids 0..rows-1, each exactly once"; [] if none.

    Row count, id sum and sum of squares all match and no rank saw an id twice: a lost row can
    only hide behind a duplicate elsewhere that also matches both sums, which the checks make
    vanishingly unlikely for a test table.
    """
    problems = []
    ranks = sorted(r.rank for r in results)
    if ranks != list(range(world)):
        problems.append(f"expected one result per rank 0..{world - 1}, got ranks {ranks}")
    for r in results:
        if r.world != world:
            problems.append(f"rank {r.rank} ran with WORLD_SIZE={r.world}, expected {world}")
        if r.unique != r.rows:
            problems.append(f"rank {r.rank} saw {r.rows} rows but only {r.unique} distinct ids")
    total = sum(r.rows for r in results)
    if total != rows:
        problems.append(f"ranks saw {total} rows in all, the table has {rows}")
    id_sum = sum(r.id_sum for r in results)
    if id_sum != rows * (rows - 1) // 2:
        problems.append(f"id sum {id_sum} != {rows * (rows - 1) // 2} (ids 0..{rows - 1})")
    sq_sum = sum(r.id_sq_sum for r in results)
    if sq_sum != (rows - 1) * rows * (2 * rows - 1) // 6:
        problems.append(f"sum of squared ids {sq_sum} != {(rows - 1) * rows * (2 * rows - 1) // 6}")
    return problems


def helm_values(namespace: str) -> dict[str, Any]:
    """Chart values of the Helm install: the data cache on, its images the locally built ones."""
    registry, _, _ = CACHE_IMAGE.rpartition("/")
    return {
        "dataCache": {
            "enabled": True,
            "initializer": {"image": {"repository": f"{registry}/initializer", "tag": IMAGE_TAG}},
            "cache": {"image": {"repository": f"{registry}/cache", "tag": IMAGE_TAG}},
            "namespaces": [namespace],
        }
    }


def upstream_image_refs(obj: Any) -> list[str]:
    """Every string in a tree that still names a published data-cache image."""
    if isinstance(obj, dict):
        return [ref for v in obj.values() for ref in upstream_image_refs(v)]
    if isinstance(obj, list):
        return [ref for v in obj for ref in upstream_image_refs(v)]
    return [obj] if isinstance(obj, str) and UPSTREAM_IMAGE_RE.search(obj) else []
