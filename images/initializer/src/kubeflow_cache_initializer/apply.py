"""Create-or-adopt: what the initializer creates survives its own restarts, and is checked when found.

`ensure` POSTs the desired object. On 409 it reads the existing one and decides:

* being deleted: wait (LeaderWorkerSet, with a watch) until it is gone, then create it again;
* owned by this TrainJob: adopt it, and patch it back to the desired spec if it drifted (a
  Service is never patched: its spec drifted is refused naming the fix, see NOT_PATCHED);
* shared cache: check it holds the same table, add this TrainJob as one more owner reference
  (a merge patch guarded by resourceVersion, retried on conflict), and use it as it is;
* anything else: `ForeignObjectError`, naming the object and its owners.

`create_or_keep` is for the cache's key Secret, which the initializer may create but not read.
"""

from __future__ import annotations

import logging
import random
import re
import time
from typing import Any

from kubernetes.utils import parse_quantity

from kubeflow_cache_initializer import constants as c
from kubeflow_cache_initializer import termination
from kubeflow_cache_initializer.builders import cluster_key_entry, with_cluster_key_entry
from kubeflow_cache_initializer.errors import (
    CacheTimeoutError,
    ForeignObjectError,
    InitializerError,
    KubeApiError,
    TerminatedError,
)
from kubeflow_cache_initializer.kube import LEADER_WORKER_SETS, TRANSIENT_STATUSES, Kube, Resource

log = logging.getLogger(__name__)
_MISSING = object()
# Where the cache's objects hold Kubernetes quantities: container resources.
_QUANTITY_PATH = re.compile(r"\.resources\.(?:requests|limits)\.[^\[\]]+$")


def differences(want: Any, have: Any, path: str = "") -> list[str]:
    """Paths where `want` is not contained in `have` (fields the server added are fine)."""
    if isinstance(want, dict):
        if not isinstance(have, dict):
            return [path or "."]
        return [d for key, value in want.items() for d in differences(value, have.get(key, _MISSING), f"{path}.{key}")]
    if isinstance(want, list):
        if not isinstance(have, list) or len(have) != len(want):
            return [path]
        return [d for i, (w, h) in enumerate(zip(want, have, strict=True)) for d in differences(w, h, f"{path}[{i}]")]
    return [] if want == have or _same_quantity(path, want, have) else [path]


def _same_quantity(path: str, want: Any, have: Any) -> bool:
    """A resource quantity the server stored in its canonical form: LeaderWorkerSet's webhook
    writes `0.5` back as `500m` and `4096Mi` as `4Gi`. The same amount, so no drift to restore
    (nor a shared cache that differs)."""
    if not (_QUANTITY_PATH.search(path) and isinstance(want, str) and isinstance(have, str)):
        return False
    try:
        return parse_quantity(want) == parse_quantity(have)
    except ValueError:
        return False


# Maps that must match exactly, not just contain ours: an extra selector key selects no pod.
EXACT_MAPS = {"Service": (("spec", "selector"),)}
# Kinds the initializer's Role may create but not patch. `patch` on Services would let any pod
# running as its ServiceAccount point every Service of the namespace at pods of its choosing
# (in `default`, the `kubernetes` Service, which the API server does not restore); a Service of
# ours that drifted is rare (edited by hand between two attempts of one initializer) and is
# refused naming the object to delete, or, where only labels or annotations differ, kept.
NOT_PATCHED = {"Service"}
# Fields of such a kind that an earlier version of the initializer did not set, kept as they are
# where they differ: refused, every attempt of a TrainJob resumed after an upgrade (Trainer builds
# its JobSet again from the runtime, new image included) failed on the Service it still owned.
KEPT_FROM_EARLIER_VERSIONS = frozenset({".spec.publishNotReadyAddresses"})


def _exact_map_extras(desired: dict, existing: dict) -> dict[tuple[str, ...], list[str]]:
    """For each exact map, the keys the existing object has that the desired one has not."""
    extras = {}
    for path in EXACT_MAPS.get(desired["kind"], ()):
        want, have = desired, existing
        for key in path:
            want, have = (want or {}).get(key) or {}, (have or {}).get(key) or {}
        if set(have) - set(want):
            extras[path] = sorted(set(have) - set(want))
    return extras


def _desired_fields(desired: dict) -> dict:
    """What adoption compares and restores: labels, annotations and the body (never names or owners)."""
    fields = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind", "metadata", "status")}
    meta = {k: desired["metadata"][k] for k in ("labels", "annotations") if k in desired["metadata"]}
    return {"metadata": meta, **fields}


def _describe(obj: dict) -> str:
    return f"{obj['kind']} {obj['metadata']['namespace']}/{obj['metadata']['name']}"


def _owners(obj: dict) -> list[dict]:
    return list(obj["metadata"].get("ownerReferences") or [])


def ensure(kube: Kube, resource: Resource, desired: dict, owner: dict, *, shared: bool, deadline: float) -> dict:
    """Create `desired` or adopt the object already there under its name; return what the API holds."""
    namespace, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
    while True:
        termination.raise_if_received()
        if time.monotonic() > deadline:
            raise CacheTimeoutError(f"gave up creating {_describe(desired)}: the deadline passed")
        try:
            created = kube.create(resource, namespace, desired)
            log.info("created %s", _describe(desired))
            return created
        except KubeApiError as err:
            if err.kind_not_served:
                raise InitializerError(
                    f"{err}: is the {resource.kind} API ({resource.api_version}) installed?"
                ) from err
            if not err.already_exists:  # a 404 naming an object (its namespace) says so itself
                raise
        try:
            existing = kube.get(resource, namespace, name)
        except KubeApiError as err:
            if err.not_found:  # deleted between our create and get: create it again
                continue
            raise
        if existing["metadata"].get("deletionTimestamp"):
            with termination.released():  # nothing made yet: a SIGTERM need not wait for the deletion
                _wait_deleted(kube, resource, existing, deadline)
            continue
        if not shared and _left_by_a_deleted_namesake(existing, owner):
            # A TrainJob deleted and made again under its name: the garbage collector deletes the
            # old one's objects in the background, with no deletionTimestamp to show for it.
            log.info(
                "%s belongs to an earlier TrainJob %s (deleted); waiting for the garbage collector to delete it",
                _describe(existing),
                owner["name"],
            )
            with termination.released():
                _wait_deleted(kube, resource, existing, deadline, collected=True)
            continue
        target = desired
        if resource == LEADER_WORKER_SETS:
            # Each run draws a new key Secret name: compared as it is, it would read as drift (and,
            # adopted, restart the pods of the cache). The key the cache was made with stays, in
            # whichever form it was made with (a Secret; the value itself, or none, from older runs).
            # Only for this adoption: a cache made again below, after this one vanished, takes the
            # new name, not the old cache's Secret, which the garbage collector deletes with it.
            target = with_cluster_key_entry(desired, cluster_key_entry(existing))
        try:
            if shared:
                return _join_shared(kube, resource, target, existing, owner)
            return _adopt_owned(kube, resource, target, existing, owner)
        except KubeApiError as err:
            # Gone between our get and patch: the garbage collector deletes a shared cache whose
            # last TrainJob went (in the background, so no deletionTimestamp was there to see).
            if not err.not_found:
                raise
            log.info("%s was deleted while adopting it; creating it again", _describe(existing))


def create_or_keep(kube: Kube, resource: Resource, desired: dict) -> None:
    """Create `desired`; one already there under its name is kept as it is, unread.

    For the cache's key Secret: its name is drawn per LeaderWorkerSet, so one already there was
    made for this very cache by an earlier run. Reading it would need `get` on Secrets, which
    reads every Secret of the namespace; the initializer's Role grants `create` only.
    """
    try:
        kube.create(resource, desired["metadata"]["namespace"], desired)
        log.info("created %s", _describe(desired))
    except KubeApiError as err:
        if err.already_exists:
            log.info("kept %s, created by an earlier run of this initializer", _describe(desired))
            return
        raise  # a 403 names the missing grant and its fix (rbac.forbidden_hint)


def _left_by_a_deleted_namesake(existing: dict, owner: dict) -> bool:
    """Whether every owner of ``existing`` is a TrainJob of ``owner``'s name but another uid: an
    earlier TrainJob of that name, so one that was deleted (a name is one object's at a time)."""
    owners = _owners(existing)
    return bool(owners) and all(
        ref.get("kind") == owner["kind"] and ref.get("name") == owner["name"] and ref.get("uid") != owner["uid"]
        for ref in owners
    )


def _adopt_owned(kube: Kube, resource: Resource, desired: dict, existing: dict, owner: dict) -> dict:
    owners = _owners(existing)
    if owner["uid"] not in {ref.get("uid") for ref in owners}:
        held_by = ", ".join(f"{r.get('kind')} {r.get('name')} (uid {r.get('uid')})" for r in owners) or "nobody"
        raise ForeignObjectError(
            f"{_describe(existing)} already exists and is not owned by {owner['kind']} {owner['name']} "
            f"(uid {owner['uid']}); it is owned by {held_by}. Delete it, or rename the TrainJob"
        )
    fields = _desired_fields(desired)
    drift = differences(fields, existing)
    for path, keys in _exact_map_extras(desired, existing).items():
        target = fields
        for key in path:
            target = target[key]
        target.update(dict.fromkeys(keys))  # null deletes the key in a merge patch
        drift += [".".join(("", *path, key)) for key in keys]
    if not drift:
        log.info("adopted %s, created by an earlier run of this initializer", _describe(existing))
        return existing
    if desired["kind"] in NOT_PATCHED:
        return _adopt_unpatched(existing, drift)
    log.info("adopted %s; restoring %s", _describe(existing), ", ".join(drift))
    return _patch_guarded(kube, resource, existing, lambda current: fields)


def _adopt_unpatched(existing: dict, drift: list[str]) -> dict:
    body = [path for path in drift if not path.startswith(".metadata") and path not in KEPT_FROM_EARLIER_VERSIONS]
    if body:
        meta = existing["metadata"]
        raise InitializerError(
            f"{_describe(existing)}, made for this TrainJob by an earlier attempt, differs from what this "
            f"attempt would create in {', '.join(body)} (edited since?), and the initializer may not change "
            f"{existing['kind']}s: delete it (kubectl delete {existing['kind'].lower()} {meta['name']} -n "
            f"{meta['namespace']}); the initializer's retry, or the TrainJob created again, makes it anew"
        )
    log.warning("adopted %s; its %s differ from this run's, kept as they are", _describe(existing), ", ".join(drift))
    return existing


def _join_shared(kube: Kube, resource: Resource, desired: dict, existing: dict, owner: dict) -> dict:
    want_table = {k: desired["metadata"]["annotations"][k] for k in (c.ANNOTATION_METADATA_LOC, c.ANNOTATION_TABLE)}
    have = existing["metadata"].get("annotations") or {}
    if any(have.get(k) != v for k, v in want_table.items()):
        raise ForeignObjectError(
            f"{_describe(existing)} exists but does not cache {want_table}: it holds "
            f"{ {k: have.get(k) for k in want_table} }; delete it, or turn DATA_CACHE_SHARED off"
        )
    drift = differences(_desired_fields(desired), existing)
    if drift:
        log.warning(
            "shared %s differs from this TrainJob's settings in %s; using it as it is",
            _describe(existing),
            ", ".join(drift),
        )

    def with_owner(current: dict) -> dict | None:
        refs = _owners(current)
        if owner["uid"] in {ref.get("uid") for ref in refs}:
            return None
        return {"metadata": {"ownerReferences": [*refs, owner]}}

    joined = _patch_guarded(kube, resource, existing, with_owner)
    log.info("joined shared %s as one more owner (%d owners)", _describe(joined), len(_owners(joined)))
    return joined


def _patch_guarded(kube: Kube, resource: Resource, current: dict, make_patch) -> dict:
    """Merge-patch with the object's resourceVersion as a precondition; re-read and retry on 409.

    Retried until the run's deadline (at least PATCH_CONFLICT_RETRIES times), after a pause that
    grows and is drawn at random: a sweep's TrainJobs joining one shared cache at once each win a
    round in turn, and five tries in a row with no pause failed a dozen joining together.
    """
    namespace, name = current["metadata"]["namespace"], current["metadata"]["name"]
    pause, tries = c.PATCH_CONFLICT_PAUSE_SECONDS, 0
    while True:
        patch = make_patch(current)
        if patch is None:
            return current
        patch.setdefault("metadata", {})["resourceVersion"] = current["metadata"]["resourceVersion"]
        try:
            return kube.patch(resource, namespace, name, patch)
        except KubeApiError as err:
            if not err.conflict:
                raise
        tries += 1
        left = (kube.deadline - time.monotonic()) if kube.deadline is not None else 0.0
        if tries >= c.PATCH_CONFLICT_RETRIES and left <= 0:
            raise InitializerError(f"{_describe(current)} kept changing; gave up after {tries} patches")
        time.sleep(min(random.uniform(0, pause), max(left, 0.0)))
        pause = min(pause * 2, c.PATCH_CONFLICT_MAX_PAUSE_SECONDS)
        current = kube.get(resource, namespace, name)


def _watch_broke(err: Exception, remaining: float) -> None:
    """A watch that broke: read the object again (below) and watch again, after a pause."""
    log.info("the watch broke (%s); reading it again", err)
    time.sleep(min(remaining, c.GONE_POLL_SECONDS))


def _wait_deleted(kube: Kube, resource: Resource, existing: dict, deadline: float, collected: bool = False) -> None:
    """Wait for an object being deleted to go: a shared cache whose last owner went away, or
    (``collected``) one the garbage collector is to delete, its owner gone. LeaderWorkerSets
    with a watch; other kinds, which the initializer may not watch, by reading them again."""
    namespace, name = existing["metadata"]["namespace"], existing["metadata"]["name"]
    if resource != LEADER_WORKER_SETS and not collected:
        raise InitializerError(f"{_describe(existing)} is being deleted; run the initializer again once it is gone")
    if not collected:
        log.info("%s is being deleted; waiting for it to go before creating it again", _describe(existing))
    version = existing["metadata"]["resourceVersion"]
    while True:
        termination.raise_if_received()  # one whose raise the last turn's log line swallowed
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            why = (
                "its owner is gone, so the garbage collector (kube-controller-manager) should have deleted it: "
                "check that it runs, or delete the object by hand"
                if collected
                else "its finalizers (or dependents, in a foreground deletion) have not finished"
            )
            raise CacheTimeoutError(f"{_describe(existing)} was still there at the deadline; {why}")
        if resource == LEADER_WORKER_SETS:
            seconds = max(1, min(int(remaining), c.MAX_WATCH_SECONDS))
            try:
                with kube.watch(
                    resource, namespace, version, seconds, field_selector=f"metadata.name={name}"
                ) as stream:
                    for kind, obj in stream:
                        if kind == "DELETED":
                            return
                        if kind == "ERROR":
                            break
                        version = obj["metadata"]["resourceVersion"]
            except KubeApiError as err:
                # 410: our version is too old, said as the HTTP status (as some API servers and
                # proxies do): the object is read again below, as for a broken watch.
                if err.status not in TRANSIENT_STATUSES and not err.gone:
                    raise
                _watch_broke(err, remaining)
            except TerminatedError:
                raise  # a SIGTERM is no broken watch: it took the whole wait to be seen
            except Exception as err:  # a dropped connection, as the cache's own wait takes it (wait._Watcher)
                _watch_broke(err, remaining)
        else:
            time.sleep(min(remaining, c.GONE_POLL_SECONDS))
        try:
            current = kube.get(resource, namespace, name)
        except KubeApiError as err:
            if err.not_found:
                return
            raise
        if current["metadata"]["uid"] != existing["metadata"]["uid"]:
            return  # gone, and made again meanwhile (a restarted run of ours): ensure looks at it anew
        version = current["metadata"]["resourceVersion"]
