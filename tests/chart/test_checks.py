"""templates/checks.yaml and the label helper: rules between values that the schema cannot state."""

import shutil

import helm_python
import pytest
import yaml

from tests.chart.rbac_rules import grants
from tests.chart.render import DATA_CACHE, one, prepared_chart, render_chart, render_chart_files, render_notes
from tests.schemas import validate_objects

SELECTED = {"Deployment", "Service"}


@pytest.mark.parametrize("key", ["app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component"])
def test_common_labels_cannot_replace_what_selectors_use(key):
    with pytest.raises(helm_python.HelmRenderError, match=f"commonLabels cannot set {key}"):
        render_chart({"commonLabels": {key: "ml"}})


@pytest.mark.parametrize("enabled", [True, False])
def test_the_initializer_may_not_run_as_the_namespaces_default_account(enabled):
    """Every pod of a namespace that names no account runs as `default`: none may get the
    initializer's rights. Refused in words (a schema `not` says only "'not' failed")."""
    values = {"dataCache": {"enabled": enabled, "serviceAccount": {"name": "default"}}}
    with pytest.raises(
        helm_python.HelmRenderError, match="dataCache.serviceAccount.name cannot be `default`: every pod"
    ):
        render_chart(values)


def test_the_refusal_of_the_default_account_names_the_rights_the_role_grants():
    """The message says which rights every pod would get: the role's writes, as they are (it named
    `patch Services`, which the role leaves out on purpose, and not the ServiceAccount patch)."""
    with pytest.raises(helm_python.HelmRenderError) as refused:
        render_chart({"dataCache": {"enabled": True, "serviceAccount": {"name": "default"}}})
    rights = str(refused.value).split("the initializer's rights (", 1)[1].split(")", 1)[0]
    named = set()
    for clause in rights.split("; "):
        verb, _, kinds = clause.partition(" ")
        named |= {(verb, kind.lower()) for kind in kinds.replace(" and ", ", ").split(", ")}
    role = one(render_chart(DATA_CACHE), "ClusterRole", "kubeflow-trainer-cache-initializer")
    writes = {(verb, resource) for _, resource, verb in grants(role["rules"]) if verb in {"create", "patch", "delete"}}
    assert named == writes


def test_common_labels_replace_the_other_chart_labels_once():
    """part-of is an admin's usual label: it replaces the chart's, and no key repeats (a repeated
    key breaks kustomize post-renderers, and last-wins parsers would take either value)."""
    values = {**DATA_CACHE, "commonLabels": {"app.kubernetes.io/part-of": "ml-platform", "team": "ml"}}
    rendered = render_chart_files(values)
    ours = 0
    for path, text in rendered.items():
        if "/charts/" in path or path.endswith("NOTES.txt"):
            continue  # the subcharts label their own objects
        for doc in yaml.compose_all(text):
            if doc is None:
                continue
            labels = _mapping(_mapping(doc, "metadata"), "labels")
            keys = [k.value for k, _ in labels.value]
            assert len(keys) == len(set(keys)), (path, keys)
            ours += 1
    assert ours > 5
    for obj in render_chart(values):
        if obj["metadata"].get("labels", {}).get("helm.sh/chart", "").startswith("kubeflow-trainer-"):
            assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "ml-platform"
            assert obj["metadata"]["labels"]["team"] == "ml"


def _mapping(node, key):
    return next(v for k, v in node.value if k.value == key)


def test_lws_install_is_refused_with_the_value_that_does_it():
    with pytest.raises(helm_python.HelmRenderError, match=r"set dataCache\.lws\.install=false"):
        render_chart({**DATA_CACHE, "lws": {"install": False}})


def test_release_names_the_jobset_subchart_cannot_fit_are_refused():
    render_chart(name="a" * 40)
    render_chart(name="jobset-" + "a" * 40)  # the subchart does not repeat "jobset" then
    with pytest.raises(helm_python.HelmRenderError, match="at most 40 characters"):
        render_chart(name="a" * 41)
    render_chart({"jobset": {"install": False}}, name="a" * 41)


def test_a_chart_without_its_crds_is_refused(tmp_path):
    """`helm dependency build` alone leaves crds/ empty: the install would lack the Trainer CRDs."""
    chart = tmp_path / "kubeflow-trainer"
    shutil.copytree(prepared_chart(), chart)
    shutil.rmtree(chart / "crds")
    with helm_python.Chart.load(chart) as loaded, pytest.raises(helm_python.HelmRenderError, match="make sync-crds"):
        loaded.render({}, name="kubeflow-trainer", namespace="kubeflow-system", is_install=True)


def test_several_controllers_without_leader_election_are_refused():
    with pytest.raises(helm_python.HelmRenderError, match="would run 3 Trainer controllers at once"):
        render_chart({"manager": {"replicas": 3, "config": {"leaderElect": False}}})
    render_chart({"manager": {"replicas": 3}})  # leader election on (the default): fine


# Helm reads manifests as YAML 1.1 (go-yaml v2): integers as Go parses them (0o, 0x, 0b), and
# floats with an optional fraction and exponent. Release names may hold dots; namespaces not.
YAML_NON_STRINGS = [("1234", "ml"), ("007", "ml"), ("1.5", "ml"), ("1.e3", "ml"), ("1.5e3", "ml"), ("kt", "2024")]
YAML_NON_STRINGS += [("kt", "1e3"), ("kt", "1e-3"), ("kt", "0o17"), ("kt", "0x1f"), ("kt", "0b101"), ("kt", "yes")]
YAML_NON_STRINGS += [("on", "ml"), ("kt", "n"), ("kt", "null"), ("kt", "false")]
YAML_STRINGS = [("on-call", "no-ml"), ("1234a", "0x"), ("0b", "inf"), ("y1", "e3")]


@pytest.mark.parametrize("name, namespace", YAML_NON_STRINGS)
def test_a_release_name_or_namespace_yaml_reads_as_a_number_or_boolean_is_refused_for_the_subcharts(name, namespace):
    """JobSet's and LWS's templates write both unquoted: their objects would be refused."""
    with pytest.raises(helm_python.HelmRenderError, match="reads as a number or a boolean in YAML"):
        render_chart(DATA_CACHE, name=name, namespace=namespace)


@pytest.mark.parametrize("name, namespace", YAML_STRINGS)
def test_names_yaml_reads_as_strings_are_not_refused(name, namespace):
    """And they render as strings in the subcharts' objects too."""
    objects = render_chart(DATA_CACHE, name=name, namespace=namespace)
    # (and `default`, where the cache's namespace RBAC goes by default)
    assert {obj["metadata"].get("namespace") for obj in objects} - {None, "lws-system", "default"} == {namespace}


def test_our_own_objects_quote_names_and_namespaces_yaml_would_read_as_numbers():
    """Without the subcharts, a numeric namespace and names render as strings everywhere: the
    initializer's ServiceAccount and the controller's priority class were written unquoted."""
    values = {
        "jobset": {"install": False},
        "nameOverride": "007",
        "manager": {"priorityClassName": "1000"},
        "dataCache": {
            "enabled": True,
            "lws": {"install": False},
            "namespaces": ["1234", "yes"],
            "serviceAccount": {"name": "123"},
        },
    }
    objects = render_chart(values, name="2024", namespace="2025")
    validate_objects(objects)
    accounts = [obj["metadata"]["name"] for obj in objects if obj["kind"] == "ServiceAccount"]
    assert accounts.count("123") == 2  # one per namespace
    (manager,) = [obj for obj in objects if obj["kind"] == "Deployment"]
    assert manager["spec"]["template"]["spec"]["priorityClassName"] == "1000"
    namespaces = {obj["metadata"].get("namespace") for obj in objects} - {None}
    assert namespaces == {"2025", "1234", "yes"}
    labels = {obj["metadata"]["labels"]["app.kubernetes.io/name"] for obj in objects if "labels" in obj["metadata"]}
    assert labels == {"007"}


def test_the_notes_name_the_controller_image_installed_not_the_charts_version():
    notes = render_notes({"manager": {"image": {"tag": "v2.2.0"}}})
    assert notes.splitlines()[0].startswith(
        "Kubeflow Trainer (ghcr.io/kubeflow/trainer/trainer-controller-manager:v2.2.0)"
    )


def test_common_labels_cannot_replace_managed_by():
    """Helm adopts only objects labelled managed-by=Helm: a retried upgrade after one that failed
    part way refused the objects it had made ("invalid ownership metadata")."""
    with pytest.raises(helm_python.HelmRenderError, match="commonLabels cannot set app.kubernetes.io/managed-by"):
        render_chart({"commonLabels": {"app.kubernetes.io/managed-by": "argocd"}})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {
                "dataCache": {
                    "enabled": True,
                    "initializer": {"resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "256Mi"}}},
                }
            },
            r"dataCache.initializer.resources requests memory 1Gi, more than its limit 256Mi, .*pod; raise the limit",
        ),
        # 1Gi is 2^30 bytes, more than 1G (10^9).
        (
            {
                "dataCache": {
                    "enabled": True,
                    "initializer": {"resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "1G"}}},
                }
            },
            r"requests memory 1Gi, more than its limit 1G",
        ),
        (
            {"manager": {"resources": {"requests": {"cpu": "1001m"}, "limits": {"cpu": 1}}}},
            r"manager.resources requests cpu 1001m",
        ),
        # A limit below the chart's default request (1Gi): the merged values refuse the pod.
        (
            {**DATA_CACHE, "lws": {"resources": {"limits": {"memory": "512Mi"}}}},
            r"lws.resources requests memory 1Gi, more than its limit 512Mi, .*merges with the chart's defaults for lws.resources",
        ),
    ],
)
def test_a_request_above_its_limit_is_refused_at_install(values, message):
    """The API server refuses the pod, not the Deployment or the runtime: the install passed and the
    controller's pods, or every cached TrainJob's initializer, were never created."""
    with pytest.raises(helm_python.HelmRenderError, match=message):
        render_chart(values)


@pytest.mark.parametrize(
    ("request_", "limit"),
    [
        ("1G", "1Gi"),
        ("500m", 0.5),
        ("1e3", "1k"),
        ("0.5", "500m"),
        (1, "1000m"),
        ("128974848", "123Mi"),
        ("1.5Gi", "1536Mi"),
    ],
)
def test_a_request_up_to_its_limit_in_other_units_is_accepted(request_, limit):
    resources = {"requests": {"cpu": request_, "memory": request_}, "limits": {"cpu": limit, "memory": limit}}
    render_chart({"dataCache": {"enabled": True, "initializer": {"resources": resources}}})


def test_a_fractional_initializer_quantity_reaches_the_runtime_as_a_string():
    """The runtime CRD types quantities int-or-string: a YAML 0.5 (which a Deployment takes) passed
    the values schema and was refused when the release was applied."""
    resources = {"requests": {"cpu": 0.25, "memory": 100000000}, "limits": {"cpu": 0.5, "memory": "256Mi"}}
    objects = render_chart({"dataCache": {"enabled": True, "initializer": {"resources": resources}}})
    runtime = one(objects, "ClusterTrainingRuntime", "torch-distributed-with-cache")
    validate_objects([runtime])
    initializer = next(
        job for job in runtime["spec"]["template"]["spec"]["replicatedJobs"] if job["name"] == "dataset-initializer"
    )
    (container,) = [
        c
        for c in initializer["template"]["spec"]["template"]["spec"]["containers"]
        if c["name"] == "dataset-initializer"
    ]
    assert container["resources"] == {
        "requests": {"cpu": "0.25", "memory": "1e+08"},
        "limits": {"cpu": "0.5", "memory": "256Mi"},
    }


@pytest.mark.parametrize("path", ["manager", "lws", "initializer"])
def test_resources_set_to_null_render(path):
    """`--set x.resources=null` drops the defaults: the requests-and-limits check read a field of nil."""
    values = {"dataCache": {"enabled": True}}
    if path == "initializer":
        values["dataCache"]["initializer"] = {"resources": None}
    else:
        values[path] = {"resources": None}
    render_chart(values)
