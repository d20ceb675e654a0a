"""The cache-initializer ClusterRole (chart and kustomize) grants every call the initializer makes,
and the verbs OwnerReferencesPermissionEnforcement asks for only where the install turns them on."""

import pytest

from kubeflow_cache_initializer.rbac import ADMISSION_PERMISSIONS, REQUIRED_PERMISSIONS
from tests.chart.rbac_rules import covered, grants
from tests.chart.render import DATA_CACHE, build_kustomize, one, render_chart

ROLE = "kubeflow-trainer-cache-initializer"
OWNER_ADMISSION = {"dataCache": {"enabled": True, "ownerReferencePermissions": True}}

# (chart values, kustomize overlay, what admission asks of the calls where that install is meant)
INSTALLS = {
    "default": (DATA_CACHE, "overlays/data-cache", []),
    "owner-reference-admission": (OWNER_ADMISSION, "overlays/data-cache-openshift", ADMISSION_PERMISSIONS),
}


def required(admission) -> set:
    """What the role must grant: the calls, and what admission asks of them there."""
    needed = {tuple(p) for p in [*REQUIRED_PERMISSIONS, *admission]}
    assert REQUIRED_PERMISSIONS, "REQUIRED_PERMISSIONS is empty"
    return needed


@pytest.mark.parametrize("install", INSTALLS)
def test_chart_cluster_role_grants_exactly_what_the_initializer_needs(install):
    """Least privilege: the role is exactly the package's list, no more."""
    values, _, admission = INSTALLS[install]
    role = one(render_chart(values), "ClusterRole", ROLE)
    assert grants(role["rules"]) == required(admission)


@pytest.mark.parametrize("install", INSTALLS)
def test_kustomize_cluster_role_grants_exactly_what_the_initializer_needs(install):
    _, overlay, admission = INSTALLS[install]
    role = one(build_kustomize(overlay), "ClusterRole", ROLE)
    assert grants(role["rules"]) == required(admission)


def test_the_default_role_may_delete_no_secret_service_or_service_account():
    """`delete` on every Secret and Service of a namespace is granted only where asked for."""
    role = one(render_chart(DATA_CACHE), "ClusterRole", ROLE)
    assert not {("", plural, "delete") for plural in ("secrets", "services", "serviceaccounts")} & grants(role["rules"])


@pytest.mark.parametrize("install", INSTALLS)
def test_chart_and_kustomize_grant_the_same(install):
    values, overlay, _ = INSTALLS[install]
    chart_role = one(render_chart(values), "ClusterRole", ROLE)
    kustomize_role = one(build_kustomize(overlay), "ClusterRole", ROLE)
    assert grants(chart_role["rules"]) == grants(kustomize_role["rules"])


def test_the_openshift_overlay_changes_nothing_else():
    plain = build_kustomize("overlays/data-cache")
    openshift = build_kustomize("overlays/data-cache-openshift")
    others = [o for o in openshift if (o["kind"], o["metadata"]["name"]) != ("ClusterRole", ROLE)]
    assert others == [o for o in plain if (o["kind"], o["metadata"]["name"]) != ("ClusterRole", ROLE)]


def test_the_coverage_check_can_fail():
    """Guards the guard: a role without `trainjobs get` is reported."""
    role = one(render_chart(DATA_CACHE), "ClusterRole", ROLE)
    rules = [r for r in role["rules"] if r["resources"] != ["trainjobs"]]
    assert ("trainer.kubeflow.org", "trainjobs", "get") in covered(grants(rules), required([]))
