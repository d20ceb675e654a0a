"""What the kind suite relies on, checked without a cluster (these run under plain `make test`).

Every object it applies is validated against the pinned schemas; the table writer runs against a
local S3 (moto); the trainer script runs against a local cache; the image retargeting is checked
on the real chart and overlay renders; the tool pins agree across config, code and workflow.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import free_port
from tests.e2e.e2e_objects import (
    ACCESS_PROBE,
    CACHE_IMAGE,
    DEFAULT_CLUSTER_NAME,
    INITIALIZER_IMAGE,
    KIND_CONFIG,
    KIND_VERSION,
    READER_TOKEN,
    READER_TOKEN_SECRET,
    REPO,
    RUNTIME_NAME,
    TABLE,
    TLS_SERVER_NAME,
    TRAINER_IMAGE,
    WRITER_SCRIPT,
    RankResult,
    check_exactly_once,
    cluster_name,
    helm_values,
    minio_objects,
    parse_metadata_location,
    parse_results,
    reader_token_secret,
    retarget_images,
    split_for_apply,
    table_writer_objects,
    tls_secret,
    train_job,
    upstream_image_refs,
)
from tests.schemas import ObjectInvalid, validate_objects
from tests.tls_certs import tls_secret_pems

NS = "dc-e2e-offline"
META = "s3://warehouse/iceberg/e2e/events/metadata/00004-0f.metadata.json"
TRAINER_SCRIPT = REPO / "images" / "trainer-e2e" / "e2e_train.py"
WORKFLOWS = REPO / ".github" / "workflows"


def applied_objects() -> list[dict]:
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
        *minio_objects(NS),
        *table_writer_objects(NS),
        train_job("stream", NS, META),
        train_job("bad-metadata", NS, META.replace("00004-0f", "missing"), ready_timeout_s=180),
        train_job("share-a", NS, META, shared=True),
        reader_token_secret(NS),
        tls_secret(NS, tls_secret_pems(TLS_SERVER_NAME)),
    ]


def test_every_object_the_suite_applies_passes_strict_validation() -> None:
    validate_objects(applied_objects())


@pytest.mark.parametrize(
    ("index", "path", "value"),
    [
        (6, ("spec", "trainer", "numNode"), 2),  # TrainJob: a misspelt field
        (6, ("spec", "initializer", "dataset", "storageURI"), "cache://e2e/events"),
        (1, ("spec", "template", "spec", "contianers"), []),  # MinIO Deployment
        (3, ("stringdata",), {}),  # MinIO credentials Secret
        (5, ("spec", "backoffLimt"), 2),  # writer Job
    ],
)
def test_a_typo_in_an_applied_object_is_caught(index: int, path: tuple, value) -> None:
    target = applied_objects()[index]
    node = target
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ObjectInvalid):
        validate_objects([target])


def test_trainjob_is_shaped_like_the_sdk_data_cache_initializer() -> None:
    job = train_job("stream", NS, META, data_nodes=2)
    dataset = job["spec"]["initializer"]["dataset"]
    env = [(e["name"], e["value"]) for e in dataset["env"]]
    assert dataset["storageUri"] == f"cache://{TABLE.schema}/{TABLE.name}"
    assert env[:2] == [("CLUSTER_SIZE", "3"), ("METADATA_LOC", META)]
    names = dict(env)
    assert {"AWS_ENDPOINT_URL", "AWS_REGION", "CACHE_ENV_FROM_SECRET"} <= set(names)
    assert names["AWS_ENDPOINT_URL"] == f"http://minio.{NS}.svc.cluster.local:9000"
    assert "DATA_CACHE_SHARED" not in names
    shared = dict(
        (e["name"], e["value"]) for e in train_job("a", NS, META, shared=True)["spec"]["initializer"]["dataset"]["env"]
    )
    assert shared["DATA_CACHE_SHARED"] == "true"
    assert job["spec"]["runtimeRef"]["name"] == RUNTIME_NAME
    assert job["spec"]["trainer"]["image"] == TRAINER_IMAGE
    assert job["spec"]["trainer"]["numNodes"] == 2


def stream_cache() -> tuple[dict, dict, dict[str, dict]]:
    """The suite's "stream" TrainJob, the LeaderWorkerSet its initializer builds (its own config
    and builders, fed the TrainJob's dataset env), and the Secrets the suite applies, by name."""
    from kubeflow_cache_initializer.builders import build_leader_worker_set
    from kubeflow_cache_initializer.config import load_config

    job = train_job("stream", NS, META)
    dataset = job["spec"]["initializer"]["dataset"]
    # What the runtime's dataset-initializer container holds besides the TrainJob's env.
    runtime_env = {"STORAGE_URI": dataset["storageUri"], "TRAIN_JOB_NAME": "stream", "CACHE_IMAGE": CACHE_IMAGE}
    cfg = load_config({**runtime_env, **{e["name"]: e["value"] for e in dataset["env"]}, "NAMESPACE": NS})
    owner = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "name": "stream", "uid": "u"}
    secrets = {o["metadata"]["name"]: o for o in applied_objects() if o["kind"] == "Secret"}
    return job, build_leader_worker_set(cfg, [owner]), secrets


def test_the_cache_pods_of_the_suites_trainjobs_can_sign_their_requests_to_minio() -> None:
    """What a cache pod's S3 client gets, followed from the TrainJob through the initializer's own
    config and builders and the Secrets the suite applies, as the kubelet fills env and envFrom.

    The initializer never forwards AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY from its env: given
    only there, the cache would read MinIO unsigned, be denied, and every TrainJob would fail.
    """
    from kubeflow_data_cache.s3_settings import s3_properties_from_env

    _, lws, secrets = stream_cache()
    for template in ("leaderTemplate", "workerTemplate"):
        (container,) = lws["spec"]["leaderWorkerTemplate"][template]["spec"]["containers"]
        pod_env = {}
        for ref in container.get("envFrom") or []:
            name = ref["secretRef"]["name"]
            assert name in secrets, f"the cache pods read Secret {name}, which the suite never applies"
            pod_env.update(secrets[name]["stringData"])
        pod_env.update({e["name"]: e["value"] for e in container["env"] if "value" in e})
        props = s3_properties_from_env(pod_env)
        assert props["s3.endpoint"] == f"http://minio.{NS}.svc.cluster.local:9000", template
        assert (props.get("s3.access-key-id"), props.get("s3.secret-access-key")) == (
            "e2e-access-key",
            "e2e-secret-key-not-a-secret",
        ), template


def kubelet_env(container: dict, secrets: dict[str, dict]) -> dict[str, str]:
    """A container's env as the kubelet fills it from ``secrets`` (name -> Secret): envFrom
    first, then env entries over it; a missing optional Secret key leaves its variable unset, a
    missing required one is what the kubelet reports as CreateContainerConfigError. Downward-API
    values (fieldRef, resourceFieldRef) are left out."""

    def data(secret: dict) -> dict[str, str]:
        return secret.get("stringData") or {}

    env: dict[str, str] = {}
    for ref in container.get("envFrom") or []:
        name = ref["secretRef"]["name"]
        assert name in secrets, f"CreateContainerConfigError: secret {name!r} not found"
        env.update(data(secrets[name]))
    for var in container.get("env") or []:
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        ref = (var.get("valueFrom") or {}).get("secretKeyRef")
        if ref is None:
            continue
        value = data(secrets.get(ref["name"], {})).get(ref["key"])
        if value is not None:
            env[var["name"]] = value
        else:
            assert ref.get("optional"), f"CreateContainerConfigError: {ref} not found"
    return env


@pytest.mark.parametrize("with_token_secret", [True, False])
def test_the_namespaces_token_secret_reaches_the_cache_and_its_trainers_alike(with_token_secret: bool) -> None:
    """The reader token, followed from the Secret an admin creates in the namespace through the
    initializer's own config and builders (the cache pods) and the shipped runtime (the
    trainers), as the kubelet fills env: both hold the same token, or, without the Secret, both
    none and every pod still starts."""
    from kubeflow_data_cache.dataset import default_token
    from kubeflow_data_cache.security import load_token

    job, lws, secrets = stream_cache()
    if not with_token_secret:
        del secrets[READER_TOKEN_SECRET]
    want = READER_TOKEN if with_token_secret else None

    runtime = yaml.safe_load((REPO / "runtimes" / f"{RUNTIME_NAME}.yaml").read_text())
    (trainers,) = [j for j in runtime["spec"]["template"]["spec"]["replicatedJobs"] if j["name"] == "node"]
    (trainer,) = trainers["template"]["spec"]["template"]["spec"]["containers"]
    trainer_env = {
        **kubelet_env(trainer, secrets),
        **{e["name"]: e["value"] for e in job["spec"]["trainer"].get("env", [])},
    }
    assert default_token(trainer_env) == want
    for template in ("leaderTemplate", "workerTemplate"):
        (container,) = lws["spec"]["leaderWorkerTemplate"][template]["spec"]["containers"]
        pod_env = kubelet_env(container, secrets)
        assert load_token(pod_env.get("DATA_CACHE_TOKEN"), pod_env.get("DATA_CACHE_TOKEN_FILE")) == want, template


def _probe(cache_endpoint: str, env: dict[str, str]) -> str:
    """ACCESS_PROBE's output, run as in the head pod: the pod's env, the head's host:port."""
    probe_env = {k: v for k, v in os.environ.items() if not k.startswith("DATA_CACHE_")}
    address = cache_endpoint.split("://", 1)[1]
    out = subprocess.run(
        [sys.executable, "-c", ACCESS_PROBE, address],
        env={**probe_env, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_access_probe_tells_a_refusing_cache_from_an_open_one(small_table) -> None:
    """ACCESS_PROBE, which the kind suite runs in the head pod, against a local cache with the
    reader token and one without."""
    from tests.conftest import running_cache

    for token, expected in ((READER_TOKEN, "without token: refused"), (None, "without token: served")):
        env = {"DATA_CACHE_TOKEN": token} if token else {}
        with running_cache(small_table.metadata_location, data_nodes=1, env=env) as cache:
            out = _probe(cache.endpoint, env)
        assert "transport: plaintext" in out and expected in out and "with token: " in out, out
        if token:
            assert "with token: 1 table(s)" in out, out


def test_the_probe_reads_a_tls_cache_as_its_pod_would_and_sees_plaintext_refused(small_table, tmp_path) -> None:
    """With the namespace's TLS Secret mounted (the folder and server name the initializer gives
    the cache pods), the probe speaks TLS as they do, and a plaintext client is refused."""
    from tests.conftest import running_cache

    folder = tmp_path / "tls"
    folder.mkdir()
    for name, pem in tls_secret(NS, tls_secret_pems(TLS_SERVER_NAME))["stringData"].items():
        (folder / name).write_text(pem)  # the Secret object itself, as the kubelet mounts it
    env = {"DATA_CACHE_TOKEN": READER_TOKEN, "DATA_CACHE_TLS_DIR": str(folder)}
    env["DATA_CACHE_TLS_SERVER_NAME"] = TLS_SERVER_NAME
    with running_cache(small_table.metadata_location, data_nodes=1, env=env) as cache:
        out = _probe(cache.endpoint, env)
    assert "transport: tls" in out and "plaintext: refused" in out, out
    assert "without token: refused" in out and "with token: 1 table(s)" in out, out


@pytest.fixture(scope="module")
def moto_endpoint():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    yield f"http://127.0.0.1:{server._port}"
    server.stop()


def writer_env(endpoint: str, tmp_path: Path, rows: int, files: int) -> dict[str, str]:
    job = table_writer_objects(NS)[1]
    env = {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    return {
        **os.environ,
        **env,
        "AWS_ENDPOINT_URL": endpoint,
        "TABLE_ROWS": str(rows),
        "TABLE_FILES": str(files),
        "CATALOG_DB": str(tmp_path / "catalog.db"),
    }


def test_table_writer_writes_the_table_and_prints_its_location(moto_endpoint, tmp_path) -> None:
    from pyiceberg.table import StaticTable

    env = writer_env(moto_endpoint, tmp_path, rows=2_000, files=3)
    done = subprocess.run([sys.executable, str(WRITER_SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    location = parse_metadata_location(done.stdout)
    assert location.startswith("s3://warehouse/iceberg/") and location.endswith(".metadata.json")
    props = {"s3.endpoint": moto_endpoint, "s3.access-key-id": env["AWS_ACCESS_KEY_ID"]}
    props |= {"s3.secret-access-key": env["AWS_SECRET_ACCESS_KEY"], "s3.region": env["AWS_REGION"]}
    table = StaticTable.from_metadata(location, properties=props)
    ids = sorted(table.scan(selected_fields=("id",)).to_arrow()["id"].to_pylist())
    assert ids == list(range(2_000))
    assert len(list(table.scan().plan_files())) == 3


def test_table_writer_names_missing_settings(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "TABLE_", "WAREHOUSE", "CATALOG_DB"))}
    done = subprocess.run([sys.executable, str(WRITER_SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "missing settings: AWS_ENDPOINT_URL" in done.stderr


def test_metadata_location_parsing() -> None:
    assert parse_metadata_location("noise\nMETADATA_LOC=s3://b/a.json\n") == "s3://b/a.json"
    with pytest.raises(ValueError, match="no METADATA_LOC"):
        parse_metadata_location("wrote 10 rows\n")


def test_trainer_script_ranks_together_see_every_row_once(small_cache, small_table) -> None:
    """e2e_train.py as each TrainJob node runs it (RANK/WORLD_SIZE), against a real local cache."""
    env = {k: v for k, v in os.environ.items() if k != "TRAIN_JOB_NAME"}
    env |= {"DATA_CACHE_ENDPOINT": small_cache.endpoint, "WORLD_SIZE": "2"}
    # Both at once, as the TrainJob's nodes run (each pays its own torch import).
    ranks = [
        subprocess.Popen(
            [sys.executable, str(TRAINER_SCRIPT)],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    logs = ""
    try:
        for proc in ranks:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-3000:]
            logs += out
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()
    results = parse_results(logs)
    assert len(results) == 2
    assert {r.endpoint for r in results} == {small_cache.endpoint}
    assert check_exactly_once(results, small_table.rows, world=2) == []


def _result(rank: int, ids: list[int], world: int = 2) -> RankResult:
    return RankResult(rank, world, len(ids), len(set(ids)), sum(ids), sum(i * i for i in ids))


@pytest.mark.parametrize(
    ("results", "expected"),
    [
        ([_result(0, [0, 1, 2]), _result(1, [3, 4, 5])], []),
        ([_result(0, [0, 1, 2]), _result(1, [3, 4, 4])], ["distinct ids"]),
        ([_result(0, [0, 1, 2]), _result(1, [3, 4])], ["5 rows in all"]),
        ([_result(0, [0, 1, 2, 3, 4, 5])], ["one result per rank"]),
        ([_result(0, [0, 1, 2], world=1), _result(1, [3, 4, 5])], ["WORLD_SIZE=1"]),
        ([_result(0, [0, 1, 2]), _result(1, [2, 4, 6])], ["sum of squared ids"]),  # id sum alone matches
    ],
)
def test_exactly_once_check(results: list[RankResult], expected: list[str]) -> None:
    problems = check_exactly_once(results, rows=6, world=2)
    assert len(problems) >= len(expected)
    for fragment in expected:
        assert any(fragment in p for p in problems), problems


def test_result_lines_are_parsed_from_prefixed_pod_logs() -> None:
    line = "E2E_RESULT rank=1 world=2 rows=5 unique=5 id_sum=10 id_sq_sum=30 endpoint=grpc+tls://s-cache-service:50051"
    log = f"[pod/stream-node-0-0/node] {line}\nother\n"
    assert parse_results(log) == [RankResult(1, 2, 5, 5, 10, 30, "grpc+tls://s-cache-service:50051")]


def test_kustomize_render_is_retargeted_to_the_local_images() -> None:
    from tests.chart.render import build_kustomize

    rendered = build_kustomize("overlays/data-cache")
    assert upstream_image_refs(rendered), "the overlay should name the published images before retargeting"
    retargeted, changed = retarget_images(rendered, {"cache": CACHE_IMAGE, "initializer": INITIALIZER_IMAGE})
    assert changed >= 2
    assert upstream_image_refs(retargeted) == []
    runtime = next(
        o for o in retargeted if o["kind"] == "ClusterTrainingRuntime" and o["metadata"]["name"] == RUNTIME_NAME
    )
    text = yaml.safe_dump(runtime)
    assert INITIALIZER_IMAGE in text and f"value: {CACHE_IMAGE}" in text


def test_helm_values_point_the_runtime_at_the_local_images() -> None:
    from tests.chart.render import render_chart

    rendered = render_chart(helm_values(NS))
    assert upstream_image_refs(rendered) == []
    runtime = next(
        o for o in rendered if o["kind"] == "ClusterTrainingRuntime" and o["metadata"]["name"] == RUNTIME_NAME
    )
    text = yaml.safe_dump(runtime)
    assert INITIALIZER_IMAGE in text and f"value: {CACHE_IMAGE}" in text
    assert any(o["kind"] == "ServiceAccount" and o["metadata"].get("namespace") == NS for o in rendered)


def test_split_for_apply_orders_crds_first_and_runtimes_last() -> None:
    objs = [{"kind": k} for k in ("ClusterTrainingRuntime", "Deployment", "CustomResourceDefinition", "Service")]
    crds, rest, late = split_for_apply(objs)
    assert [o["kind"] for o in crds] == ["CustomResourceDefinition"]
    assert [o["kind"] for o in rest] == ["Deployment", "Service"]
    assert [o["kind"] for o in late] == ["ClusterTrainingRuntime"]


def test_kind_node_image_is_pinned_to_kubernetes_1_31_or_newer() -> None:
    config = yaml.safe_load(KIND_CONFIG.read_text())
    images = {node["image"] for node in config["nodes"]}
    assert len(images) == 1
    m = re.fullmatch(r"kindest/node:v1\.(\d+)\.\d+@sha256:[0-9a-f]{64}", images.pop())
    assert m and int(m.group(1)) >= 31
    assert f"kind {KIND_VERSION}" in KIND_CONFIG.read_text()
    # Each node offers the host's CPUs: the kustomize install's controllers and a cached TrainJob
    # did not fit beside the control plane on one node of a 4-CPU runner.
    assert [node["role"] for node in config["nodes"]] == ["control-plane", "worker", "worker"]


def test_images_script_names_the_images_the_suite_uses() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("IMAGE_REGISTRY", "IMAGE_TAG")}
    script = REPO / "hack" / "e2e-images.sh"
    listed = subprocess.run(["bash", str(script), "list"], env=env, capture_output=True, text=True, timeout=30)
    assert listed.stdout.split() == [CACHE_IMAGE, INITIALIZER_IMAGE, TRAINER_IMAGE]
    wrong = subprocess.run(["bash", str(script), "push"], env=env, capture_output=True, text=True, timeout=30)
    assert wrong.returncode == 2 and "usage" in wrong.stderr


FAKE_KIND = """#!/bin/bash
echo "kind $*" >> "$CALLS"
if [ "$1 $2" = "get nodes" ]; then
  printf '%s\\n' "$4-control-plane" "$4-worker" "$4-worker2"
  exit 0
fi
if [ "$2" = docker-image ]; then
  [ -n "$DIGEST_BUG" ] && { echo "ctr: content digest sha256:0: not found" >&2; exit 1; }
  exit 0
fi
[ "$(cat "${@: -1}")" = "one platform" ] || { echo "not the saved archive" >&2; exit 1; }
"""
FAKE_DOCKER = """#!/bin/bash
echo "docker $*" >> "$CALLS"
[ "$1" = version ] && { case "$*" in *Client.APIVersion*) echo "${API:-1.51}" ;; *) echo arm64 ;; esac; exit 0; }
while [ $# -gt 0 ]; do [ "$1" = --output ] && echo "one platform" > "$2"; shift; done
"""


def test_the_kind_cluster_name_comes_from_kind_cluster_name() -> None:
    assert cluster_name({}) == cluster_name({"KIND_CLUSTER_NAME": ""}) == DEFAULT_CLUSTER_NAME
    assert cluster_name({"KIND_CLUSTER_NAME": "ci-1234.e2e"}) == "ci-1234.e2e"
    for bad in ("CI_Run", "e2e cluster", "e2e/1"):
        with pytest.raises(ValueError, match="not a kind cluster name: use lower-case letters"):
            cluster_name({"KIND_CLUSTER_NAME": bad})


def _load_images(tmp_path: Path, cluster: str, digest_bug: bool, api: str = "1.51") -> list[str]:
    """Runs `hack/e2e-images.sh load` against fake kind and docker; the commands they got."""
    for name, text in (("kind", FAKE_KIND), ("docker", FAKE_DOCKER)):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    calls = tmp_path / "calls"
    env = {**os.environ, "KIND": str(tmp_path / "kind"), "DOCKER": str(tmp_path / "docker"), "CALLS": str(calls),
           "TMPDIR": str(tmp_path), "DIGEST_BUG": "1" if digest_bug else "", "KIND_CLUSTER_NAME": cluster,
           "API": api}  # fmt: skip
    done = subprocess.run(["bash", str(REPO / "hack" / "e2e-images.sh"), "load"], env=env, capture_output=True,
                          text=True, timeout=30)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return calls.read_text().splitlines()


@pytest.mark.parametrize("cluster", [DEFAULT_CLUSTER_NAME, "e2e-second-run"])
def test_images_load_onto_the_named_clusters_workers(tmp_path, cluster: str) -> None:
    loaded = [line for line in _load_images(tmp_path, cluster, False) if line.startswith("kind load")]
    # Onto the two workers only: the control plane is tainted.
    workers = f"--nodes {cluster}-worker,{cluster}-worker2"
    assert loaded == [f"kind load docker-image --name {cluster} {workers} {i}"
                      for i in (CACHE_IMAGE, INITIALIZER_IMAGE, TRAINER_IMAGE)]  # fmt: skip


def test_images_load_through_a_single_platform_archive_where_kind_load_fails(tmp_path) -> None:
    """Docker 29's containerd image store breaks `kind load docker-image` (kubernetes-sigs/kind#3795)."""
    lines = _load_images(tmp_path, DEFAULT_CLUSTER_NAME, True)
    loaded = [line for line in lines if line.startswith("kind load")]
    saves = [line for line in lines if line.startswith("docker image save")]
    assert [s.split()[-1] for s in saves] == [CACHE_IMAGE, INITIALIZER_IMAGE, TRAINER_IMAGE]
    assert all("--platform linux/arm64" in s for s in saves)
    assert [line.split()[1:3] for line in loaded] == [["load", "docker-image"], ["load", "image-archive"]] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calls", "docker", "kind"]  # archives removed


def test_an_engine_older_than_docker_28_saves_without_the_platform_flag(tmp_path) -> None:
    """`image save --platform` came with Docker 28 (API 1.48): an older engine refused the flag."""
    saves = [line for line in _load_images(tmp_path, DEFAULT_CLUSTER_NAME, True, api="1.47") if " save " in line]
    assert len(saves) == 3 and not any("--platform" in line for line in saves)


@pytest.mark.parametrize("builder_keeps_images", [False, True])
def test_an_image_the_builder_kept_to_itself_fails_the_build_naming_the_builder(tmp_path, builder_keeps_images) -> None:
    """A docker-container buildx builder does not load what it builds: the trainer image's FROM
    then went to a registry that does not exist, and `kind load` found nothing to load."""
    docker = tmp_path / "docker"
    inspect = "exit 1" if builder_keeps_images else "exit 0"
    docker.write_text(
        f'#!/bin/bash\necho "docker $*" >> "$CALLS"\n[ "$1 $2" = "image inspect" ] && {inspect}\nexit 0\n'
    )
    docker.chmod(0o755)
    calls = tmp_path / "calls"
    env = {**os.environ, "DOCKER": str(docker), "CALLS": str(calls)}
    done = subprocess.run(["bash", str(REPO / "hack" / "e2e-images.sh"), "build"], env=env, capture_output=True,
                          text=True, timeout=30)  # fmt: skip
    builds = [line.split()[3] for line in calls.read_text().splitlines() if line.startswith("docker build")]
    if not builder_keeps_images:
        assert done.returncode == 0, done.stderr
        assert builds == [CACHE_IMAGE, INITIALIZER_IMAGE, TRAINER_IMAGE]
        return
    assert done.returncode == 1
    assert f"error: {CACHE_IMAGE} was built but is not in Docker's local image store" in done.stderr
    assert "docker buildx use default" in done.stderr
    assert builds == [CACHE_IMAGE]  # stopped before the trainer image tried to pull it


def test_workflows_call_the_makefile_and_pin_their_tools() -> None:
    ci = yaml.safe_load((WORKFLOWS / "ci.yaml").read_text())
    e2e = yaml.safe_load((WORKFLOWS / "e2e.yaml").read_text())
    ci_runs = " ".join(s.get("run", "") for job in ci["jobs"].values() for s in job["steps"])
    e2e_runs = " ".join(s.get("run", "") for job in e2e["jobs"].values() for s in job["steps"])
    for target in ("make setup", "make lint", "make test"):
        assert target in ci_runs
    assert "make test-e2e" in e2e_runs and "make setup" in e2e_runs
    assert e2e["env"]["KIND_VERSION"] == KIND_VERSION
    assert re.fullmatch(r"v3\.\d+\.\d+", e2e["env"]["HELM_VERSION"])
    assert e2e["env"]["E2E_REQUIRE"] == "1"
    uses = [s["uses"] for wf in (ci, e2e) for job in wf["jobs"].values() for s in job["steps"] if "uses" in s]
    assert all(re.search(r"@v\d+(\.\d+)*$", u) for u in uses), uses
    # The dumps of a run hung until the job's limit, which GitHub cancels rather than fails.
    uploads = [s for job in e2e["jobs"].values() for s in job["steps"] if "upload-artifact" in s.get("uses", "")]
    assert len(uploads) == 1 and "cancelled()" in uploads[0]["if"] and "failure()" in uploads[0]["if"]
    # And the suite's step stops before the job's limit, leaving the upload time to run.
    (job,) = e2e["jobs"].values()
    (suite,) = [s for s in job["steps"] if s.get("run") == "make test-e2e"]
    assert suite["timeout-minutes"] + 5 <= job["timeout-minutes"]


@pytest.mark.parametrize(
    ("markexpr", "environ", "runs"),
    [
        ("", {}, False),  # plain `make test`, also where Docker answers
        ("not slow", {}, False),  # make test-fast
        ("not e2e", {}, False),
        ("e2e", {}, True),  # make test-e2e
        ("e2e and not slow", {}, True),
        ("", {"E2E": "1"}, True),
        ("", {"E2E_REQUIRE": "1"}, True),
        ("", {"E2E": "0"}, False),
    ],
)
def test_the_kind_suite_runs_only_when_asked_for(markexpr: str, environ: dict, runs: bool) -> None:
    from tests.e2e.conftest import opted_in

    assert opted_in(markexpr, environ) is runs


@pytest.mark.parametrize(
    ("system", "machine", "expected"),
    [
        ("Linux", "x86_64", ("linux", "amd64")),
        ("Linux", "aarch64", ("linux", "arm64")),
        ("Darwin", "arm64", ("darwin", "arm64")),
        ("Windows", "AMD64", None),
        ("Linux", "riscv64", None),
    ],
)
def test_kind_and_kubectl_are_downloaded_for_the_machine_they_run_on(system, machine, expected) -> None:
    from tests.e2e.conftest import download_platform

    assert download_platform(system, machine) == expected


def test_a_command_past_its_timeout_is_stopped_with_everything_it_started(tmp_path) -> None:
    """subprocess.run's timeout killed only the child: a script's `docker build` ran on behind."""
    import time

    from tests.e2e.e2e_kube import CommandError, run

    pid_file = tmp_path / "grandchild"
    with pytest.raises(CommandError, match="did not finish within 1s"):
        run(["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], timeout=1)
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{grandchild}").exists() and "zombie" not in _proc_state(grandchild):
        assert time.monotonic() < deadline, "the command's own child outlived its timeout"
        time.sleep(0.05)
    assert run(["bash", "-c", "cat; echo done"], timeout=10, input="in ") == "in done\n"


def test_a_command_interrupted_otherwise_is_stopped_with_everything_it_started(tmp_path) -> None:
    """pytest-timeout's backstop (or Ctrl-C) raises inside communicate(): the with block then
    waited for the child with no limit, and its group outlived the run."""
    import signal
    import time

    from tests.e2e.e2e_kube import run

    class Backstop(Exception):
        pass

    def fire(signum, frame):
        raise Backstop

    pid_file = tmp_path / "grandchild"
    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    started = time.monotonic()
    try:
        with pytest.raises(Backstop):
            run(["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], timeout=120)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - started < 30  # not the child's 60 s
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{grandchild}").exists() and "zombie" not in _proc_state(grandchild):
        assert time.monotonic() < deadline, "the command's own child outlived the interruption"
        time.sleep(0.05)


def test_the_table_writer_fails_by_its_own_deadline_before_the_suite_stops_waiting() -> None:
    """Equal deadlines made a hung writer a bare wait timeout, not the Job's DeadlineExceeded."""
    from tests.e2e.conftest import TABLE_WRITE_TIMEOUT
    from tests.e2e.e2e_objects import WRITER_DEADLINE_SECONDS

    (job,) = [o for o in table_writer_objects(NS) if o["kind"] == "Job"]
    assert job["spec"]["activeDeadlineSeconds"] == WRITER_DEADLINE_SECONDS <= TABLE_WRITE_TIMEOUT - 60


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "zombie"  # gone meanwhile


def _fake_kind(tmp_path: Path, script: str) -> tuple[Path, Path]:
    """A `kind` that logs each call and answers as ``script`` (bash, given "$@") says."""
    calls = tmp_path / "calls"
    kind = tmp_path / "kind"
    kind.write_text(f'#!/bin/bash\necho "$*" >> {calls}\n{script}\n')
    kind.chmod(0o755)
    return kind, calls


def test_a_cluster_creation_that_fails_deletes_what_it_left(tmp_path, monkeypatch) -> None:
    from tests.e2e.e2e_kube import CommandError, E2EKindCluster

    monkeypatch.chdir(tmp_path)  # pytest-kind makes ./.pytest-kind/<name>: not in the checkout

    kind, calls = _fake_kind(tmp_path, 'case "$1 $2" in "get clusters") ;; "create cluster") exit 1 ;; esac')
    cluster = E2EKindCluster("e2e", kubeconfig=tmp_path / "kubeconfig", kind_path=kind, kubectl_path=kind)
    with pytest.raises(CommandError, match="create cluster"):
        cluster.create_bounded(tmp_path / "kind-config.yaml", 30, nodes=3)
    assert calls.read_text().splitlines()[-1] == "delete cluster --name=e2e"


@pytest.mark.parametrize(("nodes_found", "recreated"), [(3, False), (1, True)])
def test_an_existing_cluster_is_reused_only_whole(tmp_path, monkeypatch, nodes_found: int, recreated: bool) -> None:
    """A leftover of a creation that died half-way was reused, failing far from its cause."""
    from tests.e2e.e2e_kube import E2EKindCluster

    monkeypatch.chdir(tmp_path)  # pytest-kind makes ./.pytest-kind/<name>: not in the checkout

    node_names = " ".join(f"e2e-node-{i}" for i in range(nodes_found))
    kind, calls = _fake_kind(
        tmp_path,
        f"""case "$1 $2" in
  "get clusters") echo e2e ;;
  "get nodes") printf '%s\\n' {node_names} ;;
  "get kubeconfig") echo "apiVersion: v1" ;;
esac""",
    )
    cluster = E2EKindCluster("e2e", kubeconfig=tmp_path / "kubeconfig", kind_path=kind, kubectl_path=kind)
    cluster.create_bounded(tmp_path / "kind-config.yaml", 30, nodes=3)
    made = [line.split()[:2] for line in calls.read_text().splitlines()]
    assert (["delete", "cluster"] in made, ["create", "cluster"] in made) == (recreated, recreated)
    if not recreated:
        assert (tmp_path / "kubeconfig").read_text() == "apiVersion: v1\n"


@pytest.mark.parametrize("published", ["right", "wrong", "empty"])
def test_a_downloaded_tool_is_checked_against_its_published_sha256(tmp_path, published) -> None:
    """kind and kubectl fetched for a local run are checked as the e2e workflow checks them."""
    import hashlib

    from tests.e2e.conftest import _download

    binary = tmp_path / "kind-linux-amd64"
    binary.write_bytes(b"\x7fELF not really")
    digest = {"right": hashlib.sha256(binary.read_bytes()).hexdigest(), "wrong": "0" * 64, "empty": ""}[published]
    (tmp_path / "kind-linux-amd64.sha256sum").write_text(f"{digest}  kind-linux-amd64\n" if digest else "")
    dest = tmp_path / "kind"
    url = binary.as_uri()
    if published == "right":
        _download(url, dest, f"{url}.sha256sum")
        assert dest.read_bytes() == binary.read_bytes() and os.access(dest, os.X_OK)
        return
    with pytest.raises(RuntimeError, match="has SHA-256 [0-9a-f]{64}, not the"):
        _download(url, dest, f"{url}.sha256sum")
    assert not dest.exists()
