"""The cache-initializer ClusterRole (chart and kustomize) grants every call the initializer makes."""

from kubeflow_cache_initializer.rbac import ADMISSION_PERMISSIONS, REQUIRED_PERMISSIONS
from tests.chart.rbac_rules import covered, grants
from tests.chart.render import DATA_CACHE, build_kustomize, one, render_chart

ROLE = "kubeflow-trainer-cache-initializer"


def required():
    """What the role must grant: the calls, and what admission asks of them."""
    needed = {tuple(p) for p in [*REQUIRED_PERMISSIONS, *ADMISSION_PERMISSIONS]}
    assert needed, "REQUIRED_PERMISSIONS is empty"
    return needed


def test_chart_cluster_role_grants_every_initializer_call():
    role = one(render_chart(DATA_CACHE), "ClusterRole", ROLE)
    assert covered(grants(role["rules"]), required()) == set()


def test_kustomize_cluster_role_grants_every_initializer_call():
    role = one(build_kustomize("overlays/data-cache"), "ClusterRole", ROLE)
    assert covered(grants(role["rules"]), required()) == set()


def test_the_role_grants_nothing_the_initializer_does_not_call():
    """Least privilege: the role is exactly the package's list."""
    role = one(render_chart(DATA_CACHE), "ClusterRole", ROLE)
    assert grants(role["rules"]) == required()


def test_chart_and_kustomize_grant_the_same():
    chart_role = one(render_chart(DATA_CACHE), "ClusterRole", ROLE)
    kustomize_role = one(build_kustomize("overlays/data-cache"), "ClusterRole", ROLE)
    assert grants(chart_role["rules"]) == grants(kustomize_role["rules"])


def test_the_coverage_check_can_fail():
    """Guards the guard: a role without `trainjobs get` is reported."""
    role = one(render_chart(DATA_CACHE), "ClusterRole", ROLE)
    rules = [r for r in role["rules"] if r["resources"] != ["trainjobs"]]
    assert ("trainer.kubeflow.org", "trainjobs", "get") in covered(grants(rules), required())
