"""What a real cluster throws at the initializer besides a broken cache: API outages, a head it
cannot reach, names another TrainJob holds, pods that wait on something, and the unforeseen."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import signal
import socket
import threading
import time

import pytest
from kubernetes import client

from kubeflow_cache_initializer import main as main_module
from kubeflow_cache_initializer.builders import build_leader_worker_set, build_service, cache_names
from kubeflow_cache_initializer.config import load_config
from kubeflow_cache_initializer.errors import CacheTimeoutError, ConfigError, KubeApiError
from kubeflow_cache_initializer.health import describe_status, fetch_head_status, not_ready_reason, status_failure
from kubeflow_cache_initializer.kube import PODS, RETRY_INITIAL_SECONDS, TRAINJOBS, Kube
from kubeflow_cache_initializer.wait import _Watcher
from tests.conftest import free_port

from .fake_k8s_rules import ApiFailure
from .support import MINIMAL, NAMESPACE, add_train_job, initializer_env


def test_passing_api_errors_are_retried_honouring_retry_after(fake, make_sim, run_initializer, caplog):
    """A 429 (Retry-After: 1) on the TrainJob and a 500 from the LWS webhook: waited out, not fatal."""
    add_train_job(fake, "job-a")
    sim = make_sim("healthy")
    fake.fail_next[("trainjobs", "get")] = [429]
    fake.fail_next[("leaderworkersets", "create")] = [500, 503]

    started = time.monotonic()
    assert run_initializer(initializer_env(sim)) == (0, "")

    assert time.monotonic() - started >= 1.0  # the 429's Retry-After was honoured
    assert fake.fail_next[("leaderworkersets", "create")] == []
    assert "HTTP 429" in caplog.text and "trying again in 1.0s" in caplog.text
    assert sim.created == ["job-a-cache"]


def test_a_watch_failing_until_the_deadline_is_named_and_the_cache_deleted(fake, make_sim, run_initializer):
    add_train_job(fake, "job-a")
    fake.fail_next[("pods", "watch")] = [503] * 50

    code, error = run_initializer(initializer_env(make_sim("stuck"), CACHE_READY_TIMEOUT_SECONDS="3"))

    assert code == 1
    assert "not ready within CACHE_READY_TIMEOUT_SECONDS=3" in error
    assert re.search(r"the API has failed for \d+s: watch pods in namespace team-a failed: HTTP 503", error)
    assert fake.get("leaderworkersets", NAMESPACE, "job-a-cache") is None


def _refusing_api() -> client.ApiClient:
    """A client of an API server that refuses connections; only Kube's own retries, to time them."""
    configuration = client.Configuration(host=f"http://127.0.0.1:{free_port()}")
    configuration.retries = 0
    return client.ApiClient(configuration)


def test_an_api_server_that_does_not_answer_is_retried_until_the_deadline():
    kube = Kube(_refusing_api(), deadline=time.monotonic() + 1.5)

    started = time.monotonic()
    with pytest.raises(KubeApiError) as caught:
        kube.get(TRAINJOBS, NAMESPACE, "job-a")

    assert caught.value.status == 0
    assert 0.9 <= time.monotonic() - started < 5
    assert caught.value.retried_seconds >= 0.9
    assert str(caught.value).endswith("of retries)")
    # Given up at the deadline while still failing: a timeout message built now still names it.
    assert "get trainjobs.trainer.kubeflow.org job-a in namespace team-a failed: HTTP 0" in kube.trouble_line()


def test_without_a_deadline_nothing_is_retried():
    started = time.monotonic()
    with pytest.raises(KubeApiError):
        Kube(_refusing_api()).get(TRAINJOBS, NAMESPACE, "job-a")
    assert time.monotonic() - started < 1


def test_a_loaded_cache_whose_status_port_is_unreachable_is_taken_as_ready(fake, make_sim, run_initializer, caplog):
    """A NetworkPolicy that lets the kubelet probe the pods but not the initializer reach :8080."""
    add_train_job(fake, "job-a")
    sim = make_sim("healthy")
    env = initializer_env(sim, CACHE_READY_TIMEOUT_SECONDS="20", CACHE_HEALTH_PORT=str(free_port()))

    assert run_initializer(env) == (0, "")

    waited = re.search(r"/status has not answered for (\d+)s", caplog.text)
    assert waited, caplog.text
    # After its grace (a few status polls), not at the 20 s deadline, the last look.
    assert int(waited[1]) < 10, caplog.text
    assert "refused" in caplog.text  # the reason the head did not answer
    assert fake.get("leaderworkersets", NAMESPACE, "job-a-cache") is not None


def test_a_foreign_service_stops_the_run_before_any_cache_pod_exists(fake, make_sim, run_initializer):
    add_train_job(fake, "job-a")
    sim = make_sim("healthy")
    env = initializer_env(sim)
    other = add_train_job(fake, "someone-else")
    owner = {"apiVersion": other["apiVersion"], "kind": "TrainJob", "name": "someone-else"}
    fake.put("services", build_service(load_config(env), [{**owner, "uid": other["metadata"]["uid"]}]))

    code, error = run_initializer(env)

    assert code == 1
    assert "Service team-a/job-a-cache-service already exists and is not owned by TrainJob job-a" in error
    assert fake.items("leaderworkersets", NAMESPACE) == []
    assert fake.items("pods", NAMESPACE) == []


@pytest.mark.parametrize("owned_by", ["someone-else", None])
def test_a_foreign_leader_worker_set_is_refused_and_left_as_it_is(fake, make_sim, run_initializer, owned_by):
    """The run fails, and the LeaderWorkerSet it found under the cache's name, another's or no
    one's, is not deleted with the run's own objects."""
    add_train_job(fake, "job-a")
    env = initializer_env(make_sim("healthy"))
    owners = []
    if owned_by:
        other = add_train_job(fake, owned_by)
        owners = [{"apiVersion": other["apiVersion"], "kind": "TrainJob", "name": owned_by, "controller": True}]
        owners[0]["uid"] = other["metadata"]["uid"]
    foreign = fake.put("leaderworkersets", build_leader_worker_set(load_config(env), owners, "some-secret"))

    code, error = run_initializer(env)

    assert code == 1
    assert "LeaderWorkerSet team-a/job-a-cache already exists and is not owned by TrainJob job-a" in error
    assert fake.get("leaderworkersets", NAMESPACE, "job-a-cache")["metadata"]["uid"] == foreign["metadata"]["uid"]


def test_sigterm_as_the_cache_is_created_still_deletes_it(fake, run_initializer):
    """A SIGTERM that came while the LeaderWorkerSet's create was answered: the run said its cache
    was deleted, and the cache pods ran on (through a Kueue suspension, holding their quota)."""
    add_train_job(fake, "job-a")
    fake.before[("leaderworkersets", "create")] = [lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(0.2))]

    code, error = run_initializer(initializer_env(None, CACHE_READY_TIMEOUT_SECONDS="10"))
    time.sleep(1)  # the create the signal interrupted lands 0.2 s after it

    assert code == 143
    assert "stopped by SIGTERM before the cache was ready" in error
    assert fake.items("leaderworkersets", NAMESPACE) == []


def _a_shared_cache_being_deleted(fake) -> dict[str, str]:
    """TrainJob job-a, and its shared cache terminating (a finalizer holds it): the env of a
    run that joins it, and so waits for it to go, for at most 20 s."""
    add_train_job(fake, "job-a")
    env = initializer_env(None, DATA_CACHE_SHARED="true", CACHE_READY_TIMEOUT_SECONDS="20")
    dying = build_leader_worker_set(load_config(env), [], "some-secret")
    dying["metadata"].pop("ownerReferences")
    dying["metadata"] |= {"deletionTimestamp": "2026-01-01T00:00:00Z", "finalizers": ["example.com/slow"]}
    fake.put("leaderworkersets", dying)
    return env


def test_sigterm_while_an_earlier_cache_is_deleted_ends_the_run_at_once(fake, run_initializer):
    """Held while the cache was made, a SIGTERM was held through the wait for an earlier cache's
    deletion too: the run went on to its deadline (600 s by default), and the kubelet's 30 s grace
    ended it with a SIGKILL and no message."""
    env = _a_shared_cache_being_deleted(fake)

    def terminate() -> None:
        fake.wait_for_watches(("leaderworkersets",))
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate, daemon=True).start()
    started = time.monotonic()
    code, error = run_initializer(env)

    assert time.monotonic() - started < 10
    assert code == 143 and "stopped by SIGTERM before the cache was ready" in error


@pytest.mark.parametrize("other", ["job-a-cache", "job-a-cache-service"])
def test_a_train_job_named_like_the_cache_is_refused(fake, make_sim, run_initializer, other):
    add_train_job(fake, "job-a")
    add_train_job(fake, other)

    code, error = run_initializer(initializer_env(make_sim("healthy")))

    assert code == 1
    assert f"TrainJob {other} exists in namespace team-a" in error
    assert "Rename one of the two TrainJobs" in error
    assert fake.items("leaderworkersets", NAMESPACE) == []


def _headless_service(name: str, selector: dict, owner: dict | None = None) -> dict:
    meta = {"name": name, "namespace": NAMESPACE, **({"ownerReferences": [owner]} if owner else {})}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {"clusterIP": "None", "selector": selector},
    }


@pytest.mark.parametrize("role", ["the LeaderWorkerSet's", "the initializer's"])
def test_a_train_job_named_like_another_ones_cache_is_refused(fake, make_sim, run_initializer, role):
    """TrainJob `foo-cache` after TrainJob `foo`'s cache: a Service under this TrainJob's name
    selecting other pods (the cache's, made by its LeaderWorkerSet or its initializer) would be
    taken by JobSet as its own, and this job's pod hostnames would not resolve."""
    name = "job-b-cache" if role == "the LeaderWorkerSet's" else "job-b-cache-service"
    add_train_job(fake, name)
    selector = {"leaderworkerset.sigs.k8s.io/name": "job-b-cache"}
    owner = {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "name": "job-b-cache", "uid": "u"}
    fake.put("services", _headless_service(name, selector, owner))

    code, error = run_initializer(initializer_env(make_sim("healthy"), train_job=name))

    assert code == 1
    assert f"Service team-a/{name} (owned by LeaderWorkerSet job-b-cache) has this TrainJob's name" in error
    assert "Rename this TrainJob" in error
    assert fake.items("leaderworkersets", NAMESPACE) == []


def test_a_service_named_like_the_cache_that_selects_other_pods_is_refused(fake, make_sim, run_initializer):
    """An app's Service `job-a-cache` (a Redis): the LeaderWorkerSet controller keeps a Service of
    its name as the cache's subdomain, whatever it selects, and the data nodes' LWS_LEADER_ADDRESS
    never resolves. Refused before anything is made, naming the Service."""
    add_train_job(fake, "job-a")
    fake.put("services", _headless_service("job-a-cache", {"app": "redis"}))

    code, error = run_initializer(initializer_env(make_sim("healthy")))

    assert code == 1
    assert "Service team-a/job-a-cache exists and selects {'app': 'redis'}" in error
    assert "Rename that Service, or this TrainJob" in error
    assert fake.items("leaderworkersets", NAMESPACE) == []


def test_the_caches_own_leader_worker_set_service_is_no_clash(fake, make_sim, run_initializer):
    """Left by a previous run's LeaderWorkerSet, or a shared cache's: the cache's own subdomain."""
    add_train_job(fake, "job-a")
    fake.put("services", _headless_service("job-a-cache", {"leaderworkerset.sigs.k8s.io/name": "job-a-cache"}))

    assert run_initializer(initializer_env(make_sim("healthy"))) == (0, "")


def test_the_train_jobs_own_headless_service_is_no_clash(fake, make_sim, run_initializer):
    add_train_job(fake, "job-a")
    fake.put("services", _headless_service("job-a", {"jobset.sigs.k8s.io/jobset-name": "job-a"}))

    assert run_initializer(initializer_env(make_sim("healthy"))) == (0, "")


def _pod(name: str, status: dict) -> dict:
    return {"metadata": {"name": name, "labels": {}}, "status": status}


def test_a_pod_that_is_not_ready_says_what_it_waits_on():
    gated = _pod(
        "c-0",
        {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "SchedulingGated",
                    "message": "Scheduling is blocked due to non-empty scheduling gates",
                }
            ],
        },
    )
    creating = _pod(
        "c-0-1",
        {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [{"name": "cache", "state": {"waiting": {"reason": "ContainerCreating"}}}],
        },
    )
    running = _pod("c-0-2", {"phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True"}]})

    assert not_ready_reason(gated) == (
        "c-0 not scheduled: SchedulingGated: Scheduling is blocked due to non-empty scheduling gates"
    )
    assert not_ready_reason(creating) == "c-0-1 container cache waiting: ContainerCreating"
    assert not_ready_reason(running) == "c-0-2 running, not ready"


@pytest.mark.parametrize(
    ("name", "value", "named"),
    [
        ("HEAD_MEM", "500m", "`HEAD_MEM` should be a memory size such as 500Mi (m means a thousandth of a byte)"),
        ("WORKER_MEM", "1", "`WORKER_MEM` should be at least 400Mi"),
        ("WORKER_MEM", "300Mi", "`WORKER_MEM` should be at least 400Mi"),
        ("HEAD_MEM", "0.3Gi", "`HEAD_MEM` should be at least 400Mi"),
    ],
)
def test_memory_sizes_that_cannot_be_meant_are_refused(name, value, named):
    with pytest.raises(ConfigError) as caught:
        load_config({**MINIMAL, name: value})
    assert named in str(caught.value)


@pytest.mark.parametrize("value", ["400Mi", "1Gi", "512M", "1.5e9", "0.5Gi"])
def test_memory_sizes_from_the_floor_up_are_accepted(value):
    assert load_config({**MINIMAL, "WORKER_MEM": value}).worker_mem == value


def test_an_unforeseen_failure_still_exits_1_with_a_termination_message(tmp_path, monkeypatch, caplog):
    def broken(kube, cfg):
        raise ValueError("Expecting value: line 1 column 1 (char 0)")  # e.g. a proxy's HTML page as JSON

    monkeypatch.setattr(main_module, "run", broken)
    termination_log = tmp_path / "termination-log"
    termination_log.write_text("")

    code = main_module.main(env=MINIMAL, api_client=object(), termination_log=termination_log)

    assert code == 1
    assert termination_log.read_text().strip() == (
        "the initializer failed unexpectedly: ValueError: Expecting value: line 1 column 1 (char 0)"
    )
    assert "Traceback" in caplog.text


def _answer(body: bytes, content_type: str = "application/json", cut_at: int | None = None) -> bytes:
    """A raw HTTP 200 with ``body``; with ``cut_at``, only that much of it (the connection then drops)."""
    head = f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
    if cut_at is not None:
        return (head + "\r\n").encode() + body[:cut_at]
    return (head + "Connection: close\r\n\r\n").encode() + body


class _RawServer:
    """An API server on loopback answering each connection with the next of ``answers`` (the
    last one over and over), then closing it."""

    def __init__(self, *answers: bytes) -> None:
        self.answers, self.requests = answers, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._serve, daemon=True).start()

    def kube(self, deadline_seconds: float) -> Kube:
        configuration = client.Configuration(host=f"http://127.0.0.1:{self.sock.getsockname()[1]}")
        configuration.retries = 0  # only Kube's own retries
        return Kube(client.ApiClient(configuration), deadline=time.monotonic() + deadline_seconds)

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                with conn:
                    conn.recv(65536)
                    self.requests += 1  # before answering: the client may check it once answered
                    conn.sendall(self.answers[min(self.requests - 1, len(self.answers) - 1)])

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize(
    ("answer", "unserved"),
    [
        # An older API server, for a group it does not serve: Go's plain text.
        (b"HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\nContent-Length: 19\r\n\r\n404 page not found\n", True),
        (
            b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\n\r\n"
            + json.dumps(
                {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404,
                 "message": "the server could not find the requested resource", "details": {}}
            ).encode(),
            True,
        ),
        (
            b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\n\r\n"
            + json.dumps(
                {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404,
                 "message": 'trainjobs.trainer.kubeflow.org "job-a" not found',
                 "details": {"name": "job-a", "group": "trainer.kubeflow.org", "kind": "trainjobs"}}
            ).encode(),
            False,
        ),
    ],
    ids=["plain-text", "status", "object"],
)  # fmt: skip
def test_a_404_for_a_kind_not_served_is_told_from_one_for_a_missing_object(answer, unserved):
    server = _RawServer(answer)
    with pytest.raises(KubeApiError) as caught:
        server.kube(10).get(TRAINJOBS, NAMESPACE, "job-a")
    server.close()
    assert caught.value.not_found and caught.value.kind_not_served is unserved
    assert "\n" not in str(caught.value), "one line, for the termination log"


def test_an_answer_that_breaks_mid_body_is_retried_like_no_answer():
    body = json.dumps({"kind": "TrainJob", "metadata": {"name": "job-a"}}).encode()
    server = _RawServer(_answer(body, cut_at=5), _answer(body))

    assert server.kube(10).get(TRAINJOBS, NAMESPACE, "job-a")["metadata"]["name"] == "job-a"
    assert server.requests == 2
    server.close()


def test_a_retry_after_of_zero_still_backs_off():
    kube = Kube(client.ApiClient(client.Configuration()), deadline=time.monotonic() + 60)
    err = KubeApiError("get", "trainjobs", 429, "TooManyRequests", "slow down", retry_after=0)
    assert kube._retry_pause(err, 4.0) == RETRY_INITIAL_SECONDS
    assert kube._retry_pause(KubeApiError("get", "trainjobs", 503, "", "", retry_after=None), 4.0) == 4.0


def test_the_failed_run_deletes_its_cache_even_through_an_api_outage(fake, make_sim, run_initializer):
    add_train_job(fake, "job-a")
    fake.fail_next[("pods", "watch")] = [503] * 50
    fake.fail_next[("leaderworkersets", "delete")] = [503]  # the outage is still on at the deadline

    code, _ = run_initializer(initializer_env(make_sim("stuck"), CACHE_READY_TIMEOUT_SECONDS="3"))

    assert code == 1
    assert fake.fail_next[("leaderworkersets", "delete")] == []
    assert fake.get("leaderworkersets", NAMESPACE, "job-a-cache") is None


def test_a_cache_the_cleanup_could_not_delete_is_named_with_the_command(fake, make_sim, run_initializer):
    """A delete refused (a Role without it, as upstream's) or failing through the cleanup's own
    deadline: the termination message said nothing of the cache left holding its pods."""
    add_train_job(fake, "job-a")
    fake.fail_next[("leaderworkersets", "delete")] = [403]

    code, error = run_initializer(initializer_env(make_sim("stuck"), CACHE_READY_TIMEOUT_SECONDS="2"))

    assert code == 1 and error.startswith("the cache was not ready within CACHE_READY_TIMEOUT_SECONDS=2: "), error
    assert error.endswith(
        "; LeaderWorkerSet job-a-cache could not be deleted (HTTP 403 ServiceUnavailable) and holds its pods' "
        f"resources: `kubectl delete leaderworkerset -n {NAMESPACE} job-a-cache`"
    ), error
    assert fake.get("leaderworkersets", NAMESPACE, "job-a-cache") is not None


def test_an_admission_webhook_that_does_not_answer_gets_its_own_budget_and_a_fix(fake, run_initializer, monkeypatch):
    """The LeaderWorkerSet webhook down (its controller gone, its Service without endpoints): the
    create was retried to the run's deadline, 10 minutes (twice with the Job's retry), and the
    message named no fix."""
    from kubeflow_cache_initializer import kube as kube_module

    def webhook_down():
        raise ApiFailure(
            500,
            "InternalError",
            'Internal error occurred: failed calling webhook "mleaderworkerset.kb.io": failed to call webhook: Post '
            '"https://lws-webhook-service.lws-system.svc:443/mutate": no endpoints available for service',
        )

    monkeypatch.setattr(kube_module, "WEBHOOK_RETRY_SECONDS", 1.0)
    add_train_job(fake, "job-a")
    fake.before[("leaderworkersets", "create")] = [webhook_down] * 50

    started = time.monotonic()
    code, error = run_initializer(initializer_env(None, CACHE_READY_TIMEOUT_SECONDS="600"))

    assert code == 1 and time.monotonic() - started < 30
    assert 'failed calling webhook "mleaderworkerset.kb.io"' in error
    assert error.endswith(
        "the LeaderWorkerSet admission webhook does not answer: check the LeaderWorkerSet controller's pods, "
        "`kubectl get pods,endpoints -n lws-system` (its Service lws-webhook-service)"
    ), error
    assert 2 <= 50 - len(fake.before[("leaderworkersets", "create")]) < 10  # retried, a few times
    assert fake.get("leaderworkersets", NAMESPACE, "job-a-cache") is None


def test_a_cleanup_after_a_sigterm_fits_the_initializer_pods_grace():
    """The watchers joined one after the other (5 s each), then 30 s of retries whose last request
    could wait 30 s more, in the default 30 s grace: the kubelet killed the cleanup before its
    last delete and before the termination message was written."""
    from pathlib import Path

    import yaml

    from kubeflow_cache_initializer import initializer, kube, wait

    runtime = yaml.safe_load((Path(__file__).parents[2] / "runtimes" / "torch-distributed-with-cache.yaml").read_text())
    (step,) = [j for j in runtime["spec"]["template"]["spec"]["replicatedJobs"] if j["name"] == "dataset-initializer"]
    grace = step["template"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    # The last call of the cleanup, as urllib3 sends it (kube.API_RETRIES): where it cannot connect,
    # once and again for each connect retry, with its backoff between (none before the first
    # retry, then 1 s, 2 s: measured, 11 s at a 2 s timeout); where the answer never comes, twice.
    retries, timeout = kube.API_RETRIES, initializer.CLEANUP_REQUEST_TIMEOUT_SECONDS
    backoff = sum(
        min(retries.backoff_factor * 2 ** (n - 1), retries.DEFAULT_BACKOFF_MAX) for n in range(2, retries.connect + 1)
    )
    last_call = max((retries.connect + 1) * timeout + backoff, (retries.read + 1) * timeout)
    worst = wait.STOP_JOIN_SECONDS + initializer.CLEANUP_SECONDS + last_call
    assert worst + 5 <= grace, (worst, grace)  # and a few seconds to write the message and exit


def test_the_cleanup_deletes_only_the_cache_its_run_made(fake, run_initializer, monkeypatch):
    """A TrainJob deleted and made again under its name has a new initializer and a new cache;
    the old run's delete, retried through an outage, removed that one by its name."""
    from kubeflow_cache_initializer import initializer

    def replaced(kube, cfg, deadline):
        mine = fake.get("leaderworkersets", NAMESPACE, "job-a-cache")
        fake.delete("leaderworkersets", NAMESPACE, "job-a-cache")
        fake.put("leaderworkersets", {**mine, "metadata": {**mine["metadata"], "uid": "the-new-runs"}})
        raise CacheTimeoutError("cache job-a-cache not ready within 1s")

    add_train_job(fake, "job-a")
    monkeypatch.setattr(initializer, "wait_until_ready", replaced)

    code, error = run_initializer(initializer_env(None))

    assert code == 1 and error == "cache job-a-cache not ready within 1s"
    assert fake.get("leaderworkersets", NAMESPACE, "job-a-cache")["metadata"]["uid"] == "the-new-runs"


def test_an_unforeseen_failure_while_waiting_still_deletes_the_cache(fake, run_initializer, monkeypatch):
    from kubeflow_cache_initializer import initializer

    def broken(kube, cfg, deadline):
        raise ValueError("Expecting value: line 1 column 1 (char 0)")

    add_train_job(fake, "job-a")
    monkeypatch.setattr(initializer, "wait_until_ready", broken)

    code, error = run_initializer(initializer_env(None))  # no simulated pods: the wait is replaced

    assert code == 1 and error.startswith("the initializer failed unexpectedly: ValueError")
    assert fake.get("leaderworkersets", NAMESPACE, "job-a-cache") is None


class _Events:
    """A watch stream: its events, then a broken connection or a quiet open watch."""

    def __init__(self, events, broken: bool) -> None:
        self.events, self.broken, self.closed = events, broken, threading.Event()

    def __iter__(self):
        yield from self.events
        if self.broken:
            raise ConnectionResetError("reset by peer")
        self.closed.wait(20)

    def close(self) -> None:
        self.closed.set()


class _ReconnectingKube(Kube):
    """Its first watch breaks after one event; the next one stays open and healthy."""

    def __init__(self) -> None:
        super().__init__(api_client=None, deadline=time.monotonic() + 30)
        self.watches = 0

    def _call_once(self, verb, *args, **kwargs):
        self.watches += 1
        event = ("MODIFIED", {"metadata": {"resourceVersion": str(self.watches + 1)}})
        return _Events([event], broken=self.watches == 1)


def test_a_watch_that_reconnects_clears_its_trouble():
    """The timeout message must not blame an API that has recovered."""
    kube = _ReconnectingKube()
    events: queue.Queue = queue.Queue()
    watcher = _Watcher(kube, PODS, NAMESPACE, "1", time.monotonic() + 30, events)
    watcher.start()
    try:
        deadline = time.monotonic() + 10
        while events.qsize() < 2 and time.monotonic() < deadline:  # one event from each watch
            time.sleep(0.05)
        assert kube.watches == 2
        assert kube.trouble_line() is None
    finally:
        watcher.stop()
        watcher.join(5)


def test_a_loaded_cache_seen_only_at_the_deadline_is_not_thrown_away(fake, make_sim, run_initializer, caplog):
    """Available, /status unreachable, and the deadline comes before the grace: taken as ready."""
    add_train_job(fake, "job-a")
    env = initializer_env(
        make_sim("healthy"),
        CACHE_READY_TIMEOUT_SECONDS="3",
        CACHE_STATUS_POLL_SECONDS="5",  # grace of 3 polls = 15 s, past the deadline
        CACHE_HEALTH_PORT=str(free_port()),
    )

    assert run_initializer(env) == (0, "")
    assert "the head's /status could not be read from here" in caplog.text
    assert fake.get("leaderworkersets", NAMESPACE, "job-a-cache") is not None


def test_an_answer_that_is_not_json_fails_at_once_quoting_it():
    """A proxy's HTML page where the API's JSON was due: an answer, not an outage to wait out."""
    server = _RawServer(_answer(b"<html><body>Proxy login</body></html>", "text/html"))
    started = time.monotonic()
    with pytest.raises(KubeApiError) as caught:
        server.kube(30).get(TRAINJOBS, NAMESPACE, "job-a")
    server.close()
    assert time.monotonic() - started < 5
    assert server.requests == 1  # not retried
    assert "the answer is not JSON: '<html><body>Proxy login" in str(caught.value)


@contextlib.contextmanager
def _head_on_one_connection(serve):
    """A port whose first connection, its request read, is handed to ``serve`` in a thread."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)

        def accept() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(4096)
                serve(conn)

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        yield listener.getsockname()[1]
        thread.join(5)


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"state":', "IncompleteRead"),
        (b"SSH-2.0-OpenSSH_9.6\r\n", "BadStatusLine"),
    ],
)
def test_a_head_status_answer_cut_short_or_not_http_is_not_reachable_yet(answer, why):
    """A head that dies mid-answer, or a pod IP now held by something else: 'not answering' (the
    wait goes on to its deadline), not an error that ends the run and deletes the cache."""
    with _head_on_one_connection(lambda conn: conn.sendall(answer)) as port:
        status, reason = fetch_head_status("127.0.0.1", port, timeout=5)
    assert status is None
    assert reason.startswith(f"GET http://127.0.0.1:{port}/status: "), reason
    assert why in reason, reason


@pytest.mark.parametrize("version", ["HTTP/1.1", "HTTP/1.0"])
def test_a_head_status_answer_that_trickles_is_cut_at_its_timeout(version):
    """The timeout bounds the whole answer: a server sending a byte a second passed every read's
    timeout, and the wait's loop, blocked in this one call, never checked its own deadline."""
    stop = threading.Event()

    def trickle(conn: socket.socket) -> None:
        # The head answers HTTP/1.0, after which http.client lets go of the socket.
        conn.sendall(version.encode() + b" 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
        with contextlib.suppress(OSError):
            while not stop.wait(0.2):
                conn.sendall(b" ")

    with _head_on_one_connection(trickle) as port:
        started = time.monotonic()
        status, reason = fetch_head_status("127.0.0.1", port, timeout=1.5)
        took = time.monotonic() - started
        stop.set()
    assert status is None
    assert reason == f"GET http://127.0.0.1:{port}/status: no whole answer within 1.5 s", reason
    assert took < 4, took


def test_the_head_status_is_read_without_the_initializers_proxy(monkeypatch):
    """The head's pod IP is reached directly, whatever HTTP_PROXY the initializer's pod has."""
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    body = b'{"state": "ready"}'
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    with _head_on_one_connection(lambda conn: conn.sendall(answer)) as port:
        assert fetch_head_status("127.0.0.1", port, timeout=5) == ({"state": "ready"}, None)


def _failed_pod(name: str, labels: dict[str, str], created: str | None = None) -> dict:
    """A pod whose container exited 1, as a cache head does on SIGTERM after a failed load."""
    meta = {"name": name, "namespace": NAMESPACE, "labels": labels}
    if created:
        meta["creationTimestamp"] = created
    terminated = {"terminated": {"exitCode": 1, "reason": "Error", "message": "load failed: no such table"}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"containers": [{"name": "cache", "image": "example"}]},
        "status": {"phase": "Failed", "containerStatuses": [{"name": "cache", "ready": False, "state": terminated}]},
    }


def test_pods_that_are_not_this_caches_do_not_fail_it(fake, make_sim, run_initializer):
    """Two kinds of pods the instance label alone would take for the cache's own, both failed:
    a Helm release's pod named like the cache (Helm labels every pod with its release name),
    and a pod of the cache's previous LeaderWorkerSet, deleted in the background by a failed
    run and still terminating while the Job's retry makes the next one."""
    add_train_job(fake, "job-a")
    sim = make_sim("healthy")
    cache = cache_names(load_config(initializer_env(sim))).cache
    # Made after the cache (a far-off creationTimestamp): only its labels tell it apart.
    foreign = {"app.kubernetes.io/instance": cache, "app.kubernetes.io/name": "redis"}
    fake.put("pods", _failed_pod("redis-0", foreign, created="2999-01-01T00:00:00Z"))
    leftover = {"app.kubernetes.io/instance": cache, "app.kubernetes.io/name": "data-cache",
                "app.kubernetes.io/component": "head", "app.kubernetes.io/managed-by": "cache-initializer"}  # fmt: skip
    fake.put("pods", _failed_pod(f"{cache}-0-old", leftover, created="2026-01-01T00:00:00Z"))

    assert run_initializer(initializer_env(sim)) == (0, "")
    assert sim.created == [cache]


_RUN_WITH_KUBECONFIG = """
import sys
from pathlib import Path
from kubeflow_cache_initializer.main import main
sys.exit(main(termination_log=Path(sys.argv[1])))
"""


def test_sigterm_while_waiting_deletes_the_cache_and_says_why(fake, make_sim, tmp_path):
    """A pod deleted or evicted, or a TrainJob suspended (Kueue's preemption): the process ended
    at once with neither a message nor a termination message, its cache pods left holding their
    CPU and memory while the quota counted them freed."""
    import subprocess
    import sys

    from .fake_k8s import TOKEN

    add_train_job(fake, "job-a")
    sim = make_sim("stuck")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        f"apiVersion: v1\nkind: Config\nclusters: [{{name: f, cluster: {{server: '{fake.url}'}}}}]\n"
        f"users: [{{name: u, user: {{token: '{TOKEN}'}}}}]\n"
        "contexts: [{name: c, context: {cluster: f, user: u}}]\ncurrent-context: c\n"
    )
    termination_log = tmp_path / "termination-log"
    termination_log.write_text("")
    env = {**os.environ, **initializer_env(sim, CACHE_READY_TIMEOUT_SECONDS="120"), "KUBECONFIG": str(kubeconfig)}
    env.pop("KUBERNETES_SERVICE_HOST", None)  # not in a pod: the kubeconfig
    proc = subprocess.Popen(
        [sys.executable, "-c", _RUN_WITH_KUBECONFIG, str(termination_log)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        # Waiting on the cache's pods, as in a cluster: the key Secret is made just before the wait.
        while not (fake.items("pods", NAMESPACE) and fake.items("secrets", NAMESPACE)):
            assert proc.poll() is None and time.monotonic() < deadline, "the cache's pods never came"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, output[-2000:]
    said = "stopped by SIGTERM before the cache was ready"
    assert said in termination_log.read_text() and said in output
    assert "Traceback" not in output
    assert fake.get("leaderworkersets", NAMESPACE, "job-a-cache") is None


@pytest.mark.parametrize(
    "nodes", [[None], ["a"], {"a": 1}, 5, [None, {"index": 1, "state": "failed", "error": "disk"}]]
)
def test_a_head_status_with_node_entries_of_another_shape_does_not_fail_the_run(nodes):
    """A head of another version may shape its node entries otherwise: the entries that are not
    objects say nothing, where one crashed the run as an unexpected error (and the cache went)."""
    status = {"state": "loading", "nodes": nodes}
    failed = [n for n in nodes if isinstance(n, dict)] if isinstance(nodes, list) else []
    expected = "data node 1 failed to load: disk" if failed else None
    assert status_failure(status) == expected
    assert describe_status(status).startswith("head loading: 0/")


def test_a_sigterm_held_then_raised_leaves_nothing_pending(monkeypatch):
    """A SIGTERM during a held call that then failed was raised, and stayed pending: a later run
    in the same process (a test's) was stopped by a SIGTERM no one sent."""
    from types import SimpleNamespace

    from kubeflow_cache_initializer import termination
    from kubeflow_cache_initializer.errors import TerminatedError

    monkeypatch.setattr(signal, "signal", lambda *args: None)  # the handler ignores SIGTERM from then on: not here
    with pytest.raises(TerminatedError), termination.held(SimpleNamespace(deadline=None)):
        termination.on_sigterm(signal.SIGTERM, None)
        raise RuntimeError("the call its retries were cut short for")
    termination.start()  # as main does for each run
    with termination.released():  # a later run's wait for an earlier ServiceAccount: no SIGTERM came since
        pass
    with termination.held(SimpleNamespace(deadline=None)), termination.released():
        pass


class _SignalledWhileEmitting(logging.Handler):
    """Sends SIGTERM from within the emit of the first record that says ``said``, guarded as
    logging's handlers guard theirs: the handler's raise is caught, printed and forgotten."""

    def __init__(self, said: str) -> None:
        super().__init__()
        self.said, self.sent = said, False

    def emit(self, record: logging.LogRecord) -> None:
        if self.sent or self.said not in record.getMessage():
            return
        self.sent = True
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler runs here, in the main thread
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def _sigterm_swallowed_when_logged(said: str):
    handler = _SignalledWhileEmitting(said)
    logger = logging.getLogger("kubeflow_cache_initializer")
    logger.addHandler(handler)
    raise_exceptions, logging.raiseExceptions = logging.raiseExceptions, False  # the traceback print, not needed
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logging.raiseExceptions = raise_exceptions


def test_a_sigterm_whose_raise_a_log_call_swallowed_still_ends_the_run(fake, make_sim, run_initializer):
    """The handler raises where the main thread is; inside a log call, logging's own error
    handling caught it, printed it and went on, and SIGTERM was ignored from then on: the run
    waited out its deadline, and its cache stayed, holding its pods through the suspension."""
    add_train_job(fake, "job-a")
    sim = make_sim("stuck")
    with _sigterm_swallowed_when_logged("cache pods ready") as handler:
        started = time.monotonic()
        code, error = run_initializer(initializer_env(sim, CACHE_READY_TIMEOUT_SECONDS="60"))

    assert handler.sent
    assert time.monotonic() - started < 20  # one status poll (5 s) after the signal, not the 60 s deadline
    assert code == 143 and "stopped by SIGTERM before the cache was ready" in error
    assert fake.items("leaderworkersets", NAMESPACE) == []


def test_a_sigterm_swallowed_in_an_api_retry_warning_ends_the_retries(fake, make_sim, run_initializer):
    """The API retry loop logs each retry: a SIGTERM lost there was retried through to the
    run's deadline, which then failed as an API outage (exit 1), not a SIGTERM (143)."""
    add_train_job(fake, "job-a")
    fake.fail_next[("trainjobs", "get")] = [503] * 100
    with _sigterm_swallowed_when_logged("trying again in") as handler:
        started = time.monotonic()
        code, error = run_initializer(initializer_env(make_sim("healthy"), CACHE_READY_TIMEOUT_SECONDS="30"))

    assert handler.sent
    assert time.monotonic() - started < 10
    assert code == 143 and "stopped by SIGTERM before the cache was ready" in error
    assert len(fake.fail_next[("trainjobs", "get")]) >= 98  # no retry after the one that logged the signal


def test_the_cleanup_after_a_sigterm_still_retries_its_delete(fake, make_sim, run_initializer):
    """The cleanup a SIGTERM starts retries a delete the API fails for a moment: the SIGTERM
    that ended the run's retries must not end the cleanup's, or the cache holds its pods."""
    add_train_job(fake, "job-a")
    fake.fail_next[("leaderworkersets", "delete")] = [503, 503]
    with _sigterm_swallowed_when_logged("cache pods ready") as handler:
        code, error = run_initializer(initializer_env(make_sim("stuck"), CACHE_READY_TIMEOUT_SECONDS="60"))

    assert handler.sent
    assert code == 143 and "stopped by SIGTERM before the cache was ready" in error
    assert fake.fail_next[("leaderworkersets", "delete")] == []
    assert fake.items("leaderworkersets", NAMESPACE) == []


def test_a_sigterm_in_the_held_creates_retry_warning_still_deletes_the_cache_the_api_stored(
    fake, make_sim, run_initializer
):
    """The create of the LeaderWorkerSet is held from SIGTERM: its answer lost (a proxy's 504
    after the API server stored it), its one more try finds it (409) and the cleanup deletes it.
    Raised at the retry's warning, the SIGTERM left that cache, unknown to the run, in place."""
    add_train_job(fake, "job-a")
    stored: list[dict] = []

    def store_then_lose_the_answer(obj: dict) -> None:
        if not stored:
            stored.append(obj)
            raise ApiFailure(504, "Timeout", "the request was stored but its answer timed out")

    fake.on_create.setdefault("leaderworkersets", []).append(store_then_lose_the_answer)
    with _sigterm_swallowed_when_logged("create leaderworkersets") as handler:
        code, error = run_initializer(initializer_env(make_sim("stuck"), CACHE_READY_TIMEOUT_SECONDS="60"))

    assert handler.sent and stored
    assert code == 143 and "stopped by SIGTERM before the cache was ready" in error
    assert fake.items("leaderworkersets", NAMESPACE) == []


def test_a_first_sigterm_during_a_cleanup_does_not_cut_its_delete_short(fake, make_sim, run_initializer):
    """A run that failed (here, its deadline) deletes its cache, retrying through an API outage;
    a SIGTERM then (the pod deleted, the job suspended) ended those retries, and the cache stayed."""

    class SignalledAfterEmitting(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.sent = False

        def emit(self, record: logging.LogRecord) -> None:
            if not self.sent and "delete leaderworkersets" in record.getMessage():
                self.sent = True  # lands in the retry's pause, not in this log call
                threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()

    add_train_job(fake, "job-a")
    fake.fail_next[("leaderworkersets", "delete")] = [503, 503]
    handler = SignalledAfterEmitting()
    logger = logging.getLogger("kubeflow_cache_initializer")
    logger.addHandler(handler)
    try:
        code, error = run_initializer(initializer_env(make_sim("stuck"), CACHE_READY_TIMEOUT_SECONDS="3"))
    finally:
        logger.removeHandler(handler)

    assert handler.sent
    assert code == 1 and "not ready within CACHE_READY_TIMEOUT_SECONDS=3" in error  # the run's own failure
    assert fake.fail_next[("leaderworkersets", "delete")] == []
    assert fake.items("leaderworkersets", NAMESPACE) == []


def test_a_sigterm_swallowed_while_waiting_for_a_cache_to_go_ends_the_wait(fake, run_initializer):
    """The wait for a shared cache being deleted logs before it watches: a SIGTERM lost there
    was watched through to the run's deadline, then failed as a timeout (exit 1)."""
    env = _a_shared_cache_being_deleted(fake)
    with _sigterm_swallowed_when_logged("waiting for it to go") as handler:
        started = time.monotonic()
        code, error = run_initializer(env)

    assert handler.sent
    assert time.monotonic() - started < 10
    assert code == 143 and "stopped by SIGTERM before the cache was ready" in error


def test_a_sigterm_swallowed_in_the_wait_turn_that_finds_the_cache_ready_still_ends_the_run(
    fake, make_sim, run_initializer, monkeypatch
):
    """That turn logs its last lines, then returns ready: a SIGTERM whose raise one of them
    swallowed was lost, and the run ended 0, its cache kept through the pod's deletion."""
    from kubeflow_cache_initializer import wait

    sent = []
    log_changes = wait._Progress.log_changes

    def log_changes_swallowing_a_sigterm(self) -> None:
        log_changes(self)
        if not sent and self.ready():
            sent.append(True)
            try:  # as logging.Handler.handleError does with what a handler's emit raised
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
            except Exception:
                pass

    monkeypatch.setattr(wait._Progress, "log_changes", log_changes_swallowing_a_sigterm)
    add_train_job(fake, "job-a")
    code, error = run_initializer(initializer_env(make_sim("healthy"), CACHE_READY_TIMEOUT_SECONDS="60"))

    assert sent
    assert code == 143 and "stopped by SIGTERM before the cache was ready" in error
    assert fake.items("leaderworkersets", NAMESPACE) == []
