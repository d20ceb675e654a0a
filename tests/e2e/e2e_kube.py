"""kubectl, helm and kind driven by subprocess, every call and every wait with a deadline.

pytest-kind's ``KindCluster`` holds the cluster's paths and deletes it; creation here adds
``--wait`` and a timeout, which its own ``create`` lacks.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pytest_kind import KindCluster

T = TypeVar("T")

KUBECTL_TIMEOUT_SECONDS = 120
POLL_SECONDS = 3.0
# Errors worth retrying while a freshly installed controller's webhook comes up.
TRANSIENT = ("failed calling webhook", "connection refused", "no endpoints available", "context deadline exceeded")


class CommandError(RuntimeError):
    """A command exited non-zero; the message carries its stderr."""


def run(argv: list[str], *, timeout: float, env: dict[str, str] | None = None, input: str | None = None) -> str:
    """``argv``'s stdout; a CommandError when it fails or outlasts ``timeout``, after which its whole
    process group is killed: subprocess.run's timeout kills only the child, and the `docker build`
    a script started, or kind's node containers' setup, went on behind the next step."""
    with subprocess.Popen(
        argv,
        stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise CommandError(f"{' '.join(argv[:4])} ... did not finish within {timeout:.0f}s") from e
        except BaseException:
            # Interrupted otherwise (pytest-timeout's backstop, Ctrl-C): leaving by the with block
            # would wait for the child with no limit, and its group (a `docker build`, a `helm
            # --wait`) would outlive the run.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise
    if proc.returncode != 0:
        raise CommandError(f"{' '.join(argv)} exited {proc.returncode}:\n{stderr.strip()[-4000:]}")
    return stdout


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, interval: float = POLL_SECONDS) -> T:
    """Call ``probe`` until it returns something truthy; TimeoutError naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            value = probe()
        except CommandError as e:
            value, last = None, e
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f}s (last error: {last})")
        time.sleep(interval)


class E2EKindCluster(KindCluster):
    """pytest-kind's cluster with tool paths given, a config file, and a bounded ``create``."""

    def create_bounded(self, config_file: Path, timeout: float, nodes: int) -> None:
        """Create the cluster, or reuse one of this name that has its ``nodes`` nodes. A creation
        that fails or times out deletes what it left: the next run would reuse half a cluster."""
        existing = run([str(self.kind_path), "get", "clusters"], timeout=60).split()
        if self.name in existing:
            found = run([str(self.kind_path), "get", "nodes", f"--name={self.name}"], timeout=60).split()
            if len(found) == nodes:
                kubeconfig = run([str(self.kind_path), "get", "kubeconfig", f"--name={self.name}"], timeout=60)
                Path(self.kubeconfig_path).write_text(kubeconfig)
                return
            print(f"\nkind cluster {self.name} has {len(found)} node(s), not {nodes}: deleting it to start again")
            self.delete_bounded()
        argv = [str(self.kind_path), "create", "cluster", f"--name={self.name}"]
        argv += [f"--kubeconfig={self.kubeconfig_path}", f"--config={config_file}", f"--wait={int(timeout)}s"]
        if self.image:
            argv.append(f"--image={self.image}")
        try:
            run(argv, timeout=timeout + 60)
        except BaseException:
            with contextlib.suppress(Exception):
                self.delete_bounded()
            raise

    def delete_bounded(self, timeout: float = 300) -> None:
        """pytest-kind's ``delete`` waits on `kind delete cluster` without a deadline."""
        run([str(self.kind_path), "delete", "cluster", f"--name={self.name}"], timeout=timeout)


# What a failure dump holds, each kind on its own; the cluster-scoped ones say whether the
# install got as far as its webhooks (and their caBundle), runtimes and CRDs.
DUMPED_KINDS = (
    "trainjobs", "jobsets", "leaderworkersets", "jobs", "deployments", "pods", "services",
    "serviceaccounts", "rolebindings",
)  # fmt: skip
DUMPED_CLUSTER_KINDS = (
    "validatingwebhookconfigurations", "mutatingwebhookconfigurations", "clustertrainingruntimes",
    "customresourcedefinitions",
)  # fmt: skip


class Kube:
    """kubectl (and helm) against one cluster's kubeconfig."""

    def __init__(self, kubectl: Path, kubeconfig: Path, helm: str | None = None) -> None:
        self.kubectl = str(kubectl)
        self.kubeconfig = str(kubeconfig)
        self.helm_bin = helm

    def __call__(self, *args: str, timeout: float = KUBECTL_TIMEOUT_SECONDS, input: str | None = None) -> str:
        return run([self.kubectl, f"--kubeconfig={self.kubeconfig}", *args], timeout=timeout, input=input)

    def helm(self, *args: str, timeout: float) -> str:
        if not self.helm_bin:
            raise CommandError("helm is not on PATH")
        return run([self.helm_bin, f"--kubeconfig={self.kubeconfig}", *args], timeout=timeout)

    def apply(self, objs: list[dict], namespace: str | None = None, timeout: float = KUBECTL_TIMEOUT_SECONDS) -> str:
        args = ["apply", "--server-side", "--force-conflicts", "--field-manager=kubeflow-data-cache-e2e", "-f", "-"]
        if namespace:
            args += ["-n", namespace]
        return self(*args, input=yaml.safe_dump_all(objs), timeout=timeout)

    def apply_until_accepted(self, objs: list[dict], timeout: float, namespace: str | None = None) -> None:
        """Apply, retrying only the errors of a webhook that is not serving yet."""

        def attempt() -> bool:
            try:
                self.apply(objs, namespace)
            except CommandError as e:
                if any(t in str(e) for t in TRANSIENT):
                    raise
                raise AssertionError(str(e)) from e
            return True

        wait_for(f"apply {[o['kind'] + '/' + o['metadata']['name'] for o in objs]}", attempt, timeout)

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict | None:
        args = ["get", kind, name, "-o", "json", "--ignore-not-found"]
        if namespace:
            args += ["-n", namespace]
        out = self(*args)
        return json.loads(out) if out.strip() else None

    def items(
        self, kind: str, namespace: str, selector: str | None = None, field_selector: str | None = None
    ) -> list[dict]:
        args = ["get", kind, "-n", namespace, "-o", "json"]
        if selector:
            args += ["-l", selector]
        if field_selector:
            args += [f"--field-selector={field_selector}"]
        return json.loads(self(*args))["items"]

    def logs(self, pod: str, namespace: str) -> str:
        return self("logs", pod, "-n", namespace, "--all-containers", "--prefix", timeout=60)

    def pod_logs(self, namespace: str, selector: str) -> str:
        return "\n".join(self.logs(p["metadata"]["name"], namespace) for p in self.items("pods", namespace, selector))

    def dump(self, namespace: str, dest: Path) -> Path:
        """Object status, events and every container's log in ``namespace``, written under ``dest``."""
        dest.mkdir(parents=True, exist_ok=True)
        # One get per kind: a single `get a,b,c` fails whole when one kind is not installed (a
        # failed install before the LeaderWorkerSet CRD), which is when the dump matters most.
        sections = (
            {f"objects-{kind}.yaml": ["get", kind, "-n", namespace, "-o", "yaml"] for kind in DUMPED_KINDS}
            | {f"cluster-{kind}.yaml": ["get", kind, "-o", "yaml"] for kind in DUMPED_CLUSTER_KINDS}
            | {
                "events.txt": ["get", "events", "-n", namespace, "--sort-by=.lastTimestamp"],
                "pods.txt": ["get", "pods", "-n", namespace, "-o", "wide"],
                # Why a pod waits (Pending on CPU, the kind config's known squeeze): its conditions
                # and the nodes' allocated requests, which events alone leave to guesswork.
                "pods-described.txt": ["describe", "pods", "-n", namespace],
                "nodes-described.txt": ["describe", "nodes"],
            }
        )
        for filename, args in sections.items():
            try:
                (dest / filename).write_text(self(*args))
            except CommandError as e:
                (dest / filename).write_text(f"# {e}\n")
        try:
            pods = self.items("pods", namespace)
        except CommandError:
            pods = []
        for pod in pods:
            name = pod["metadata"]["name"]
            for previous in (False, True):
                try:
                    text = self(
                        "logs", name, "-n", namespace, "--all-containers", "--prefix", *(["-p"] if previous else [])
                    )
                except CommandError as e:
                    if previous:
                        continue
                    text = f"# {e}\n"
                (dest / f"logs-{name}{'-previous' if previous else ''}.txt").write_text(text)
        return dest


def condition(obj: dict | None, kind: str) -> dict | None:
    """The status condition of type ``kind`` when it is True."""
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == kind and c.get("status") == "True":
            return c
    return None


def wait_trainjob(kube: Kube, namespace: str, name: str, want: str, timeout: float) -> dict:
    """Wait for the TrainJob's ``want`` condition (Complete or Failed); fail at once on the other."""
    other = {"Complete": "Failed", "Failed": "Complete"}[want]

    def probe() -> dict | None:
        job = kube.get("trainjob", name, namespace)
        if (c := condition(job, other)) is not None:
            raise AssertionError(f"TrainJob {namespace}/{name} is {other}, expected {want}: {c.get('message')}")
        return job if condition(job, want) else None

    return wait_for(f"TrainJob {namespace}/{name} {want}", probe, timeout)
