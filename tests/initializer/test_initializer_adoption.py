"""A restarted initializer adopts what it made before; what is not its own, it refuses."""

from __future__ import annotations

import base64
import json
import threading

import pytest

from kubeflow_cache_initializer.apply import differences
from kubeflow_cache_initializer.builders import (
    build_leader_worker_set,
    build_service,
    build_service_account,
    cache_names,
    key_secret_of,
    new_key_secret_name,
)
from kubeflow_cache_initializer.config import load_config

from .support import NAMESPACE, add_train_job, initializer_env

CACHE_OBJECTS = (
    ("serviceaccounts", "job-a-cache"),
    ("leaderworkersets", "job-a-cache"),
    ("services", "job-a-cache-service"),
)


def _uids(fake) -> dict[str, str]:
    return {plural: fake.get(plural, NAMESPACE, name)["metadata"]["uid"] for plural, name in CACHE_OBJECTS}


def _creates(fake) -> list[tuple[str, int]]:
    return [(path.rsplit("/", 1)[-1], code) for method, path, _, code in fake.responses if method == "POST"]


def test_a_restart_adopts_the_cache_it_created(fake, make_sim, run_initializer, caplog):
    add_train_job(fake, "job-a")
    sim = make_sim("healthy")
    env = initializer_env(sim)
    assert run_initializer(env)[0] == 0
    before = _uids(fake)
    fake.responses.clear()

    code, error = run_initializer(env)

    assert (code, error) == (0, "")
    assert _uids(fake) == before
    assert _creates(fake) == [("serviceaccounts", 409), ("services", 409), ("leaderworkersets", 409), ("secrets", 409)]
    assert not [r for r in fake.responses if r[0] == "PATCH"]
    assert sim.created == ["job-a-cache"]
    assert "adopted LeaderWorkerSet team-a/job-a-cache, created by an earlier run" in caplog.text


def _with_secret_volume_defaults(lws: dict) -> None:
    """What the API server stores for the TLS Secret volume: its defaultMode filled in."""
    for template in lws["spec"]["leaderWorkerTemplate"].values():
        if isinstance(template, dict) and "spec" in template:
            for volume in template["spec"]["volumes"]:
                if "secret" in volume:
                    volume["secret"]["defaultMode"] = 420


def test_a_restart_adopts_a_cache_with_its_tls_volume_as_the_api_server_stored_it(fake, make_sim, run_initializer):
    """The optional TLS volume, with the fields the API server defaults, is no drift: the restart
    patches nothing (a patch would recreate the cache's pods)."""
    add_train_job(fake, "job-a")
    env = initializer_env(make_sim("healthy"))
    assert run_initializer(env)[0] == 0
    fake.update("leaderworkersets", NAMESPACE, "job-a-cache", _with_secret_volume_defaults)
    stored = fake.get("leaderworkersets", NAMESPACE, "job-a-cache")
    volumes = stored["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["volumes"]
    assert {
        "name": "data-cache-tls",
        "secret": {"secretName": "data-cache-tls", "optional": True, "defaultMode": 420},
    } in volumes
    fake.responses.clear()

    assert run_initializer(env) == (0, "")
    assert not [r for r in fake.responses if r[0] == "PATCH"]
    assert (
        fake.get("leaderworkersets", NAMESPACE, "job-a-cache")["metadata"]["generation"]
        == stored["metadata"]["generation"]
    )


def _with_canonical_quantities(lws: dict) -> None:
    """What LeaderWorkerSet's webhook stores: each quantity in Kubernetes' canonical form."""
    canonical = {"0.5": "500m", "1.5": "1500m", "4096Mi": "4Gi", "1024Mi": "1Gi"}
    for template in lws["spec"]["leaderWorkerTemplate"].values():
        if isinstance(template, dict) and "spec" in template:
            for container in template["spec"]["containers"]:
                for amounts in container["resources"].values():
                    amounts.update({k: canonical.get(v, v) for k, v in amounts.items()})


def test_a_restart_adopts_a_cache_whose_quantities_the_webhook_made_canonical(fake, make_sim, run_initializer, caplog):
    """`HEAD_CPU=0.5` is stored as `500m`: the same amount, so no drift. The restart read it as
    one, logged "restoring ...resources...", and sent a patch the webhook undid."""
    add_train_job(fake, "job-a")
    env = initializer_env(make_sim("healthy"), HEAD_CPU="0.5", HEAD_MEM="1024Mi", WORKER_CPU="1.5", WORKER_MEM="4096Mi")
    assert run_initializer(env)[0] == 0
    fake.update("leaderworkersets", NAMESPACE, "job-a-cache", _with_canonical_quantities)
    stored = fake.get("leaderworkersets", NAMESPACE, "job-a-cache")
    head = stored["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]["resources"]
    assert head["limits"] == {"cpu": "500m", "memory": "1Gi"}
    fake.responses.clear()

    assert run_initializer(env) == (0, "")
    assert not [r for r in fake.responses if r[0] == "PATCH"]
    assert "restoring" not in caplog.text


@pytest.mark.parametrize(
    ("want", "have", "drift"),
    [
        ("0.5", "500m", False),
        ("4096Mi", "4Gi", False),
        ("1", "1000m", False),
        ("1", "2", True),  # a quantity changed by hand is drift, restored
        ("4Gi", "4G", True),  # 4 GiB is not 4 GB
        ("1Gi", "not a quantity", True),
    ],
)
def test_resource_quantities_compare_by_amount_elsewhere_by_value(want, have, drift):
    resources = ".spec.containers[0].resources.limits.memory"
    found = differences({"limits": {"memory": want}}, {"limits": {"memory": have}}, ".spec.containers[0].resources")
    assert found == ([resources] if drift else [])
    # Elsewhere a string is a string: an env value "0.5" set to "500m" changed.
    assert differences({"value": "0.5"}, {"value": "500m"}) == [".value"]


def test_a_restart_after_a_crash_between_creates_finishes_the_job(fake, make_sim, run_initializer):
    job = add_train_job(fake, "job-a")
    sim = make_sim("healthy")
    env = initializer_env(sim)
    owner = {**{k: job[k] for k in ("apiVersion", "kind")}, "name": "job-a", "uid": job["metadata"]["uid"]}
    fake.put("serviceaccounts", build_service_account(load_config(env), [{**owner, "controller": True}]))

    code, error = run_initializer(env)

    assert (code, error) == (0, "")
    assert _creates(fake) == [
        ("serviceaccounts", 409),
        ("services", 201),
        ("leaderworkersets", 201),
        ("secrets", 201),
    ]
    assert sim.created == ["job-a-cache"]


def test_adopted_objects_that_drifted_are_patched_back(fake, make_sim, run_initializer, caplog):
    add_train_job(fake, "job-a")
    sim = make_sim("healthy")
    env = initializer_env(sim)
    assert run_initializer(env)[0] == 0
    fake.update(
        "services", NAMESPACE, "job-a-cache-service", lambda o: o["metadata"]["labels"].pop("app.kubernetes.io/name")
    )
    containers = [{"name": "cache", "image": "example.com/other:1"}]
    by_hand = {"spec": {"leaderWorkerTemplate": {"workerTemplate": {"spec": {"containers": containers}}}}}
    fake.patch("leaderworkersets", "LeaderWorkerSet", NAMESPACE, "job-a-cache", by_hand, "application/merge-patch+json")
    fake.update(
        "serviceaccounts", NAMESPACE, "job-a-cache", lambda o: o["metadata"]["labels"].pop("app.kubernetes.io/name")
    )

    code, error = run_initializer(env)

    assert (code, error) == (0, "")
    service = fake.get("services", NAMESPACE, "job-a-cache-service")
    # A Service is never patched: a label it lost is left so, and said.
    assert "app.kubernetes.io/name" not in service["metadata"]["labels"]
    assert ".metadata.labels.app.kubernetes.io/name differ from this run's, kept as they are" in caplog.text
    lws = fake.get("leaderworkersets", NAMESPACE, "job-a-cache")
    assert lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["image"] == env["CACHE_IMAGE"]
    assert lws["metadata"]["generation"] == 3  # created, edited by hand, restored
    assert lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["readinessProbe"]
    sa = fake.get("serviceaccounts", NAMESPACE, "job-a-cache")
    assert sa["metadata"]["labels"]["app.kubernetes.io/name"] == "data-cache"
    assert "restoring .spec.leaderWorkerTemplate.workerTemplate.spec.containers[0].image" in caplog.text
    assert fake.rejected == []


def test_a_service_whose_spec_drifted_is_refused_naming_it_not_patched(fake, make_sim, run_initializer):
    """The initializer may not patch Services (its Role would let any pod running as it repoint
    every Service of the namespace): a cache Service edited between two attempts is named, with
    the command that deletes it, and the next attempt makes it anew."""
    add_train_job(fake, "job-a")
    sim = make_sim("healthy")
    env = initializer_env(sim)
    assert run_initializer(env)[0] == 0
    fake.update("services", NAMESPACE, "job-a-cache-service", lambda s: s["spec"]["selector"].update(app="other"))

    code, output = run_initializer(env)

    assert code == 1
    assert f"Service {NAMESPACE}/job-a-cache-service, made for this TrainJob by an earlier attempt" in output
    assert ".spec.selector.app" in output and "may not change Services" in output
    assert f"kubectl delete service job-a-cache-service -n {NAMESPACE}" in output
    assert fake.get("services", NAMESPACE, "job-a-cache-service")["spec"]["selector"]["app"] == "other"
    fake.delete("services", NAMESPACE, "job-a-cache-service")
    assert run_initializer(env)[0] == 0
    service = fake.get("services", NAMESPACE, "job-a-cache-service")
    assert service["spec"]["selector"] == build_service(load_config(env), [])["spec"]["selector"]
    assert fake.rejected == []


def test_a_service_an_earlier_version_made_is_kept_where_only_its_newer_fields_differ(
    fake, make_sim, run_initializer, caplog
):
    """A TrainJob suspended across an upgrade runs the new initializer against the Service the old
    one made, without publishNotReadyAddresses: refused as drifted, every attempt failed."""
    add_train_job(fake, "job-a")
    env = initializer_env(make_sim("healthy"))
    assert run_initializer(env)[0] == 0
    fake.update("services", NAMESPACE, "job-a-cache-service", lambda s: s["spec"].pop("publishNotReadyAddresses"))

    assert run_initializer(env)[0] == 0

    assert "job-a-cache-service; its .spec.publishNotReadyAddresses differ from this run's, kept" in caplog.text
    assert "publishNotReadyAddresses" not in fake.get("services", NAMESPACE, "job-a-cache-service")["spec"]


def test_an_object_owned_by_another_train_job_is_refused_and_left_alone(fake, make_sim, run_initializer):
    add_train_job(fake, "job-a")
    other = add_train_job(fake, "job-old")
    env = initializer_env(make_sim("healthy"))
    owner = {"apiVersion": other["apiVersion"], "kind": "TrainJob", "name": "job-old", "uid": other["metadata"]["uid"]}
    foreign = fake.put("services", build_service(load_config(env), [{**owner, "controller": True}]))

    code, error = run_initializer(env)

    assert code != 0
    assert error.startswith("Service team-a/job-a-cache-service already exists and is not owned by TrainJob job-a")
    assert f"owned by TrainJob job-old (uid {other['metadata']['uid']})" in error
    assert fake.get("services", NAMESPACE, "job-a-cache-service") == foreign


def test_a_watch_that_breaks_while_a_cache_is_deleted_is_watched_again(fake, make_sim, run_initializer, monkeypatch):
    """The wait for a terminating shared cache watches it; a dropped connection there ended the
    run as 'the initializer failed unexpectedly: ProtocolError' (exit 1), training never started."""
    add_train_job(fake, "job-a")
    env = initializer_env(make_sim("healthy"), DATA_CACHE_SHARED="true")
    cache = load_config(env)
    name = cache_names(cache).cache
    dying = build_leader_worker_set(cache, [])
    dying["metadata"].pop("ownerReferences")
    dying["metadata"] |= {"deletionTimestamp": "2026-01-01T00:00:00Z", "finalizers": ["example.com/slow"]}
    fake.put("leaderworkersets", dying)
    streams, dropped = fake.stream_events, threading.Event()

    def drop_the_first(plural, *args, **kwargs):
        if plural == "leaderworkersets" and not dropped.is_set():
            dropped.set()
            raise OSError("connection reset")  # the fake ends the response without its last chunk
        return streams(plural, *args, **kwargs)

    monkeypatch.setattr(fake, "stream_events", drop_the_first)

    def finish_deletion() -> None:
        dropped.wait(30)
        fake.wait_for_watches(("leaderworkersets",))  # the watch made again
        fake.delete("leaderworkersets", NAMESPACE, name)

    finisher = threading.Thread(target=finish_deletion, daemon=True)
    finisher.start()
    code, error = run_initializer(env)
    finisher.join(30)

    assert (code, error) == (0, "") and dropped.is_set()
    assert fake.get("leaderworkersets", NAMESPACE, name)["metadata"].get("deletionTimestamp") is None


@pytest.mark.parametrize("watch_gone", [False, True], ids=["watched", "first-watch-410"])
def test_a_cache_being_deleted_is_waited_for_then_created_again(fake, make_sim, run_initializer, caplog, watch_gone):
    """A shared cache whose last TrainJob just went: the LWS is terminating when the next job comes.
    Its watch answered HTTP 410 (as some API servers and proxies say "too old") is read again,
    as the cache's own wait does: it failed the run."""
    add_train_job(fake, "job-a")
    if watch_gone:
        fake.fail_next[("leaderworkersets", "watch")] = [410]
    sim = make_sim("healthy")
    env = initializer_env(sim, DATA_CACHE_SHARED="true")
    cache = load_config(env)
    name = cache_names(cache).cache
    dying = build_leader_worker_set(cache, [])
    dying["metadata"].pop("ownerReferences")
    dying["metadata"] |= {"deletionTimestamp": "2026-01-01T00:00:00Z", "finalizers": ["example.com/slow"]}
    old_uid = fake.put("leaderworkersets", dying)["metadata"]["uid"]

    def finish_deletion() -> None:
        fake.wait_for_watches(("leaderworkersets",))
        fake.delete("leaderworkersets", NAMESPACE, name)

    finisher = threading.Thread(target=finish_deletion, daemon=True)
    finisher.start()
    code, error = run_initializer(env)
    finisher.join(30)

    assert (code, error) == (0, "")
    assert fake.get("leaderworkersets", NAMESPACE, name)["metadata"]["uid"] != old_uid
    assert sim.created == [name]
    assert "is being deleted; waiting for it to go" in caplog.text


def _keys(fake, lws: dict) -> list[str | None]:
    """Each pod template's DATA_CACHE_CLUSTER_KEY, as the kubelet would give it: read from the
    Secret its env points at (or the value itself, as an older initializer wrote it)."""
    templates = lws["spec"]["leaderWorkerTemplate"]
    keys = []
    for t in ("leaderTemplate", "workerTemplate"):
        entry = next((e for e in templates[t]["spec"]["containers"][0]["env"] if e["name"] == CLUSTER_KEY), None)
        ref = ((entry or {}).get("valueFrom") or {}).get("secretKeyRef")
        if ref is not None:
            secret = fake.get("secrets", lws["metadata"]["namespace"], ref["name"])
            keys.append(base64.b64decode(secret["data"][ref["key"]]).decode())
        else:
            keys.append((entry or {}).get("value"))
    return keys


CLUSTER_KEY = "DATA_CACHE_CLUSTER_KEY"


def test_every_cache_gets_a_cluster_key_of_its_own_and_a_restart_keeps_it(fake, make_sim, run_initializer, caplog):
    """Head and data nodes share a random key, held in a Secret the cache owns; a restarted
    initializer adopts the cache with the key it was made with (a new one would read as drift
    and restart the cache's pods), without reading the Secret."""
    add_train_job(fake, "job-a")
    add_train_job(fake, "job-b")
    sim = make_sim("healthy")
    env = initializer_env(sim)
    assert run_initializer(env)[0] == 0
    lws = fake.get("leaderworkersets", NAMESPACE, "job-a-cache")
    first = _keys(fake, lws)
    assert first[0] is not None and first[0] == first[1] and len(first[0]) >= 32
    assert first[0] not in json.dumps(lws)  # in the Secret only, not in what `view` reads
    (secret,) = fake.items("secrets", NAMESPACE)
    assert secret["metadata"]["ownerReferences"][0]["uid"] == lws["metadata"]["uid"]

    fake.responses.clear()
    fake.calls.clear()
    assert run_initializer(env) == (0, "")
    assert _keys(fake, fake.get("leaderworkersets", NAMESPACE, "job-a-cache")) == first
    assert not [r for r in fake.responses if r[0] == "PATCH"]
    assert [v for g, r, v in fake.calls if r == "secrets"] == ["create"]  # kept, never read

    assert run_initializer({**env, "TRAIN_JOB_NAME": "job-b"})[0] == 0
    other = _keys(fake, fake.get("leaderworkersets", NAMESPACE, "job-b-cache"))
    assert other[0] == other[1] and other[0] != first[0]
    assert first[0] not in caplog.text and other[0] not in caplog.text

    # Deleting the TrainJob deletes its cache, and with it the cache's key.
    fake.delete("trainjobs", NAMESPACE, "job-a")
    assert fake.get("leaderworkersets", NAMESPACE, "job-a-cache") is None
    assert [s["metadata"]["name"] for s in fake.items("secrets", NAMESPACE)] == [
        key_secret_of(fake.get("leaderworkersets", NAMESPACE, "job-b-cache"))
    ]


def test_a_cache_made_with_its_key_in_the_env_is_adopted_as_it_is(fake, make_sim, run_initializer):
    """One made by the initializer of before the Secret: adopting it keeps its key and its pods."""
    add_train_job(fake, "job-a")
    env = initializer_env(make_sim("healthy"))
    assert run_initializer(env)[0] == 0
    for secret in fake.items("secrets", NAMESPACE):
        fake.delete("secrets", NAMESPACE, secret["metadata"]["name"])

    def as_before_the_secret(lws: dict) -> None:
        for template in lws["spec"]["leaderWorkerTemplate"].values():
            if isinstance(template, dict) and "spec" in template:
                for var in template["spec"]["containers"][0]["env"]:
                    if var["name"] == CLUSTER_KEY:
                        var.pop("valueFrom")
                        var["value"] = "an-old-key-in-the-pod-spec"

    fake.update("leaderworkersets", NAMESPACE, "job-a-cache", as_before_the_secret)
    fake.responses.clear()

    assert run_initializer(env) == (0, "")
    assert _keys(fake, fake.get("leaderworkersets", NAMESPACE, "job-a-cache")) == ["an-old-key-in-the-pod-spec"] * 2
    assert not [r for r in fake.responses if r[0] == "PATCH"]
    assert fake.items("secrets", NAMESPACE) == []


def test_an_initializer_that_may_not_create_secrets_says_so_and_frees_the_cache(fake, make_sim, run_initializer):
    """An initializer upgraded without its Role: the cache's pods would wait on a Secret for ever."""
    add_train_job(fake, "job-a")
    env = initializer_env(make_sim("healthy"))
    fake.allowed.discard(("", "secrets", "create"))
    code, error = run_initializer(env)
    assert code == 1 and "may not `create` secrets" in error and "upgrade the chart" in error
    assert fake.get("leaderworkersets", NAMESPACE, "job-a-cache") is None  # a failed run frees the pods
    assert fake.items("secrets", NAMESPACE) == []


def test_a_restart_after_a_crash_between_the_cache_and_its_key_makes_the_key(fake, make_sim, run_initializer):
    """The cache's pods wait on its Secret (CreateContainerConfigError); the next run adopts the
    cache and makes the Secret under the name the cache reads, and the pods start."""
    job = add_train_job(fake, "job-a")
    sim = make_sim("healthy")
    env = initializer_env(sim)
    cfg = load_config(env)
    owner = {**{k: job[k] for k in ("apiVersion", "kind")}, "name": "job-a", "uid": job["metadata"]["uid"]}
    name = new_key_secret_name(cfg)
    fake.create("leaderworkersets", "LeaderWorkerSet", NAMESPACE,
                build_leader_worker_set(cfg, [{**owner, "controller": True}], name))  # fmt: skip

    assert run_initializer(env) == (0, "")
    (secret,) = fake.items("secrets", NAMESPACE)
    assert secret["metadata"]["name"] == name
    assert sim.created == ["job-a-cache"]  # adopted, not made again


def test_a_cache_made_without_a_cluster_key_is_adopted_as_it_is(fake, make_sim, run_initializer):
    """One made by an initializer of before the key: adopting it must not restart its pods."""
    add_train_job(fake, "job-a")
    env = initializer_env(make_sim("healthy"))
    assert run_initializer(env)[0] == 0

    def as_before_the_key(lws: dict) -> None:
        for template in lws["spec"]["leaderWorkerTemplate"].values():
            if isinstance(template, dict) and "spec" in template:
                container = template["spec"]["containers"][0]
                container["env"] = [e for e in container["env"] if e["name"] != CLUSTER_KEY]

    fake.update("leaderworkersets", NAMESPACE, "job-a-cache", as_before_the_key)
    fake.responses.clear()

    assert run_initializer(env) == (0, "")
    assert _keys(fake, fake.get("leaderworkersets", NAMESPACE, "job-a-cache")) == [None, None]
    assert not [r for r in fake.responses if r[0] == "PATCH"]


def _left_by_an_earlier_job_a(fake, env: dict[str, str], plurals: tuple[str, ...]) -> str:
    """The objects a deleted TrainJob job-a left for the garbage collector (owned by its uid)."""
    cfg = load_config(env)
    gone = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "name": "job-a"}
    owner = {**gone, "uid": "0000-earlier-job-a", "controller": True}
    build = {
        "serviceaccounts": lambda: build_service_account(cfg, [owner]),
        "services": lambda: build_service(cfg, [owner]),
        "leaderworkersets": lambda: build_leader_worker_set(cfg, [owner], new_key_secret_name(cfg)),
    }
    for plural in plurals:
        fake.put(plural, build[plural]())
    return owner["uid"]


@pytest.mark.parametrize(
    "left",
    [("serviceaccounts", "services", "leaderworkersets"), ("leaderworkersets",)],
    ids=["all-read-again", "cache-watched"],
)
def test_a_train_job_made_again_under_its_name_waits_for_the_old_ones_objects_to_go(
    fake, make_sim, run_initializer, caplog, left
):
    """`kubectl delete trainjob job-a` then the same TrainJob again: the garbage collector deletes
    the old job's objects in the background, maybe after the new initializer started. They are
    waited for and made anew, not refused as another's (which burnt the Job's one retry)."""
    sim = make_sim("healthy")
    env = initializer_env(sim)
    old_uid = _left_by_an_earlier_job_a(fake, env, left)
    new_uid = add_train_job(fake, "job-a")["metadata"]["uid"]

    # The run's second read of its ServiceAccount: it has seen the old one and waits for it to go.
    # (A 1.5 s sleep here lost the race on a loaded machine: the run read it only once it was gone.)
    read_again = threading.Event()
    fake.before[("serviceaccounts", "get")] = [lambda: None, read_again.set]

    def collect_garbage() -> None:
        if "serviceaccounts" in left:
            read_again.wait(30)
        else:
            fake.wait_for_watches(("leaderworkersets",))
        fake.collect_garbage()

    collector = threading.Thread(target=collect_garbage, daemon=True)
    collector.start()
    code, error = run_initializer(env)
    collector.join(30)

    assert (code, error) == (0, "")
    for plural, name in CACHE_OBJECTS:
        owners = fake.get(plural, NAMESPACE, name)["metadata"]["ownerReferences"]
        assert [ref["uid"] for ref in owners] == [new_uid], plural
    assert old_uid not in json.dumps(fake.items("leaderworkersets", NAMESPACE))
    assert sim.created == ["job-a-cache"]
    assert "belongs to an earlier TrainJob job-a (deleted); waiting for the garbage collector" in caplog.text


def test_an_earlier_train_jobs_object_the_collector_never_deletes_fails_at_the_deadline(
    fake, make_sim, run_initializer
):
    """A garbage collector that does not run: the run ends at its deadline, saying so."""
    env = initializer_env(make_sim("healthy"), CACHE_READY_TIMEOUT_SECONDS="2")
    _left_by_an_earlier_job_a(fake, env, ("serviceaccounts",))
    add_train_job(fake, "job-a")

    code, error = run_initializer(env)

    assert code != 0
    assert "ServiceAccount team-a/job-a-cache was still there at the deadline" in error
    assert "garbage collector (kube-controller-manager) should have deleted it" in error
