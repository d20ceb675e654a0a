"""S3 credentials for the cache pods: the TrainJob's dataset secretRef reaches them as envFrom,
and credentials the initializer sees but cannot pass on are said in a warning."""

from __future__ import annotations

import logging

import pytest

from .support import NAMESPACE, add_train_job, initializer_env


def _cache_containers(fake) -> list[dict]:
    template = fake.get("leaderworkersets", NAMESPACE, "job-a-cache")["spec"]["leaderWorkerTemplate"]
    return [template[t]["spec"]["containers"][0] for t in ("leaderTemplate", "workerTemplate")]


def test_the_train_jobs_dataset_secret_ref_reaches_the_cache_pods(fake, make_sim, run_initializer, caplog):
    """The Trainer gives secretRef to this container as envFrom (the Kubeflow way to hand over a
    dataset's credentials); the cache pods, which read the store, got nothing of it, and their
    access-denied message said no credentials were set."""
    add_train_job(fake, "job-a", dataset={"storageUri": "cache://sales/orders", "secretRef": {"name": "s3-creds"}})
    sim = make_sim("healthy")
    # What the kubelet makes of that envFrom: the Secret's keys in this container's env.
    env = initializer_env(sim, AWS_ACCESS_KEY_ID="AKIAEXAMPLE", AWS_SECRET_ACCESS_KEY="wJalrEXAMPLE")

    assert run_initializer({**env, "CACHE_ENV_FROM_SECRET": "other"}) == (0, "")

    for container in _cache_containers(fake):
        assert container["envFrom"] == [{"secretRef": {"name": "other"}}, {"secretRef": {"name": "s3-creds"}}]
        assert "AWS_SECRET_ACCESS_KEY" not in {e["name"] for e in container["env"]}  # never a value in a spec
    assert "the TrainJob's dataset secretRef" in caplog.text
    assert "wJalrEXAMPLE" not in caplog.text
    assert "never go into a pod spec" not in caplog.text


def test_credentials_with_no_way_to_the_cache_pods_are_warned_of(fake, make_sim, run_initializer, caplog):
    add_train_job(fake, "job-a")
    sim = make_sim("healthy")
    env = initializer_env(sim, AWS_ACCESS_KEY_ID="AKIAEXAMPLE", AWS_SECRET_ACCESS_KEY="wJalrEXAMPLE")

    assert run_initializer(env) == (0, "")

    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY set here never go into a pod spec")
    assert "spec.initializer.dataset.secretRef" in warning and "CACHE_ENV_FROM_SECRET" in warning
    assert "IAM_ROLE" in warning and "wJalrEXAMPLE" not in caplog.text
    assert "envFrom" not in _cache_containers(fake)[0]


@pytest.mark.parametrize(
    "given", [{"CACHE_ENV_FROM_SECRET": "s3-creds"}, {"IAM_ROLE": "arn:aws:iam::123456789012:role/r"}]
)
def test_credentials_the_cache_pods_get_another_way_are_not_warned_of(fake, make_sim, run_initializer, caplog, given):
    add_train_job(fake, "job-a")
    sim = make_sim("healthy")
    assert run_initializer(initializer_env(sim, AWS_ACCESS_KEY_ID="AKIAEXAMPLE", **given)) == (0, "")
    assert "never go into a pod spec" not in caplog.text


def test_a_secret_ref_that_is_no_secret_name_is_a_setting_to_fix(fake, run_initializer):
    add_train_job(fake, "job-a", dataset={"storageUri": "cache://sales/orders", "secretRef": {"name": "S3 Creds"}})
    code, error = run_initializer(initializer_env(None))
    assert code == 2
    assert "spec.initializer.dataset.secretRef.name should be a Secret name" in error and "'S3 Creds'" in error
    assert fake.items("leaderworkersets", NAMESPACE) == []
