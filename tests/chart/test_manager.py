"""templates/manager/: the Trainer controller manager Deployment, Service and config."""

import copy

import pytest
import yaml

from tests.chart.pod_security import restricted_problems
from tests.chart.render import (
    DATA_CACHE,
    NAMESPACE,
    build_kustomize,
    container,
    one,
    prepared_chart,
    render_chart,
    select,
)

MANAGER = "kubeflow-trainer-controller-manager"
RESTRICTED = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def manager_config(objects):
    config_map = one(objects, "ConfigMap", "kubeflow-trainer-config")
    return yaml.safe_load(config_map["data"]["controller_manager_config.yaml"])


def test_renders_the_controller_manager_in_the_release_namespace(default_objects):
    deployment = one(default_objects, "Deployment", MANAGER)
    assert deployment["metadata"]["namespace"] == NAMESPACE
    manager = container(deployment["spec"]["template"]["spec"], "manager")
    app_version = yaml.safe_load((prepared_chart() / "Chart.yaml").read_text())["appVersion"]
    assert manager["image"] == f"ghcr.io/kubeflow/trainer/trainer-controller-manager:{app_version}"
    assert app_version == "v2.1.0"
    assert "--config=/controller_manager_config.yaml" in manager["args"]


def test_renders_a_custom_controller_image_when_manager_image_tag_is_set():
    objects = render_chart({"manager": {"image": {"repository": "registry.example/trainer", "tag": "v2.1.1"}}})
    manager = container(one(objects, "Deployment", MANAGER)["spec"]["template"]["spec"], "manager")
    assert manager["image"] == "registry.example/trainer:v2.1.1"


def test_config_names_the_service_and_secret_the_chart_renders(default_objects):
    cert = manager_config(default_objects)["certManagement"]
    assert cert["enable"] is True
    one(default_objects, "Service", cert["webhookServiceName"])
    one(default_objects, "Secret", cert["webhookSecretName"])
    volumes = one(default_objects, "Deployment", MANAGER)["spec"]["template"]["spec"]["volumes"]
    assert {"name": "cert", "secret": {"secretName": cert["webhookSecretName"], "defaultMode": 420}} in volumes


def test_service_ports_reach_the_container_ports(default_objects):
    service = one(default_objects, "Service", MANAGER)
    manager = container(one(default_objects, "Deployment", MANAGER)["spec"]["template"]["spec"], "manager")
    port_names = {p["name"]: p["containerPort"] for p in manager["ports"]}
    config = manager_config(default_objects)
    assert port_names["webhook-server"] == config["webhook"]["port"]
    assert f":{port_names['metrics']}" == config["metrics"]["bindAddress"]
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in port_names
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]}["webhook-server"] == 443


def test_every_container_of_ours_runs_restricted(cache_objects):
    """The manager (templates) and the initializer (the runtime) are ours; JobSet/LWS are not."""
    ours = [
        o for o in cache_objects if o["metadata"].get("labels", {}).get("app.kubernetes.io/name") == "kubeflow-trainer"
    ]
    pod_specs = [o["spec"]["template"]["spec"] for o in select(ours, "Deployment")]
    runtime = one(ours, "ClusterTrainingRuntime", "torch-distributed-with-cache")
    for job in runtime["spec"]["template"]["spec"]["replicatedJobs"]:
        if job["name"] == "dataset-initializer":
            pod_specs.append(job["template"]["spec"]["template"]["spec"])
    assert len(pod_specs) == 2
    for pod_spec in pod_specs:
        assert pod_spec["securityContext"]["runAsNonRoot"] is True
        for c in pod_spec["containers"]:
            assert c["securityContext"] == RESTRICTED, c["name"]


@pytest.mark.parametrize("source", ["chart", "kustomize"])
def test_every_controller_passes_pod_security_restricted(source, cache_objects):
    """Ours, JobSet's and LWS's controllers all run in a namespace that enforces `restricted`."""
    objects = cache_objects if source == "chart" else build_kustomize("overlays/data-cache")
    deployments = select(objects, "Deployment")
    assert len(deployments) == 3
    for deployment in deployments:
        assert restricted_problems(deployment["spec"]["template"]["spec"]) == [], deployment["metadata"]["name"]


def test_the_restricted_check_finds_what_the_profile_refuses():
    deployment = one(build_kustomize("overlays/data-cache"), "Deployment", "lws-controller-manager")
    pod = copy.deepcopy(deployment["spec"]["template"]["spec"])
    pod["securityContext"].pop("seccompProfile")
    pod["hostNetwork"] = True
    pod["volumes"] = [*pod.get("volumes", []), {"name": "host", "hostPath": {"path": "/"}}]
    pod["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    problems = "\n".join(restricted_problems(pod))
    for fragment in ("hostNetwork", "volume host", "allowPrivilegeEscalation", "seccompProfile is None"):
        assert fragment in problems


def test_every_object_of_ours_carries_the_app_kubernetes_io_labels(cache_objects):
    ours = [o for o in cache_objects if "helm.sh/chart" in o["metadata"].get("labels", {})]
    ours = [o for o in ours if o["metadata"]["labels"]["helm.sh/chart"].startswith("kubeflow-trainer-")]
    assert len(ours) >= 12
    for obj in ours:
        labels = obj["metadata"]["labels"]
        for key in (
            "app.kubernetes.io/name",
            "app.kubernetes.io/instance",
            "app.kubernetes.io/version",
            "app.kubernetes.io/managed-by",
            "app.kubernetes.io/component",
            "app.kubernetes.io/part-of",
        ):
            assert key in labels, f"{obj['kind']}/{obj['metadata']['name']} lacks {key}"


def test_names_follow_the_release_name():
    objects = render_chart(copy.deepcopy(DATA_CACHE), name="trainer")
    one(objects, "Deployment", "trainer-kubeflow-trainer-controller-manager")
    role = one(objects, "ClusterRole", "trainer-kubeflow-trainer-cache-initializer")
    binding = one(objects, "RoleBinding", "trainer-kubeflow-trainer-cache-initializer")  # named after its roleRef
    assert binding["roleRef"]["name"] == role["metadata"]["name"]


def test_config_change_rolls_the_pods(default_objects):
    before = one(default_objects, "Deployment", MANAGER)["spec"]["template"]["metadata"]["annotations"]
    after = one(render_chart({"manager": {"config": {"qps": 20}}}), "Deployment", MANAGER)
    assert after["spec"]["template"]["metadata"]["annotations"]["checksum/config"] != before["checksum/config"]
