"""`DATA_CACHE_SHARED=true`: TrainJobs that ask for the same table share one cache, owned by all."""

from __future__ import annotations

import copy
import threading
import time

import pytest

from kubeflow_cache_initializer.builders import build_leader_worker_set, key_secret_of, shared_cache_name
from kubeflow_cache_initializer.config import load_config
from kubeflow_cache_initializer.main import main
from tests.conftest import free_port

from .support import NAMESPACE, TABLE_ENV, add_train_job, initializer_env

CACHE = shared_cache_name(TABLE_ENV["METADATA_LOC"], "sales", "orders")


def _owners(obj: dict) -> list[tuple[str, bool]]:
    return [(ref["name"], bool(ref.get("controller"))) for ref in obj["metadata"]["ownerReferences"]]


def _selects(service: dict, pod: dict) -> bool:
    return all(pod["metadata"]["labels"].get(k) == v for k, v in service["spec"]["selector"].items())


def test_a_second_train_job_joins_the_ready_cache_and_gc_follows_the_last_owner(
    fake, make_sim, run_initializer, caplog
):
    add_train_job(fake, "job-a")
    add_train_job(fake, "job-b")
    sim = make_sim("healthy")

    assert run_initializer(initializer_env(sim, "job-a", DATA_CACHE_SHARED="true")) == (0, "")
    pods = fake.items("pods", NAMESPACE)
    code, error = run_initializer(initializer_env(sim, "job-b", DATA_CACHE_SHARED="true"))

    assert (code, error) == (0, "")
    assert sim.created == [CACHE]  # one cluster, built once
    assert fake.items("pods", NAMESPACE) == pods  # the second job did not disturb it
    # Its own draw of the cluster key is no difference to warn of: the cache keeps the one it has.
    assert "differs from this TrainJob's settings" not in caplog.text
    for plural in ("leaderworkersets", "serviceaccounts"):
        assert _owners(fake.get(plural, NAMESPACE, CACHE)) == [("job-a", False), ("job-b", False)]
    # Each job finds the cache at grpc://{TRAIN_JOB_NAME}-cache-service:50051, on the shared head.
    (head,) = [p for p in pods if p["metadata"]["labels"]["app.kubernetes.io/component"] == "head"]
    for job in ("job-a", "job-b"):
        service = fake.get("services", NAMESPACE, f"{job}-cache-service")
        assert _owners(service) == [(job, True)]
        assert [p["metadata"]["name"] for p in pods if _selects(service, p)] == [head["metadata"]["name"]]
    assert fake.rejected == []

    fake.delete("trainjobs", NAMESPACE, "job-a")

    assert fake.get("services", NAMESPACE, "job-a-cache-service") is None
    assert _owners(fake.get("leaderworkersets", NAMESPACE, CACHE)) == [("job-b", False)]
    assert len(fake.items("pods", NAMESPACE)) == 3
    # The key lives as long as the cache, not as the TrainJob that made it: a pod restarted now
    # still finds its Secret.
    (secret,) = fake.items("secrets", NAMESPACE)
    assert secret["metadata"]["name"] == key_secret_of(fake.get("leaderworkersets", NAMESPACE, CACHE))

    fake.delete("trainjobs", NAMESPACE, "job-b")

    for plural in ("serviceaccounts", "leaderworkersets", "services", "pods", "secrets"):
        assert fake.items(plural, NAMESPACE) == [], plural


def test_two_train_jobs_starting_together_build_one_cache(fake, make_sim, api_client, tmp_path):
    """Whichever creates first, the other gets 409 and joins; both exit 0 and own the cache."""
    sim = make_sim("healthy")
    codes: dict[str, int] = {}

    def start(job: str) -> None:
        add_train_job(fake, job)
        env = initializer_env(sim, job, DATA_CACHE_SHARED="true")
        codes[job] = main(env=env, api_client=api_client, termination_log=tmp_path / job)

    threads = [threading.Thread(target=start, args=(job,)) for job in ("job-a", "job-b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert codes == {"job-a": 0, "job-b": 0}
    assert sim.created == [CACHE]
    owners = sorted(name for name, _ in _owners(fake.get("leaderworkersets", NAMESPACE, CACHE)))
    assert owners == ["job-a", "job-b"]
    assert fake.rejected == []


def test_a_different_table_gets_its_own_cache(fake, make_sim, run_initializer):
    add_train_job(fake, "job-a")
    add_train_job(fake, "job-b")
    sim = make_sim("healthy")

    assert run_initializer(initializer_env(sim, "job-a", DATA_CACHE_SHARED="true"))[0] == 0
    other = initializer_env(sim, "job-b", DATA_CACHE_SHARED="true", STORAGE_URI="cache://sales/returns")
    assert run_initializer(other)[0] == 0

    assert sim.created == [CACHE, shared_cache_name(TABLE_ENV["METADATA_LOC"], "sales", "returns")]


def test_a_cache_of_that_name_holding_another_table_is_refused(fake, make_sim, run_initializer):
    add_train_job(fake, "job-a")
    env = initializer_env(make_sim("healthy"), "job-a", DATA_CACHE_SHARED="true")
    impostor = build_leader_worker_set(load_config(env), [])
    impostor["metadata"].pop("ownerReferences")
    impostor["metadata"]["annotations"]["data-cache.kubeflow.org/table"] = "sales.refunds"
    fake.put("leaderworkersets", impostor)

    code, error = run_initializer(env)

    assert code != 0
    assert f"LeaderWorkerSet team-a/{CACHE} exists but does not cache" in error
    assert "sales.refunds" in error
    assert fake.get("leaderworkersets", NAMESPACE, CACHE)["metadata"].get("ownerReferences") is None


def test_a_failed_shared_cache_no_other_job_uses_is_deleted(fake, make_sim, run_initializer, caplog):
    """Made by this job and used by no other: freed as a dedicated cache is (kept, it held its
    pods, and every later job for the table joined it and failed the same way)."""
    add_train_job(fake, "job-a")

    code, error = run_initializer(initializer_env(make_sim("head_load_error"), "job-a", DATA_CACHE_SHARED="true"))

    assert code != 0
    assert "AccessDenied" in error
    assert fake.get("leaderworkersets", NAMESPACE, CACHE) is None
    assert f"deleted shared LeaderWorkerSet {CACHE}, which failed with this TrainJob's settings" in caplog.text


@pytest.mark.parametrize("scenario", ["head_load_error", "stuck"])
def test_a_shared_cache_its_maker_could_not_delete_is_named_with_the_command(fake, make_sim, run_initializer, scenario):
    """A hopeless failure (deleted as made) or a timeout (deleted unless joined), the delete
    refused: the warning in the log was all, and the cache held its pods."""
    add_train_job(fake, "job-a")
    fake.fail_next[("leaderworkersets", "delete")] = [403] * 3

    code, error = run_initializer(
        initializer_env(make_sim(scenario), "job-a", DATA_CACHE_SHARED="true", CACHE_READY_TIMEOUT_SECONDS="2")
    )

    assert code == 1
    note = (
        f"; LeaderWorkerSet {CACHE} could not be deleted (HTTP 403 ServiceUnavailable) and holds its pods' "
        f"resources: `kubectl delete leaderworkerset -n {NAMESPACE} {CACHE}`"
    )
    assert error.endswith(note) and error.count(note) == 1, error
    assert fake.get("leaderworkersets", NAMESPACE, CACHE) is not None


def test_a_shared_cache_whose_maker_timed_out_is_kept_for_a_job_that_joined(fake, make_sim, run_initializer, caplog):
    """A deadline that passed is the maker's alone: a job that joined may wait longer, and the
    cache may yet load for it."""
    add_train_job(fake, "job-a")
    job_b = add_train_job(fake, "job-b")
    owner_b = {"apiVersion": job_b["apiVersion"], "kind": "TrainJob", "name": "job-b", "uid": job_b["metadata"]["uid"]}
    fake.before[("leaderworkersets", "delete")] = [
        lambda: fake.update(
            "leaderworkersets", NAMESPACE, CACHE, lambda lws: lws["metadata"]["ownerReferences"].append(owner_b)
        )
    ]
    env = initializer_env(make_sim("stuck"), "job-a", DATA_CACHE_SHARED="true", CACHE_READY_TIMEOUT_SECONDS="1")

    code, error = run_initializer(env)

    assert code != 0 and "was not ready within CACHE_READY_TIMEOUT_SECONDS=1" in error
    assert _owners(fake.get("leaderworkersets", NAMESPACE, CACHE)) == [("job-a", False), ("job-b", False)]
    assert "another TrainJob uses it now" in caplog.text


def test_a_failed_shared_cache_is_deleted_by_its_maker_even_where_another_job_joined(fake, make_sim, run_initializer):
    """Job B joins the cache job A made, and the cache fails for good (its load, with A's
    settings). Kept for B, it held its pods while both TrainJobs failed, and B's retry joined it
    again: nothing ever deleted it. A deletes it; B's retry makes it anew, with B's settings."""
    add_train_job(fake, "job-a")
    job_b = add_train_job(fake, "job-b")
    owner_b = {"apiVersion": job_b["apiVersion"], "kind": "TrainJob", "name": "job-b", "uid": job_b["metadata"]["uid"]}

    def b_joins() -> None:  # between job A's read of the cache and its delete
        fake.update(
            "leaderworkersets", NAMESPACE, CACHE, lambda lws: lws["metadata"]["ownerReferences"].append(owner_b)
        )

    fake.before[("leaderworkersets", "delete")] = [b_joins]
    sim = make_sim("head_load_error")
    code, error = run_initializer(initializer_env(sim, "job-a", DATA_CACHE_SHARED="true"))

    assert code != 0 and "AccessDenied" in error and "joined shared cache" not in error
    assert f"Shared cache {CACHE}, made with this TrainJob's settings, was deleted" in error
    assert fake.before[("leaderworkersets", "delete")] == [], "job B joined before the delete"
    assert fake.get("leaderworkersets", NAMESPACE, CACHE) is None

    code, error = run_initializer(initializer_env(sim, "job-b", DATA_CACHE_SHARED="true"))
    assert code != 0 and "AccessDenied" in error and "made by another TrainJob" not in error
    assert sim.created == [CACHE, CACHE]  # made anew, by job B
    assert fake.get("leaderworkersets", NAMESPACE, CACHE) is None  # and freed: no other job uses it


def test_a_job_that_joins_a_failed_shared_cache_is_told_its_settings_do_not_apply(fake, make_sim, run_initializer):
    """A cache job A made and is done with (its initializer gone) fails while job B waits on it:
    the usual fix (other settings) cannot work there, so the message names the cache to delete,
    and B leaves it to job A's TrainJob."""
    add_train_job(fake, "job-a")
    add_train_job(fake, "job-b")
    sim = make_sim("healthy")
    assert run_initializer(initializer_env(sim, "job-a", DATA_CACHE_SHARED="true")) == (0, "")

    def oom_killed(pod: dict) -> None:
        (status,) = pod["status"]["containerStatuses"]
        status.update(ready=False, state={"waiting": {"reason": "CrashLoopBackOff"}},
                      lastState={"terminated": {"reason": "OOMKilled", "exitCode": 137}})  # fmt: skip

    worker = next(
        p for p in fake.items("pods", NAMESPACE) if p["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
    )
    fake.update("leaderworkersets", NAMESPACE, CACHE, lambda lws: lws.update(status={"conditions": []}))
    fake.update("pods", NAMESPACE, worker["metadata"]["name"], oom_killed)
    code, error = run_initializer(initializer_env(sim, "job-b", DATA_CACHE_SHARED="true"))

    assert code != 0 and "was OOMKilled" in error
    assert f"This TrainJob joined shared cache {CACHE}, made by another TrainJob" in error
    assert f"kubectl delete leaderworkerset -n {NAMESPACE} {CACHE}" in error
    assert _owners(fake.get("leaderworkersets", NAMESPACE, CACHE)) == [("job-a", False), ("job-b", False)]


def test_a_shared_cache_deleted_while_a_joined_job_waits_says_so_not_which_settings(fake, make_sim, run_initializer):
    """Deleted while job B waits on it (by hand, or its last owner's end): B's error said the
    cache was another job's settings, to delete and run again; there is nothing left to delete."""
    add_train_job(fake, "job-a")
    add_train_job(fake, "job-b")
    sim = make_sim("healthy")
    assert run_initializer(initializer_env(sim, "job-a", DATA_CACHE_SHARED="true")) == (0, "")
    fake.update("leaderworkersets", NAMESPACE, CACHE, lambda lws: lws.update(status={"conditions": []}))

    def delete_it() -> None:  # once job B has joined it and waits on it
        deadline = time.monotonic() + 30
        while ("job-b", False) not in _owners(fake.get("leaderworkersets", NAMESPACE, CACHE)):
            assert time.monotonic() < deadline, "job B did not join the cache"
            time.sleep(0.01)
        fake.wait_for_watches(("leaderworkersets", "pods"))
        fake.delete("leaderworkersets", NAMESPACE, CACHE)

    deleter = threading.Thread(target=delete_it, daemon=True)
    deleter.start()
    code, error = run_initializer(initializer_env(sim, "job-b", DATA_CACHE_SHARED="true"))
    deleter.join(30)

    assert code != 0 and f"LeaderWorkerSet {CACHE} was deleted while waiting for it: run the TrainJob again" in error
    assert "made by another TrainJob" not in error and "kubectl delete" not in error


def test_a_job_joining_a_shared_cache_judges_it_by_the_caches_own_size_and_health_port(
    fake, make_sim, run_initializer, caplog
):
    """Job B's own CLUSTER_SIZE (3) and CACHE_HEALTH_PORT (nothing listens) are not the shared
    cache's (2 pods, the head's port): B counts the pods and asks the head as the cache was made."""
    add_train_job(fake, "job-a")
    add_train_job(fake, "job-b")
    sim = make_sim("healthy")
    assert run_initializer(initializer_env(sim, "job-a", DATA_CACHE_SHARED="true", CLUSTER_SIZE="2")) == (0, "")
    caplog.clear()

    # A short grace for missing pods: judged by B's own size, "only 2 of the 3" would fail it.
    env = initializer_env(
        sim,
        "job-b",
        DATA_CACHE_SHARED="true",
        CACHE_HEALTH_PORT=str(free_port()),
        CACHE_UNSCHEDULABLE_GRACE_SECONDS="0.05",
    )
    assert run_initializer(env) == (0, "")
    assert "2/2 cache pods ready" in caplog.text
    assert "has not answered" not in caplog.text  # the head's /status was read, on its own port
    assert sim.created == [CACHE]


def test_a_shared_cache_deleted_while_a_job_joins_it_is_made_again(fake, make_sim, run_initializer, caplog):
    """Job B reads the cache, then its last owner (job A) is deleted and the garbage collector
    takes the cache before B's owner patch lands: B gets 404 and makes the cache anew."""
    add_train_job(fake, "job-a")
    add_train_job(fake, "job-b")
    sim = make_sim("healthy")
    assert run_initializer(initializer_env(sim, "job-a", DATA_CACHE_SHARED="true")) == (0, "")

    fake.before[("leaderworkersets", "patch")] = [lambda: fake.delete("trainjobs", NAMESPACE, "job-a")]
    assert run_initializer(initializer_env(sim, "job-b", DATA_CACHE_SHARED="true")) == (0, "")

    assert fake.before[("leaderworkersets", "patch")] == [], "the cache went between B's get and patch"
    assert sim.created == [CACHE, CACHE]
    assert _owners(fake.get("leaderworkersets", NAMESPACE, CACHE)) == [("job-b", False)]
    assert "was deleted while adopting it; creating it again" in caplog.text


def test_a_shared_cache_made_again_after_a_join_found_it_gone_reads_its_own_key_secret(fake, make_sim, run_initializer):
    """As above, but the garbage collector lags, as a real one does: the old cache's key Secret
    outlives it for a while. The cache made again must not name that Secret, which the collector
    deletes with the old cache: its pods then waited on a missing Secret at every start."""
    add_train_job(fake, "job-a")
    add_train_job(fake, "job-b")
    sim = make_sim("healthy")
    assert run_initializer(initializer_env(sim, "job-a", DATA_CACHE_SHARED="true")) == (0, "")
    old_secret = key_secret_of(fake.get("leaderworkersets", NAMESPACE, CACHE))

    fake.before[("leaderworkersets", "patch")] = [
        lambda: fake.delete("leaderworkersets", NAMESPACE, CACHE, collect=False)
    ]
    assert run_initializer(initializer_env(sim, "job-b", DATA_CACHE_SHARED="true")) == (0, "")
    assert sim.created == [CACHE, CACHE]
    fake.collect_garbage()

    cache = fake.get("leaderworkersets", NAMESPACE, CACHE)
    assert key_secret_of(cache) != old_secret
    secret = fake.get("secrets", NAMESPACE, key_secret_of(cache))
    assert secret is not None
    assert [ref["uid"] for ref in secret["metadata"]["ownerReferences"]] == [cache["metadata"]["uid"]]


def test_a_sweeps_train_jobs_joining_one_shared_cache_at_once_all_join(fake, make_sim, api_client, tmp_path):
    """Each join is a patch guarded by the resourceVersion, so one joiner wins each round: with
    five tries in a row and no pause, 2 or 3 of 12 jobs started together failed ("kept changing")."""
    sim = make_sim("healthy")
    jobs = [f"job-{i}" for i in range(12)]
    for job in jobs:
        add_train_job(fake, job)
    codes: dict[str, int] = {}
    barrier = threading.Barrier(len(jobs))

    def start(job: str) -> None:
        env = initializer_env(sim, job, DATA_CACHE_SHARED="true")
        barrier.wait()
        codes[job] = main(env=env, api_client=api_client, termination_log=tmp_path / job)

    threads = [threading.Thread(target=start, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert codes == dict.fromkeys(jobs, 0), {
        job: (tmp_path / job).read_text() for job in jobs if (tmp_path / job).exists()
    }
    owners = {ref["name"] for ref in fake.get("leaderworkersets", NAMESPACE, CACHE)["metadata"]["ownerReferences"]}
    assert owners == set(jobs)
    assert any(r[0] == "PATCH" and r[3] == 409 for r in fake.responses), "the joins never met: nothing was tested"


def test_a_maker_keeps_a_cache_another_job_made_anew_under_its_name(fake, make_sim, run_initializer):
    """Job A's cache is deleted (by hand, as a joiner's error advises) and job B makes it anew
    while A waits; A's watch relists after an API server restart and never sees the delete. B's
    cache then fails for good: A, which made the first one, must not delete B's by its name."""
    add_train_job(fake, "job-a")
    job_b = add_train_job(fake, "job-b")
    owner_b = {"apiVersion": job_b["apiVersion"], "kind": "TrainJob", "name": "job-b", "uid": job_b["metadata"]["uid"]}

    def made_anew_by_b() -> None:
        deadline = time.monotonic() + 30
        while not (fake.get("leaderworkersets", NAMESPACE, CACHE) and len(fake.items("pods", NAMESPACE)) == 3):
            assert time.monotonic() < deadline, "job A made no cache"
            time.sleep(0.02)
        fake.wait_for_watches(("leaderworkersets", "pods"))
        with fake.cond:
            old = fake.get("leaderworkersets", NAMESPACE, CACHE)
            worker = next(p for p in fake.items("pods", NAMESPACE) if p["metadata"]["name"].endswith("-1"))
            fake.delete("leaderworkersets", NAMESPACE, CACHE)
            new = copy.deepcopy(old)
            new["metadata"] = {k: v for k, v in new["metadata"].items() if k not in ("uid", "resourceVersion")}
            new["metadata"]["ownerReferences"] = [owner_b]
            new = fake.put("leaderworkersets", new)
            pod = copy.deepcopy(worker)
            pod["metadata"] = {k: v for k, v in pod["metadata"].items() if k not in ("uid", "resourceVersion")}
            pod["metadata"]["ownerReferences"] = [
                {"apiVersion": new["apiVersion"], "kind": "LeaderWorkerSet", "name": CACHE,
                 "uid": new["metadata"]["uid"], "controller": True}
            ]  # fmt: skip
            (status,) = pod["status"]["containerStatuses"]
            status.update(ready=False, state={"waiting": {"reason": "CrashLoopBackOff"}},
                          lastState={"terminated": {"reason": "OOMKilled", "exitCode": 137}})  # fmt: skip
            fake.put("pods", pod)
            fake.compact(end_watches=True)  # A's watches relist: they never see the delete

    remake = threading.Thread(target=made_anew_by_b, daemon=True)
    remake.start()
    code, error = run_initializer(
        initializer_env(make_sim("stuck"), "job-a", DATA_CACHE_SHARED="true", CACHE_READY_TIMEOUT_SECONDS="30")
    )
    remake.join(30)

    assert code != 0 and "was OOMKilled" in error and "was deleted" not in error
    assert _owners(fake.get("leaderworkersets", NAMESPACE, CACHE)) == [("job-b", False)]
