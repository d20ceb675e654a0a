"""The fake API server keeps the semantics the initializer relies on (so passing tests mean something)."""

from __future__ import annotations

import pytest

from kubeflow_cache_initializer.errors import KubeApiError
from kubeflow_cache_initializer.kube import SERVICES, TRAINJOBS, Kube

from .support import NAMESPACE, add_train_job

SERVICE = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {"name": "svc", "namespace": NAMESPACE},
    "spec": {"selector": {"a": "b"}, "ports": [{"port": 80}]},
}


@pytest.fixture
def kube(api_client) -> Kube:
    return Kube(api_client)


def test_create_twice_is_409_already_exists_and_get_of_nothing_is_404(kube):
    created = kube.create(SERVICES, NAMESPACE, SERVICE)
    with pytest.raises(KubeApiError) as exists:
        kube.create(SERVICES, NAMESPACE, SERVICE)
    with pytest.raises(KubeApiError) as missing:
        kube.get(SERVICES, NAMESPACE, "other")

    assert created["metadata"]["uid"] and created["spec"]["clusterIP"]
    assert exists.value.already_exists and not exists.value.conflict
    assert missing.value.not_found


def test_a_merge_patch_with_a_stale_resource_version_is_409_conflict(fake, kube):
    fake.allowed = None  # the fake's semantics, not the initializer's Role (which may not patch Services)
    created = kube.create(SERVICES, NAMESPACE, SERVICE)
    kube.patch(SERVICES, NAMESPACE, "svc", {"metadata": {"labels": {"x": "1"}}})
    stale = {"metadata": {"resourceVersion": created["metadata"]["resourceVersion"], "labels": {"x": "2"}}}

    with pytest.raises(KubeApiError) as conflict:
        kube.patch(SERVICES, NAMESPACE, "svc", stale)

    assert conflict.value.conflict
    assert kube.get(SERVICES, NAMESPACE, "svc")["metadata"]["labels"] == {"x": "1"}


def test_invalid_bodies_and_two_controllers_are_422(fake, kube):
    bad_port = {**SERVICE, "spec": {"ports": [{"port": "eighty"}]}}
    ref = {"apiVersion": "v1", "kind": "TrainJob", "name": "a", "controller": True}
    two_controllers = {**SERVICE, "metadata": {**SERVICE["metadata"], "ownerReferences": [
        {**ref, "uid": "1"}, {**ref, "uid": "2"}]}}  # fmt: skip

    for body in (bad_port, two_controllers):
        with pytest.raises(KubeApiError) as invalid:
            kube.create(SERVICES, NAMESPACE, body)
        assert invalid.value.status == 422
    assert any("Only one reference can have Controller set to true" in r for r in fake.rejected)


def test_a_watch_from_a_compacted_version_is_410_gone(fake, kube):
    fake.allowed = None
    job = add_train_job(fake, "job-a")
    add_train_job(fake, "job-b")
    fake.compact()

    with kube.watch(TRAINJOBS, NAMESPACE, job["metadata"]["resourceVersion"], 5) as stream:
        events = list(stream)

    assert [(kind, obj["code"]) for kind, obj in events] == [("ERROR", 410)]


def test_a_watch_streams_changes_after_its_version_only(fake, kube):
    fake.allowed = None
    first = add_train_job(fake, "job-a")
    add_train_job(fake, "job-b")
    fake.delete("trainjobs", NAMESPACE, "job-a")

    with kube.watch(TRAINJOBS, NAMESPACE, first["metadata"]["resourceVersion"], 1) as stream:
        events = [(kind, obj["metadata"]["name"]) for kind, obj in stream]

    assert events == [("ADDED", "job-b"), ("DELETED", "job-a")]


def test_calls_outside_the_allowed_set_are_403(fake, kube):
    fake.allowed = {("", "services", "get")}
    with pytest.raises(KubeApiError) as forbidden:
        kube.create(SERVICES, NAMESPACE, SERVICE)
    assert forbidden.value.status == 403
