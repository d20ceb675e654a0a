"""templates/data-cache/: LWS subchart, the cache runtime, the initializer's ClusterRole and namespace RBAC."""

import json
import re

import helm_python
import pytest

from tests.chart.render import DATA_CACHE, container, env_of, one, render_chart, render_notes, replicated_job, select

RUNTIME = "torch-distributed-with-cache"
ROLE = "kubeflow-trainer-cache-initializer"
ACCOUNT = "kubeflow-trainer-cache-initializer"


def lws_objects(objects):
    return [o for o in objects if o["metadata"].get("labels", {}).get("helm.sh/chart", "").startswith("lws-")]


def test_renders_nothing_of_the_cache_by_default(default_objects):
    assert select(default_objects, "ClusterTrainingRuntime") == []
    assert select(default_objects, "ClusterRole", ROLE) == []
    assert select(default_objects, "RoleBinding", ACCOUNT) == []
    assert lws_objects(default_objects) == []
    assert select(default_objects, "CustomResourceDefinition") == []


def test_renders_lws_runtime_and_rbac_when_data_cache_enabled_is_set(cache_objects):
    assert one(cache_objects, "Deployment", "kubeflow-trainer-lws-controller-manager")
    one(cache_objects, "CustomResourceDefinition", "leaderworkersets.leaderworkerset.x-k8s.io")
    runtime = one(cache_objects, "ClusterTrainingRuntime", RUNTIME)
    assert runtime["metadata"]["labels"]["trainer.kubeflow.org/webhook-validation"] == "disabled"
    one(cache_objects, "ClusterRole", ROLE)
    account = one(cache_objects, "ServiceAccount", ACCOUNT)
    assert account["metadata"]["namespace"] == "default"


def test_installs_no_job_or_hook(cache_objects):
    """Upstream installs runtimes with a post-install Job that needs internet access; we do not."""
    assert select(cache_objects, "Job") == []
    assert not [o for o in cache_objects if "helm.sh/hook" in o["metadata"].get("annotations", {})]


def test_skips_lws_when_data_cache_lws_install_is_false():
    objects = render_chart({"dataCache": {"enabled": True, "lws": {"install": False}}})
    assert lws_objects(objects) == []
    one(objects, "ClusterTrainingRuntime", RUNTIME)


def test_refuses_lws_install_without_data_cache_enabled():
    with pytest.raises(
        helm_python.HelmRenderError, match=r"dataCache\.lws\.install=true requires dataCache\.enabled=true"
    ):
        render_chart({"dataCache": {"lws": {"install": True}}})


def test_binds_the_initializer_in_each_listed_namespace():
    namespaces = ["team-a", "team-b", "default"]
    objects = render_chart({"dataCache": {"enabled": True, "namespaces": namespaces}})
    bindings = select(objects, "RoleBinding", ACCOUNT)
    assert sorted(b["metadata"]["namespace"] for b in bindings) == sorted(namespaces)
    for binding in bindings:
        namespace = binding["metadata"]["namespace"]
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": ROLE}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": namespace}]
    assert sorted(a["metadata"]["namespace"] for a in select(objects, "ServiceAccount", ACCOUNT)) == sorted(namespaces)


def test_renders_custom_images_and_service_account_into_the_runtime():
    values = {
        "dataCache": {
            "enabled": True,
            "initializer": {"image": {"repository": "registry.example/init", "tag": "v9"}},
            "cache": {"image": {"repository": "registry.example/cache", "tag": "v8"}},
            "serviceAccount": {"name": "cache-init"},
            "namespaces": ["ml"],
        }
    }
    objects = render_chart(values)
    runtime = one(objects, "ClusterTrainingRuntime", RUNTIME)
    pod = replicated_job(runtime, "dataset-initializer")["template"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "cache-init"
    init = container(pod, "dataset-initializer")
    assert init["image"] == "registry.example/init:v9"
    assert env_of(init)["CACHE_IMAGE"]["value"] == "registry.example/cache:v8"
    binding = one(objects, "RoleBinding", "kubeflow-trainer-cache-initializer")  # named after its ClusterRole
    assert binding["subjects"][0]["name"] == "cache-init"
    one(objects, "ServiceAccount", "cache-init")


def test_cache_pod_placement_and_pull_secrets_reach_the_pods_the_initializer_builds():
    """Chart values -> the runtime's initializer env -> the initializer's own parser -> pod specs."""
    from kubeflow_cache_initializer.builders import build_leader_worker_set
    from kubeflow_cache_initializer.config import load_config

    toleration = {"key": "dedicated", "value": "cache", "effect": "NoExecute", "tolerationSeconds": 30}
    cache = {
        "imagePullSecrets": [{"name": "regcred"}, {"name": "mirror"}],
        "nodeSelector": {"node.kubernetes.io/pool": "cache"},
        "tolerations": [toleration, {"key": "nvidia.com/gpu", "operator": "Exists"}],
    }
    runtime = one(render_chart({"dataCache": {"enabled": True, "cache": cache}}), "ClusterTrainingRuntime", RUNTIME)
    pod = replicated_job(runtime, "dataset-initializer")["template"]["spec"]["template"]["spec"]
    env = {name: e["value"] for name, e in env_of(container(pod, "dataset-initializer")).items() if "value" in e}
    sdk = {"STORAGE_URI": "cache://s/t", "METADATA_LOC": "s3://b/m.json", "TRAIN_JOB_NAME": "job", "NAMESPACE": "ml"}

    lws = build_leader_worker_set(load_config({**sdk, **env}), [])
    for template in ("leaderTemplate", "workerTemplate"):
        spec = lws["spec"]["leaderWorkerTemplate"][template]["spec"]
        assert spec["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]
        assert spec["nodeSelector"] == {"node.kubernetes.io/pool": "cache"}
        assert spec["tolerations"] == cache["tolerations"]


PLACEMENTS = [
    # (dataCache.cache values, whether the API server accepts them)
    ({"tolerations": [{"key": "a", "operator": "", "value": "b"}]}, True),
    ({"tolerations": [{"key": "", "operator": "Exists"}]}, True),
    ({"tolerations": [{"operator": "Exists", "effect": "NoSchedule"}]}, True),
    ({"tolerations": [{"key": "a", "effect": "NoExecute", "tolerationSeconds": 5}]}, True),
    ({"tolerations": [{"key": "example.com/x", "operator": "Equal", "value": "", "effect": ""}]}, True),
    ({"tolerations": [{"effect": "NoSchedule"}]}, False),
    ({"tolerations": [{}]}, False),
    ({"tolerations": [{"key": "a", "operator": "Exists", "value": "b"}]}, False),
    ({"tolerations": [{"key": "a", "value": "a b"}]}, False),
    ({"tolerations": [{"key": "a", "value": "\x7f"}]}, False),
    ({"tolerations": [{"key": "a", "operator": "Exists", "tolerationSeconds": 5}]}, False),
    ({"tolerations": [{"key": "a b", "operator": "Exists"}]}, False),
    ({"nodeSelector": {"example.com/pool": "cache", "empty": ""}}, True),
    ({"nodeSelector": {"a" * 254 + "/x": "y"}}, False),
    ({"nodeSelector": {"pool": "a b"}}, False),
    ({"nodeSelector": {"pool": "-x"}}, False),
    ({"nodeSelector": {"-pool": "x"}}, False),
]


@pytest.mark.parametrize(("cache", "valid"), PLACEMENTS, ids=[str(p[0]) for p in PLACEMENTS])
def test_the_chart_and_the_initializer_accept_the_same_placements(cache, valid):
    """A placement the schema lets through but the initializer refuses would fail every TrainJob."""
    from kubeflow_cache_initializer.config import load_config
    from kubeflow_cache_initializer.errors import ConfigError

    try:
        runtime = one(render_chart({"dataCache": {"enabled": True, "cache": cache}}), "ClusterTrainingRuntime", RUNTIME)
    except helm_python.HelmValuesError:
        chart_accepts = False
    else:
        chart_accepts = True
        pod = replicated_job(runtime, "dataset-initializer")["template"]["spec"]["template"]["spec"]
        env = {name: e["value"] for name, e in env_of(container(pod, "dataset-initializer")).items() if "value" in e}
    sdk = {"STORAGE_URI": "cache://s/t", "METADATA_LOC": "s3://b/m.json", "TRAIN_JOB_NAME": "job", "NAMESPACE": "ml"}
    if not chart_accepts:  # what the initializer would get from a TrainJob's own env instead
        env = {
            f"CACHE_{'NODE_SELECTOR' if k == 'nodeSelector' else 'TOLERATIONS'}": json.dumps(v)
            for k, v in cache.items()
        }
    try:
        load_config({**sdk, **env})
        initializer_accepts = True
    except ConfigError:
        initializer_accepts = False
    assert (chart_accepts, initializer_accepts) == (valid, valid)


def test_an_unset_placement_leaves_the_runtime_env_as_the_source_has_it(cache_objects):
    pod = replicated_job(one(cache_objects, "ClusterTrainingRuntime", RUNTIME), "dataset-initializer")
    names = env_of(container(pod["template"]["spec"]["template"]["spec"], "dataset-initializer"))
    assert not {
        "CACHE_IMAGE_PULL_POLICY",
        "CACHE_IMAGE_PULL_SECRETS",
        "CACHE_NODE_SELECTOR",
        "CACHE_TOLERATIONS",
    } & set(names)


def _initializer_container(objects: list[dict]) -> dict:
    pod = replicated_job(one(objects, "ClusterTrainingRuntime", RUNTIME), "dataset-initializer")
    return container(pod["template"]["spec"]["template"]["spec"], "dataset-initializer")


def test_the_initializer_has_resources_and_takes_the_values_ones(cache_objects):
    """Set by default (a quota that requires them admits the pod); dataCache.initializer.resources replaces them."""
    assert _initializer_container(cache_objects)["resources"] == {
        "requests": {"cpu": "100m", "memory": "128Mi"},
        "limits": {"cpu": "1", "memory": "256Mi"},
    }
    mine = {"requests": {"cpu": "50m", "memory": "96Mi"}, "limits": {"memory": "192Mi"}}
    objects = render_chart({"dataCache": {"enabled": True, "initializer": {"resources": mine}}})
    assert _initializer_container(objects)["resources"] == mine


def test_pull_policies_reach_the_initializer_container_and_the_cache_pods(cache_objects):
    from kubeflow_cache_initializer.config import load_config

    assert "imagePullPolicy" not in _initializer_container(cache_objects)  # Kubernetes' default, as the source
    images = {"initializer": {"image": {"pullPolicy": "Never"}}, "cache": {"image": {"pullPolicy": "Always"}}}
    init = _initializer_container(render_chart({"dataCache": {"enabled": True, **images}}))
    assert init["imagePullPolicy"] == "Never"
    env = {name: e["value"] for name, e in env_of(init).items() if "value" in e}
    sdk = {"STORAGE_URI": "cache://s/t", "METADATA_LOC": "s3://b/m.json", "TRAIN_JOB_NAME": "job", "NAMESPACE": "ml"}
    assert load_config({**sdk, **env}).image_pull_policy == "Always"
    # The API server refuses any other spelling, so the schema does (at install, not at each TrainJob).
    with pytest.raises(helm_python.HelmValuesError, match="pullPolicy"):
        render_chart({"dataCache": {"enabled": True, "cache": {"image": {"pullPolicy": "always"}}}})


def test_digests_pin_every_image_the_chart_names():
    d = {name: "sha256:" + hex_digit * 64 for name, hex_digit in (("manager", "a"), ("init", "b"), ("cache", "c"))}
    values = {
        "manager": {"image": {"digest": d["manager"]}},
        "dataCache": {
            "enabled": True,
            "initializer": {"image": {"digest": d["init"]}},
            "cache": {"image": {"digest": d["cache"]}},
        },
    }
    objects = render_chart(values)
    manager = one(objects, "Deployment", "kubeflow-trainer-controller-manager")["spec"]["template"]["spec"]
    assert container(manager, "manager")["image"].endswith(f":v2.1.0@{d['manager']}")
    runtime = one(objects, "ClusterTrainingRuntime", RUNTIME)
    init = container(
        replicated_job(runtime, "dataset-initializer")["template"]["spec"]["template"]["spec"], "dataset-initializer"
    )
    assert init["image"] == f"ghcr.io/kubeflow-data-cache/initializer:v0.1.0@{d['init']}"
    assert env_of(init)["CACHE_IMAGE"]["value"] == f"ghcr.io/kubeflow-data-cache/cache:v0.1.0@{d['cache']}"


def test_the_subchart_controllers_pin_by_a_digest_after_their_tag():
    """JobSet's and LWS's charts have no digest value; a digest after the tag pins them."""
    digest = "sha256:" + "d" * 64
    values = {
        "jobset": {"image": {"tag": f"v0.10.1@{digest}"}},
        "lws": {"image": {"manager": {"tag": f"v0.7.0@{digest}"}}},
        "dataCache": {"enabled": True},
    }
    images = {
        c["image"]
        for d in select(render_chart(values), "Deployment")
        for c in d["spec"]["template"]["spec"]["containers"]
    }
    assert f"registry.k8s.io/jobset/jobset:v0.10.1@{digest}" in images
    assert f"registry.k8s.io/lws/lws:v0.7.0@{digest}" in images
    with pytest.raises(helm_python.HelmValuesError, match="jobset/image/tag"):
        render_chart({"jobset": {"image": {"tag": "v0.10.1@sha256:abc"}}})


def test_notes_give_the_next_steps():
    notes = render_notes({"dataCache": {"enabled": True, "namespaces": ["team-a"]}})
    assert "kubectl create rolebinding kubeflow-trainer-cache-initializer -n <namespace>" in notes
    assert "--clusterrole=kubeflow-trainer-cache-initializer" in notes
    assert "kubectl apply -n team-a" in notes
    assert "kind: TrainJob" in notes and "storageUri: cache://" in notes
    assert "patch serviceaccount" not in notes and "PodMonitor" not in notes
    # Off: the upgrade that turns it on keeps the release's other values (without --reuse-values,
    # Helm would reset them: jobset.install=false back to true, a second JobSet installed).
    off = render_notes()
    assert "--reuse-values \\\n    --set dataCache.enabled=true" in off
    assert "rollout restart deployment" in off
    # On: turning it off later would delete LWS's CRD and every LeaderWorkerSet; the notes say so.
    assert "dataCache.lws.allowCrdRemoval=true" in notes and "dataCache.lws.allowCrdRemoval" not in off
    # The namespace's reader token (docs/install.md#securing-the-cache), under the name the runtime reads.
    assert "kubectl create secret generic data-cache-token -n <namespace>" in notes
    # The namespace's TLS Secret, under the name the runtime and the initializer's default mount.
    assert "kubectl create secret tls data-cache-tls -n <namespace>" in notes and "DNS name data-cache" in notes
    # Adding a namespace through the chart is an upgrade: the JobSet controller needs a restart after it.
    assert (
        "rollout restart deployment \\\n    -l app.kubernetes.io/name=jobset,app.kubernetes.io/instance=kubeflow-trainer"
        in notes
    )
    assert "rollout restart" not in render_notes({"dataCache": {"enabled": True}, "jobset": {"install": False}})


def test_the_notes_upgrade_command_adds_a_namespace_the_chart_accepts():
    """The suggested --set lists the bound namespaces plus the new one (a name already bound,
    as a fixed example name was, would be refused as a duplicate)."""
    values = {"dataCache": {"enabled": True, "namespaces": ["team-a", "team-b"]}}
    listed = re.search(r"--set 'dataCache\.namespaces=\{(.*)\}'", render_notes(values)).group(1).split(",")
    assert listed == ["team-a", "team-b", "<namespace>"]
    upgraded = {"dataCache": {"enabled": True, "namespaces": [n.replace("<namespace>", "team-c") for n in listed]}}
    bound = {o["metadata"]["namespace"] for o in select(render_chart(upgraded), "RoleBinding")}
    assert {"team-a", "team-b", "team-c"} <= bound


def test_notes_bind_by_hand_with_the_pull_secrets_and_say_what_is_not_scraped():
    values = {
        "dataCache": {
            "enabled": True,
            "namespaces": ["team-a"],
            "initializer": {"imagePullSecrets": [{"name": "regcred"}]},
            "cache": {"imagePullSecrets": [{"name": "regcred"}, {"name": "mirror"}]},
            "metrics": {"podMonitor": {"enabled": True}},
        }
    }
    notes = render_notes(values)
    # The ServiceAccount made by hand gets what the chart's own ones get.
    patch = re.search(r"kubectl patch serviceaccount \S+ -n <namespace> \\\n\s+-p '(.*)'", notes)
    sa = next(
        o for o in render_chart(values) if o["kind"] == "ServiceAccount" and o["metadata"]["namespace"] == "team-a"
    )
    assert json.loads(patch.group(1)) == {"imagePullSecrets": sa["imagePullSecrets"]}
    assert "(the initializer pulls with regcred: create that Secret in <namespace> too)" in notes
    assert "(the cache pods pull with regcred, mirror: create these Secrets in <namespace> too)" in notes
    assert "dataCache.metrics.podMonitor.allNamespaces=true" in notes
    values["dataCache"]["metrics"]["podMonitor"]["allNamespaces"] = True
    assert "allNamespaces=true" not in render_notes(values)


@pytest.mark.parametrize(
    ("initializer", "cache", "lines"),
    [
        # Only the initializer's: the cache pods get none, and the notes say so rather than
        # naming them among the pods that pull with it.
        (
            ["regcred"],
            [],
            [
                "(the initializer pulls with regcred: create that Secret in <namespace> too; the cache pods pull "
                "with none: set dataCache.cache.imagePullSecrets if their image is private too)"
            ],
        ),
        ([], ["mirror"], ["(the cache pods pull with mirror: create that Secret in <namespace> too)"]),
        (
            ["a", "b"],
            ["a", "b"],
            ["(the initializer and cache pods pull with a, b: create these Secrets in <namespace> too)"],
        ),
        ([], [], []),
        # The same Secrets in another order, or one named twice, are still one list.
        (
            ["a", "b", "a"],
            ["b", "a"],
            ["(the initializer and cache pods pull with a, b: create these Secrets in <namespace> too)"],
        ),
    ],
)
def test_notes_name_each_pods_own_pull_secrets(initializer, cache, lines):
    values = {
        "dataCache": {
            "enabled": True,
            "initializer": {"imagePullSecrets": [{"name": n} for n in initializer]},
            "cache": {"imagePullSecrets": [{"name": n} for n in cache]},
        }
    }
    notes = render_notes(values)
    assert [line for line in notes.splitlines() if "pull with" in line or "pulls with" in line] == lines


@pytest.mark.parametrize(
    ("values", "waited"),
    [
        ({}, {"kubeflow-trainer-jobset-controller"}),
        (
            {"dataCache": {"enabled": True}},
            {"kubeflow-trainer-jobset-controller", "kubeflow-trainer-lws-controller-manager"},
        ),
        ({"dataCache": {"enabled": True, "lws": {"install": False}}}, {"kubeflow-trainer-jobset-controller"}),
        ({"dataCache": {"enabled": True}, "jobset": {"install": False}}, {"kubeflow-trainer-lws-controller-manager"}),
    ],
)
def test_notes_wait_for_each_installed_controller(values, waited):
    """Each `kubectl wait ... -l` line in the NOTES selects exactly the subchart controller it waits for."""
    selectors = re.findall(r"-l (\S+)", render_notes(values))
    deployments = select(render_chart(values), "Deployment")
    found = set()
    for selector in selectors:
        labels = dict(pair.split("=", 1) for pair in selector.split(","))
        picked = [d["metadata"]["name"] for d in deployments if labels.items() <= d["metadata"]["labels"].items()]
        assert len(picked) == 1, (selector, picked)
        found.update(picked)
    assert found == waited


def test_initializer_pull_secrets_go_on_each_namespace_service_account():
    """A private registry for the initializer image: its pods take the secret from their ServiceAccount."""
    values = {
        **DATA_CACHE,
        "dataCache": {
            **DATA_CACHE["dataCache"],
            "namespaces": ["team-a", "team-b"],
            "initializer": {"imagePullSecrets": [{"name": "regcred"}]},
        },
    }
    accounts = [o for o in render_chart(values) if o["kind"] == "ServiceAccount" and o["metadata"]["name"] == ACCOUNT]
    assert sorted(a["metadata"]["namespace"] for a in accounts) == ["team-a", "team-b"]
    assert all(a["imagePullSecrets"] == [{"name": "regcred"}] for a in accounts)
    default = [
        o for o in render_chart(DATA_CACHE) if o["kind"] == "ServiceAccount" and o["metadata"]["name"] == ACCOUNT
    ]
    assert default and all("imagePullSecrets" not in a for a in default)


def test_a_namespace_rolebinding_is_named_after_its_cluster_role_whatever_the_service_account():
    """A RoleBinding's roleRef cannot change: named after the ServiceAccount, an upgrade with a new
    fullnameOverride (a new ClusterRole name) failed patching it; named after the ClusterRole,
    it is replaced instead."""
    for overrides in ({}, {"fullnameOverride": "trainer"}):
        values = {
            **overrides,
            "dataCache": {"enabled": True, "namespaces": ["team-a"], "serviceAccount": {"name": "sa"}},
        }
        objects = render_chart(values)
        (cluster_role,) = [
            o for o in select(objects, "ClusterRole") if o["metadata"]["name"].endswith("cache-initializer")
        ]
        (binding,) = [o for o in select(objects, "RoleBinding") if o["metadata"]["namespace"] == "team-a"]
        assert binding["metadata"]["name"] == binding["roleRef"]["name"] == cluster_role["metadata"]["name"]
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "sa", "namespace": "team-a"}]
