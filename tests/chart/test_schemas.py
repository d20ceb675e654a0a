"""Every rendered object validates against its schema: the pinned CRDs or Kubernetes' own."""

import copy
import re
import subprocess

import pytest
import yaml

from tests.chart.render import REPO_ROOT, build_kustomize, chart_crds, render_chart, render_notes
from tests.schemas import ObjectInvalid, SchemaNotFound, validate_object, validate_objects

SCENARIOS = {
    "default": {},
    "data-cache": {"dataCache": {"enabled": True}},
    "lws-install-false": {"dataCache": {"enabled": True, "lws": {"install": False}}},
    "several-namespaces": {"dataCache": {"enabled": True, "namespaces": ["default", "team-a", "team-b"]}},
    "custom-images": {
        "manager": {"image": {"repository": "registry.example/trainer", "tag": "v2.1.0-patched"}},
        "dataCache": {
            "enabled": True,
            "initializer": {"image": {"repository": "registry.example/init", "tag": "dev"}},
            "cache": {"image": {"repository": "registry.example/cache", "tag": "dev"}},
            "serviceAccount": {"name": "cache-init"},
        },
    },
    "defaulter-and-no-jobset": {"webhook": {"defaulter": {"enabled": True}}, "jobset": {"install": False}},
}


def sample_trainjob() -> dict:
    """The TrainJob in docs/install.md, as the Kubeflow SDK builds it for DataCacheInitializer."""
    text = (REPO_ROOT / "docs" / "install.md").read_text()
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "kind: TrainJob" in b]
    assert len(blocks) == 1, "docs/install.md should hold one TrainJob sample"
    return yaml.safe_load(blocks[0])


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_chart_objects_validate(scenario):
    objects = render_chart(SCENARIOS[scenario])
    assert objects
    validate_objects(objects)


def test_chart_crds_validate():
    crds = chart_crds()
    assert {c["metadata"]["name"] for c in crds} >= {"trainjobs.trainer.kubeflow.org", "jobsets.jobset.x-k8s.io"}
    validate_objects(crds)


@pytest.mark.parametrize(
    "overlay",
    [
        "overlays/manager",
        "overlays/trainer",
        "overlays/data-cache",
        "overlays/data-cache/addon",
        "overlays/data-cache/namespace-rbac",
        "overlays/data-cache-openshift",
        # overlays/data-cache/monitoring holds only a PodMonitor, which has no pinned schema:
        # test_pod_monitor checks it against the fields of the Prometheus Operator API.
    ],
)
def test_kustomize_objects_validate(overlay):
    validate_objects(build_kustomize(overlay))


def test_sample_trainjob_validates_against_the_trainjob_crd():
    job = sample_trainjob()
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed-with-cache"
    dataset = job["spec"]["initializer"]["dataset"]
    assert dataset["storageUri"].startswith("cache://")
    assert {"METADATA_LOC", "CLUSTER_SIZE"} <= {e["name"] for e in dataset["env"]}
    validate_object(job)


def test_notes_trainjob_pastes_into_a_shell_and_validates():
    """The NOTES' `kubectl apply ... <<'YAML'` runs as pasted: bash closes the heredoc (an indented
    terminator would swallow every later line) and hands kubectl a valid TrainJob."""
    notes = render_notes({"dataCache": {"enabled": True}})
    snippet = notes[notes.index("  kubectl apply -n") :]
    script = "kubectl() { cat; }\n" + snippet + "\necho HEREDOC-CLOSED\n"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30, check=True)
    assert out.stderr == ""
    manifest, closed, _ = out.stdout.partition("HEREDOC-CLOSED")
    assert closed
    validate_object(yaml.safe_load(manifest.replace("<your training image>", "example/train:v1")))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda j: j["spec"]["initializer"]["dataset"].update(storageURI="x"), r"storageURI.*unexpected"),
        (
            lambda j: j["spec"]["trainer"].update(numNodes="two"),
            r"spec\.trainer\.numNodes: 'two' is not of type 'integer'",
        ),
        (lambda j: j["spec"].pop("runtimeRef"), r"'runtimeRef' is a required property"),
        (lambda j: j["metadata"].update(labels={"bad label": "x"}), r"invalid key"),
        (lambda j: j["metadata"].update(finalizerz=["x"]), r"metadata\..*finalizerz"),
    ],
)
def test_validator_rejects_a_broken_trainjob(mutate, message):
    job = copy.deepcopy(sample_trainjob())
    mutate(job)
    with pytest.raises(ObjectInvalid, match=message):
        validate_object(job)


def test_validator_rejects_broken_builtin_and_unknown_kinds():
    deployment = next(o for o in render_chart() if o["kind"] == "Deployment")
    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = 3
    with pytest.raises(ObjectInvalid, match=r"imagePullPolicy"):
        validate_object(broken)
    broken = copy.deepcopy(deployment)
    broken["spec"]["replica"] = 1
    with pytest.raises(ObjectInvalid, match=r"replica"):
        validate_object(broken)
    with pytest.raises(SchemaNotFound):
        validate_object({"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": {"name": "x"}})


def test_validator_rejects_a_namespaced_cluster_runtime():
    runtime = next(o for o in render_chart({"dataCache": {"enabled": True}}) if o["kind"] == "ClusterTrainingRuntime")
    runtime = copy.deepcopy(runtime)
    runtime["metadata"]["namespace"] = "kubeflow-system"
    with pytest.raises(ObjectInvalid, match="cluster-scoped"):
        validate_object(runtime)
