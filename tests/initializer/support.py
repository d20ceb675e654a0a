"""Helpers the initializer tests share: TrainJobs in the fake API and the initializer's env."""

from __future__ import annotations

from .cluster_sim import CacheSim
from .fake_k8s import FakeKube

NAMESPACE = "team-a"
# Generous: the simulated cache is ready in well under a second; only timeout tests lower it.
READY_TIMEOUT = "30"
TABLE_ENV = {
    "STORAGE_URI": "cache://sales/orders",
    "METADATA_LOC": "s3://warehouse/sales/orders/metadata/00001.metadata.json",
}

# What the Kubeflow SDK always sets (no defaults for these), outside a pod.
MINIMAL = {
    "STORAGE_URI": "cache://sales/orders",
    "METADATA_LOC": "s3://warehouse/orders/metadata/1.metadata.json",
    "TRAIN_JOB_NAME": "job-a",
    "CACHE_IMAGE": "ghcr.io/example/data-cache:0.1.0",
    "NAMESPACE": "team-a",
}


def add_train_job(fake: FakeKube, name: str, namespace: str = NAMESPACE, dataset: dict | None = None) -> dict:
    """A TrainJob as the Trainer's API holds it (the fake gives it a uid); ``dataset``: its
    ``spec.initializer.dataset``."""
    spec: dict = {"runtimeRef": {"name": "torch-distributed-with-cache"}}
    if dataset is not None:
        spec["initializer"] = {"dataset": dataset}
    return fake.put(
        "trainjobs",
        {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
         "metadata": {"name": name, "namespace": namespace}, "spec": spec},
    )  # fmt: skip


def initializer_env(sim: CacheSim | None, train_job: str = "job-a", **overrides: str) -> dict[str, str]:
    """The env the SDK and the runtime give the initializer, pointed at the simulated head."""
    env = {
        **TABLE_ENV,
        "TRAIN_JOB_NAME": train_job,
        "CACHE_IMAGE": "ghcr.io/example/data-cache:0.1.0",
        "CLUSTER_SIZE": "3",
        "NAMESPACE": NAMESPACE,
        "CACHE_READY_TIMEOUT_SECONDS": READY_TIMEOUT,
        "CACHE_STATUS_POLL_SECONDS": "0.05",
        "CACHE_UNSCHEDULABLE_GRACE_SECONDS": "0.3",
        "CACHE_START_ERROR_GRACE_SECONDS": "0.3",
        "CACHE_HEALTH_PORT": str(sim.health_port if sim else 8080),
    }
    return {**env, **overrides}
