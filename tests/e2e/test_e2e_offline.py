"""What the kind suite relies on, checked without a cluster (these run under plain `make test`).

Every object it applies is validated against the pinned schemas; the table writer runs against a
local S3 (moto); the trainer script runs against a local cache; the image retargeting is checked
on the real chart and overlay renders; the tool pins agree across config, code and workflow.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e.e2e_objects import (
    CACHE_IMAGE,
    INITIALIZER_IMAGE,
    KIND_CONFIG,
    KIND_VERSION,
    REPO,
    RUNTIME_NAME,
    TABLE,
    TRAINER_IMAGE,
    WRITER_SCRIPT,
    RankResult,
    check_exactly_once,
    helm_values,
    minio_objects,
    parse_metadata_location,
    parse_results,
    retarget_images,
    split_for_apply,
    table_writer_objects,
    train_job,
    upstream_image_refs,
)
from tests.schemas import ObjectInvalid, validate_objects

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
    ]


def test_every_object_the_suite_applies_passes_strict_validation() -> None:
    validate_objects(applied_objects())


@pytest.mark.parametrize(
    ("index", "path", "value"),
    [
        (5, ("spec", "trainer", "numNode"), 2),  # TrainJob: a misspelt field
        (5, ("spec", "initializer", "dataset", "storageURI"), "cache://e2e/events"),
        (1, ("spec", "template", "spec", "contianers"), []),  # MinIO Deployment
        (4, ("spec", "backoffLimt"), 2),  # writer Job
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
    assert {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"} <= set(names)
    assert names["AWS_ENDPOINT_URL"] == f"http://minio.{NS}.svc.cluster.local:9000"
    assert "DATA_CACHE_SHARED" not in names
    shared = dict(
        (e["name"], e["value"]) for e in train_job("a", NS, META, shared=True)["spec"]["initializer"]["dataset"]["env"]
    )
    assert shared["DATA_CACHE_SHARED"] == "true"
    assert job["spec"]["runtimeRef"]["name"] == RUNTIME_NAME
    assert job["spec"]["trainer"]["image"] == TRAINER_IMAGE
    assert job["spec"]["trainer"]["numNodes"] == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def moto_endpoint():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port(), verbose=False)
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
    logs = ""
    for rank in (0, 1):
        done = subprocess.run(
            [sys.executable, str(TRAINER_SCRIPT)],
            env={**env, "RANK": str(rank)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        logs += done.stdout
    results = parse_results(logs)
    assert len(results) == 2
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
    log = "[pod/stream-node-0-0/node] E2E_RESULT rank=1 world=2 rows=5 unique=5 id_sum=10 id_sq_sum=30\nother\n"
    assert parse_results(log) == [RankResult(1, 2, 5, 5, 10, 30)]


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


def test_images_script_names_the_images_the_suite_uses() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("IMAGE_REGISTRY", "IMAGE_TAG")}
    script = REPO / "hack" / "e2e-images.sh"
    listed = subprocess.run(["bash", str(script), "list"], env=env, capture_output=True, text=True, timeout=30)
    assert listed.stdout.split() == [CACHE_IMAGE, INITIALIZER_IMAGE, TRAINER_IMAGE]
    wrong = subprocess.run(["bash", str(script), "push"], env=env, capture_output=True, text=True, timeout=30)
    assert wrong.returncode == 2 and "usage" in wrong.stderr


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
