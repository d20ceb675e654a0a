"""The kind suite's fixtures: cluster, images, the distribution installed two ways, MinIO, a table.

Everything skips, with the reason, unless asked for (`-m e2e`, as `make test-e2e` runs it, or
E2E=1) and a Docker engine answers (E2E_REQUIRE=1 asks for it and turns a missing engine into a
failure, for CI). KEEP_CLUSTER=1 (or --keep-cluster) keeps the kind cluster afterwards;
E2E_ARTIFACTS names the folder that failure dumps go to; KIND_CLUSTER_NAME names the kind cluster
(default kubeflow-data-cache-e2e; one per run on a shared Docker host); KIND_NODE_IMAGE overrides the
node image of hack/kind-config.yaml; E2E_SKIP_BUILD=1 loads images built earlier instead of building them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import re
import shutil
import subprocess
import urllib.request
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.e2e.e2e_kube import CommandError, E2EKindCluster, Kube, condition, run, wait_for
from tests.e2e.e2e_objects import (
    CACHE_IMAGE,
    IMAGE_REGISTRY,
    IMAGE_TAG,
    IMAGES_SCRIPT,
    INITIALIZER_IMAGE,
    KIND_CONFIG,
    KIND_VERSION,
    KUBECTL_VERSION,
    LWS_NAMESPACE,
    REPO,
    RUNTIME_NAME,
    SYSTEM_NAMESPACE,
    TLS_SERVER_NAME,
    WRITER_NAME,
    cluster_name,
    helm_values,
    minio_objects,
    parse_metadata_location,
    reader_token_secret,
    retarget_images,
    split_for_apply,
    table_writer_objects,
    tls_secret,
    upstream_image_refs,
)
from tests.tls_certs import tls_secret_pems

CLUSTER_CREATE_TIMEOUT = 300
DOWNLOAD_TIMEOUT = 300
IMAGE_BUILD_TIMEOUT = 2400
IMAGE_LOAD_TIMEOUT = 900
INSTALL_TIMEOUT = 600
CONTROLLERS_READY_TIMEOUT = 420
UNINSTALL_TIMEOUT = 300
MINIO_READY_TIMEOUT = 300
TABLE_WRITE_TIMEOUT = 600
SUBMIT_TIMEOUT = 180
HELM_RELEASE = "kubeflow-trainer"
CHART = REPO / "charts" / "kubeflow-trainer"
OVERLAY = REPO / "manifests" / "overlays" / "data-cache"
RBAC_OVERLAY = OVERLAY / "namespace-rbac"
METHODS = ["helm", "kustomize"]


def unavailable(what: str, reason: str) -> None:
    """Skip ``what`` (the kind suite, one install path) for ``reason``; with E2E_REQUIRE=1 (what
    `make test-e2e` sets), fail, and say so in words that do not read "skipped"."""
    if os.environ.get("E2E_REQUIRE") == "1":
        pytest.fail(f"{what} cannot run: {reason} (E2E_REQUIRE=1)")
    pytest.skip(f"{what} skipped: {reason}")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


def opted_in(markexpr: str, environ: dict[str, str]) -> bool:
    """The kind suite runs only when asked for: `-m e2e` (make test-e2e), E2E=1 or E2E_REQUIRE=1.

    Gated on Docker alone, plain `make test` on any machine with a Docker engine (a developer's
    laptop, a GitHub runner) would start building three images and a cluster, ~30 min.
    """
    if environ.get("E2E") == "1" or environ.get("E2E_REQUIRE") == "1":
        return True
    return re.search(r"(?<!not )\be2e\b", markexpr) is not None


@pytest.fixture(scope="session")
def docker_engine(request) -> str:
    # Docker first, so that the skip names what is missing for `make test-e2e` to run at all.
    version = _docker_engine_version()
    if not opted_in(request.config.getoption("markexpr") or "", dict(os.environ)):
        pytest.skip(
            f"kind suite skipped: it is opt-in (make test-e2e, or E2E=1), as it builds images and a kind "
            f"cluster (Docker {version} answers here)"
        )
    return version


def _docker_engine_version() -> str:
    docker = shutil.which("docker")
    if docker is None:
        unavailable("kind suite", "no `docker` client on PATH")
    try:
        done = subprocess.run(
            [docker, "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        unavailable("kind suite", "`docker info` did not answer within 30s")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        unavailable("kind suite", f"no Docker engine answers (`docker info`: {last})")
    return done.stdout.strip()


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory) -> Path:
    path = Path(os.environ.get("E2E_ARTIFACTS") or tmp_path_factory.mktemp("e2e-artifacts"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _download(url: str, dest: Path, sha256_url: str) -> None:
    """``url`` to ``dest`` (executable), checked against the SHA-256 its release publishes at
    ``sha256_url`` (a file whose first word is the digest), as the e2e workflow checks it."""
    with urllib.request.urlopen(sha256_url, timeout=DOWNLOAD_TIMEOUT) as response:
        words = response.read().decode().split()
    with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT) as response:
        body = response.read()
    got = hashlib.sha256(body).hexdigest()
    if not words or got != words[0].lower():
        raise RuntimeError(f"{url} has SHA-256 {got}, not the {words[0] if words else 'nothing'} of {sha256_url}")
    tmp = dest.with_suffix(".tmp")
    tmp.write_bytes(body)
    tmp.chmod(0o755)
    tmp.rename(dest)


def _tool(name: str, version: str, workdir: Path, url: str, sha256_url: str) -> Path:
    """The binary on PATH, else a pinned, checked download (pytest-kind's own defaults are years old)."""
    found = shutil.which(name)
    if found:
        return Path(found)
    dest = workdir / f"{name}-{version}"
    if not dest.exists():
        _download(url, dest, sha256_url)
    return dest


def download_platform(system: str, machine: str) -> tuple[str, str] | None:
    """(os, arch) of the kind and kubectl release binaries for this machine, or None."""
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(machine.lower())
    os_name = {"Linux": "linux", "Darwin": "darwin"}.get(system)
    return (os_name, arch) if os_name and arch else None


@pytest.fixture(scope="session")
def kind_cluster(request, docker_engine, tmp_path_factory) -> Iterator[E2EKindCluster]:
    workdir = tmp_path_factory.mktemp("kind")
    found = download_platform(platform.system(), platform.machine())
    if found is None and not (shutil.which("kind") and shutil.which("kubectl")):
        unavailable("kind suite", f"put kind {KIND_VERSION} and kubectl on PATH (no release binaries "
                    f"to download for {platform.system()} {platform.machine()})")  # fmt: skip
    try:
        name = cluster_name()
    except ValueError as err:
        pytest.fail(str(err))
    os_name, arch = found or ("linux", "amd64")
    kind_url = f"https://github.com/kubernetes-sigs/kind/releases/download/{KIND_VERSION}/kind-{os_name}-{arch}"
    kind = _tool("kind", KIND_VERSION, workdir, kind_url, f"{kind_url}.sha256sum")
    kubectl_url = f"https://dl.k8s.io/release/{KUBECTL_VERSION}/bin/{os_name}/{arch}/kubectl"
    kubectl = _tool("kubectl", KUBECTL_VERSION, workdir, kubectl_url, f"{kubectl_url}.sha256")
    # kind supports only the node images of its own release (hack/kind-config.yaml pins one).
    version = run([str(kind), "version"], timeout=60)
    if f"kind {KIND_VERSION} " not in f"{version} " and not os.environ.get("KIND_NODE_IMAGE"):
        # A warning, not a print: pytest keeps a passing fixture's output to itself.
        warnings.warn(
            f"kind on PATH is `{version.strip()}`, not {KIND_VERSION}: the node image that "
            f"{KIND_CONFIG.name} pins may not start with it (KIND_NODE_IMAGE picks another)",
            stacklevel=1,
        )
    with contextlib.chdir(workdir):  # KindCluster makes ./.pytest-kind/<name> in the working folder
        cluster = E2EKindCluster(
            name,
            kubeconfig=workdir / "kubeconfig",
            image=os.environ.get("KIND_NODE_IMAGE"),
            kind_path=kind,
            kubectl_path=kubectl,
        )
    nodes = len(yaml.safe_load(KIND_CONFIG.read_text())["nodes"])
    cluster.create_bounded(KIND_CONFIG, CLUSTER_CREATE_TIMEOUT, nodes)
    yield cluster
    if os.environ.get("KEEP_CLUSTER") == "1" or request.config.getoption("keep_cluster"):
        terminal = request.config.pluginmanager.get_plugin("terminalreporter")
        note = f"keeping kind cluster {name} (kind delete cluster --name {name})"
        if terminal is not None:  # a print alone is captured, and shown only for a failure
            terminal.write_line(note)
        else:
            print(note)
        return
    cluster.delete_bounded()


@pytest.fixture(scope="session")
def kube(kind_cluster) -> Kube:
    return Kube(kind_cluster.kubectl_path, kind_cluster.kubeconfig_path, helm=shutil.which("helm"))


@pytest.fixture(scope="session")
def e2e_images(kind_cluster) -> None:
    env = {
        **os.environ,
        "KIND": str(kind_cluster.kind_path),
        "KIND_CLUSTER_NAME": kind_cluster.name,
        "IMAGE_REGISTRY": IMAGE_REGISTRY,
        "IMAGE_TAG": IMAGE_TAG,
    }
    if os.environ.get("E2E_SKIP_BUILD") != "1":
        run(["bash", str(IMAGES_SCRIPT), "build"], timeout=IMAGE_BUILD_TIMEOUT, env=env)
    run(["bash", str(IMAGES_SCRIPT), "load"], timeout=IMAGE_LOAD_TIMEOUT, env=env)


@dataclass(frozen=True)
class Install:
    method: str
    namespace: str

    @property
    def tls(self) -> bool:
        """Whether this install's namespace gets the Flight TLS Secret (TLS_SECRET): the kustomize
        one does, so the suite runs the TLS transport once and plaintext once."""
        return self.method == "kustomize"


def _install_helm(kube: Kube, namespace: str, workdir: Path) -> None:
    if not any((CHART / "crds").glob("*.yaml")) or not any((CHART / "charts").glob("*.tgz")):
        run(["make", "-C", str(REPO), "sync-crds"], timeout=300)
    values = workdir / "values.yaml"
    values.write_text(yaml.safe_dump(helm_values(namespace)))
    argv = ["upgrade", "--install", HELM_RELEASE, str(CHART), "-n", SYSTEM_NAMESPACE, "--create-namespace"]
    argv += ["-f", str(values), "--wait", "--timeout", f"{INSTALL_TIMEOUT}s"]
    kube.helm(*argv, timeout=INSTALL_TIMEOUT + 60)


def _uninstall_helm(kube: Kube) -> None:
    kube.helm(
        "uninstall",
        HELM_RELEASE,
        "-n",
        SYSTEM_NAMESPACE,
        "--wait",
        "--timeout",
        f"{UNINSTALL_TIMEOUT}s",
        timeout=UNINSTALL_TIMEOUT + 60,
    )
    wait_for(
        "the runtime removed by helm uninstall",
        lambda: kube.get("clustertrainingruntime", RUNTIME_NAME) is None,
        UNINSTALL_TIMEOUT,
    )


def _render_kustomize(kube: Kube) -> list[dict]:
    rendered = [o for o in yaml.safe_load_all(kube("kustomize", str(OVERLAY), timeout=300)) if o]
    retargeted, changed = retarget_images(rendered, {"cache": CACHE_IMAGE, "initializer": INITIALIZER_IMAGE})
    assert changed >= 2, f"expected the initializer image and CACHE_IMAGE in {OVERLAY}, changed {changed}"
    return retargeted


def _install_kustomize(kube: Kube, namespace: str, objs: list[dict]) -> None:
    crds, rest, runtimes = split_for_apply(objs)
    kube.apply(crds, timeout=300)
    kube("wait", "--for=condition=Established", "crd", "--all", "--timeout=120s", timeout=150)
    kube.apply_until_accepted(rest, timeout=INSTALL_TIMEOUT)
    _wait_controllers(kube)
    kube.apply_until_accepted(runtimes, timeout=INSTALL_TIMEOUT)
    rbac = [o for o in yaml.safe_load_all(kube("kustomize", str(RBAC_OVERLAY), timeout=120)) if o]
    kube.apply(rbac, namespace=namespace)


def _wait_controllers(kube: Kube) -> None:
    kube(
        "wait",
        "--for=condition=Available",
        "deployment",
        "--all",
        "--all-namespaces",
        f"--timeout={CONTROLLERS_READY_TIMEOUT}s",
        timeout=CONTROLLERS_READY_TIMEOUT + 30,
    )


def _check_runtime_uses_local_images(kube: Kube, namespace: str) -> None:
    runtime = kube.get("clustertrainingruntime", RUNTIME_NAME)
    assert runtime is not None, f"ClusterTrainingRuntime {RUNTIME_NAME} was not installed"
    text = yaml.safe_dump(runtime)
    assert upstream_image_refs(runtime) == [], "the runtime still names the published images"
    assert INITIALIZER_IMAGE in text and CACHE_IMAGE in text, text
    assert kube.get("serviceaccount", "kubeflow-trainer-cache-initializer", namespace) is not None


@pytest.fixture(scope="session", params=METHODS)
def distribution(request, kube, e2e_images, artifacts, tmp_path_factory) -> Iterator[Install]:
    method = request.param
    namespace = f"dc-e2e-{method}"
    if method == "helm" and not kube.helm_bin:
        unavailable("helm install", "no `helm` on PATH")
    if method == "kustomize" and not shutil.which("git"):
        # kubectl's kustomize runs git to fetch Trainer's CRDs from GitHub (a git address).
        unavailable("kustomize install", "no `git` on PATH (kubectl kustomize fetches Trainer's CRDs with it)")
    kube.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}])
    rendered: list[dict] = []
    try:
        if method == "helm":
            _install_helm(kube, namespace, tmp_path_factory.mktemp("helm"))
            _wait_controllers(kube)
        else:
            rendered = _render_kustomize(kube)
            _install_kustomize(kube, namespace, rendered)
        _check_runtime_uses_local_images(kube, namespace)
    except BaseException:
        dest = artifacts / f"{method}-install"
        for ns in (SYSTEM_NAMESPACE, LWS_NAMESPACE, namespace):
            kube.dump(ns, dest / ns)
        print(f"\n{method} install failed; status, events and logs dumped to {dest}")
        # Removed even so: the other install method runs next on the same cluster, and a
        # leftover release (its controller Deployment has other selectors) would fail it too,
        # hiding whether that method works. Its own errors must not replace this one.
        with contextlib.suppress(Exception):
            _uninstall(kube, method, namespace, rendered)
        raise
    yield Install(method, namespace)
    _uninstall(kube, method, namespace, rendered)


def _uninstall(kube: Kube, method: str, namespace: str, rendered: list[dict]) -> None:
    """The test namespace, then what the install method put in the cluster, that too when the
    namespace's delete fails: a release left behind fails the other method's install next."""
    try:
        kube(
            "delete",
            "namespace",
            namespace,
            "--ignore-not-found",
            "--wait=true",
            f"--timeout={UNINSTALL_TIMEOUT}s",
            timeout=UNINSTALL_TIMEOUT + 30,
        )
    finally:
        _uninstall_method(kube, method, rendered)


def _uninstall_method(kube: Kube, method: str, rendered: list[dict]) -> None:
    if method == "helm":
        _uninstall_helm(kube)
    elif rendered:
        kube(
            "delete",
            "-f",
            "-",
            "--ignore-not-found",
            "--wait=true",
            f"--timeout={UNINSTALL_TIMEOUT}s",
            input=yaml.safe_dump_all(rendered),
            timeout=UNINSTALL_TIMEOUT + 30,
        )


@pytest.fixture(scope="session")
def metadata_loc(kube, distribution, artifacts) -> str:
    """MinIO in the test namespace, then the table-writer Job; the table's metadata location."""
    ns = distribution.namespace
    try:
        # The token, and the TLS Secret where the install has one, before any cache starts.
        tls = [tls_secret(ns, tls_secret_pems(TLS_SERVER_NAME))] if distribution.tls else []
        kube.apply([*minio_objects(ns), reader_token_secret(ns), *tls])
        kube(
            "rollout",
            "status",
            "deployment/minio",
            "-n",
            ns,
            f"--timeout={MINIO_READY_TIMEOUT}s",
            timeout=MINIO_READY_TIMEOUT + 30,
        )
        kube.apply(table_writer_objects(ns))

        def written() -> bool:
            job = kube.get("job", WRITER_NAME, ns)
            if (c := condition(job, "Failed")) is not None:
                raise AssertionError(
                    f"the table writer failed: {c.get('message')}\n{kube.pod_logs(ns, f'job-name={WRITER_NAME}')}"
                )
            return condition(job, "Complete") is not None

        wait_for(f"Job {ns}/{WRITER_NAME} Complete", written, TABLE_WRITE_TIMEOUT)
        # The attempt that succeeded: `logs job/...` may pick a failed earlier one (backoffLimit 2).
        (pod, *_) = kube.items("pods", ns, f"job-name={WRITER_NAME}", field_selector="status.phase=Succeeded")
        return parse_metadata_location(kube("logs", pod["metadata"]["name"], "-n", ns))
    except (AssertionError, TimeoutError, CommandError, ValueError):
        dest = kube.dump(ns, artifacts / f"{distribution.method}-table" / ns)
        with contextlib.suppress(CommandError):  # the controllers' side, as for a TrainJob's failure
            for system in (SYSTEM_NAMESPACE, LWS_NAMESPACE):
                kube.dump(system, dest.parent / system)
        print(f"\nwriting the table failed; status, events and logs dumped to {dest.parent}")
        raise


class TrainJobs:
    """Submits the test's TrainJobs; the fixture dumps the namespace on failure, then deletes them."""

    def __init__(self, kube: Kube, namespace: str) -> None:
        self.kube, self.namespace, self.names = kube, namespace, []

    def submit(self, job: dict) -> None:
        self.names.append(job["metadata"]["name"])
        self.kube.apply_until_accepted([job], timeout=SUBMIT_TIMEOUT)


@pytest.fixture
def trainjobs(request, kube, distribution, artifacts) -> Iterator[TrainJobs]:
    jobs = TrainJobs(kube, distribution.namespace)
    yield jobs
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        dest = artifacts / f"{distribution.method}-{request.node.name.replace('/', '_')}"
        with contextlib.suppress(CommandError):
            kube.dump(distribution.namespace, dest / distribution.namespace)
            for ns in (SYSTEM_NAMESPACE, LWS_NAMESPACE):
                kube.dump(ns, dest / ns)
        events = dest / distribution.namespace / "events.txt"
        tail = "\n".join(events.read_text().splitlines()[-40:]) if events.exists() else ""
        print(f"\nstatus, events and logs of {distribution.namespace} dumped to {dest}\n{tail}")
    for name in jobs.names:
        kube("delete", "trainjob", name, "-n", distribution.namespace, "--ignore-not-found", "--wait=false")
    for name in jobs.names:
        wait_for(
            f"TrainJob {name} deleted",
            lambda n=name: kube.get("trainjob", n, distribution.namespace) is None,
            UNINSTALL_TIMEOUT,
        )
