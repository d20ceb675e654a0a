"""The Pod Security Standards' `restricted` profile, as the admission plugin checks a pod spec.

A namespace labelled `pod-security.kubernetes.io/enforce: restricted` refuses a pod that breaks
any of these; the controllers the chart and overlays install should run in such a namespace.
"""

from __future__ import annotations

ALLOWED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
}  # fmt: skip
ALLOWED_SECCOMP = {"RuntimeDefault", "Localhost"}


def restricted_problems(pod_spec: dict) -> list[str]:
    """What the `restricted` profile would refuse in ``pod_spec``; empty when it passes."""
    problems = []
    pod_context = pod_spec.get("securityContext") or {}
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(host):
            problems.append(f"{host} is set")
    for volume in pod_spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            problems.append(f"volume {volume['name']} is of type {sorted(kinds)}")
    if pod_context.get("runAsUser") == 0:
        problems.append("the pod runs as user 0")
    containers = [*pod_spec.get("initContainers", []), *pod_spec.get("containers", [])]
    for c in containers:
        ctx = c.get("securityContext") or {}
        name = c["name"]
        if ctx.get("privileged"):
            problems.append(f"{name}: privileged")
        if ctx.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation is not false")
        if (ctx.get("runAsNonRoot", pod_context.get("runAsNonRoot"))) is not True:
            problems.append(f"{name}: runAsNonRoot is not true")
        if ctx.get("runAsUser") == 0:
            problems.append(f"{name}: runs as user 0")
        seccomp = (ctx.get("seccompProfile") or pod_context.get("seccompProfile") or {}).get("type")
        if seccomp not in ALLOWED_SECCOMP:
            problems.append(f"{name}: seccompProfile is {seccomp!r}, not RuntimeDefault or Localhost")
        capabilities = ctx.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            problems.append(f"{name}: capabilities do not drop ALL")
        if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            problems.append(f"{name}: adds capabilities {capabilities['add']}")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            problems.append(f"{name}: uses a hostPort")
    return problems
