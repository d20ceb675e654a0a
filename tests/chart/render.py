"""Offline renders of what a platform admin installs: the Helm chart and the kustomize overlays.

Shared with other suites (the e2e one validates its objects the same way):

    render_chart(values) -> list[dict]          # templates only, as `helm template` prints them
    chart_crds() -> list[dict]                  # the CRDs `helm install` applies first (crds/ + subcharts)
    build_kustomize("overlays/manager") -> list[dict]
    select(objects, kind, name=None) -> list[dict]; one(objects, kind, name) -> dict
    container(pod_spec, name) -> dict           # by name, never by index

The chart is copied to a temporary folder whose crds/ and charts/ are filled from ../shared (the
fresh-clone state of CI: both are git-ignored); the kustomize tree is copied with every remote
reference swapped for its pinned copy in ../shared. Nothing here touches the network.
"""

from __future__ import annotations

import atexit
import copy
import functools
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "charts" / "kubeflow-trainer"
MANIFESTS_DIR = REPO_ROOT / "manifests"
RUNTIMES_DIR = REPO_ROOT / "runtimes"
RELEASE_NAME = "kubeflow-trainer"
NAMESPACE = "kubeflow-system"
KUSTOMIZE_TIMEOUT_SECONDS = 120
# The values that turn the data cache on, as `--set dataCache.enabled=true`.
DATA_CACHE = {"dataCache": {"enabled": True}}

# Remote kustomize resources and the pinned files in ../shared that stand in for them offline.
_REMOTE_TO_SHARED = [
    (re.compile(r"github\.com/kubeflow/trainer/*/manifests/base/crds\?ref=(?P<v>v[\d.]+)$"), "crds/trainer-{v}"),
    (
        re.compile(r"github\.com/kubernetes-sigs/(?P<p>jobset|lws)/releases/download/(?P<v>v[\d.]+)/manifests\.yaml$"),
        "third-party/{p}-{v}-manifests.yaml",
    ),
]


def shared_dir() -> Path:
    return Path(os.environ.get("SHARED_DIR") or REPO_ROOT / ".." / "shared").resolve()


def _scratch(prefix: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, True)
    return path


@functools.cache
def prepared_chart() -> Path:
    """A copy of the chart with crds/ and charts/ filled from ../shared, as `make sync-crds` does offline."""
    target = _scratch("chart-") / CHART_DIR.name
    # symlinks=False: the runtime symlink becomes the file it points at, as in `helm package`.
    shutil.copytree(CHART_DIR, target, symlinks=False, ignore=shutil.ignore_patterns("crds", "charts"))
    meta = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    crds = target / "crds"
    crds.mkdir()
    for crd in sorted((shared_dir() / "crds" / f"trainer-{meta['appVersion']}").glob("trainer.kubeflow.org_*.yaml")):
        shutil.copy2(crd, crds / crd.name)
    (target / "charts").mkdir()
    for dep in meta["dependencies"]:
        shutil.copy2(shared_dir() / "charts" / f"{dep['name']}-{dep['version']}.tgz", target / "charts")
    return target


# libyaml's parser: the pure-Python one needs seconds for the CRDs some renders carry.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _parse(text: str) -> list[dict]:
    return [doc for doc in yaml.load_all(text, Loader=_LOADER) if doc]


def render_chart_files(
    values: dict | None = None, *, name: str = RELEASE_NAME, namespace: str = NAMESPACE
) -> dict[str, str]:
    """Template path -> rendered text (NOTES.txt included). Raises helm_python's errors on bad values."""
    import helm_python

    with helm_python.Chart.load(prepared_chart()) as chart:
        values = copy.deepcopy(values or {})
        # `helm install` checks the schema before rendering; render() alone does not.
        chart.validate_schema(values)
        return chart.render(values, name=name, namespace=namespace, is_install=True)


def render_chart(values: dict | None = None, *, name: str = RELEASE_NAME, namespace: str = NAMESPACE) -> list[dict]:
    """Every object the chart's templates render (subcharts included, CRDs from crds/ not)."""
    rendered = render_chart_files(values, name=name, namespace=namespace)
    objects = []
    for path in sorted(rendered):
        if not path.endswith("NOTES.txt"):
            objects.extend(_parse(rendered[path]))
    return objects


def render_notes(values: dict | None = None) -> str:
    rendered = render_chart_files(values)
    return next(text for path, text in rendered.items() if path == f"{CHART_DIR.name}/templates/NOTES.txt")


def chart_crds() -> list[dict]:
    import helm_python

    with helm_python.Chart.load(prepared_chart()) as chart:
        return [
            doc
            for crd in chart.crds
            for doc in _parse(crd["data"] if isinstance(crd["data"], str) else crd["data"].decode())
        ]


def offline_copy(url: str) -> Path:
    """The file or folder in ../shared that stands in for a remote kustomize resource."""
    for pattern, template in _REMOTE_TO_SHARED:
        match = pattern.search(url)
        if match:
            path = shared_dir() / template.format(**match.groupdict())
            if not path.exists():
                raise FileNotFoundError(f"no offline copy of {url} at {path}")
            return path
    raise LookupError(f"remote kustomize resource {url} has no offline copy mapped in {__file__}")


def is_remote(resource: str) -> bool:
    return bool(re.match(r"^(https?://|github\.com/|git@|ssh://)", resource))


@functools.cache
def offline_manifest_tree() -> Path:
    """manifests/ and runtimes/ copied side by side, remote resources replaced by local copies."""
    root = _scratch("kustomize-")
    shutil.copytree(MANIFESTS_DIR, root / "manifests")
    shutil.copytree(RUNTIMES_DIR, root / "runtimes")
    for kustomization in (root / "manifests").rglob("kustomization.yaml"):
        data = yaml.safe_load(kustomization.read_text())
        resources = data.get("resources") or []
        if not any(is_remote(r) for r in resources):
            continue
        swapped = []
        for index, resource in enumerate(resources):
            if not is_remote(resource):
                swapped.append(resource)
                continue
            source = offline_copy(resource)
            local = kustomization.parent / f"offline-{index}-{source.name}"
            if source.is_dir():
                shutil.copytree(source, local)
            else:
                shutil.copy2(source, local)
            swapped.append(local.name)
        data["resources"] = swapped
        kustomization.write_text(yaml.safe_dump(data, sort_keys=False))
    return root


@functools.cache
def _build(overlay: str) -> str:
    directory = offline_manifest_tree() / "manifests" / overlay
    result = subprocess.run(
        ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=KUSTOMIZE_TIMEOUT_SECONDS
    )
    if result.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {overlay} failed: {result.stderr.strip()}")
    return result.stdout


def build_kustomize(overlay: str) -> list[dict]:
    """`kubectl kustomize manifests/<overlay>`, offline; a fresh copy of the objects on every call."""
    return _parse(_build(overlay))


def select(objects: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: list[dict], kind: str, name: str) -> dict:
    found = select(objects, kind, name)
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def container(pod_spec: dict, name: str) -> dict:
    found = [c for c in pod_spec.get("containers", []) if c["name"] == name]
    assert len(found) == 1, (
        f"expected one container {name!r}, found {[c['name'] for c in pod_spec.get('containers', [])]}"
    )
    return found[0]


def replicated_job(runtime: dict, name: str) -> dict:
    jobs = [j for j in runtime["spec"]["template"]["spec"]["replicatedJobs"] if j["name"] == name]
    assert len(jobs) == 1, f"expected one replicatedJob {name!r}"
    return jobs[0]


def env_of(container_spec: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container_spec.get("env", [])}


def selects(selector, labels) -> bool:
    """Kubernetes' label selector semantics for matchLabels and In/NotIn/Exists/DoesNotExist."""
    if selector is None:
        return True
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True
