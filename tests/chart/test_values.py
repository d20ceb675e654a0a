"""values.yaml, values.schema.json and the README's values table."""

import importlib.util

import helm_python
import pytest
import yaml

from tests.chart.render import CHART_DIR, REPO_ROOT, render_chart


def helm_cli():
    spec = importlib.util.spec_from_file_location("helm_cli", REPO_ROOT / "hack" / "helm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SPREAD = {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"dataCache": {"enabeld": True}}, r"/dataCache.*additional properties 'enabeld' not allowed"),
        ({"dataCache": {"enabled": "yes"}}, r"/dataCache/enabled.*got string, want boolean"),
        ({"dataCache": {"namespaces": ["Team_A"]}}, r"/dataCache/namespaces/0"),
        ({"dataCache": {"namespaces": ["a", "a"]}}, r"/dataCache/namespaces"),
        ({"dataCache": {"initializer": {"image": {"tag": ""}}}}, r"/dataCache/initializer/image/tag"),
        ({"dataCache": {"cache": {"image": {"repository": "Bad Repo"}}}}, r"/dataCache/cache/image/repository"),
        ({"dataCache": {"serviceAccount": {"name": ""}}}, r"/dataCache/serviceAccount/name"),
        # The API server refuses negative requests and limits: the pods would never be created.
        ({"dataCache": {"initializer": {"resources": {"limits": {"memory": "-1"}}}}}, r"/resources/limits/memory"),
        ({"manager": {"resources": {"requests": {"cpu": "-500m"}}}}, r"/manager/resources/requests/cpu"),
        ({"dataCache": {"lws": {"install": "no"}}}, r"/dataCache/lws/install"),
        ({"webhook": {"failurePolicy": "Never"}}, r"/webhook/failurePolicy"),
        # No controller: its webhooks fail closed, so every TrainJob and runtime change is refused.
        ({"manager": {"replicas": 0}}, r"/manager/replicas': minimum: got 0, want 1"),
        ({"managr": {}}, r"additional properties 'managr' not allowed"),
        # The controller's resources and tolerations follow the same rules as the cache's.
        ({"manager": {"resources": {"requests": {"cpu": -1}}}}, r"/manager/resources/requests/cpu"),
        ({"manager": {"tolerations": [{"key": "a", "operator": "Maybe"}]}}, r"/manager/tolerations/0/operator"),
        # A tag inside the repository would render repo:tag:tag.
        ({"manager": {"image": {"repository": "ghcr.io/me/trainer:v2.1.0"}}}, r"/manager/image/repository"),
        ({"dataCache": {"namespaces": None}}, r"/dataCache': missing property 'namespaces'"),
        ({"dataCache": {"cache": {"image": {"digest": "sha256:abc"}}}}, r"/dataCache/cache/image/digest"),
        ({"manager": {"image": {"digest": "latest"}}}, r"/manager/image/digest"),
        ({"dataCache": {"cache": {"tolerations": [{"key": "a", "effect": "NoLoad"}]}}}, r"/tolerations/0/effect"),
        ({"dataCache": {"cache": {"tolerations": [{"key": "a", "efect": "NoSchedule"}]}}}, r"'efect' not allowed"),
        ({"dataCache": {"cache": {"nodeSelector": {"pool": "in memory"}}}}, r"/dataCache/cache/nodeSelector"),
        ({"dataCache": {"cache": {"nodeSelector": {"bad key": "x"}}}}, r"invalid propertyName 'bad key'"),
        ({"dataCache": {"cache": {"imagePullSecrets": ["regcred"]}}}, r"/dataCache/cache/imagePullSecrets/0"),
        ({"dataCache": {"initializer": {"resources": {"limits": {"memory": "256MB"}}}}}, r"/resources/limits/memory"),
        ({"dataCache": {"initializer": {"resources": {"limit": {"cpu": "1"}}}}}, r"'limit' not allowed"),
        ({"dataCache": {"initializer": {"resources": {"requests": {"cpu": -1}}}}}, r"/resources/requests/cpu"),
        # A misspelt resource name passed install, and JobSet's Job for the initializer was refused
        # ("must be a standard resource type or fully qualified") when a TrainJob first ran.
        (
            {"dataCache": {"initializer": {"resources": {"limits": {"memroy": "256Mi"}}}}},
            r"invalid propertyName 'memroy'",
        ),
        ({"manager": {"resources": {"requests": {"gpu": 1}}}}, r"invalid propertyName 'gpu'"),
        ({"lws": {"resources": {"limits": {"Memory": "2Gi"}}}}, r"invalid propertyName 'Memory'"),
        # controller-runtime refuses --zap-log-level=0: the controller would crash-loop.
        ({"manager": {"logLevel": 0}}, r"/manager/logLevel"),
        ({"manager": {"logLevel": "verbose"}}, r"/manager/logLevel"),
        # The API server would refuse every object of the release.
        ({"commonLabels": {"bad key!": "ml"}}, r"invalid propertyName 'bad key!'"),
        ({"commonLabels": {"team": "machine learning"}}, r"/commonLabels/team"),
        # A misspelt field of a Pod topologySpreadConstraint was passed to the Deployment as is.
        (
            {"manager": {"topologySpreadConstraints": [{**SPREAD, "labelselector": {}}]}},
            r"'labelselector' not allowed",
        ),
        # The API server refuses both: the controller's Deployment failed after the schema passed it.
        (
            {"manager": {"topologySpreadConstraints": [{**SPREAD, "minDomains": 2}]}},
            r"/manager/topologySpreadConstraints/0/whenUnsatisfiable",
        ),
        ({"manager": {"nodeSelector": {"pool": "gpu nodes"}}}, r"/manager/nodeSelector/pool"),
        ({"manager": {"nodeSelector": {"bad key": "x"}}}, r"invalid propertyName 'bad key'"),
        ({"dataCache": {"lws": {"allowCrdRemoval": "yes"}}}, r"/dataCache/lws/allowCrdRemoval"),
        # A misspelt affinity kind or rule list: helm template went on, and the pod had no affinity.
        ({"manager": {"affinity": {"nodeAfinity": {}}}}, r"'nodeAfinity' not allowed"),
        (
            {"manager": {"affinity": {"podAntiAffinity": {"requiredDuringScheduling": []}}}},
            r"'requiredDuringScheduling' not allowed",
        ),
    ],
)
def test_bad_values_fail_with_a_message_naming_the_value(values, message):
    with pytest.raises(helm_python.HelmValuesError, match=message):
        render_chart(values)


def test_a_registry_port_is_not_taken_for_a_tag():
    objects = render_chart({"manager": {"image": {"repository": "localhost:5000/trainer"}}})
    (deployment,) = [
        o
        for o in objects
        if o["metadata"]["name"] == "kubeflow-trainer-controller-manager" and o["kind"] == "Deployment"
    ]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "localhost:5000/trainer:v2.1.0"


def test_every_value_has_a_comment():
    cli = helm_cli()
    documented = {row[0] for row in cli.values_rows(CHART_DIR / "values.yaml")}
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    undocumented = [p for p in cli.leaf_paths(values) if not any(p == d or p.startswith(d + ".") for d in documented)]
    assert undocumented == []


def test_readme_values_table_matches_values_yaml(tmp_path):
    cli = helm_cli()
    readme = (CHART_DIR / "README.md").read_text()
    assert cli.values_table(CHART_DIR / "values.yaml") in readme, (
        "run: .venv/bin/python hack/helm.py readme charts/kubeflow-trainer"
    )
    # The check fails on a stale table.
    (tmp_path / "Chart.yaml").write_text("name: x\n")
    (tmp_path / "values.yaml").write_text("# -- A new value.\nnewValue: 1\n")
    (tmp_path / "README.md").write_text(readme)
    assert cli.readme(tmp_path, check=True) == 1
    assert cli.readme(tmp_path, check=False) == 0
    assert "| `newValue` | `1` | A new value. |" in (tmp_path / "README.md").read_text()


def test_schema_allows_the_default_values():
    with helm_python.Chart.load(CHART_DIR) as chart:
        chart.validate_schema({})
        chart.validate_schema({"dataCache": {"enabled": True, "lws": {"install": False}, "namespaces": []}})
        chart.validate_schema({"manager": {"logLevel": "debug"}, "commonLabels": {"example.com/team": "ml-1"}})


def test_a_pod_topology_spread_constraint_keeps_every_field_of_the_pod_spec():
    spread = {
        **SPREAD,
        "whenUnsatisfiable": "DoNotSchedule",  # minDomains is only taken with it
        "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "manager"}},
        "matchLabelKeys": ["pod-template-hash"],
        "minDomains": 2,
        "nodeAffinityPolicy": "Honor",
        "nodeTaintsPolicy": "Ignore",
    }
    objects = render_chart({"manager": {"topologySpreadConstraints": [spread]}})
    (deployment,) = [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("controller-manager")
    ]
    assert deployment["spec"]["template"]["spec"]["topologySpreadConstraints"] == [spread]


def test_a_manager_affinity_is_passed_to_the_deployment_as_given():
    term = {"labelSelector": {"matchLabels": {"app.kubernetes.io/component": "manager"}}, "topologyKey": "zone"}
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["system"]}]}]
            }
        },
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": term}]
        },
    }
    objects = render_chart({"manager": {"affinity": affinity}})
    (deployment,) = [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("controller-manager")
    ]
    assert deployment["spec"]["template"]["spec"]["affinity"] == affinity


def test_a_large_burst_renders_as_an_integer_the_controller_can_read():
    """Helm reads numbers as floats: 2000000 rendered as 2e+06, which the manager's int32 field refuses."""
    objects = render_chart({"manager": {"config": {"burst": 2_000_000}}})
    configs = [v for o in objects if o["kind"] == "ConfigMap" for v in o.get("data", {}).values() if "burst:" in v]
    assert any("burst: 2000000" in text for text in configs)
    assert not any("e+06" in text for text in configs)


def test_standard_and_fully_qualified_resource_names_are_accepted():
    """hugepages-2Mi is standard (the name rule had refused its capital letters), and extended
    resources are named with their domain."""
    names = {"cpu": "1", "memory": "1Gi", "ephemeral-storage": "1Gi", "hugepages-2Mi": "2Mi", "nvidia.com/gpu": 1}
    resources = {"requests": names, "limits": names}
    render_chart({"manager": {"resources": resources}, "lws": {"resources": resources}})
    render_chart({"dataCache": {"enabled": True, "initializer": {"resources": resources}}})


@pytest.mark.parametrize("key", ["on", "yes", "null", "0x10", "true"])
def test_a_common_label_key_yaml_reads_as_another_type_stays_the_string_given(key):
    """Written bare, ``on`` parsed as the label ``true`` (YAML 1.1), ``null`` failed the install."""
    labelled = [
        o
        for o in render_chart({"commonLabels": {key: "x"}})
        if o["metadata"].get("labels", {}).get("helm.sh/chart", "").startswith("kubeflow-trainer-")
    ]
    assert labelled
    for obj in labelled:
        assert obj["metadata"]["labels"].get(key) == "x", (obj["kind"], obj["metadata"]["name"])
