"""docs/install.md's recipes work as written: built here offline, as kubectl would build them."""

import re
import subprocess

import pytest
import yaml

from tests.chart.render import (
    REPO_ROOT,
    _parse,
    container,
    env_of,
    offline_manifest_tree,
    one,
    prepared_chart,
    replicated_job,
    selects,
)

DOC = REPO_ROOT / "docs" / "install.md"
RUNTIME = "torch-distributed-with-cache"


def doc_block(marker: str) -> str:
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S) if marker in b]
    assert len(blocks) == 1, f"docs/install.md should hold one yaml block with {marker!r}"
    return blocks[0]


def test_the_image_overlay_retargets_both_images_and_places_the_cache_pods():
    overlay = offline_manifest_tree() / "my-overlay"  # beside manifests/, as the doc's ../ assumes
    overlay.mkdir(exist_ok=True)
    kustomization = yaml.safe_load(doc_block("my-overlay/kustomization.yaml"))
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    built = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    runtime = one(_parse(built.stdout), "ClusterTrainingRuntime", RUNTIME)
    init = replicated_job(runtime, "dataset-initializer")["template"]["spec"]["template"]["spec"]
    step = container(init, "dataset-initializer")
    assert step["image"] == "registry.example/data-cache/initializer:v0.1.0"
    assert step["imagePullPolicy"] == "Always"
    assert env_of(step)["CACHE_IMAGE"]["value"] == "registry.example/data-cache/cache:v0.1.0"

    # The placement env is what the initializer itself accepts.
    from kubeflow_cache_initializer.config import load_config

    env = {name: e["value"] for name, e in env_of(step).items() if "value" in e}
    sdk = {"STORAGE_URI": "cache://s/t", "METADATA_LOC": "s3://b/m.json", "TRAIN_JOB_NAME": "job", "NAMESPACE": "ml"}
    cfg = load_config({**sdk, **env})
    assert cfg.node_selector == (("node.kubernetes.io/pool", "cache"),)
    assert cfg.tolerations == ({"key": "dedicated", "value": "cache", "effect": "NoSchedule"},)
    assert cfg.image_pull_secrets == ("regcred",)
    assert cfg.image_pull_policy == "Always"


def preview_doc_flags(marker: str, flags_after: str) -> tuple[list[str], list[dict]]:
    """The helm flags of the doc's one bash block holding ``marker`` (the words after
    ``flags_after``), and what hack/helm.py template renders with them, as the doc would run it."""
    import shlex
    import sys

    blocks = [b for b in re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S) if marker in b]
    assert len(blocks) == 1, f"docs/install.md should hold one bash block with {marker!r}"
    words = shlex.split(blocks[0].replace("\\\n", " "))
    # --reuse-values keeps an existing release's values on upgrade: a preview has none to keep.
    flags = [word for word in words[words.index(flags_after) + 1 :] if word != "--reuse-values"]
    rendered = subprocess.run(
        [sys.executable, str(REPO_ROOT / "hack" / "helm.py"), "template", str(prepared_chart()), *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr
    return flags, _parse(rendered.stdout)


def test_the_placement_flags_preview_through_hack_helm_as_written():
    """The doc's helm flags, --set-json included, give the runtime the placement env when
    previewed with hack/helm.py template (the preview the doc recommends)."""
    import json

    flags, objects = preview_doc_flags("cache.tolerations", "...")
    assert "--set-json" in flags
    runtime = one(objects, "ClusterTrainingRuntime", RUNTIME)
    init = replicated_job(runtime, "dataset-initializer")["template"]["spec"]["template"]["spec"]
    env = env_of(container(init, "dataset-initializer"))
    assert json.loads(env["CACHE_TOLERATIONS"]["value"]) == [
        {"key": "dedicated", "value": "cache", "effect": "NoSchedule"}
    ]
    assert json.loads(env["CACHE_NODE_SELECTOR"]["value"]) == {"node.kubernetes.io/pool": "cache"}


def test_the_highly_available_controller_recipe_renders_as_written():
    """The doc's flags for keeping the controller up: two replicas, a budget that lets one go,
    the priority class and a spread over nodes that counts the manager's pods."""
    from tests.schemas import validate_objects

    _, objects = preview_doc_flags("podDisruptionBudget", "kubeflow-system")
    validate_objects(objects)
    deployment = one(objects, "Deployment", "kubeflow-trainer-controller-manager")
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["replicas"] == 2
    assert pod["spec"]["priorityClassName"] == "system-cluster-critical"
    (spread,) = pod["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert selects(spread["labelSelector"], pod["metadata"]["labels"])
    budget = one(objects, "PodDisruptionBudget", "kubeflow-trainer-controller-manager")
    assert budget["spec"]["minAvailable"] == 1
    assert selects(budget["spec"]["selector"], pod["metadata"]["labels"])


def _admitted(policy: dict, labels: dict[str, str], namespace_labels: dict[str, str], port: int) -> bool:
    """Whether ``policy`` lets a pod with ``labels`` in a namespace with ``namespace_labels``
    reach ``port`` of the pods it selects (the policy's own namespace is the one carrying its name)."""
    own = namespace_labels.get("kubernetes.io/metadata.name") == policy["metadata"]["namespace"]
    for rule in policy["spec"]["ingress"]:
        if port not in [p["port"] for p in rule.get("ports") or []]:
            continue
        for peer in rule["from"]:
            pods, spaces = peer.get("podSelector"), peer.get("namespaceSelector")
            in_namespace = selects(spaces, namespace_labels) if spaces is not None else own
            if in_namespace and (pods is None or selects(pods, labels)):
                return True
    return False


def test_the_network_policy_admits_the_cache_its_trainjobs_and_prometheus_only():
    """The doc's NetworkPolicy validates, selects the pods the initializer makes, and admits
    what a cached TrainJob needs (its initializer and trainers, which the runtime knows by the
    JobSet label it reads TRAIN_JOB_NAME from; head <-> data nodes; Prometheus on the health
    port) and nothing else."""
    from kubeflow_cache_initializer import constants as c
    from kubeflow_cache_initializer.builders import build_leader_worker_set
    from kubeflow_cache_initializer.config import load_config
    from tests.schemas import validate_object

    policy = yaml.safe_load(doc_block("kind: NetworkPolicy"))
    validate_object(policy)
    namespace = policy["metadata"]["namespace"]
    sdk = {"STORAGE_URI": "cache://s/t", "METADATA_LOC": "s3://b/m.json", "TRAIN_JOB_NAME": "job-a"}
    cfg = load_config({**sdk, "CACHE_IMAGE": "cache:dev", "NAMESPACE": namespace})
    lws = build_leader_worker_set(cfg, [{"apiVersion": "v1", "kind": "TrainJob", "name": "job-a", "uid": "u"}])
    templates = [lws["spec"]["leaderWorkerTemplate"][t] for t in ("leaderTemplate", "workerTemplate")]
    cache_pods = [t["metadata"]["labels"] for t in templates]
    assert all(selects(policy["spec"]["podSelector"], labels) for labels in cache_pods)
    ports = {p["containerPort"] for t in templates for p in t["spec"]["containers"][0]["ports"]}
    assert ports == {c.FLIGHT_PORT, c.DEFAULT_HEALTH_PORT}

    runtime = yaml.safe_load((REPO_ROOT / "runtimes" / f"{RUNTIME}.yaml").read_text())
    label_paths = {
        env["valueFrom"]["fieldRef"]["fieldPath"]
        for job in runtime["spec"]["template"]["spec"]["replicatedJobs"]
        for ctr in job["template"]["spec"]["template"]["spec"]["containers"]
        for env in ctr["env"]
        if env["name"] == "TRAIN_JOB_NAME"
    }
    assert label_paths == {"metadata.labels['jobset.sigs.k8s.io/jobset-name']"}, label_paths
    trainjob_pod = {"jobset.sigs.k8s.io/jobset-name": "job-a", "trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
    here = {"kubernetes.io/metadata.name": namespace}
    elsewhere = {"kubernetes.io/metadata.name": "other-team"}
    monitoring = {"kubernetes.io/metadata.name": "monitoring"}
    for port in ports:
        assert _admitted(policy, trainjob_pod, here, port)
        assert all(_admitted(policy, labels, here, port) for labels in cache_pods)
        assert not _admitted(policy, {"app": "web"}, here, port)
        assert not _admitted(policy, trainjob_pod, elsewhere, port)
    assert _admitted(policy, {"app.kubernetes.io/name": "prometheus"}, monitoring, c.DEFAULT_HEALTH_PORT)
    assert not _admitted(policy, {"app.kubernetes.io/name": "prometheus"}, monitoring, c.FLIGHT_PORT)


def doc_bash_block(marker: str) -> str:
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S) if marker in b]
    assert len(blocks) == 1, f"docs/install.md should hold one bash block with {marker!r}"
    return blocks[0]


def runtime_tls_secret() -> str:
    runtime = yaml.safe_load((REPO_ROOT / "runtimes" / f"{RUNTIME}.yaml").read_text())
    pod = replicated_job(runtime, "node")["template"]["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "data-cache-tls"]
    return volume["secret"]["secretName"]


def test_the_openssl_recipe_makes_a_certificate_for_the_name_every_client_checks(tmp_path):
    """The doc's openssl line, run as written: a certificate whose SAN is data-cache and the key
    that goes with it, put in the Secret the runtime and the initializer mount."""
    import shlex
    import shutil

    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    from kubeflow_cache_initializer import constants as c

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    lines = doc_bash_block("openssl req -x509").replace("\\\n", " ").splitlines()
    (openssl,) = [shlex.split(line) for line in lines if line.startswith("openssl ")]
    (create,) = [shlex.split(line) for line in lines if line.startswith("kubectl create secret tls")]
    made = subprocess.run(openssl, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr

    cert = x509.load_pem_x509_certificate((tmp_path / "tls.crt").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == [c.TLS_SERVER_NAME]
    key = serialization.load_pem_private_key((tmp_path / "tls.key").read_bytes(), password=None)
    assert key.public_key() == cert.public_key()
    assert create[4] == c.DEFAULT_TLS_SECRET == runtime_tls_secret()


def test_the_cert_manager_certificate_fills_the_secret_the_pods_mount():
    from kubeflow_cache_initializer import constants as c

    certificate = yaml.safe_load(doc_block("kind: Certificate"))
    assert certificate["apiVersion"] == "cert-manager.io/v1"
    assert certificate["spec"]["secretName"] == c.DEFAULT_TLS_SECRET == runtime_tls_secret()
    assert certificate["spec"]["dnsNames"] == [c.TLS_SERVER_NAME]
    assert set(certificate["spec"]["issuerRef"]) == {"name", "kind"}


# kubectl's resource names in the migration recipe, and the kinds they name.
KUBECTL_KINDS = {
    "configmap": "ConfigMap", "secret": "Secret", "service": "Service", "serviceaccount": "ServiceAccount",
    "deployment": "Deployment", "rolebinding": "RoleBinding", "clusterrole": "ClusterRole",
    "clusterrolebinding": "ClusterRoleBinding", "validatingwebhookconfiguration": "ValidatingWebhookConfiguration",
    "clustertrainingruntime": "ClusterTrainingRuntime",
}  # fmt: skip
NAMESPACED = {"ConfigMap", "Secret", "Service", "ServiceAccount", "Deployment", "RoleBinding"}


def _named_objects(words: list[str]) -> set[tuple[str, str, str]]:
    """(kind, namespace, name) of the ``type/name`` words of one kubectl command line."""
    namespace = words[words.index("-n") + 1] if "-n" in words else ""
    found = set()
    for word in words:
        kind, slash, name = word.partition("/")
        if slash and kind in KUBECTL_KINDS:
            kind = KUBECTL_KINDS[kind]
            found.add((kind, namespace if kind in NAMESPACED else "", name))
    return found


def _objects_by_key(objects: list[dict], namespace: str) -> set[tuple[str, str, str]]:
    """Every object but CRDs (kept on a move), namespaced ones placed in ``namespace`` when unset."""
    return {
        (o["kind"], o["metadata"].get("namespace", namespace) if o["kind"] in NAMESPACED else "", o["metadata"]["name"])
        for o in objects
        if o["kind"] != "CustomResourceDefinition"
    }


def test_the_move_to_the_chart_hands_over_every_object_the_chart_and_the_earlier_install_share():
    """Helm refuses to install over any object without its ownership metadata: the recipe must
    adopt every object the chart renders that upstream's manifests or the overlays already made
    (it named two, and `helm install` stopped on the other eight), and delete the Deployment,
    whose selector cannot change."""
    import shlex
    import sys

    from tests.chart.render import build_kustomize, shared_dir

    block = doc_bash_block("adopt() {")
    lines = [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines()]
    lines = [words for words in lines if words]
    adopted = set().union(*(_named_objects(w) for w in lines if w[0] == "adopt"))
    deleted = set().union(*(_named_objects(w) for w in lines if w[:2] == ["kubectl", "delete"]))
    (install,) = [w for w in lines if w[:2] == ["helm", "install"]]
    at = install.index("-n")
    release, namespace, flags = install[2], install[at + 1], install[4:at] + install[at + 2 :]
    rendered = subprocess.run(
        [sys.executable, str(REPO_ROOT / "hack" / "helm.py"), "template", str(prepared_chart()),
         "--name", release, "--namespace", namespace, *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr
    chart = _objects_by_key(_parse(rendered.stdout), namespace)

    upstream = (shared_dir() / "third-party" / "trainer-v2.1.0-manager-manifests.yaml").read_text()
    earlier = _objects_by_key([o for o in yaml.safe_load_all(upstream) if o], "")
    for overlay in ("overlays/manager", "overlays/data-cache"):
        earlier |= _objects_by_key(build_kustomize(overlay), "")
    # namespace-rbac, applied in the namespace the chart binds by default.
    earlier |= _objects_by_key(build_kustomize("overlays/data-cache/namespace-rbac"), "default")
    shared = chart & earlier
    assert {o for o in shared if o[0] == "Deployment"} == deleted
    assert shared - deleted == adopted
