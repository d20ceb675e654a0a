"""app.kubernetes.io/version: the data cache's objects carry the data cache's version (its initializer
image tag, which the runtime pins), Trainer's objects Trainer's (Chart.yaml's appVersion)."""

import atexit
import functools
import re
import shutil
import tempfile
from pathlib import Path

import helm_python
import pytest
import yaml

from tests.chart.render import (
    CHART_DIR,
    NAMESPACE,
    RELEASE_NAME,
    RUNTIMES_DIR,
    build_kustomize,
    container,
    prepared_chart,
    render_chart,
    replicated_job,
)

VERSION = "app.kubernetes.io/version"
COMPONENT = "app.kubernetes.io/component"
# Every data-cache template: the runtime, the ClusterRole, the namespace RBAC and the PodMonitor.
ALL_OF_THE_CACHE = {
    "dataCache": {"enabled": True, "namespaces": ["team-a"], "metrics": {"podMonitor": {"enabled": True}}}
}
DATA_CACHE_KINDS = {"ClusterRole", "ClusterTrainingRuntime", "RoleBinding", "ServiceAccount", "PodMonitor"}
# A Kubernetes label value: at most 63 characters, alphanumeric at both ends.
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def is_label_value(value: str) -> bool:
    return len(value) <= 63 and bool(LABEL_VALUE.match(value))


def with_initializer_tag(tag: str) -> dict:
    return {"dataCache": {**ALL_OF_THE_CACHE["dataCache"], "initializer": {"image": {"tag": tag}}}}


def ours(objects):
    """This chart's own objects (not the JobSet or LWS subcharts')."""
    return [
        o for o in objects if o["metadata"].get("labels", {}).get("helm.sh/chart", "").startswith("kubeflow-trainer-")
    ]


def cache_objects_of(objects):
    return [o for o in ours(objects) if o["metadata"]["labels"].get(COMPONENT) == "data-cache"]


@functools.cache
def chart_without_schema() -> Path:
    target = Path(tempfile.mkdtemp(prefix="chart-noschema-")) / CHART_DIR.name
    atexit.register(shutil.rmtree, target.parent, True)
    shutil.copytree(prepared_chart(), target)
    (target / "values.schema.json").unlink()
    return target


def render_skipping_the_schema(values: dict) -> list[dict]:
    """`helm template --skip-schema-validation`: the template's own guard, without the schema's."""
    with helm_python.Chart.load(chart_without_schema()) as chart:
        rendered = chart.render(values, name=RELEASE_NAME, namespace=NAMESPACE, is_install=True)
    return [d for path, text in rendered.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def app_version() -> str:
    return yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())["appVersion"]


def runtime_initializer_tag() -> str:
    """The initializer image tag that runtimes/ pins: the data cache's version."""
    runtime = yaml.safe_load((RUNTIMES_DIR / "torch-distributed-with-cache.yaml").read_text())
    pod = replicated_job(runtime, "dataset-initializer")["template"]["spec"]["template"]["spec"]
    return container(pod, "dataset-initializer")["image"].rpartition(":")[2]


def test_the_data_cache_version_is_the_initializer_tag_the_runtime_pins():
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())["dataCache"]
    assert runtime_initializer_tag() == values["initializer"]["image"]["tag"] == values["cache"]["image"]["tag"]
    assert runtime_initializer_tag() == "v0.1.0" != app_version()


def test_every_data_cache_object_carries_the_cache_version():
    cache = cache_objects_of(render_chart(ALL_OF_THE_CACHE))
    assert {o["kind"] for o in cache} == DATA_CACHE_KINDS
    wrong = {f"{o['kind']}/{o['metadata']['name']}": o["metadata"]["labels"].get(VERSION) for o in cache}
    assert wrong == {name: "v0.1.0" for name in wrong}


def test_trainer_objects_keep_trainers_version_and_cache_objects_their_own():
    versions = {}
    for obj in ours(render_chart(ALL_OF_THE_CACHE)):
        labels = obj["metadata"]["labels"]
        versions.setdefault(labels[COMPONENT], set()).add(labels[VERSION])
    assert versions.pop("data-cache") == {"v0.1.0"}
    assert set(versions) >= {"manager", "rbac", "webhook"}
    assert app_version() == "v2.1.0"
    assert versions == {component: {"v2.1.0"} for component in versions}


def test_the_version_follows_the_initializer_tag():
    cache = cache_objects_of(render_chart(with_initializer_tag("v0.2.0-rc.1")))
    assert {o["metadata"]["labels"][VERSION] for o in cache} == {"v0.2.0-rc.1"}


def test_a_build_metadata_tag_gives_a_valid_label_value():
    """`v9.9.9+build.1` is no image tag (the schema refuses it, as `helm install` does); rendered
    anyway, the label turns the `+` into `_`, as the chart's helm.sh/chart label does."""
    with pytest.raises(helm_python.HelmValuesError, match=r"initializer/image/tag"):
        render_chart(with_initializer_tag("v9.9.9+build.1"))
    cache = cache_objects_of(render_skipping_the_schema(with_initializer_tag("v9.9.9+build.1")))
    assert {o["kind"] for o in cache} == DATA_CACHE_KINDS
    assert {o["metadata"]["labels"][VERSION] for o in cache} == {"v9.9.9_build.1"}


@pytest.mark.parametrize(
    ("tag", "label"),
    [
        # Image tags the schema takes (up to 128 characters, `_` first) that are no label values as they are.
        ("v" + "1" * 61 + "_-rc" + "2" * 60, "v" + "1" * 61),
        ("_v1.2.3_", "v1.2.3"),
    ],
)
def test_a_tag_that_is_no_label_value_is_made_one(tag, label):
    cache = cache_objects_of(render_chart(with_initializer_tag(tag)))
    assert {o["metadata"]["labels"][VERSION] for o in cache} == {label}
    assert is_label_value(label)


def test_an_empty_tag_falls_back_to_the_app_version():
    cache = cache_objects_of(render_skipping_the_schema(with_initializer_tag("")))
    assert {o["metadata"]["labels"][VERSION] for o in cache} == {app_version()}


def test_common_labels_still_win_over_the_cache_version():
    values = {**with_initializer_tag("v0.1.0"), "commonLabels": {VERSION: "pinned"}}
    assert {o["metadata"]["labels"][VERSION] for o in ours(render_chart(values))} == {"pinned"}


def test_kustomize_labels_the_cache_with_the_same_version_as_the_chart():
    chart = {
        (o["kind"], o["metadata"]["name"]): o["metadata"]["labels"][VERSION]
        for o in cache_objects_of(render_chart(ALL_OF_THE_CACHE))
    }
    overlays = ("", "/addon", "/namespace-rbac", "/monitoring")
    for overlay in (f"overlays/data-cache{part}" for part in overlays):
        for obj in build_kustomize(overlay):
            labels = obj["metadata"].get("labels", {})
            key = (obj["kind"], obj["metadata"]["name"])
            if labels.get(COMPONENT) == "data-cache":
                assert labels[VERSION] == chart[key] == runtime_initializer_tag(), f"{overlay} {key}"
            elif labels.get("app.kubernetes.io/name") == "trainer":
                assert labels[VERSION] == app_version(), f"{overlay} {key}"
