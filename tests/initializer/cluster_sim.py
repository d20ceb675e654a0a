"""Plays the LWS controller, the kubelet and the cache head against a `FakeKube`, one scenario each.

When a LeaderWorkerSet is created, a thread turns it into pods (labels and owner reference as
LWS makes them) and moves them through a scripted scenario. The head's `/status` is a real HTTP
server on 127.0.0.1; pod IPs are 127.0.0.1 and its port is the `CACHE_HEALTH_PORT` to use.
Each script is a handful of steps, so every thread ends on its own.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .fake_k8s import FakeKube

ROWS_PER_NODE = 1000
# How long a pod waits for a Secret its env reads before the scenario gives up on it (a kubelet
# tries for ever; every scenario thread must end).
SECRET_WAIT_SECONDS = 30.0
BYTES_PER_NODE = 64_000
SCENARIOS = (
    "healthy",
    "stuck",
    "image_pull",
    "image_pull_passes",
    "invalid_image",
    "oom",
    "recovered_oom",
    "unschedulable",
    "evicted",
    "workers_refused",
    "node_load_error",
    "exits_0",
    "head_load_error",
    "compaction",
    "not_available",
)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class CacheSim:
    def __init__(self, fake: FakeKube, scenario: str = "healthy", step_seconds: float = 0.01):
        assert scenario in SCENARIOS, scenario
        self.fake, self.scenario, self.step = fake, scenario, step_seconds
        self.head_status: dict | None = None
        self.created: list[str] = []
        self.threads: list[threading.Thread] = []
        self._closing = threading.Event()
        fake.on_create.setdefault("leaderworkersets", []).append(self._on_lws)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, args=(0.05,), name="head-status", daemon=True).start()

    @property
    def health_port(self) -> int:
        return self.server.server_address[1]

    def close(self) -> None:
        self._closing.set()  # a scenario thread still waiting ends now, not at its deadline
        for thread in self.threads:
            thread.join(10)
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        sim = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                status = sim.head_status
                code = 200 if self.path == "/status" and status is not None else 503
                body = json.dumps(status if code == 200 else {"state": "starting"}).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler

    # -- objects as the LWS controller and the kubelet make them ---------------------------
    def _on_lws(self, lws: dict) -> None:
        self.created.append(lws["metadata"]["name"])
        thread = threading.Thread(target=self._play, args=(lws,), name="cache-sim", daemon=True)
        self.threads.append(thread)
        thread.start()

    def _pod(self, lws: dict, index: int) -> dict:
        spec = lws["spec"]["leaderWorkerTemplate"]
        template = spec["leaderTemplate"] if index == 0 else spec["workerTemplate"]
        name = lws["metadata"]["name"]
        labels = {
            **template["metadata"]["labels"],
            "leaderworkerset.sigs.k8s.io/name": name,
            "leaderworkerset.sigs.k8s.io/group-index": "0",
            "leaderworkerset.sigs.k8s.io/worker-index": str(index),
        }
        owner = {"apiVersion": lws["apiVersion"], "kind": lws["kind"], "name": name, "uid": lws["metadata"]["uid"]}
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{name}-0" if index == 0 else f"{name}-0-{index}",
                "namespace": lws["metadata"]["namespace"],
                "labels": labels,
                "ownerReferences": [{**owner, "controller": True}],
            },
            "spec": template["spec"],
            "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]},
        }

    def _set(self, pod: dict, **container) -> None:
        """Move a pod along: `ready`, `state`, `lastState` of its container; phase Running."""
        ready = container.get("ready", False)

        def change(obj: dict) -> None:
            image = obj["spec"]["containers"][0]["image"]
            obj["status"] = {
                "phase": "Running",
                "podIP": "127.0.0.1",
                "conditions": [
                    {"type": "PodScheduled", "status": "True"},
                    {"type": "Ready", "status": str(ready)},
                ],
                "containerStatuses": [
                    {
                        "name": "cache",
                        "image": image,
                        "ready": ready,
                        "restartCount": 1 if "lastState" in container else 0,
                        "state": container.get("state", {"running": {"startedAt": _now()}}),
                        "lastState": container.get("lastState", {}),
                    }
                ],
            }

        meta = pod["metadata"]
        self.fake.update("pods", meta["namespace"], meta["name"], change)

    def _status(self, state: str, nodes: int, loaded: int, error: str | None = None, node_error: int = -1) -> None:
        """The head's /status as head.Head.status() shapes it: a loading node holds no rows yet
        and says in ``loading`` how far its read is (half way, here)."""
        reading = {"rows": ROWS_PER_NODE // 2, "bytes": BYTES_PER_NODE // 2, "oldest_read": None}
        self.head_status = {
            "state": state,
            "detail": error or f"{loaded}/{nodes} data nodes ready",
            "error": error,
            "rows": loaded * ROWS_PER_NODE,
            "bytes": loaded * BYTES_PER_NODE,
            "nodes": [
                {
                    "index": i,
                    "state": "failed" if i == node_error else ("ready" if i < loaded else "loading"),
                    "rows": ROWS_PER_NODE if i < loaded else 0,
                    "bytes": BYTES_PER_NODE if i < loaded else 0,
                    "error": error if i == node_error else None,
                    "loading": reading if i >= loaded and i != node_error else None,
                }
                for i in range(nodes)
            ],
        }

    def _available(self, lws: dict) -> None:
        def change(obj: dict) -> None:
            obj["status"] = {
                "replicas": 1,
                "readyReplicas": 1,
                "updatedReplicas": 1,
                "conditions": [
                    {"type": "Available", "status": "True", "reason": "AllGroupsReady",
                     "message": "All replicas are ready", "lastTransitionTime": _now()}
                ],
            }  # fmt: skip

        meta = lws["metadata"]
        self.fake.update("leaderworkersets", meta["namespace"], meta["name"], change)

    # -- scenarios ---------------------------------------------------------------------------
    def _missing_secret_key(self, lws: dict) -> str | None:
        """What a kubelet says of the first env value read from a Secret that is not there (or
        lacks the key); None when every one is there."""
        ns = lws["metadata"]["namespace"]
        for template in lws["spec"]["leaderWorkerTemplate"].values():
            if not (isinstance(template, dict) and "spec" in template):
                continue
            for var in template["spec"]["containers"][0].get("env") or []:
                ref = (var.get("valueFrom") or {}).get("secretKeyRef")
                if ref is None or ref.get("optional"):  # an optional one missing: the variable stays unset
                    continue
                secret = self.fake.get("secrets", ns, ref["name"])
                if secret is None:
                    return f'secret "{ref["name"]}" not found'
                if ref["key"] not in (secret.get("data") or {}):
                    return f"couldn't find key {ref['key']} in Secret {ns}/{ref['name']}"
        return None

    def _relists(self) -> tuple[int, int]:
        """How many times the LeaderWorkerSets and the pods have been listed so far."""
        calls = list(self.fake.calls)
        return calls.count(("leaderworkerset.x-k8s.io", "leaderworkersets", "list")), calls.count(("", "pods", "list"))

    def _gone(self, lws: dict) -> bool:
        """The sim is closing, or this LeaderWorkerSet was deleted (its pods with it): a
        scenario thread waiting on it has nothing left to wait for."""
        meta = lws["metadata"]
        now = self.fake.get("leaderworkersets", meta["namespace"], meta["name"])
        return self._closing.is_set() or now is None or now["metadata"]["uid"] != meta["uid"]

    def _wait_for(self, done, seconds: float = SECRET_WAIT_SECONDS) -> None:
        """Poll ``done`` for at most ``seconds`` (every scenario thread must end)."""
        until = time.monotonic() + seconds
        while not done() and time.monotonic() < until and not self._closing.is_set():
            time.sleep(0.01)

    def _wait_for_secrets(self, lws: dict, pods: list[dict]) -> bool:
        """As the kubelet: a container whose env reads a missing Secret waits in
        CreateContainerConfigError and starts once the Secret is there. False if it never came."""
        until, waiting = time.monotonic() + SECRET_WAIT_SECONDS, False
        while (missing := self._missing_secret_key(lws)) is not None:
            if time.monotonic() > until or self._gone(lws):
                return False
            if not waiting:
                for pod in pods:
                    self._set(pod, state={"waiting": {"reason": "CreateContainerConfigError", "message": missing}})
                waiting = True
            time.sleep(0.05)
        if waiting:  # the kubelet makes the container now: the error is gone from the pods
            for pod in pods:
                meta, pending = pod["metadata"], pod["status"]
                self.fake.update("pods", meta["namespace"], meta["name"], lambda p, s=pending: p.update(status=s))
        return True

    def _play(self, lws: dict) -> None:
        size = lws["spec"]["leaderWorkerTemplate"]["size"]
        nodes = size - 1
        if self.scenario == "workers_refused":  # e.g. a ResourceQuota with room for the leader only
            self.fake.put("pods", self._pod(lws, 0))
            return
        pods = [self.fake.put("pods", self._pod(lws, i)) for i in range(size)]
        time.sleep(self.step)
        if not self._wait_for_secrets(lws, pods):
            return
        if self.scenario == "unschedulable":
            message = "0/3 nodes are available: 3 Insufficient memory."
            cond = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
            self.fake.update("pods", pods[1]["metadata"]["namespace"], pods[1]["metadata"]["name"],
                             lambda p: p["status"].update(conditions=[cond]))  # fmt: skip
            return
        if self.scenario == "evicted":  # the kubelet under memory pressure; its StatefulSet makes it again
            evicted = {"phase": "Failed", "reason": "Evicted", "message": "The node was low on resource: memory."}
            self.fake.update("pods", pods[1]["metadata"]["namespace"], pods[1]["metadata"]["name"],
                             lambda p: p["status"].update(evicted))  # fmt: skip
            return
        if self.scenario in ("image_pull", "image_pull_passes"):
            waiting = {"waiting": {"reason": "ErrImagePull", "message": "manifest unknown"}}
            self._set(pods[1], state=waiting)
            if self.scenario == "image_pull":
                return
            time.sleep(0.5)  # a registry blip: the kubelet's next try pulls it
        if self.scenario == "invalid_image":
            waiting = {"waiting": {"reason": "InvalidImageName", "message": 'couldn\'t parse image name "Bad:Image"'}}
            self._set(pods[1], state=waiting)
            return
        # As the head reports a data node it cannot reach yet: an error, but not a failure.
        self._status("loading", nodes, 0)
        self.head_status["nodes"][-1] |= {"state": "unreachable", "error": "connection refused", "loading": None}
        self.head_status["detail"] = (
            f"0/{nodes} data nodes ready, {ROWS_PER_NODE // 2} rows loaded; data node {nodes - 1} unreachable; "
            "data node 0 has waited 42s on a read of s3://bucket/data/0.parquet"
        )
        for pod in pods:
            self._set(pod)
        time.sleep(self.step)
        if self.scenario == "stuck":
            return
        if self.scenario == "compaction":  # an API server restart: every watch ends, history is gone
            self.fake.wait_for_watches(("leaderworkersets", "pods"))
            elsewhere = self._pod(lws, 0)
            elsewhere["metadata"] = {"name": "unrelated", "namespace": "elsewhere"}
            self.fake.put("pods", elsewhere)
            relists = self._relists()
            self.fake.compact(end_watches=True)
            # Go on once the initializer has listed both kinds again (what a watcher does after
            # 410 Gone): else the LeaderWorkerSet watch could see the cache Available and end the
            # wait before the pod watch had resumed, and the re-list would not happen at all.
            self._wait_for(lambda: all(now > before for now, before in zip(self._relists(), relists, strict=True)))
        if self.scenario == "oom":
            oom = {"terminated": {"reason": "OOMKilled", "exitCode": 137}}
            self._set(pods[2], state={"waiting": {"reason": "CrashLoopBackOff"}}, lastState=oom)
            return
        if self.scenario == "exits_0":  # a command that ends at once, restarted over and over
            done = {"terminated": {"reason": "Completed", "exitCode": 0}}
            self._set(pods[1], state={"waiting": {"reason": "CrashLoopBackOff"}}, lastState=done)
            return
        if self.scenario == "node_load_error":
            failed = {
                "terminated": {"reason": "Error", "exitCode": 1, "message": "load failed: NoSuchKey data/0.parquet"}
            }
            self._set(pods[1], state=failed)
            return
        if self.scenario == "head_load_error":
            self._status("failed", nodes, 0, error="AccessDenied reading s3://bucket/data/0.parquet", node_error=0)
            return
        for loaded in range(1, nodes + 1):
            self._status("loading", nodes, loaded)
            if self.scenario == "recovered_oom" and loaded == 1:
                # OOM-killed once while starting, restarted by its kubelet, and ready since.
                oom = {"terminated": {"reason": "OOMKilled", "exitCode": 137}}
                self._set(pods[loaded], ready=True, lastState=oom)
            else:
                self._set(pods[loaded], ready=True)
            time.sleep(self.step)
        self._status("ready", nodes, nodes)
        self._set(pods[0], ready=True)
        time.sleep(self.step)
        if self.scenario == "not_available":  # every pod ready, yet LWS never says Available
            return
        self._available(lws)
