"""docs/install.md's recipes work as written: built here offline, as kubectl would build them."""

import re
import subprocess

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
    assert env_of(step)["CACHE_IMAGE"]["value"] == "registry.example/data-cache/cache:v0.1.0"

    # The placement env is what the initializer itself accepts.
    from kubeflow_cache_initializer.config import load_config

    env = {name: e["value"] for name, e in env_of(step).items() if "value" in e}
    sdk = {"STORAGE_URI": "cache://s/t", "METADATA_LOC": "s3://b/m.json", "TRAIN_JOB_NAME": "job", "NAMESPACE": "ml"}
    cfg = load_config({**sdk, **env})
    assert cfg.node_selector == (("node.kubernetes.io/pool", "cache"),)
    assert cfg.tolerations == ({"key": "dedicated", "value": "cache", "effect": "NoSchedule"},)
    assert cfg.image_pull_secrets == ("regcred",)


def test_the_placement_flags_preview_through_hack_helm_as_written():
    """The doc's helm flags, --set-json included, give the runtime the placement env when
    previewed with hack/helm.py template (the preview the doc recommends)."""
    import json
    import shlex
    import sys

    blocks = [b for b in re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S) if "cache.tolerations" in b]
    assert len(blocks) == 1
    words = shlex.split(blocks[0].replace("\\\n", " "))
    flags = words[words.index("...") + 1 :]
    assert "--set-json" in flags
    rendered = subprocess.run(
        [sys.executable, str(REPO_ROOT / "hack" / "helm.py"), "template", str(prepared_chart()), *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr
    runtime = one(_parse(rendered.stdout), "ClusterTrainingRuntime", RUNTIME)
    init = replicated_job(runtime, "dataset-initializer")["template"]["spec"]["template"]["spec"]
    env = env_of(container(init, "dataset-initializer"))
    assert json.loads(env["CACHE_TOLERATIONS"]["value"]) == [
        {"key": "dedicated", "value": "cache", "effect": "NoSchedule"}
    ]
    assert json.loads(env["CACHE_NODE_SELECTOR"]["value"]) == {"node.kubernetes.io/pool": "cache"}
