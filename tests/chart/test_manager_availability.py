"""The values that keep the fail-closed Trainer controller up (replicas, disruption budget, spread,
priority), and the controllers' resources an admin's quota may require."""

import helm_python
import pytest

from tests.chart.render import CHART_DIR, DATA_CACHE, build_kustomize, one, render_chart, select, selects
from tests.schemas import validate_objects

MANAGER = "kubeflow-trainer-controller-manager"
HOSTNAME_SPREAD = {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"}


def manager_pod(objects) -> dict:
    return one(objects, "Deployment", MANAGER)["spec"]["template"]


def test_by_default_no_budget_priority_or_spread_is_rendered(default_objects):
    assert select(default_objects, "PodDisruptionBudget") == []
    spec = manager_pod(default_objects)["spec"]
    assert "priorityClassName" not in spec
    assert "topologySpreadConstraints" not in spec


def test_a_highly_available_manager_renders_valid_objects_that_select_its_pods():
    values = {
        "manager": {
            "replicas": 2,
            "podDisruptionBudget": {"enabled": True},
            "priorityClassName": "system-cluster-critical",
            "topologySpreadConstraints": [HOSTNAME_SPREAD],
        }
    }
    objects = render_chart(values)
    validate_objects(objects)
    pod = manager_pod(objects)
    budget = one(objects, "PodDisruptionBudget", MANAGER)
    assert budget["spec"]["minAvailable"] == 1
    assert selects(budget["spec"]["selector"], pod["metadata"]["labels"])
    # Only the manager's pods count toward it: JobSet's controller runs in the same namespace.
    jobset = one(objects, "Deployment", "kubeflow-trainer-jobset-controller")
    assert not selects(budget["spec"]["selector"], jobset["spec"]["template"]["metadata"]["labels"])
    assert pod["spec"]["priorityClassName"] == "system-cluster-critical"
    (spread,) = pod["spec"]["topologySpreadConstraints"]
    assert {k: spread[k] for k in HOSTNAME_SPREAD} == HOSTNAME_SPREAD
    # Filled in: a constraint without a selector counts no pods, and spreads nothing.
    assert selects(spread["labelSelector"], pod["metadata"]["labels"])
    assert not selects(spread["labelSelector"], jobset["spec"]["template"]["metadata"]["labels"])


def test_a_spread_constraint_keeps_its_own_selector():
    own = {**HOSTNAME_SPREAD, "labelSelector": {"matchLabels": {"team": "ml"}}}
    (spread,) = manager_pod(render_chart({"manager": {"topologySpreadConstraints": [own]}}))["spec"][
        "topologySpreadConstraints"
    ]
    assert spread == own


@pytest.mark.parametrize(("min_available", "replicas"), [(1, 2), ("50%", 2), (2, 3), ("66%", 3)])
def test_a_budget_that_lets_a_replica_go_is_rendered(min_available, replicas):
    values = {
        "manager": {"replicas": replicas, "podDisruptionBudget": {"enabled": True, "minAvailable": min_available}}
    }
    objects = render_chart(values)
    validate_objects(objects)
    assert one(objects, "PodDisruptionBudget", MANAGER)["spec"]["minAvailable"] == min_available


@pytest.mark.parametrize(
    ("min_available", "replicas", "message"),
    [
        (1, 1, "with manager.replicas=1 would block every drain"),
        (2, 2, "minAvailable=2 keeps all 2 replicas"),
        ("100%", 2, "minAvailable=100% keeps all 2 replicas"),
        # 67% of 3 is 2.01 replicas, rounded up to all 3, as the disruption controller counts.
        ("67%", 3, "minAvailable=67% keeps all 3 replicas"),
    ],
)
def test_a_budget_that_would_block_every_drain_is_refused(min_available, replicas, message):
    values = {
        "manager": {"replicas": replicas, "podDisruptionBudget": {"enabled": True, "minAvailable": min_available}}
    }
    with pytest.raises(helm_python.HelmRenderError, match=message):
        render_chart(values)
    # The same numbers without the budget are fine.
    render_chart({"manager": {"replicas": replicas}})


@pytest.mark.parametrize(
    "manager",
    [
        {"podDisruptionBudget": {"enabled": True, "minAvailable": 0}},
        {"podDisruptionBudget": {"enabled": True, "minAvailable": "0%"}},
        {"podDisruptionBudget": {"enabled": True, "minAvailable": "half"}},
        {"podDisruptionBudget": {"maxUnavailable": 1}},
        {"priorityClassName": "System Critical"},
        {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname"}]},
        {"topologySpreadConstraints": [{**HOSTNAME_SPREAD, "whenUnsatisfiable": "Sometimes"}]},
    ],
)
def test_the_schema_refuses_what_the_api_server_or_drains_would(manager):
    with helm_python.Chart.load(CHART_DIR) as chart, pytest.raises(helm_python.HelmValuesError):
        chart.validate_schema({"manager": manager})


@pytest.mark.parametrize("source", ["chart", "kustomize"])
def test_the_lws_controller_has_a_memory_limit(source):
    """A namespace quota that requires limits would refuse the release's pod, which sets none."""
    objects = render_chart(DATA_CACHE) if source == "chart" else build_kustomize("overlays/data-cache")
    deployment = next(d for d in select(objects, "Deployment") if "lws-controller-manager" in d["metadata"]["name"])
    (manager,) = deployment["spec"]["template"]["spec"]["containers"]
    assert manager["resources"] == {"requests": {"cpu": 1, "memory": "1Gi"}, "limits": {"memory": "2Gi"}}


def test_lws_resources_merge_with_the_chart_defaults():
    values = {**DATA_CACHE, "lws": {"resources": {"requests": {"cpu": "200m"}}}}
    deployment = one(render_chart(values), "Deployment", "kubeflow-trainer-lws-controller-manager")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "200m", "memory": "1Gi"},
        "limits": {"memory": "2Gi"},
    }
