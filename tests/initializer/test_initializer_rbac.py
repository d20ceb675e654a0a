"""The calls the initializer makes are exactly `REQUIRED_PERMISSIONS`, the list its Role is checked against.

Every scenario here runs with the fake answering 403 to anything outside the list, so an
unlisted call fails its test; this test drives every code path that makes a call (create,
adopt and restore, join a shared cache, re-list after 410 Gone, delete a hopeless cache) and
checks that nothing in the list is unused. The chart's and the kustomize manifests' roles are
checked against the same list in tests/chart/test_initializer_rbac.py.
"""

from __future__ import annotations

from kubeflow_cache_initializer.rbac import ADMISSION_PERMISSIONS, REQUIRED_PERMISSIONS

from .support import NAMESPACE, add_train_job, initializer_env


def test_the_initializer_calls_exactly_the_required_permissions(fake, make_sim, run_initializer):
    add_train_job(fake, "job-a")
    add_train_job(fake, "job-b")
    add_train_job(fake, "job-c")
    sim = make_sim("compaction")
    env = initializer_env(sim, "job-a")
    assert run_initializer(env)[0] == 0  # create, wait, re-list after 410
    for plural, name in (("services", "job-a-cache-service"), ("serviceaccounts", "job-a-cache")):
        fake.update(plural, NAMESPACE, name, lambda obj: obj["metadata"]["labels"].clear())
    assert run_initializer(env)[0] == 0  # adopt and restore by patch
    shared = {"DATA_CACHE_SHARED": "true"}
    sim.scenario = "healthy"
    assert run_initializer(initializer_env(sim, "job-b", **shared))[0] == 0
    assert run_initializer(initializer_env(sim, "job-c", **shared))[0] == 0  # join: patch owners
    fake.delete("trainjobs", NAMESPACE, "job-a")
    add_train_job(fake, "job-a")
    sim.scenario = "oom"
    assert run_initializer(initializer_env(sim, "job-a"))[0] != 0  # hopeless: delete

    assert fake.rejected == []
    assert sorted(set(fake.calls)) == sorted(REQUIRED_PERMISSIONS)


def test_joining_a_shared_cache_needs_delete_on_the_service_account_where_owners_are_enforced(
    fake, make_sim, run_initializer
):
    """OwnerReferencesPermissionEnforcement asks `delete` of a patch that adds an owner: without
    ADMISSION_PERMISSIONS the second TrainJob cannot join the shared cache."""
    add_train_job(fake, "job-b")
    add_train_job(fake, "job-c")
    sim = make_sim("healthy")
    shared = {"DATA_CACHE_SHARED": "true"}
    assert run_initializer(initializer_env(sim, "job-b", **shared))[0] == 0
    fake.allowed = set(REQUIRED_PERMISSIONS)
    code, output = run_initializer(initializer_env(sim, "job-c", **shared))
    assert code != 0
    assert "can't delete" in output
    fake.allowed = {*REQUIRED_PERMISSIONS, *ADMISSION_PERMISSIONS}
    assert run_initializer(initializer_env(sim, "job-c", **shared))[0] == 0


def test_required_permissions_are_well_formed():
    verbs = {"get", "list", "watch", "create", "update", "patch", "delete"}
    assert len(set(REQUIRED_PERMISSIONS)) == len(REQUIRED_PERMISSIONS)
    assert not set(REQUIRED_PERMISSIONS) & set(ADMISSION_PERMISSIONS)
    for group, resource, verb in [*REQUIRED_PERMISSIONS, *ADMISSION_PERMISSIONS]:
        assert isinstance(group, str) and resource.islower() and verb in verbs
    assert ("trainer.kubeflow.org", "trainjobs", "get") in REQUIRED_PERMISSIONS  # upstream's role lacks it
