"""What a real cluster throws at the initializer besides a broken cache: API outages, a head it
cannot reach, names another TrainJob holds, pods that wait on something, and the unforeseen."""

from __future__ import annotations

import re
import socket
import time

import pytest
from kubernetes import client

from kubeflow_cache_initializer import main as main_module
from kubeflow_cache_initializer.builders import build_service
from kubeflow_cache_initializer.config import load_config
from kubeflow_cache_initializer.errors import ConfigError, KubeApiError
from kubeflow_cache_initializer.health import not_ready_reason
from kubeflow_cache_initializer.kube import TRAINJOBS, Kube

from .support import MINIMAL, NAMESPACE, add_train_job, initializer_env


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    configuration = client.Configuration(host=f"http://127.0.0.1:{_closed_port()}")
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
    assert kube.troubles == {}  # given up: no longer "failing now"


def test_without_a_deadline_nothing_is_retried():
    started = time.monotonic()
    with pytest.raises(KubeApiError):
        Kube(_refusing_api()).get(TRAINJOBS, NAMESPACE, "job-a")
    assert time.monotonic() - started < 1


def test_a_loaded_cache_whose_status_port_is_unreachable_is_taken_as_ready(fake, make_sim, run_initializer, caplog):
    """A NetworkPolicy that lets the kubelet probe the pods but not the initializer reach :8080."""
    add_train_job(fake, "job-a")
    sim = make_sim("healthy")
    env = initializer_env(sim, CACHE_READY_TIMEOUT_SECONDS="20", CACHE_HEALTH_PORT=str(_closed_port()))

    assert run_initializer(env) == (0, "")

    assert "/status has not answered for" in caplog.text
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


@pytest.mark.parametrize("other", ["job-a-cache", "job-a-cache-service"])
def test_a_train_job_named_like_the_cache_is_refused(fake, make_sim, run_initializer, other):
    add_train_job(fake, "job-a")
    add_train_job(fake, other)

    code, error = run_initializer(initializer_env(make_sim("healthy")))

    assert code == 1
    assert f"TrainJob {other} exists in namespace team-a" in error
    assert "Rename one of the two TrainJobs" in error
    assert fake.items("leaderworkersets", NAMESPACE) == []


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
