"""Every (API group, resource, verb) the initializer calls: what its Role must grant.

The chart's and the kustomize manifests' cache-initializer roles are checked against this list,
and the initializer's tests check that the calls it makes are exactly these.
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
    # The per-TrainJob Service and the cache pods' ServiceAccount: created or adopted, restored by patch.
    ("", "services", "get"),
    ("", "services", "create"),
    ("", "services", "patch"),
    ("", "serviceaccounts", "get"),
    ("", "serviceaccounts", "create"),
    ("", "serviceaccounts", "patch"),
    # The cache pods: ready count, hopeless states, the head's IP for its /status.
    ("", "pods", "list"),
    ("", "pods", "watch"),
]
