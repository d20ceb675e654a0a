"""The calls the initializer makes are exactly `REQUIRED_PERMISSIONS`, the list its Role is checked against.

Every scenario here runs with the fake answering 403 to anything outside the list, so an
unlisted call fails its test; this test drives every code path that makes a call (create,
adopt and restore, join a shared cache, re-list after 410 Gone, delete a hopeless cache) and
checks that nothing in the list is unused. The chart's and the kustomize manifests' roles are
checked against the same list in tests/chart/test_initializer_rbac.py.
"""

from __future__ import annotations

import pytest

from kubeflow_cache_initializer.rbac import ADMISSION_PERMISSIONS, REQUIRED_PERMISSIONS, forbidden_hint

from .fake_k8s import RULES_REVIEW
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
    assert run_initializer(env)[0] == 0  # adopt; restore the ServiceAccount by patch, keep the Service
    shared = {"DATA_CACHE_SHARED": "true"}
    sim.scenario = "healthy"
    assert run_initializer(initializer_env(sim, "job-b", **shared))[0] == 0
    assert run_initializer(initializer_env(sim, "job-c", **shared))[0] == 0  # join: patch owners
    fake.delete("trainjobs", NAMESPACE, "job-a")
    add_train_job(fake, "job-a")
    sim.scenario = "oom"
    assert run_initializer(initializer_env(sim, "job-a"))[0] != 0  # hopeless: delete

    assert fake.rejected == []
    # And the review of its own grants, which every authenticated user may ask (system:basic-user).
    assert sorted(set(fake.calls)) == sorted([*REQUIRED_PERMISSIONS, RULES_REVIEW])


def test_where_owners_are_enforced_the_admission_grants_are_needed_and_enough(fake, make_sim, run_initializer):
    """OwnerReferencesPermissionEnforcement (OpenShift) asks `delete` of a create that sets owners
    and of a patch that changes them: without ADMISSION_PERMISSIONS the first such create fails
    naming the grant; with them a cache is made and a second TrainJob joins it when shared."""
    fake.owner_admission = True
    add_train_job(fake, "job-a")
    add_train_job(fake, "job-b")
    add_train_job(fake, "job-c")
    sim = make_sim("healthy")
    code, output = run_initializer(initializer_env(sim, "job-a"))
    assert code != 0
    assert "cannot set an ownerRef on a resource you can't delete" in output
    assert "OwnerReferencesPermissionEnforcement admission plugin (on in OpenShift) needs `delete` on" in output
    assert "dataCache.ownerReferencePermissions=true" in output and "overlays/data-cache-openshift" in output
    fake.allowed = {*REQUIRED_PERMISSIONS, *ADMISSION_PERMISSIONS}
    assert run_initializer(initializer_env(sim, "job-a"))[0] == 0
    shared = {"DATA_CACHE_SHARED": "true"}
    assert run_initializer(initializer_env(sim, "job-b", **shared))[0] == 0
    assert run_initializer(initializer_env(sim, "job-c", **shared))[0] == 0  # join: owners patched
    assert fake.rejected == []
    # Each admission grant is asked for: taken away, some create or join is refused.
    for grant in ADMISSION_PERMISSIONS:
        fake.allowed = {*REQUIRED_PERMISSIONS, *ADMISSION_PERMISSIONS} - {grant}
        add_train_job(fake, "job-d")
        add_train_job(fake, "job-e")
        codes = [run_initializer(initializer_env(sim, job, **env))[0] for job, env in
                 (("job-d", {}), ("job-e", shared))]  # fmt: skip
        assert any(code != 0 for code in codes), grant
        for job in ("job-d", "job-e"):
            fake.delete("trainjobs", NAMESPACE, job)
        fake.collect_garbage()


def test_required_permissions_are_well_formed():
    verbs = {"get", "list", "watch", "create", "update", "patch", "delete"}
    assert len(set(REQUIRED_PERMISSIONS)) == len(REQUIRED_PERMISSIONS)
    assert not set(REQUIRED_PERMISSIONS) & set(ADMISSION_PERMISSIONS)
    for group, resource, verb in [*REQUIRED_PERMISSIONS, *ADMISSION_PERMISSIONS]:
        assert isinstance(group, str) and resource.islower() and verb in verbs
    assert ("trainer.kubeflow.org", "trainjobs", "get") in REQUIRED_PERMISSIONS  # upstream's role lacks it


def test_a_missing_grant_names_the_verb_the_resource_and_how_to_bind_it(fake, make_sim, run_initializer):
    """Each needed grant, taken away in turn, fails the run naming it and the two ways to bind."""
    add_train_job(fake, "job-a")
    sim = make_sim("healthy")  # one cache simulator: its health port is in the Service each run makes
    for group, plural, verb in [("leaderworkerset.x-k8s.io", "leaderworkersets", "create"),
                                ("", "pods", "watch"), ("", "secrets", "create")]:  # fmt: skip
        fake.allowed = set(REQUIRED_PERMISSIONS) - {(group, plural, verb)}
        code, error = run_initializer(initializer_env(sim))
        what = f"{plural}.{group}" if group else plural
        assert code == 1, error
        assert f"may not `{verb}` {what} in namespace {NAMESPACE}" in error
        assert "`dataCache.namespaces`" in error and f"namespace-rbac -n {NAMESPACE}" in error
        assert fake.get("leaderworkersets", NAMESPACE, "job-a-cache") is None  # a failed run frees its cache


def test_a_refused_watch_fails_the_run_even_when_the_cache_is_ready_before_the_refusal(fake, make_sim, run_initializer):
    """The cache comes up before the API answers the pods watch with 403: the run still fails,
    or a missing grant would pass unseen until the day a cache starts slowly."""
    add_train_job(fake, "job-a")
    fake.allowed = set(REQUIRED_PERMISSIONS) - {("", "pods", "watch")}
    fake.slow[("pods", "watch")] = 1.0
    code, error = run_initializer(initializer_env(make_sim("healthy")))
    assert code == 1, error
    assert f"may not `watch` pods in namespace {NAMESPACE}" in error


@pytest.mark.parametrize(
    ("status_message", "expected"),
    [
        ('services "x" is forbidden: exceeded quota: q, requested: services=1, used: services=4, limited: services=4',
         "ResourceQuota of namespace team-a does not admit it"),
        ('admission webhook "deny.example.com" denied the request: no caches on Fridays', None),
        # Somebody else's resource: a grant we never asked for is no advice to give.
        ('User "u" cannot get resource "configmaps" in API group "" in the namespace "team-a"', None),
    ],
)  # fmt: skip
def test_other_refusals_get_their_own_hint_or_none(status_message, expected):
    plural = "configmaps" if "configmaps" in status_message else "services"
    verb = "get" if plural == "configmaps" else "create"
    hint = forbidden_hint("", plural, verb, "team-a", status_message)
    assert hint == expected if expected is None else expected in hint
