"""The initializer end to end against the fake API: a ready cache, hopeless caches, timeouts."""

from __future__ import annotations

import re
import time

import pytest

from kubeflow_cache_initializer.constants import COMPONENT_HEAD, LABEL_COMPONENT

from .fake_k8s import RULES_REVIEW
from .fake_k8s_rules import ApiFailure
from .support import NAMESPACE, add_train_job, initializer_env


def _owner_uids(obj: dict) -> list[str]:
    return [ref["uid"] for ref in obj["metadata"].get("ownerReferences", [])]


def test_a_healthy_cache_exits_0_with_everything_owned_by_the_train_job(fake, make_sim, run_initializer, caplog):
    job = add_train_job(fake, "job-a")
    sim = make_sim("healthy")

    code, error = run_initializer(initializer_env(sim))

    assert (code, error) == (0, "")
    assert fake.rejected == []
    uid = job["metadata"]["uid"]
    sa = fake.get("serviceaccounts", NAMESPACE, "job-a-cache")
    lws = fake.get("leaderworkersets", NAMESPACE, "job-a-cache")
    service = fake.get("services", NAMESPACE, "job-a-cache-service")
    for obj in (sa, lws, service):
        assert _owner_uids(obj) == [uid]
        assert obj["metadata"]["ownerReferences"][0]["controller"] is True
    assert sim.created == ["job-a-cache"]
    # The Service selects the head pod and only it.
    head_pods = [
        p for p in fake.items("pods", NAMESPACE)
        if all(p["metadata"]["labels"].get(k) == v for k, v in service["spec"]["selector"].items())
    ]  # fmt: skip
    assert [p["metadata"]["labels"][LABEL_COMPONENT] for p in head_pods] == [COMPONENT_HEAD]
    # The pods' progress is logged; not necessarily 3/3: the LeaderWorkerSet's Available may be
    # seen (and end the wait) before the pod watch delivers the last pod's readiness.
    assert re.search(r"[0-3]/3 cache pods ready", caplog.text)
    assert "head ready: 2/2 data nodes loaded, 2,000 rows" in caplog.text
    assert "ready at grpc://job-a-cache-service:50051" in caplog.text


def test_the_cache_pods_land_where_the_admin_placed_them(fake, make_sim, run_initializer):
    """CACHE_NODE_SELECTOR and CACHE_TOLERATIONS reach both pod templates, accepted by the LWS schema."""
    add_train_job(fake, "job-a")
    env = initializer_env(
        make_sim("healthy"),
        CACHE_NODE_SELECTOR="node.kubernetes.io/pool=cache",
        CACHE_TOLERATIONS='[{"key": "dedicated", "value": "cache", "effect": "NoSchedule"}]',
    )
    code, error = run_initializer(env)

    assert (code, error) == (0, "")
    assert fake.rejected == []
    template = fake.get("leaderworkersets", NAMESPACE, "job-a-cache")["spec"]["leaderWorkerTemplate"]
    for pod in (template["leaderTemplate"]["spec"], template["workerTemplate"]["spec"]):
        assert pod["nodeSelector"] == {"node.kubernetes.io/pool": "cache"}
        assert pod["tolerations"] == [{"key": "dedicated", "value": "cache", "effect": "NoSchedule"}]


def test_deleting_the_train_job_removes_everything_the_initializer_made(fake, make_sim, run_initializer):
    add_train_job(fake, "job-a")
    assert run_initializer(initializer_env(make_sim("healthy")))[0] == 0

    fake.delete("trainjobs", NAMESPACE, "job-a")

    for plural in ("serviceaccounts", "leaderworkersets", "services", "pods"):
        assert fake.items(plural, NAMESPACE) == [], plural


HOPELESS = [
    ("image_pull", "cannot pull image ghcr.io/example/data-cache:0.1.0: ErrImagePull: manifest unknown"),
    ("invalid_image", "cannot pull image ghcr.io/example/data-cache:0.1.0: InvalidImageName"),
    ("oom", "cache pod job-a-cache-0-2 was OOMKilled: its memory limit is too small (raise WORKER_MEM)"),
    ("unschedulable", "cache pod job-a-cache-0-1 is unschedulable: 0/3 nodes are available: 3 Insufficient memory."),
    # After CACHE_UNSCHEDULABLE_GRACE_SECONDS (0.3 s in these tests): a StatefulSet makes it again.
    ("evicted", "cache pod job-a-cache-0-1 failed: Evicted The node was low on resource: memory. (for "),
    ("node_load_error", "cache pod job-a-cache-0-1 exited with code 1: load failed: NoSuchKey data/0.parquet"),
    ("exits_0", "cache pod job-a-cache-0-1 keeps exiting with code 0 (CrashLoopBackOff)"),
    ("head_load_error", "failed load: AccessDenied reading s3://bucket/data/0.parquet"),
]


@pytest.mark.parametrize(("scenario", "reason"), HOPELESS, ids=[s for s, _ in HOPELESS])
def test_a_hopeless_cache_fails_at_once_with_the_reason_and_is_deleted(
    fake, make_sim, run_initializer, scenario, reason
):
    add_train_job(fake, "job-a")
    # A long deadline: the run must end because the state is hopeless, not because time ran out.
    code, error = run_initializer(initializer_env(make_sim(scenario), CACHE_READY_TIMEOUT_SECONDS="120"))

    assert code != 0
    assert reason in error
    assert fake.get("leaderworkersets", NAMESPACE, "job-a-cache") is None
    assert fake.items("pods", NAMESPACE) == []


def test_a_ready_pod_that_was_oom_killed_once_is_history_not_a_failure(fake, make_sim, run_initializer):
    """Its container's last state says OOMKilled, but it restarted and is ready: failing the run
    (and deleting the cache) for one OOM kill while starting would throw away a working cache."""
    add_train_job(fake, "job-a")
    code, error = run_initializer(initializer_env(make_sim("recovered_oom"), CACHE_READY_TIMEOUT_SECONDS="120"))
    assert code == 0, error
    assert fake.get("leaderworkersets", NAMESPACE, "job-a-cache") is not None


def test_a_cache_that_never_gets_ready_times_out_with_its_progress(fake, make_sim, run_initializer):
    add_train_job(fake, "job-a")

    code, error = run_initializer(initializer_env(make_sim("stuck"), CACHE_READY_TIMEOUT_SECONDS="3"))

    assert code != 0
    assert "not ready within CACHE_READY_TIMEOUT_SECONDS=3" in error
    assert re.search(r"\d/3 cache pods ready .*; head (loading: 0/2 data nodes loaded|status not available)", error)
    if "head loading" in error:
        # How far the loading node has read (the head's own totals stay 0 until a node is done),
        # and the head's detail: a read that waits on storage is the lead an admin needs.
        assert "0/2 data nodes loaded, 500 rows" in error
        assert "data node 0 has waited 42s on a read of s3://bucket/data/0.parquet" in error
    # Each pod that is not ready is named with what it waits on.
    assert "job-a-cache-0-1 running, not ready" in error
    assert fake.get("leaderworkersets", NAMESPACE, "job-a-cache") is None


def test_a_ready_head_is_not_enough_while_the_leader_worker_set_is_not_available(fake, make_sim, run_initializer):
    add_train_job(fake, "job-a")

    code, error = run_initializer(initializer_env(make_sim("not_available"), CACHE_READY_TIMEOUT_SECONDS="3"))

    assert code != 0
    assert "not ready within CACHE_READY_TIMEOUT_SECONDS=3" in error


def test_watches_resume_after_the_api_server_forgets_their_version(fake, make_sim, run_initializer):
    """All watches end and history is compacted mid-load: 410 Gone, re-list, watch on, succeed."""
    add_train_job(fake, "job-a")

    code, error = run_initializer(initializer_env(make_sim("compaction")))

    assert (code, error) == (0, "")
    assert ("leaderworkerset.x-k8s.io", "leaderworkersets", "list") in fake.calls
    assert fake.calls.count(("", "pods", "list")) >= 2


def test_a_watch_the_api_server_answers_503_is_retried(fake, make_sim, run_initializer):
    """The compaction scenario goes on only once both watches are open, so the retry is needed."""
    add_train_job(fake, "job-a")
    fake.fail_next[("pods", "watch")] = [503]

    assert run_initializer(initializer_env(make_sim("compaction"))) == (0, "")
    assert fake.fail_next[("pods", "watch")] == []


def test_a_watch_the_api_server_answers_410_gone_lists_again(fake, make_sim, run_initializer):
    """Some API servers and proxies answer a watch from a forgotten version with the HTTP status,
    not an ERROR event in the stream: the same news, so list again and watch on (it failed the
    run)."""
    add_train_job(fake, "job-a")
    fake.fail_next[("pods", "watch")] = [410]

    assert run_initializer(initializer_env(make_sim("compaction"))) == (0, "")
    assert fake.fail_next[("pods", "watch")] == []
    assert fake.calls.count(("", "pods", "list")) >= 2


def test_a_watch_the_api_server_answers_410_gone_every_time_backs_off_and_is_named(fake, make_sim, run_initializer):
    """A proxy that answers 410 to every watch, fresh version or not: listed again without a pause
    until the deadline, and the timeout said nothing of it."""
    add_train_job(fake, "job-a")
    fake.fail_next[("pods", "watch")] = [410] * 10_000

    code, error = run_initializer(initializer_env(make_sim("stuck"), CACHE_READY_TIMEOUT_SECONDS="3"))

    assert code != 0
    assert "answered 410 Gone again after a fresh list" in error, error
    assert fake.calls.count(("", "pods", "list")) <= 4  # one at the start, then one per backed-off retry


def test_a_missing_train_job_is_named(fake, run_initializer):
    code, error = run_initializer(initializer_env(None, train_job="nope"))

    assert code != 0
    assert error.startswith(f"TrainJob nope not found in namespace {NAMESPACE}")
    assert fake.calls == [RULES_REVIEW, ("trainer.kubeflow.org", "trainjobs", "get")]


def test_a_role_without_needed_grants_is_refused_naming_them_all_before_anything_is_made(fake, run_initializer):
    """Upstream Trainer's role of the same name grants no Secrets, pods, nor the cache's patch and
    delete: found at the calls that needed them, the Service and the cache were made by then, and
    the failed delete left the cache's pods holding their requests."""
    add_train_job(fake, "job-a")
    fake.allowed = {
        ("trainer.kubeflow.org", "trainjobs", "get"),
        *(("leaderworkerset.x-k8s.io", "leaderworkersets", verb) for verb in ("create", "get", "list", "watch")),
        *(("", plural, verb) for plural in ("services", "serviceaccounts") for verb in ("create", "get")),
    }

    code, error = run_initializer(initializer_env(None))

    assert code == 1
    assert error.startswith(
        "the initializer's ServiceAccount may not `patch` leaderworkersets.leaderworkerset.x-k8s.io, `delete` "
        "leaderworkersets.leaderworkerset.x-k8s.io, `patch` serviceaccounts, `create` secrets, `list` pods, "
        f"`watch` pods in namespace {NAMESPACE}, which it needs; nothing was made: bind it to the cache-initializer"
    ), error
    assert fake.calls == [RULES_REVIEW]


@pytest.mark.parametrize("review", ["refused", "incomplete"])
def test_where_the_grants_cannot_be_listed_the_calls_say_what_is_missing(fake, make_sim, run_initializer, review):
    """An authorizer that refuses the review, or lists its rules incompletely (a webhook's): the
    run goes on, and the call that lacks its grant fails with the API's words."""
    add_train_job(fake, "job-a")
    fake.allowed.discard(("", "pods", "watch"))
    if review == "refused":
        fake.fail_next[RULES_REVIEW[1:]] = [403]
    else:
        fake.rules_incomplete = True

    code, error = run_initializer(initializer_env(make_sim("stuck")))

    assert code != 0
    assert "HTTP 403" in error
    assert 'cannot watch resource "pods"' in error  # the API's own words, then what to do
    assert f"may not `watch` pods in namespace {NAMESPACE}: bind it" in error
    # The run failed: its dedicated cache must not keep its pods until the TrainJob is deleted.
    assert fake.get("leaderworkersets", NAMESPACE, "job-a-cache") is None


def test_a_cluster_without_leader_worker_set_is_named(fake, run_initializer):
    add_train_job(fake, "job-a")
    del fake.kinds[("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")]

    code, error = run_initializer(initializer_env(None))

    assert code != 0
    assert "HTTP 404" in error
    assert error.endswith("is the LeaderWorkerSet API (leaderworkerset.x-k8s.io/v1) installed?")


def test_a_404_naming_an_object_is_not_blamed_on_a_missing_api(fake, run_initializer):
    # An API server answers a create in a namespace it no longer holds with a 404 that names the
    # namespace: the LeaderWorkerSet API is there, and asking whether it is installed misleads.
    add_train_job(fake, "job-a")

    def namespace_gone():
        raise ApiFailure(
            404, "NotFound", f'namespaces "{NAMESPACE}" not found', {"name": NAMESPACE, "kind": "namespaces"}
        )

    fake.before[("leaderworkersets", "create")] = [namespace_gone]

    code, error = run_initializer(initializer_env(None))

    assert code != 0
    assert f'namespaces "{NAMESPACE}" not found' in error  # the API's own words
    assert "installed?" not in error


def test_a_cluster_that_does_not_serve_the_train_job_api_is_named(fake, run_initializer):
    """The API's 404 for the kind itself, not for the TrainJob: it read "TrainJob job-a not found",
    and blamed TRAIN_JOB_NAME."""
    del fake.kinds[("trainer.kubeflow.org", "v1alpha1", "trainjobs")]

    code, error = run_initializer(initializer_env(None))

    assert code == 1
    assert error.startswith("the cluster does not serve the TrainJob API (trainer.kubeflow.org/v1alpha1)"), error
    assert "TRAIN_JOB_NAME" not in error


def test_a_missing_train_job_is_named_as_such(fake, run_initializer):
    code, error = run_initializer(initializer_env(None))

    assert code == 1
    assert error.startswith("TrainJob job-a not found in namespace team-a: `TRAIN_JOB_NAME` must name"), error


@pytest.mark.parametrize(
    ("scenario", "grace", "not_said", "said"),
    [
        # Room for a cluster autoscaler to add a node.
        ("unschedulable", "CACHE_UNSCHEDULABLE_GRACE_SECONDS", "unschedulable", None),
        # An evicted pod: its StatefulSet makes it again. It failed the run at once.
        ("evicted", "CACHE_UNSCHEDULABLE_GRACE_SECONDS", "Evicted", None),
        # Pods not created yet: the timeout names what to check.
        ("workers_refused", "CACHE_UNSCHEDULABLE_GRACE_SECONDS", None, "only 1 of the 3 cache pods exist"),
        # A registry blip: the kubelet pulls again.
        ("image_pull", "CACHE_START_ERROR_GRACE_SECONDS", "cannot pull", None),
    ],
)
def test_within_its_grace_a_problem_that_may_pass_is_waited_for(
    fake, make_sim, run_initializer, scenario, grace, not_said, said
):
    """The run ends on its deadline instead, not on the problem."""
    add_train_job(fake, "job-a")
    # The deadline covers creating the cache's objects too: room for a slow moment of the machine.
    code, error = run_initializer(
        initializer_env(make_sim(scenario), **{grace: "600"}, CACHE_READY_TIMEOUT_SECONDS="3")
    )

    assert code != 0
    assert "not ready within CACHE_READY_TIMEOUT_SECONDS=3" in error
    assert not_said is None or not_said not in error
    assert said is None or said in error


def test_cache_pods_that_are_never_created_fail_after_the_grace_naming_where_to_look(fake, make_sim, run_initializer):
    """A quota or admission refusal leaves no trace on the pods: the run says what to check."""
    add_train_job(fake, "job-a")
    env = initializer_env(
        make_sim("workers_refused"), CACHE_UNSCHEDULABLE_GRACE_SECONDS="0.5", CACHE_READY_TIMEOUT_SECONDS="60"
    )
    started = time.monotonic()
    code, error = run_initializer(env)

    assert code != 0
    assert time.monotonic() - started < 30  # the grace ended it, not the deadline
    assert "only 1 of the 3 cache pods exist" in error
    assert f"kubectl get events -n {NAMESPACE} --field-selector reason=FailedCreate" in error
    assert fake.get("leaderworkersets", NAMESPACE, "job-a-cache") is None


def test_an_image_pull_that_fails_once_is_waited_for(fake, make_sim, run_initializer):
    """A registry blip (ErrImagePull, then a pull that works) is not a verdict within the grace."""
    add_train_job(fake, "job-a")
    code, error = run_initializer(initializer_env(make_sim("image_pull_passes"), CACHE_START_ERROR_GRACE_SECONDS="600"))
    assert (code, error) == (0, "")


def test_an_invalid_image_name_fails_at_once_whatever_the_grace(fake, make_sim, run_initializer):
    add_train_job(fake, "job-a")
    started = time.monotonic()
    env = initializer_env(
        make_sim("invalid_image"), CACHE_START_ERROR_GRACE_SECONDS="600", CACHE_READY_TIMEOUT_SECONDS="60"
    )
    code, error = run_initializer(env)
    assert code != 0 and "InvalidImageName" in error
    assert time.monotonic() - started < 30
