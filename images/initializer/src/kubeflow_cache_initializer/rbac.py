"""What the initializer's Role must grant: every (API group, resource, verb) it calls, plus,
where an admission plugin asks for them, the verbs it never calls.

The chart's and the kustomize manifests' cache-initializer roles are checked against both lists
(the second only where the install turns it on), and the initializer's tests check that the calls
it makes are exactly REQUIRED_PERMISSIONS.
"""

REQUIRED_PERMISSIONS: list[tuple[str, str, str]] = [
    # The TrainJob's UID, for the owner references.
    ("trainer.kubeflow.org", "trainjobs", "get"),
    # The cache: created or adopted, watched until Available, joined (patch) when shared,
    # deleted when it can never become ready (unshared only); list re-syncs a watch after 410 Gone.
    ("leaderworkerset.x-k8s.io", "leaderworkersets", "get"),
    ("leaderworkerset.x-k8s.io", "leaderworkersets", "list"),
    ("leaderworkerset.x-k8s.io", "leaderworkersets", "watch"),
    ("leaderworkerset.x-k8s.io", "leaderworkersets", "create"),
    ("leaderworkerset.x-k8s.io", "leaderworkersets", "patch"),
    ("leaderworkerset.x-k8s.io", "leaderworkersets", "delete"),
    # The per-TrainJob Service: created or adopted, never patched (apply.NOT_PATCHED).
    ("", "services", "get"),
    ("", "services", "create"),
    # The cache pods' ServiceAccount: created or adopted, restored by patch, joined when shared.
    ("", "serviceaccounts", "get"),
    ("", "serviceaccounts", "create"),
    ("", "serviceaccounts", "patch"),
    # The Secret holding the cache's key, made once per cache (never read: `get` on Secrets
    # would read every Secret of the namespace).
    ("", "secrets", "create"),
    # The cache pods: ready count, hopeless states, the head's IP for its /status.
    ("", "pods", "list"),
    ("", "pods", "watch"),
]

# Not called, but asked of the calls above by the OwnerReferencesPermissionEnforcement admission
# plugin where it runs (OpenShift turns it on; upstream Kubernetes leaves it off): creating an
# object with ownerReferences, or changing its ownerReferences, needs `delete` on that object.
# The initializer creates the cache pods' ServiceAccount and the Service owned by the TrainJob and
# the key Secret owned by the cache (the LeaderWorkerSet's `delete` is a call of its own), and adds
# a TrainJob to the owners of a shared cache's ServiceAccount. Granted only where asked for
# (OWNER_REFERENCE_GRANT): `delete` on every Secret and Service of a namespace is a wide right.
ADMISSION_PERMISSIONS: list[tuple[str, str, str]] = [
    ("", "serviceaccounts", "delete"),
    ("", "services", "delete"),
    ("", "secrets", "delete"),
]
OWNER_REFERENCE_GRANT = (
    "grant it with `--set dataCache.ownerReferencePermissions=true` (Helm), or apply the kustomize overlay "
    "manifests/overlays/data-cache-openshift (the component manifests/components/owner-reference-permissions "
    "in an overlay of your own)"
)


def forbidden_hint(group: str, plural: str, verb: str, namespace: str, message: str) -> str | None:
    """What to do about a 403 on ``verb`` of ``plural`` in ``namespace``, from the API's message:
    a missing grant (RBAC), the owner-reference admission check, or a ResourceQuota; None for
    anything else (an admission webhook's denial speaks for itself)."""
    what = qualified(group, plural)
    if "exceeded quota" in message:
        return f"the ResourceQuota of namespace {namespace} does not admit it: raise the quota, or free what it counts"
    if "ownerRef" in message or "blockOwnerDeletion" in message:
        # OwnerReferencesPermissionEnforcement (OpenShift): setting owners needs `delete`.
        return (
            f"the OwnerReferencesPermissionEnforcement admission plugin (on in OpenShift) needs `delete` on {what} "
            f"besides `{verb}` for an object with owners: {OWNER_REFERENCE_GRANT}"
        )
    if f"cannot {verb} resource" not in message:
        return None
    if (group, plural, verb) not in REQUIRED_PERMISSIONS:
        return None  # not a call of ours; no advice beats wrong advice
    return f"the initializer's ServiceAccount may not `{verb}` {what} in namespace {namespace}: {bind_hint(namespace)}"


def qualified(group: str, plural: str) -> str:
    """`leaderworkersets.leaderworkerset.x-k8s.io`, or `pods` for the core group, as kubectl names them."""
    return f"{plural}.{group}" if group else plural


def bind_hint(namespace: str) -> str:
    """How to give the initializer's ServiceAccount its grants in ``namespace``."""
    return (
        "bind it to the cache-initializer ClusterRole there (Helm: list the namespace in `dataCache.namespaces`; "
        f"kustomize: `kubectl apply --server-side -k manifests/overlays/data-cache/namespace-rbac -n {namespace}`); "
        "where it is bound already, that ClusterRole is older than this initializer (or another project's of the "
        "same name): upgrade the chart, or apply the manifests again"
    )


def missing_grants(rules: list[dict]) -> list[tuple[str, str, str]]:
    """The REQUIRED_PERMISSIONS no rule of a SelfSubjectRulesReview's ``resourceRules`` grants.
    A rule limited to some objects (resourceNames) counts as granting: a role written that way
    is someone's choice, and the call itself says whether it is enough."""

    def grants(rule: dict, group: str, plural: str, verb: str) -> bool:
        return all(
            "*" in (rule.get(key) or ()) or want in (rule.get(key) or ())
            for key, want in (("apiGroups", group), ("resources", plural), ("verbs", verb))
        )

    return [needed for needed in REQUIRED_PERMISSIONS if not any(grants(r, *needed) for r in rules)]
