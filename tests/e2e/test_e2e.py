"""The distribution on a kind cluster: TrainJobs on `torch-distributed-with-cache` against MinIO.

Each test runs once per install method (Helm chart, kustomize overlay). Skipped, with the reason,
where no Docker engine answers; `make test-e2e` runs it. See docs/e2e.md.
"""

from __future__ import annotations

import re

import pytest

from tests.e2e.e2e_kube import Kube, wait_for, wait_trainjob
from tests.e2e.e2e_objects import BUCKET, TABLE, check_exactly_once, parse_results, train_job

# The session's first test also pays for the cluster, the image builds and the install; every
# step below has its own deadline, this is the backstop.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(5400)]

TRAINJOB_TIMEOUT = 900
FAILURE_TIMEOUT = 900
GONE_TIMEOUT = 180
TRAINER_NODES = 2


def node_selector(job: str, step: str) -> str:
    return f"jobset.sigs.k8s.io/jobset-name={job},jobset.sigs.k8s.io/replicatedjob-name={step}"


def trainer_results(kube: Kube, namespace: str, job: str):
    log = kube.pod_logs(namespace, node_selector(job, "node"))
    return parse_results(log), log


def owned_objects(job: str) -> list[tuple[str, str]]:
    return [
        ("leaderworkerset", f"{job}-cache"),
        ("service", f"{job}-cache-service"),
        ("serviceaccount", f"{job}-cache"),
    ]


def test_trainjob_streams_every_row_exactly_once(kube, distribution, metadata_loc, trainjobs) -> None:
    ns, name = distribution.namespace, "stream"
    trainjobs.submit(train_job(name, ns, metadata_loc, trainer_nodes=TRAINER_NODES))
    job = wait_trainjob(kube, ns, name, "Complete", TRAINJOB_TIMEOUT)

    results, log = trainer_results(kube, ns, name)
    assert check_exactly_once(results, TABLE.rows, TRAINER_NODES) == [], log[-4000:]

    uid = job["metadata"]["uid"]
    for kind, obj_name in owned_objects(name):
        obj = kube.get(kind, obj_name, ns)
        assert obj is not None, f"{kind} {obj_name} was not created"
        owners = [(r["kind"], r["uid"]) for r in obj["metadata"].get("ownerReferences", [])]
        assert ("TrainJob", uid) in owners, f"{kind} {obj_name} owners: {owners}"

    kube("delete", "trainjob", name, "-n", ns, "--wait=false")
    wait_for(
        f"the cache objects of {name} garbage-collected",
        lambda: all(kube.get(kind, obj_name, ns) is None for kind, obj_name in owned_objects(name)),
        GONE_TIMEOUT,
    )


def test_wrong_metadata_location_fails_and_says_why(kube, distribution, trainjobs) -> None:
    ns, name = distribution.namespace, "bad-metadata"
    missing = f"s3://{BUCKET}/iceberg/{TABLE.schema}/missing/metadata/00000-missing.metadata.json"
    trainjobs.submit(train_job(name, ns, missing, ready_timeout_s=180))
    wait_trainjob(kube, ns, name, "Failed", FAILURE_TIMEOUT)

    log = kube.pod_logs(ns, node_selector(name, "dataset-initializer"))
    assert "00000-missing.metadata.json" in log, log[-4000:]
    assert re.search(r"(?i)not found|no such|does not exist|nosuchkey|failed", log), log[-4000:]
    assert kube.items("pods", ns, node_selector(name, "node")) == [], "trainers started after a failed initializer"


def test_two_trainjobs_share_one_cache(kube, distribution, metadata_loc, trainjobs) -> None:
    ns, names = distribution.namespace, ["share-a", "share-b"]
    for name in names:
        trainjobs.submit(train_job(name, ns, metadata_loc, trainer_nodes=TRAINER_NODES, shared=True))
    for name in names:
        wait_trainjob(kube, ns, name, "Complete", TRAINJOB_TIMEOUT)
        results, log = trainer_results(kube, ns, name)
        assert check_exactly_once(results, TABLE.rows, TRAINER_NODES) == [], f"{name}:\n{log[-4000:]}"
        assert kube.get("service", f"{name}-cache-service", ns) is not None, f"no per-job Service for {name}"

    caches = sorted(o["metadata"]["name"] for o in kube.items("leaderworkersets", ns))
    shared = [c for c in caches if c.startswith("data-cache-")]
    assert len(shared) == 1, f"expected one shared cache, found LeaderWorkerSets {caches}"
    assert not {f"{n}-cache" for n in names} & set(caches), f"a per-job cache was made: {caches}"
