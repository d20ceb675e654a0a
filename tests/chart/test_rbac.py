"""templates/rbac/: the controller manager's ServiceAccount, ClusterRole and binding."""

from tests.chart.rbac_rules import covered, grants, upstream_trainer_manifests
from tests.chart.render import NAMESPACE, build_kustomize, one, render_chart

MANAGER = "kubeflow-trainer-controller-manager"


def upstream_manager_permissions():
    role = next(
        o for o in upstream_trainer_manifests() if o["kind"] == "ClusterRole" and o["metadata"]["name"] == MANAGER
    )
    return grants(role["rules"])


def test_chart_cluster_role_grants_what_trainer_v2_1_0_needs(default_objects):
    role = one(default_objects, "ClusterRole", MANAGER)
    assert covered(grants(role["rules"]), upstream_manager_permissions()) == set()


def test_kustomize_cluster_role_grants_what_trainer_v2_1_0_needs():
    role = one(build_kustomize("overlays/manager"), "ClusterRole", MANAGER)
    assert covered(grants(role["rules"]), upstream_manager_permissions()) == set()


def test_binding_names_the_deployments_service_account(default_objects):
    binding = one(default_objects, "ClusterRoleBinding", MANAGER)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": MANAGER}
    account = one(default_objects, "ServiceAccount", MANAGER)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": MANAGER, "namespace": NAMESPACE}]
    assert account["metadata"]["namespace"] == NAMESPACE
    pod_spec = one(default_objects, "Deployment", MANAGER)["spec"]["template"]["spec"]
    assert pod_spec["serviceAccountName"] == MANAGER


def test_renders_mutating_webhook_rbac_only_when_the_defaulter_is_enabled(default_objects):
    needed = {("admissionregistration.k8s.io", "mutatingwebhookconfigurations", "update")}
    assert covered(grants(one(default_objects, "ClusterRole", MANAGER)["rules"]), needed) == needed
    enabled = render_chart({"webhook": {"defaulter": {"enabled": True}}})
    assert covered(grants(one(enabled, "ClusterRole", MANAGER)["rules"]), needed) == set()
