"""manifests/: every overlay builds offline, in upstream's namespaces, with pinned images, no selector
clashes and the selectors upstream installs use (so either can be applied over the other)."""

import pytest
import yaml

from tests.chart.render import (
    MANIFESTS_DIR,
    NAMESPACE,
    build_kustomize,
    is_remote,
    offline_manifest_tree,
    one,
    select,
    shared_dir,
)

OVERLAYS = ["overlays/manager", "overlays/data-cache", "overlays/data-cache/namespace-rbac", "overlays/trainer"]
ADDON = "overlays/data-cache/addon"
# LeaderWorkerSet keeps its own namespace, as upstream installs it (manifests/third-party/lws).
LWS_NAMESPACE = "lws-system"
UPSTREAM_INSTALLS = ["trainer-v2.1.0-manager-manifests.yaml", "lws-v0.7.0-manifests.yaml"]
CLUSTER_SCOPED = {
    "Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding",
    "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration", "ClusterTrainingRuntime",
}  # fmt: skip


def selector_clashes(objects):
    """Services whose selector does not pick exactly one Deployment's pods, by namespace.

    An object without a namespace lands in the install namespace (`helm install -n`), as some
    subchart templates leave it out."""
    clashes = []
    for service in select(objects, "Service"):
        selector = service["spec"].get("selector") or {}
        picked = [
            d["metadata"]["name"]
            for d in select(objects, "Deployment")
            if d["metadata"].get("namespace", NAMESPACE) == service["metadata"].get("namespace", NAMESPACE)
            and selector.items() <= d["spec"]["template"]["metadata"].get("labels", {}).items()
        ]
        if not selector or len(picked) != 1:
            clashes.append((service["metadata"]["name"], picked))
    return clashes


def home_namespace(obj: dict) -> str:
    """LWS's objects (all named lws-*) live in lws-system; everything else in kubeflow-system."""
    return LWS_NAMESPACE if obj["metadata"]["name"].startswith("lws-") else NAMESPACE


@pytest.mark.parametrize(
    ("overlay", "namespaces"), [(OVERLAYS[0], [NAMESPACE]), (OVERLAYS[1], [NAMESPACE, LWS_NAMESPACE])]
)
def test_overlay_installs_into_upstreams_namespaces(overlay, namespaces):
    objects = build_kustomize(overlay)
    assert sorted(o["metadata"]["name"] for o in select(objects, "Namespace")) == sorted(namespaces)
    for obj in objects:
        if obj["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in obj["metadata"], f"{obj['kind']}/{obj['metadata']['name']}"
        else:
            assert obj["metadata"].get("namespace") == home_namespace(obj), f"{obj['kind']}/{obj['metadata']['name']}"
    for hook_config in [
        *select(objects, "ValidatingWebhookConfiguration"),
        *select(objects, "MutatingWebhookConfiguration"),
    ]:
        want = {home_namespace(hook_config)}
        assert {h["clientConfig"]["service"]["namespace"] for h in hook_config["webhooks"]} == want
    for binding in [*select(objects, "ClusterRoleBinding"), *select(objects, "RoleBinding")]:
        assert {s.get("namespace") for s in binding["subjects"]} == {home_namespace(binding)}


@pytest.mark.parametrize("overlay", OVERLAYS[:2])
def test_no_service_selects_another_controllers_pods(overlay):
    assert selector_clashes(build_kustomize(overlay)) == []


def test_chart_services_each_select_one_deployment(cache_objects):
    assert selector_clashes(cache_objects) == []


def test_the_selector_check_finds_jobset_and_lws_sharing_a_namespace():
    """Why LWS keeps lws-system: in JobSet's namespace, each one's Services select both controllers."""
    objects = build_kustomize("overlays/data-cache")
    for obj in objects:
        if obj["metadata"].get("namespace") == LWS_NAMESPACE:
            obj["metadata"]["namespace"] = NAMESPACE
    assert {name for name, _ in selector_clashes(objects)} >= {"jobset-webhook-service", "lws-webhook-service"}


def test_deployment_selectors_match_the_upstream_installs():
    """A Deployment's selector is immutable: ours must equal upstream's (Trainer v2.1.0's manifests,
    which install JobSet beside it, and LWS v0.7.0's), or applying ours over theirs, or theirs over
    ours, fails with `field is immutable`."""
    upstream = {
        (d["metadata"]["namespace"], d["metadata"]["name"]): d["spec"]["selector"]
        for name in UPSTREAM_INSTALLS
        # libyaml's loader: the pure-Python one takes ~10 s over these CRD-laden installs.
        for d in yaml.load_all((shared_dir() / "third-party" / name).read_text(), Loader=yaml.CSafeLoader)
        if d and d["kind"] == "Deployment"
    }
    ours = {
        (d["metadata"]["namespace"], d["metadata"]["name"]): d["spec"]["selector"]
        for d in select(build_kustomize("overlays/data-cache"), "Deployment")
    }
    assert set(ours) == {
        (NAMESPACE, "kubeflow-trainer-controller-manager"),
        (NAMESPACE, "jobset-controller-manager"),
        (LWS_NAMESPACE, "lws-controller-manager"),
    }
    assert {key: upstream.get(key) for key in ours} == ours


@pytest.mark.parametrize("overlay", OVERLAYS[:2])
def test_images_are_pinned(overlay):
    for deployment in select(build_kustomize(overlay), "Deployment"):
        for c in deployment["spec"]["template"]["spec"]["containers"]:
            repository, _, tag = c["image"].rpartition(":")
            assert repository and tag not in ("", "main", "latest"), c["image"]
            assert not c["image"].startswith("us-central1-docker.pkg.dev/"), "staging registry image"


def test_manager_overlay_has_trainer_and_jobset_only():
    objects = build_kustomize("overlays/manager")
    assert {d["metadata"]["name"] for d in select(objects, "Deployment")} == {
        "kubeflow-trainer-controller-manager",
        "jobset-controller-manager",
    }
    assert {c["metadata"]["name"] for c in select(objects, "CustomResourceDefinition")} == {
        "trainjobs.trainer.kubeflow.org",
        "trainingruntimes.trainer.kubeflow.org",
        "clustertrainingruntimes.trainer.kubeflow.org",
        "jobsets.jobset.x-k8s.io",
    }
    assert select(objects, "ClusterTrainingRuntime") == []


def test_trainer_overlay_is_the_manager_overlay_without_jobset():
    """For a cluster that runs JobSet from its own release: the manager overlay would install a
    second JobSet under the same cluster-wide names (bindings, webhooks); this one leaves it out."""
    key = lambda o: (o["kind"], o["metadata"]["name"], o["metadata"].get("namespace"))  # noqa: E731
    trainer = {key(o): o for o in build_kustomize("overlays/trainer")}
    manager = {key(o): o for o in build_kustomize("overlays/manager")}
    jobset = {(kind, name) for kind, name, _ in map(key, build_kustomize("third-party/jobset"))}
    assert not {(kind, name) for kind, name, _ in trainer} & jobset
    assert {k for k in manager if k[:2] not in jobset} == set(trainer)
    for k, obj in trainer.items():
        assert obj == manager[k]
    one(list(trainer.values()), "Deployment", "kubeflow-trainer-controller-manager")


def test_data_cache_overlay_adds_lws_runtime_and_cluster_role():
    objects = build_kustomize("overlays/data-cache")
    one(objects, "Deployment", "lws-controller-manager")
    one(objects, "ClusterTrainingRuntime", "torch-distributed-with-cache")
    one(objects, "ClusterRole", "kubeflow-trainer-cache-initializer")


def test_addon_overlay_adds_the_cache_alone():
    """For a cluster that already runs Trainer and LWS: the same two objects as the full overlay's."""
    objects = build_kustomize(ADDON)
    assert sorted((o["kind"], o["metadata"]["name"]) for o in objects) == [
        ("ClusterRole", "kubeflow-trainer-cache-initializer"),
        ("ClusterTrainingRuntime", "torch-distributed-with-cache"),
    ]
    full = build_kustomize("overlays/data-cache")
    for obj in objects:
        assert obj == one(full, obj["kind"], obj["metadata"]["name"])


def test_data_cache_objects_carry_the_recommended_labels_and_the_runtime_file_is_applied_as_is():
    """Selecting by label (`-l app.kubernetes.io/component=data-cache`) finds the runtime too; its
    pod templates keep only the runtime file's labels (Trainer reads them)."""
    runtime_file = yaml.safe_load((MANIFESTS_DIR.parent / "runtimes" / "torch-distributed-with-cache.yaml").read_text())
    for obj in build_kustomize(ADDON):
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/component"] == "data-cache", obj["kind"]
        assert {"app.kubernetes.io/name", "app.kubernetes.io/part-of", "app.kubernetes.io/managed-by"} <= set(labels)
        if obj["kind"] == "ClusterTrainingRuntime":
            assert obj["spec"] == runtime_file["spec"]


def test_namespace_rbac_takes_its_namespace_from_the_command_line():
    objects = build_kustomize("overlays/data-cache/namespace-rbac")
    assert sorted(o["kind"] for o in objects) == ["RoleBinding", "ServiceAccount"]
    assert all("namespace" not in o["metadata"] for o in objects)
    binding = one(objects, "RoleBinding", "kubeflow-trainer-cache-initializer")
    # No subject namespace: a RoleBinding's ServiceAccount subject defaults to its own namespace.
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kubeflow-trainer-cache-initializer"}]
    assert binding["roleRef"]["name"] == "kubeflow-trainer-cache-initializer"


def test_remote_references_live_only_in_third_party():
    remote = {}
    for kustomization in MANIFESTS_DIR.rglob("kustomization.yaml"):
        resources = yaml.safe_load(kustomization.read_text()).get("resources") or []
        found = [r for r in resources if is_remote(r)]
        if found:
            remote[str(kustomization.relative_to(MANIFESTS_DIR).parent)] = found
    assert set(remote) == {"third-party/trainer-crds", "third-party/jobset", "third-party/lws"}
    # ...and the offline tree has none left.
    for kustomization in (offline_manifest_tree() / "manifests").rglob("kustomization.yaml"):
        assert not [r for r in yaml.safe_load(kustomization.read_text()).get("resources") or [] if is_remote(r)]
