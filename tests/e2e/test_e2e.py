"""The distribution on a kind cluster: TrainJobs on `torch-distributed-with-cache` against MinIO.

Each test runs once per install method (Helm chart, kustomize overlay). Skipped, with the reason,
where no Docker engine answers; `make test-e2e` runs it. See docs/e2e.md.
"""

from __future__ import annotations

import re

import pytest

from kubeflow_cache_initializer.builders import key_secret_of
from tests.e2e.e2e_kube import Kube, wait_for, wait_trainjob
from tests.e2e.e2e_objects import ACCESS_PROBE, BUCKET, TABLE, check_exactly_once, parse_results, train_job

# The session's first test also pays for the cluster, the image builds and the install; every
# step has its own deadline and a failure dump, this is the backstop for a hang between them. It
# is above the sum of the first test's step deadlines (9,000-10,000 s, counting the 120 s default
# of each kubectl call), so that a step's deadline, with its dump, always comes first (e2e.yaml's
# job limit is above it in turn). When it fires, e2e_kube.run kills the command under way.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(10200)]

TRAINJOB_TIMEOUT = 900
FAILURE_TIMEOUT = 900
GONE_TIMEOUT = 180
TRAINER_NODES = 2
HEAD_ADDRESS = "127.0.0.1:50051"  # the Flight port, from inside the head's pod


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
    # The trainers found the cache by the runtime's settings alone: over TLS where the namespace
    # has the TLS Secret, checking the certificate against its name, not the Service's address.
    scheme = "grpc+tls" if distribution.tls else "grpc"
    want = f"{scheme}://{name}-cache-service:50051"
    assert {r.endpoint for r in results} == {want}, [r.endpoint for r in results]

    uid = job["metadata"]["uid"]
    for kind, obj_name in owned_objects(name):
        obj = kube.get(kind, obj_name, ns)
        assert obj is not None, f"{kind} {obj_name} was not created"
        owners = [(r["kind"], r["uid"]) for r in obj["metadata"].get("ownerReferences", [])]
        assert ("TrainJob", uid) in owners, f"{kind} {obj_name} owners: {owners}"
    # The cache's key: in a Secret of its own, owned by the LeaderWorkerSet, not in its pod spec.
    cache = kube.get("leaderworkerset", f"{name}-cache", ns)
    key_secret = key_secret_of(cache)
    assert key_secret is not None, "the cache pods do not read their key from a Secret"
    secret_owners = [r["uid"] for r in kube.get("secret", key_secret, ns)["metadata"]["ownerReferences"]]
    assert secret_owners == [cache["metadata"]["uid"]], secret_owners
    gone = [*owned_objects(name), ("secret", key_secret)]
    # The namespace's reader token (reader_token_secret): the trainers read with it, as they
    # finished; the cache refuses a reader without it. With the TLS Secret, the head serves TLS
    # only.
    head = kube.items("pods", ns, f"app.kubernetes.io/instance={name}-cache,app.kubernetes.io/component=head")
    assert len(head) == 1, f"expected one head pod, got {[p['metadata']['name'] for p in head]}"
    probe = kube(
        "exec", head[0]["metadata"]["name"], "-n", ns, "-c", "cache", "--", "python", "-c", ACCESS_PROBE, HEAD_ADDRESS
    )
    assert "without token: refused" in probe and "with token: 1 table(s)" in probe, probe
    if distribution.tls:
        assert "transport: tls" in probe and "plaintext: refused" in probe, probe
    else:
        assert "transport: plaintext" in probe, probe

    kube("delete", "trainjob", name, "-n", ns, "--wait=false")
    wait_for(
        f"the cache objects of {name} garbage-collected",
        lambda: all(kube.get(kind, obj_name, ns) is None for kind, obj_name in gone),
        GONE_TIMEOUT,
    )


def test_wrong_metadata_location_fails_and_says_why(kube, distribution, metadata_loc, trainjobs) -> None:
    """Next to a real table in a reachable MinIO (metadata_loc), so the only thing wrong is the
    file: the initializer must fail with the cache's own reason, not any failure."""
    ns, name = distribution.namespace, "bad-metadata"
    missing = f"s3://{BUCKET}/iceberg/{TABLE.schema}/missing/metadata/00000-missing.metadata.json"
    trainjobs.submit(train_job(name, ns, missing, ready_timeout_s=180))
    wait_trainjob(kube, ns, name, "Failed", FAILURE_TIMEOUT)

    log = kube.pod_logs(ns, node_selector(name, "dataset-initializer"))
    # The initializer's first line names the location too; the reason is on its error line(s),
    # relayed from the head (a failed load) or from a cache pod's termination message.
    reasons = [line for line in log.splitlines() if " ERROR " in line]
    assert any(
        f"METADATA_LOC {missing!r} does not exist" in line and re.search(r"reports a failed load|exited with", line)
        for line in reasons
    ), log[-4000:]
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


def test_turning_lws_off_is_refused_while_the_release_owns_its_crd(kube, distribution) -> None:
    """Uninstalling the LWS subchart deletes its CRD, and with it every LeaderWorkerSet in the
    cluster: the chart looks the CRD up and refuses, naming the value that allows it."""
    from tests.e2e.conftest import CHART, HELM_RELEASE, SYSTEM_NAMESPACE
    from tests.e2e.e2e_kube import CommandError

    if distribution.method != "helm":
        pytest.skip("the guard is the Helm chart's: kustomize prunes nothing")
    argv = ["upgrade", HELM_RELEASE, str(CHART), "-n", SYSTEM_NAMESPACE, "--reuse-values"]
    with pytest.raises(CommandError, match=r"dataCache\.lws\.allowCrdRemoval=true"):
        kube.helm(*argv, "--set", "dataCache.enabled=false", timeout=300)
    assert kube.get("crd", "leaderworkersets.leaderworkerset.x-k8s.io") is not None
