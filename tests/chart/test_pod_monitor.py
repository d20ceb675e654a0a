"""templates/data-cache/pod-monitor.yaml: a Prometheus Operator PodMonitor for the cache pods.

The cache pods are created by the initializer, not the chart, so the PodMonitor's selector and
port are checked against the pods the initializer builds, for a TrainJob's own cache and for a
shared one.
"""

import helm_python
import jsonschema
import pytest

from kubeflow_cache_initializer.builders import build_leader_worker_set
from kubeflow_cache_initializer.config import load_config
from kubeflow_data_cache.service import METRICS_PATH
from tests.chart.render import DATA_CACHE, NAMESPACE, build_kustomize, one, render_chart, render_notes, select
from tests.initializer.support import MINIMAL

NAME = "kubeflow-trainer-data-cache"


def with_monitor(**settings) -> dict:
    return {"dataCache": {"enabled": True, "metrics": {"podMonitor": {"enabled": True, **settings}}}}


ENABLED = with_monitor()

_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_STRINGS = {"type": "array", "items": {"type": "string"}}
# The fields of monitoring.coreos.com/v1 PodMonitor the chart sets (the Prometheus Operator API
# reference), strict as the API server is: a misspelt field fails here. Its CRD is not pinned in
# ../shared, so tests/schemas.py cannot check it.
POD_MONITOR_FIELDS = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "namespace"],
            "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": _LABELS},
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchLabels": _LABELS},
                },
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"any": {"type": "boolean"}, "matchNames": _STRINGS},
                },
                "podTargetLabels": _STRINGS,
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h|d|w|y)"},
                        },
                    },
                },
            },
        },
    },
}


def pod_monitor(values: dict) -> dict:
    monitor = one(render_chart(values), "PodMonitor", NAME)
    jsonschema.validate(monitor, POD_MONITOR_FIELDS)
    return monitor


def cache_pod_templates(env: dict) -> list[dict]:
    lws = build_leader_worker_set(load_config(env), [])
    template = lws["spec"]["leaderWorkerTemplate"]
    return [template["leaderTemplate"], template["workerTemplate"]]


def test_no_pod_monitor_unless_asked(cache_objects):
    assert select(cache_objects, "PodMonitor") == []


@pytest.mark.parametrize("shared", [False, True], ids=["own-cache", "shared-cache"])
def test_selects_every_cache_pod_and_scrapes_its_health_port(shared):
    monitor = pod_monitor(ENABLED)
    env = {**MINIMAL, "CLUSTER_SIZE": "3"} | ({"DATA_CACHE_SHARED": "true"} if shared else {})
    templates = cache_pod_templates(env)
    selector = monitor["spec"]["selector"]["matchLabels"]
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    assert endpoint["path"] == METRICS_PATH
    instances = set()
    for template in templates:
        labels = template["metadata"]["labels"]
        assert selector.items() <= labels.items()  # head and data nodes alike
        assert set(monitor["spec"]["podTargetLabels"]) <= labels.keys()
        instances.add(labels["app.kubernetes.io/instance"])
        (container,) = template["spec"]["containers"]
        assert endpoint["port"] in {p["name"] for p in container["ports"]}
        # The port named there is the one the cache serves /metrics on.
        health = next(p for p in container["ports"] if p["name"] == endpoint["port"])
        env_vars = {e["name"]: e.get("value") for e in container["env"]}
        assert env_vars["HEALTH_PORT"] == str(health["containerPort"])
    assert len(instances) == 1  # one cache, one instance label: its series group by it


def test_scrapes_the_namespaces_of_data_cache_namespaces_or_all():
    values = with_monitor()
    values["dataCache"]["namespaces"] = ["team-a", "team-b"]
    assert pod_monitor(values)["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    assert pod_monitor(with_monitor(allNamespaces=True))["spec"]["namespaceSelector"] == {"any": True}


def test_namespace_labels_and_interval_are_the_admins():
    monitor = pod_monitor(
        with_monitor(namespace="monitoring", labels={"release": "kube-prometheus-stack"}, interval="30s")
    )
    assert monitor["metadata"]["namespace"] == "monitoring"
    labels = monitor["metadata"]["labels"]
    assert labels["release"] == "kube-prometheus-stack"
    assert labels["app.kubernetes.io/component"] == "data-cache"  # the chart's own stay
    assert monitor["spec"]["podMetricsEndpoints"][0]["interval"] == "30s"
    default = pod_monitor(ENABLED)
    assert default["metadata"]["namespace"] == NAMESPACE
    assert "interval" not in default["spec"]["podMetricsEndpoints"][0]  # Prometheus's own


def test_common_labels_and_monitor_labels_merge_without_repeating_a_key():
    values = with_monitor(labels={"team": "platform"})
    values["commonLabels"] = {"team": "ml", "cost-center": "42"}
    labels = pod_monitor(values)["metadata"]["labels"]
    assert labels["team"] == "platform" and labels["cost-center"] == "42"


@pytest.mark.parametrize(
    "settings",
    [
        {"labels": {"app.kubernetes.io/name": "mine"}},  # the chart's own label
        {"interval": "30 seconds"},
        {"namespace": "Monitoring"},
        {"allNamespaces": "yes"},
    ],
)
def test_bad_settings_are_refused_by_the_schema(settings):
    with pytest.raises(helm_python.HelmValuesError):
        render_chart(with_monitor(**settings))


def test_a_pod_monitor_without_the_cache_is_refused():
    with pytest.raises(helm_python.HelmRenderError, match=r"requires dataCache\.enabled=true"):
        render_chart({"dataCache": {"metrics": {"podMonitor": {"enabled": True}}}})


def test_no_namespaces_to_scrape_is_refused_naming_the_fix():
    values = with_monitor()
    values["dataCache"]["namespaces"] = []
    with pytest.raises(helm_python.HelmRenderError, match=r"allNamespaces=true"):
        render_chart(values)
    values["dataCache"]["metrics"]["podMonitor"]["allNamespaces"] = True
    assert pod_monitor(values)["spec"]["namespaceSelector"] == {"any": True}


def test_data_cache_alone_is_unchanged_by_the_monitor_values():
    """The monitor's values touch nothing else: the same objects but the PodMonitor."""
    plain = render_chart(DATA_CACHE)
    with_it = [o for o in render_chart(ENABLED) if o["kind"] != "PodMonitor"]
    assert with_it == plain


def test_the_kustomize_overlay_is_the_charts_all_namespaces_monitor():
    (monitor,) = build_kustomize("overlays/data-cache/monitoring")
    jsonschema.validate({**monitor, "metadata": {**monitor["metadata"], "namespace": "monitoring"}}, POD_MONITOR_FIELDS)
    assert "namespace" not in monitor["metadata"]  # given with -n, where Prometheus looks
    chart = pod_monitor(with_monitor(allNamespaces=True))
    assert monitor["spec"] == chart["spec"]
    assert monitor["metadata"]["name"] == chart["metadata"]["name"]
    assert monitor["metadata"]["labels"]["app.kubernetes.io/component"] == "data-cache"


def test_notes_name_the_pod_monitor_and_what_it_scrapes():
    assert "PodMonitor" not in render_notes(DATA_CACHE)
    notes = render_notes(with_monitor(namespace="monitoring"))
    assert f"PodMonitor monitoring/{NAME} scrapes the cache pods' /metrics in default;" in notes
    assert "in every namespace;" in render_notes(with_monitor(allNamespaces=True))
