"""The initializer's steps: find the TrainJob, create or adopt the cache, wait until it is ready."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from kubeflow_cache_initializer import constants as c
from kubeflow_cache_initializer import termination
from kubeflow_cache_initializer.apply import create_or_keep, ensure
from kubeflow_cache_initializer.builders import (
    CacheNames,
    build_cluster_key_secret,
    build_leader_worker_set,
    build_service,
    build_service_account,
    cache_names,
    key_secret_of,
    new_cluster_key,
    new_key_secret_name,
    owner_reference,
)
from kubeflow_cache_initializer.config import Config, is_secret_name
from kubeflow_cache_initializer.errors import (
    CacheDeletedError,
    CacheFailedError,
    CacheTimeoutError,
    ConfigError,
    ForeignObjectError,
    KubeApiError,
    MissingGrantsError,
    TrainJobNotFoundError,
)
from kubeflow_cache_initializer.kube import (
    LEADER_WORKER_SETS,
    SECRETS,
    SELF_SUBJECT_RULES_REVIEWS,
    SERVICE_ACCOUNTS,
    SERVICES,
    TRAINJOBS,
    Kube,
)
from kubeflow_cache_initializer.rbac import bind_hint, missing_grants, qualified
from kubeflow_cache_initializer.wait import wait_until_ready

log = logging.getLogger(__name__)
# How long the delete of a failed run's dedicated cache may be retried through an API outage.
CLEANUP_SECONDS = 30.0
# Each cleanup request's own limit (30 s otherwise): a delete sent into a hung API at the end of
# CLEANUP_SECONDS still ends within the initializer pod's grace after a SIGTERM (the runtime's
# terminationGracePeriodSeconds, 90: the watchers' 2 s, 30 s of retries, and a last call, which
# urllib3 may send 4 times where it cannot connect, kube.API_RETRIES: about 23 s).
CLEANUP_REQUEST_TIMEOUT_SECONDS = 5.0


@dataclass(frozen=True)
class CacheReady:
    """A cache that serves: where the trainer finds it, and what the head reported."""

    cache: str
    service: str
    flight_url: str
    status: dict | None  # None: taken as ready from the LeaderWorkerSet alone (/status unreachable)


def get_train_job(kube: Kube, cfg: Config) -> dict:
    try:
        return kube.get(TRAINJOBS, cfg.namespace, cfg.train_job_name)
    except KubeApiError as err:
        if err.kind_not_served:
            raise TrainJobNotFoundError(
                f"the cluster does not serve the TrainJob API ({TRAINJOBS.api_version}): install Kubeflow Trainer "
                f"at a version that serves it (the chart's trainer, v2.1), or use an initializer image made for "
                f"the Trainer installed ({err})"
            ) from err
        if err.not_found:
            raise TrainJobNotFoundError(
                f"TrainJob {cfg.train_job_name} not found in namespace {cfg.namespace}: "
                "`TRAIN_JOB_NAME` must name the TrainJob this initializer runs for"
            ) from err
        raise


def with_dataset_secret(cfg: Config, train_job: dict) -> Config:
    """``cfg`` with the TrainJob's ``spec.initializer.dataset.secretRef`` among the cache pods'
    env Secrets: the Trainer hands it to this container as envFrom, the Kubeflow way to give a
    dataset's credentials, and the cache pods are the ones that read the store. Left out, they
    read it with no credentials while this pod had them, and their refusal said none were set.
    Credentials seen here and given no way to the cache pods are said in a warning."""
    dataset = ((train_job.get("spec") or {}).get("initializer") or {}).get("dataset") or {}
    secret = (dataset.get("secretRef") or {}).get("name")
    if secret and not is_secret_name(secret):
        raise ConfigError(
            f"TrainJob {cfg.train_job_name}'s spec.initializer.dataset.secretRef.name should be a Secret name "
            f"(a DNS-1123 subdomain), got {secret!r}"
        )
    if secret and secret not in cfg.env_from_secrets:
        log.info("the cache pods read Secret %s, the TrainJob's dataset secretRef, as env", secret)
        cfg = replace(cfg, env_from_secrets=(*cfg.env_from_secrets, secret))
    if cfg.credentials_seen and not cfg.env_from_secrets and cfg.iam_role is None:
        log.warning(
            "%s set here never go into a pod spec, and nothing gives the cache pods credentials of their own: "
            "put them in a Secret named by the TrainJob's spec.initializer.dataset.secretRef or by "
            "CACHE_ENV_FROM_SECRET, or set IAM_ROLE; the cache reads the store with the AWS SDK's default chain",
            ", ".join(cfg.credentials_seen),
        )
    return cfg


def check_grants(kube: Kube, cfg: Config) -> None:
    """Refuse to start where the ServiceAccount lacks a grant the run needs, naming all of them,
    before anything is made. Found at the call that needs it, the run had made the Service and
    the cache by then, and with `delete` missing too (upstream Trainer's role of the same name
    grants neither Secrets nor that) its cleanup failed: the cache pods held their requests until
    the TrainJob was deleted.

    Where the API does not answer the review (an authorizer that refuses it), or says its rules
    are incomplete (a webhook authorizer's are not listed), the calls themselves say what is missing.
    """
    body = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SelfSubjectRulesReview",
        "spec": {"namespace": cfg.namespace},
    }
    try:
        review = kube.create(SELF_SUBJECT_RULES_REVIEWS, cfg.namespace, body)
    except KubeApiError as err:
        if err.status == 0 or err.status >= 500:
            raise  # the API is down: so would every call after this be
        log.info("could not list this ServiceAccount's grants up front (%s); the calls will say", err)
        return
    status = review.get("status") or {}
    missing = missing_grants(status.get("resourceRules") or [])
    if not missing:
        return
    if status.get("incomplete"):
        log.info("the API lists this ServiceAccount's grants incompletely; the calls will say what is missing")
        return
    listed = ", ".join(f"`{verb}` {qualified(group, plural)}" for group, plural, verb in missing)
    raise MissingGrantsError(
        f"the initializer's ServiceAccount may not {listed} in namespace {cfg.namespace}, which it needs; "
        f"nothing was made: {bind_hint(cfg.namespace)}"
    )


def check_no_name_clash(kube: Kube, cfg: Config, names: CacheNames) -> None:
    """Refuse to run where another TrainJob already holds one of the cache's names (or another
    Service the name of the cache's LeaderWorkerSet: _check_cache_subdomain).

    Trainer names a TrainJob's JobSet after it, and the JobSet names its headless Service after
    itself; the LeaderWorkerSet names its own headless Service after itself too. So TrainJob
    `foo-cache` and the cache of TrainJob `foo` (LeaderWorkerSet `foo-cache`) would share one
    Service name: whichever comes second finds the Service there and one side's DNS breaks.
    """
    for name, ours in ((names.cache, "the cache's LeaderWorkerSet"), (names.service, "the cache's Service")):
        if name == cfg.train_job_name:
            continue
        try:
            kube.get(TRAINJOBS, cfg.namespace, name)
        except KubeApiError as err:
            if err.not_found:
                continue
            raise
        raise ForeignObjectError(
            f"TrainJob {name} exists in namespace {cfg.namespace}, and {ours} for TrainJob "
            f"{cfg.train_job_name} takes the same name: their headless Services would collide and break "
            f"each other's DNS. Rename one of the two TrainJobs (no TrainJob may be named like another's "
            f"plus `{c.CACHE_NAME_SUFFIX}` or `{c.SERVICE_NAME_SUFFIX}`)"
        )
    _check_cache_subdomain(kube, cfg, names)
    _check_own_subdomain(kube, cfg)


def _check_cache_subdomain(kube: Kube, cfg: Config, names: CacheNames) -> None:
    """Any other Service already named like the cache's LeaderWorkerSet (an app's `foo-cache`).

    The LeaderWorkerSet controller makes its headless Service only where none of that name
    exists, and takes one that does as it is, whatever it selects: the cache pods would get no
    DNS names under it, and the data nodes would never resolve the head's `LWS_LEADER_ADDRESS`.
    """
    # The LeaderWorkerSet's own (a shared cache, or a previous run's being replaced) is no clash.
    foreign = _foreign_subdomain_service(kube, cfg.namespace, names.cache, c.LWS_NAME_LABEL)
    if foreign is None:
        return
    _, selector = foreign
    raise ForeignObjectError(
        f"Service {cfg.namespace}/{names.cache} exists and selects {selector or 'nothing'}, not the pods of "
        f"the cache's LeaderWorkerSet {names.cache}: the LeaderWorkerSet controller would keep it as the cache's "
        f"DNS subdomain, and the data nodes could not resolve the head. Rename that Service, or this TrainJob "
        f"(its cache is named `{cfg.train_job_name}{c.CACHE_NAME_SUFFIX}`)"
    )


def _check_own_subdomain(kube: Kube, cfg: Config) -> None:
    """The same clash the other way round: this TrainJob is named like another's cache.

    JobSet takes a Service already under its subdomain (the JobSet's name, so this TrainJob's) as
    its own, whatever it selects. The cache Service or LeaderWorkerSet of TrainJob `foo` would
    then stand for TrainJob `foo-cache`'s subdomain, selecting none of its pods: their hostnames
    would not resolve, and torch's rendezvous would fail on them after the cache came up.
    """
    # None where there is none yet (or no DNS hostnames for this TrainJob), or it is the JobSet's own.
    foreign = _foreign_subdomain_service(kube, cfg.namespace, cfg.train_job_name, c.JOBSET_NAME_LABEL)
    if foreign is None:
        return
    service, selector = foreign
    owners = ", ".join(
        f"{ref.get('kind')} {ref.get('name')}" for ref in service["metadata"].get("ownerReferences") or []
    )
    raise ForeignObjectError(
        f"Service {cfg.namespace}/{cfg.train_job_name} (owned by {owners or 'nobody'}) has this TrainJob's name "
        f"but selects {selector or 'nothing'}, not this TrainJob's pods: their hostnames would not resolve and "
        f"the training's rendezvous would fail. Rename this TrainJob (no TrainJob may be named like another's "
        f"plus `{c.CACHE_NAME_SUFFIX}` or `{c.SERVICE_NAME_SUFFIX}`)"
    )


def _foreign_subdomain_service(kube: Kube, namespace: str, name: str, owner_label: str) -> tuple[dict, dict] | None:
    """The Service ``name`` and its selector, where one exists that does not select the pods
    labelled ``owner_label=name`` (those of the controller whose subdomain that name is)."""
    try:
        service = kube.get(SERVICES, namespace, name)
    except KubeApiError as err:
        if err.not_found:
            return None
        raise
    selector = service.get("spec", {}).get("selector") or {}
    return None if selector.get(owner_label) == name else (service, selector)


def run(kube: Kube, cfg: Config) -> CacheReady:
    """Bring the cache up for the TrainJob and return once it serves; raise `InitializerError` otherwise."""
    deadline = time.monotonic() + cfg.ready_timeout_seconds
    # An API server or webhook restarting (no answer, 429, 5xx) is waited out, up to this run's deadline.
    kube.deadline = deadline
    # A SIGTERM whose raise a retry's warning swallowed ends the retries (it waited out the deadline).
    kube.before_retry = termination.raise_if_lost
    names = cache_names(cfg)
    check_grants(kube, cfg)
    train_job = get_train_job(kube, cfg)
    cfg = with_dataset_secret(cfg, train_job)
    check_no_name_clash(kube, cfg, names)
    log.info(
        "%s cache %s for TrainJob %s: table %s.%s at %s, 1 head + %d data nodes",
        "shared" if cfg.shared else "dedicated",
        names.cache,
        cfg.train_job_name,
        cfg.schema_name,
        cfg.table_name,
        cfg.metadata_loc,
        cfg.data_nodes,
    )
    # A shared cache has one owner reference per TrainJob and no controller; a dedicated one, its TrainJob.
    cache_owner = owner_reference(train_job, controller=not cfg.shared)
    job_owner = owner_reference(train_job, controller=True)
    ensure(
        kube,
        SERVICE_ACCOUNTS,
        build_service_account(cfg, [cache_owner]),
        cache_owner,
        shared=cfg.shared,
        deadline=deadline,
    )
    # The Service first: it holds no resources, so a refusal here (a foreign Service under its
    # name) leaves no cache pods behind; once the LeaderWorkerSet exists, any failure deletes it.
    ensure(kube, SERVICES, build_service(cfg, [job_owner]), job_owner, shared=False, deadline=deadline)
    cache = None
    try:
        with termination.held(kube):  # a SIGTERM is raised once the cache is made, and so deleted below
            cache = ensure(
                kube,
                LEADER_WORKER_SETS,
                build_leader_worker_set(cfg, [cache_owner], new_key_secret_name(cfg)),
                cache_owner,
                shared=cfg.shared,
                deadline=deadline,
            )
        _ensure_key_secret(kube, cfg, cache)
        status = wait_until_ready(kube, cfg, deadline)
        termination.raise_if_received()  # one whose raise a log line of the last turn swallowed
    except Exception as err:
        # Whatever ended the wait (a hopeless pod, the deadline, an API error such as a missing
        # watch grant, something unforeseen), this run reports failure and its dedicated cache
        # would hold its CPU and memory until the TrainJob is deleted. A retried initializer
        # creates it again.
        if cache is None:
            raise  # none made: refused (another's under its name), or the API failed us
        if not cfg.shared:
            _delete_cache(kube, cfg, names.cache, cache["metadata"]["uid"], err)
        elif not _made_by_another(cache, train_job):
            if _hopeless(err) and _delete_made(kube, cfg, names.cache, cache, err):
                # Made with this job's settings, which no retry cures: kept for the jobs that
                # joined it, it held its pods while each of them failed on it, and their retries
                # joined it again. Deleted, their waits end, and a retry may make it anew.
                raise type(err)(
                    f"{err}. Shared cache {names.cache}, made with this TrainJob's settings, was deleted; a "
                    "TrainJob that had joined it may make it anew, with its own settings, when it runs again"
                ) from err
            # Made by this job, maybe joined since: freed as a dedicated one is, unless another
            # TrainJob now uses it (a deadline that passed says nothing of theirs). Left in place,
            # it held its pods, and every later job for the table joined it and failed the same way.
            _delete_shared_unless_joined(kube, cfg, names.cache, train_job, err)
        elif _hopeless(err) or isinstance(err, CacheTimeoutError):
            # Kept for its other owners, so every later job for this table joins it too, and this
            # job's settings do not apply: the usual fix (more memory, another image) won't.
            raise type(err)(
                f"{err}. This TrainJob joined shared cache {names.cache}, made by another TrainJob with "
                f"that one's settings, which this job's do not change: once its jobs are done with it, "
                f"`kubectl delete leaderworkerset -n {cfg.namespace} {names.cache}` and run again, "
                "so that the cache is made anew with this job's settings"
            ) from err
        raise
    return CacheReady(cache=names.cache, service=names.service, flight_url=names.flight_url, status=status)


def _start_cleanup(kube: Kube) -> None:
    """Give a cleanup's calls their own CLEANUP_SECONDS of retries (the run's deadline has usually
    passed by then, and an API outage may be what ended it), and let no SIGTERM end them, one
    that came (it may be what this cleanup is for) or one to come (termination.cleaning_up)."""
    termination.cleaning_up()
    kube.deadline = time.monotonic() + CLEANUP_SECONDS
    kube.request_timeout = min(kube.request_timeout, CLEANUP_REQUEST_TIMEOUT_SECONDS)
    kube.before_retry = None


def _hopeless(err: Exception) -> bool:
    """Whether the cache failed in a way no retry with its settings cures (a pod OOM-killed or
    exiting, an image that cannot be pulled, a load error), rather than being deleted under us."""
    return isinstance(err, CacheFailedError) and not isinstance(err, CacheDeletedError)


def _made_by_another(cache: dict, train_job: dict) -> bool:
    """Whether another TrainJob made this shared cache, with its settings: its first owner, as
    joins add theirs after it. Any other owner counted once, and the maker's retry, after a
    join, was told the settings at fault were another job's. (Once the maker's TrainJob is gone,
    the garbage collector drops its reference, and the earliest joiner left stands for it.)"""
    owners = cache["metadata"].get("ownerReferences") or []
    return bool(owners) and owners[0].get("uid") != train_job["metadata"]["uid"]


def _owned_by_another(cache: dict, train_job: dict) -> bool:
    """Whether a shared cache has an owner other than this TrainJob: another job uses it."""
    ours = train_job["metadata"]["uid"]
    return any(ref.get("uid") != ours for ref in cache["metadata"].get("ownerReferences") or [])


def _ensure_key_secret(kube: Kube, cfg: Config, cache: dict) -> None:
    """The Secret the cache's pods read their key from: made with a fresh key, or kept.

    Made right after the LeaderWorkerSet, as its owner needs the UID the API gave it; its pods
    are not started by then (a kubelet that got there first waits on a missing Secret and tries
    again, and wait.py gives such a config error time to pass). A cache made by an older
    initializer (the key in its env, or no key) reads no Secret and gets none.
    """
    name = key_secret_of(cache)
    if name is not None:
        create_or_keep(kube, SECRETS, build_cluster_key_secret(cfg, name, cache, new_cluster_key()))


def _delete_shared_unless_joined(kube: Kube, cfg: Config, name: str, train_job: dict, failure: Exception) -> None:
    """Delete a shared cache whose only owner is this TrainJob. The delete holds only for the
    LeaderWorkerSet as read (its resourceVersion): a TrainJob joining in between changes it, the
    API answers 409, and the cache is read again and kept for that job."""
    _start_cleanup(kube)
    for _ in range(c.PATCH_CONFLICT_RETRIES):
        try:
            current = kube.get(LEADER_WORKER_SETS, cfg.namespace, name)
            if _owned_by_another(current, train_job):
                log.info("kept shared LeaderWorkerSet %s: another TrainJob uses it now", name)
                return
            meta = current["metadata"]
            kube.delete(
                LEADER_WORKER_SETS,
                cfg.namespace,
                name,
                preconditions={"uid": meta["uid"], "resourceVersion": meta["resourceVersion"]},
            )
            log.info("deleted shared LeaderWorkerSet %s, which no other TrainJob uses, to free its pods", name)
            return
        except KubeApiError as err:
            if err.not_found:
                return
            if not err.conflict:
                _left_undeleted(failure, cfg, name, err)
                return
    log.warning("kept shared LeaderWorkerSet %s: it kept changing while being deleted", name)


def _delete_made(kube: Kube, cfg: Config, name: str, cache: dict, failure: Exception) -> bool:
    """Delete the shared cache this run made (``cache``, by its uid), whoever joined it since;
    False where it is gone or another made one anew under its name (kept: not this job's)."""
    _start_cleanup(kube)
    try:
        kube.delete(LEADER_WORKER_SETS, cfg.namespace, name, preconditions={"uid": cache["metadata"]["uid"]})
    except KubeApiError as err:
        if not (err.not_found or err.conflict):
            _left_undeleted(failure, cfg, name, err)
        return False
    log.info("deleted shared LeaderWorkerSet %s, which failed with this TrainJob's settings", name)
    return True


def _delete_cache(kube: Kube, cfg: Config, name: str, uid: str, failure: Exception) -> None:
    """Free a dedicated cache's pods once it can no longer serve: the TrainJob fails, its cache goes.

    The run's deadline has usually passed by now, and an API outage may be what ended it: the
    delete gets its own CLEANUP_SECONDS of retries. Only the cache this run made (its uid): a
    TrainJob deleted and made again under its name has a new initializer, whose cache an old
    one's delete, retried through an outage, removed.
    """
    _start_cleanup(kube)
    try:
        kube.delete(LEADER_WORKER_SETS, cfg.namespace, name, preconditions={"uid": uid})
        log.info("deleted LeaderWorkerSet %s so that its pods free their resources", name)
    except KubeApiError as err:
        if err.conflict:
            log.info("kept LeaderWorkerSet %s: it is another run's, made anew under its name since", name)
        elif not err.not_found:
            _left_undeleted(failure, cfg, name, err)


def _left_undeleted(failure: Exception, cfg: Config, name: str, err: KubeApiError) -> None:
    """Say that the cleanup's delete of LeaderWorkerSet ``name`` failed: in the log, and as a
    note of the run's ``failure`` (after its reason, in the termination message), with the
    command that frees the pods. Once: a shared cache's cleanup may try twice."""
    log.warning("could not delete LeaderWorkerSet %s: %s", name, err)
    note = (
        f"LeaderWorkerSet {name} could not be deleted (HTTP {err.status} {err.reason}) and holds its "
        f"pods' resources: `kubectl delete leaderworkerset -n {cfg.namespace} {name}`"
    )
    if note not in getattr(failure, "__notes__", ()):
        failure.add_note(note)
