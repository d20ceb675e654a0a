"""An in-memory Kubernetes API server over HTTP: exactly the surface the initializer uses, strictly.

The real `kubernetes` client talks to it on 127.0.0.1. It keeps real semantics where the
initializer depends on them: a bearer token, 404 NotFound, 409 AlreadyExists on create,
409 Conflict on a merge patch whose metadata.resourceVersion is stale, 415 for patch types it
does not implement, 422 for bodies that fail validation (the schemas, names, ownerReferences
with more than one controller), one global resourceVersion, watches streaming
ADDED/MODIFIED/DELETED from a resourceVersion (410 Gone once compacted), label and field
selectors, and garbage collection by ownerReferences when an owner is deleted. Optionally it
answers 403 to calls outside a set of (group, resource, verb) (``allowed``), and, with
``owner_admission`` too, to a create of an object with ownerReferences or a patch that changes
them without `delete` on that object in that set, as the OwnerReferencesPermissionEnforcement
admission plugin does (OpenShift turns it on).
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from .fake_k8s_rules import ApiFailure, matches, merge_patch, object_problems, parse_selector

TOKEN = "fake-token"
# The ServiceAccount named in 403 messages (the chart's default name).
FORBIDDEN_USER = "kubeflow-trainer-cache-initializer"
# (group, version, plural) -> kind; everything else is 404 like an API server without that CRD.
KINDS = {
    ("trainer.kubeflow.org", "v1alpha1", "trainjobs"): "TrainJob",
    ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"): "LeaderWorkerSet",
    ("", "v1", "services"): "Service",
    ("", "v1", "serviceaccounts"): "ServiceAccount",
    ("", "v1", "pods"): "Pod",
    ("", "v1", "secrets"): "Secret",
}
_PATH = re.compile(
    r"^/(?:api/(?P<cv>v1)|apis/(?P<g>[^/]+)/(?P<v>[^/]+))/namespaces/(?P<ns>[^/]+)/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?$"
)
MAX_WATCH_SECONDS = 60
# The one cluster-scoped call: what the caller may do in a namespace (any authenticated user may
# ask). Answered from ``allowed``, one rule per grant (everything where ``allowed`` is None).
RULES_REVIEW_PATH = "/apis/authorization.k8s.io/v1/selfsubjectrulesreviews"
RULES_REVIEW = ("authorization.k8s.io", "selfsubjectrulesreviews", "create")


class FakeKube:
    """The store, the HTTP front and a log of every call as (group, resource, verb)."""

    def __init__(self, validate: Callable[[dict], None] | None = None, allowed: set | None = None):
        self.validate, self.allowed = validate, allowed
        self.owner_admission = False  # OwnerReferencesPermissionEnforcement: off, as upstream ships it
        self.kinds = dict(KINDS)  # drop one to play a cluster without that CRD
        self.fail_next: dict[tuple[str, str], list[int]] = {}  # (plural, verb) -> statuses to answer first
        self.slow: dict[tuple[str, str], float] = {}  # (plural, verb) -> seconds before each answer
        # (plural, verb) -> changes to make, one before each such call is answered: what another
        # client (a controller, the garbage collector) does between two of the initializer's calls.
        self.before: dict[tuple[str, str], list[Callable[[], None]]] = {}
        self.cond = threading.Condition()
        self.objects: dict[tuple[str, str, str], dict] = {}  # (plural, namespace, name) -> object
        self.events: list[tuple[int, str, str, dict, dict | None]] = []  # rv, plural, type, object, old
        self.compacted = 0
        self._rv = 100
        self.calls: list[tuple[str, str, str]] = []
        self.rules_incomplete = False  # a SelfSubjectRulesReview's answer, as from a webhook authorizer
        self.responses: list[tuple[str, str, str, int]] = []  # verb, plural, name, status
        self.rejected: list[str] = []
        self.on_create: dict[str, list[Callable[[dict], None]]] = {}
        self._closing = False
        self.epoch = 0  # bumped to end every open watch, as an API server restart does
        self.open_watches: dict[str, int] = {}  # plural -> watches streaming now
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), name="fake-k8s", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeKube:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self.cond:
            self._closing = True
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()

    # -- the store, also used directly by tests and the cluster simulator ----------------------
    def _bump(self, plural: str, kind: str, obj: dict, old: dict | None) -> None:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        self.events.append((self._rv, plural, kind, copy.deepcopy(obj), old))
        self.cond.notify_all()

    def put(self, plural: str, obj: dict) -> dict:
        """Create or replace an object as a controller would (no validation, no 409)."""
        obj = copy.deepcopy(obj)
        meta = obj["metadata"]
        key = (plural, meta["namespace"], meta["name"])
        with self.cond:
            old = self.objects.get(key)
            meta.setdefault("uid", old["metadata"]["uid"] if old else str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
            self.objects[key] = obj
            self._bump(plural, "MODIFIED" if old else "ADDED", obj, old)
            return copy.deepcopy(obj)

    def get(self, plural: str, namespace: str, name: str) -> dict | None:
        with self.cond:
            found = self.objects.get((plural, namespace, name))
            return copy.deepcopy(found) if found else None

    def items(self, plural: str, namespace: str | None = None) -> list[dict]:
        with self.cond:
            return [copy.deepcopy(o) for (p, ns, _), o in sorted(self.objects.items())
                    if p == plural and namespace in (None, ns)]  # fmt: skip

    def delete(
        self, plural: str, namespace: str, name: str, preconditions: dict | None = None, collect: bool = True
    ) -> None:
        """Delete one object; `collect=False` leaves its dependents to a `collect_garbage()` later,
        as a real garbage collector, which runs behind the API server, does."""
        with self.cond:
            obj = self.objects.get((plural, namespace, name))
            if obj is None:
                raise ApiFailure(404, "NotFound", f'{plural} "{name}" not found', {"name": name, "kind": plural})
            for field, want in (preconditions or {}).items():  # DeleteOptions.preconditions
                if obj["metadata"].get(field) != want:
                    raise ApiFailure(
                        409,
                        "Conflict",
                        f"Precondition failed: {field} in precondition: {want}, "
                        f"{field} in object meta: {obj['metadata'].get(field)}",
                    )
            del self.objects[(plural, namespace, name)]
            self._bump(plural, "DELETED", obj, obj)
            if collect:
                self._collect_garbage()

    def compact(self, end_watches: bool = False) -> None:
        """Forget the event history, as etcd compaction does: watches from older versions get 410 Gone."""
        with self.cond:
            self.compacted = self._rv
            if end_watches:
                self.epoch += 1
                self.cond.notify_all()

    def update(self, plural: str, namespace: str, name: str, change: Callable[[dict], None]) -> dict:
        """Read-modify-write under the store's lock, as a controller's status update."""
        with self.cond:
            obj = self.get(plural, namespace, name)
            if obj is None:
                raise ApiFailure(404, "NotFound", f'{plural} "{name}" not found', {"name": name, "kind": plural})
            change(obj)
            return self.put(plural, obj)

    def collect_garbage(self) -> None:
        """Run the garbage collector now: for dependents left when it runs late (after a delete)."""
        with self.cond:
            self._collect_garbage()

    def _collect_garbage(self) -> None:
        """Delete dependents whose owners are all gone; drop references to gone owners from the rest."""
        changed = True
        while changed:
            changed = False
            live = {o["metadata"]["uid"] for o in self.objects.values()}
            for (plural, ns, name), obj in list(self.objects.items()):
                refs = obj["metadata"].get("ownerReferences") or []
                solid = [r for r in refs if r["uid"] in live]
                if not refs or len(solid) == len(refs):
                    continue
                changed = True
                old = copy.deepcopy(obj)
                if solid:
                    obj["metadata"]["ownerReferences"] = solid
                    self._bump(plural, "MODIFIED", obj, old)
                else:
                    del self.objects[(plural, ns, name)]
                    self._bump(plural, "DELETED", obj, old)

    # -- API verbs --------------------------------------------------------------------------
    def _check(self, plural: str, kind: str, obj: dict, ns: str) -> None:
        problems = object_problems(plural, kind, obj, ns, self.validate)
        if problems:
            self.rejected.extend(problems)
            name = (obj.get("metadata") or {}).get("name", "")
            raise ApiFailure(422, "Invalid", f'{kind} "{name}" is invalid: ' + "; ".join(problems))

    def create(self, plural: str, kind: str, ns: str, body: dict, group: str = "") -> dict:
        if "generateName" in (body.get("metadata") or {}):
            raise ApiFailure(422, "Invalid", "this fake does not implement generateName")
        self._check(plural, kind, body, ns)
        if body["metadata"].get("ownerReferences"):
            self._check_owner_admission(plural, body["metadata"]["name"], group)
        with self.cond:
            name = body["metadata"]["name"]
            if (plural, ns, name) in self.objects:
                raise ApiFailure(409, "AlreadyExists", f'{plural} "{name}" already exists')
            obj = copy.deepcopy(body)
            obj.pop("status", None)
            obj["metadata"] = {**obj["metadata"], "namespace": ns, "generation": 1}
            for field in ("uid", "resourceVersion", "creationTimestamp", "deletionTimestamp"):
                obj["metadata"].pop(field, None)
            if kind == "Service":
                obj["spec"].setdefault("clusterIP", f"10.96.0.{len(self.objects) % 250 + 2}")
            created = self.put(plural, obj)
        for callback in self.on_create.get(plural, []):
            callback(created)
        return created

    def _check_owner_admission(self, plural: str, name: str, group: str) -> None:
        """As the OwnerReferencesPermissionEnforcement admission plugin answers, where it runs."""
        if self.owner_admission and self.allowed is not None and (group, plural, "delete") not in self.allowed:
            raise ApiFailure(
                403,
                "Forbidden",
                f'{plural} "{name}" is forbidden: cannot set an ownerRef on a resource you can\'t delete',
            )

    def patch(
        self, plural: str, kind: str, ns: str, name: str, patch: dict, content_type: str, group: str = ""
    ) -> dict:
        if content_type != "application/merge-patch+json":
            raise ApiFailure(415, "UnsupportedMediaType", f"the fake implements merge-patch only, got {content_type}")
        with self.cond:
            current = self.objects.get((plural, ns, name))
            if current is None:
                raise ApiFailure(404, "NotFound", f'{plural} "{name}" not found', {"name": name, "kind": plural})
            want_rv = (patch.get("metadata") or {}).get("resourceVersion")
            if want_rv is not None and want_rv != current["metadata"]["resourceVersion"]:
                raise ApiFailure(409, "Conflict", f'Operation cannot be fulfilled on {plural} "{name}": '
                                 "the object has been modified; please apply your changes to the latest version")  # fmt: skip
            updated = merge_patch(current, patch)
            owners_changed = updated["metadata"].get("ownerReferences") != current["metadata"].get("ownerReferences")
            if owners_changed:
                self._check_owner_admission(plural, name, group)
            for field in ("name", "namespace", "uid", "creationTimestamp"):
                if updated["metadata"].get(field) != current["metadata"].get(field):
                    raise ApiFailure(422, "Invalid", f"metadata.{field}: field is immutable")
            self._check(plural, kind, updated, ns)
            if updated.get("spec") != current.get("spec"):
                updated["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
            return self.put(plural, updated)

    def stream_events(self, plural: str, ns: str, version: str | None, labels, fields, timeout: float, write):
        """Write watch events (one JSON per line) until the timeout or shutdown."""
        with self.cond:
            epoch = self.epoch
            if version in (None, "", "0"):
                last = self._rv
                initial = [o for (p, n, _), o in self.objects.items() if p == plural and n == ns]
                pending = [("ADDED", copy.deepcopy(o)) for o in initial if matches(o, labels, fields)]
            else:
                last = int(version)
                pending = []
                if last < self.compacted:
                    gone = ApiFailure(410, "Expired", f"too old resource version: {last} ({self.compacted})")
                    write({"type": "ERROR", "object": gone.status()})
                    return
        for kind, obj in pending:
            write({"type": kind, "object": obj})
        with self.cond:
            self.open_watches[plural] = self.open_watches.get(plural, 0) + 1
            self.cond.notify_all()
        end = threading.Event()
        timer = threading.Timer(timeout, lambda: (end.set(), self._notify()))
        timer.start()
        try:
            while True:
                with self.cond:
                    while not end.is_set() and not self._closing and self.epoch == epoch and self._rv == last:
                        self.cond.wait()
                    if end.is_set() or self._closing or self.epoch != epoch:
                        return
                    fresh = [e for e in self.events if e[0] > last]
                    last = self._rv
                for _rv, p, kind, obj, old in fresh:
                    if p != plural or obj["metadata"]["namespace"] != ns:
                        continue
                    was, now = matches(old, labels, fields), matches(obj, labels, fields)
                    if kind == "DELETED":
                        kind = "DELETED" if was else None
                    elif was and not now:
                        kind = "DELETED"
                    elif now:
                        kind = "MODIFIED" if was else "ADDED"
                    else:
                        kind = None
                    if kind:
                        write({"type": kind, "object": obj})
        finally:
            timer.cancel()
            with self.cond:
                self.open_watches[plural] -= 1

    def wait_for_watches(self, plurals: tuple[str, ...], timeout: float = 30.0) -> None:
        """Block until each of `plurals` has an open watch (for scenarios that act on watchers)."""
        deadline = threading.Event()
        timer = threading.Timer(timeout, lambda: (deadline.set(), self._notify()))
        timer.start()
        try:
            with self.cond:
                while not all(self.open_watches.get(p, 0) for p in plurals):
                    if deadline.is_set():
                        raise TimeoutError(f"no watch on {plurals} within {timeout}s")
                    self.cond.wait()
        finally:
            timer.cancel()

    def _notify(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def answer(self, method: str, path: str, query: dict, headers, body: bytes) -> tuple[int, dict | None, dict]:
        """Route one request: (status, JSON body or None for a watch, watch parameters)."""
        if path == RULES_REVIEW_PATH and method == "POST":
            return 201, self._review_rules(json.loads(body or b"{}")), {}
        match = _PATH.match(path)
        if not match:
            raise ApiFailure(404, "NotFound", "the server could not find the requested resource")
        group = match["g"] or ""
        version = match["cv"] or match["v"]
        plural, ns, name = match["plural"], match["ns"], match["name"]
        kind = self.kinds.get((group, version, plural))
        if kind is None:
            raise ApiFailure(404, "NotFound", "the server could not find the requested resource")
        watching = query.get("watch", [""])[0] in ("true", "1")
        verb = {"GET": "get" if name else ("watch" if watching else "list"), "POST": "create",
                "PATCH": "patch", "DELETE": "delete", "PUT": "update"}.get(method, method.lower())  # fmt: skip
        if (method == "POST" and name) or (method in ("PATCH", "DELETE", "PUT") and not name):
            raise ApiFailure(405, "MethodNotAllowed", f"{method} is not allowed on {path}")
        self.calls.append((group, plural, verb))
        if self.slow.get((plural, verb)):  # an API server (or its authorizer webhook) under load
            time.sleep(self.slow[(plural, verb)])
        if self.fail_next.get((plural, verb)):
            raise ApiFailure(self.fail_next[(plural, verb)].pop(0), "ServiceUnavailable", "injected failure")
        if self.before.get((plural, verb)):
            self.before[(plural, verb)].pop(0)()
        if self.allowed is not None and (group, plural, verb) not in self.allowed:
            # The API server's wording (its RBAC authorizer's "forbidden" message).
            qualified = f"{plural}.{group}" if group else plural
            raise ApiFailure(
                403,
                "Forbidden",
                f"{qualified}{f' {json.dumps(name)}' if name else ''} is forbidden: User "
                f'"system:serviceaccount:{ns}:{FORBIDDEN_USER}" cannot {verb} resource "{plural}" '
                f'in API group "{group}" in the namespace "{ns}"',
            )
        labels = parse_selector(query.get("labelSelector", [""])[0], fields=False)
        fields = parse_selector(query.get("fieldSelector", [""])[0], fields=True)
        payload = json.loads(body) if body else None
        if verb == "get":
            found = self.get(plural, ns, name)
            if found is None:
                raise ApiFailure(404, "NotFound", f'{plural} "{name}" not found', {"name": name, "kind": plural})
            return 200, found, {}
        if verb == "list":
            with self.cond:
                items = [o for o in self.items(plural, ns) if matches(o, labels, fields)]
                listed = {"apiVersion": "v1", "kind": f"{kind}List", "metadata": {"resourceVersion": str(self._rv)}}
            return 200, {**listed, "items": items}, {}
        if verb == "watch":
            seconds = min(float(query.get("timeoutSeconds", [MAX_WATCH_SECONDS])[0]), MAX_WATCH_SECONDS)
            return 200, None, {"plural": plural, "ns": ns, "version": query.get("resourceVersion", [None])[0],
                               "labels": labels, "fields": fields, "timeout": seconds}  # fmt: skip
        if verb == "create":
            return 201, self.create(plural, kind, ns, payload or {}, group), {}
        if verb == "patch":
            return 200, self.patch(plural, kind, ns, name, payload or {}, headers.get("Content-Type", ""), group), {}
        if verb == "delete":
            if payload and payload.get("kind") != "DeleteOptions":
                raise ApiFailure(400, "BadRequest", "the body of a DELETE must be DeleteOptions")
            self.delete(plural, ns, name, (payload or {}).get("preconditions"))
            return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}, {}
        raise ApiFailure(405, "MethodNotAllowed", f"the fake does not implement {method}")

    def _review_rules(self, review: dict) -> dict:
        """A SelfSubjectRulesReview, answered from ``allowed``."""
        self.calls.append(RULES_REVIEW)
        if self.fail_next.get(RULES_REVIEW[1:]):
            raise ApiFailure(self.fail_next[RULES_REVIEW[1:]].pop(0), "Forbidden", "injected failure")
        if not (review.get("spec") or {}).get("namespace"):
            raise ApiFailure(422, "Invalid", "spec.namespace: Required value")
        grants = sorted(self.allowed) if self.allowed is not None else [("*", "*", "*")]
        rules = [{"verbs": [verb], "apiGroups": [group], "resources": [plural]} for group, plural, verb in grants]
        status = {"resourceRules": rules, "nonResourceRules": [], "incomplete": self.rules_incomplete}
        return {**review, "status": status}


def _handler(fake: FakeKube):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def handle(self) -> None:
            with contextlib.suppress(ConnectionError):  # a client dropping its keep-alive connection
                super().handle()

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            if code == 429:  # the API server's rate limit (priority and fairness) says when to come back
                self.send_header("Retry-After", "1")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _serve(self) -> None:
            url = urlsplit(self.path)
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            name = url.path.rsplit("/", 1)[-1]
            try:
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    raise ApiFailure(401, "Unauthorized", "Unauthorized")
                code, answer, watch = fake.answer(self.command, url.path, parse_qs(url.query), self.headers, body)
            except ApiFailure as err:
                fake.responses.append((self.command, url.path, name, err.code))
                self._send(err.code, err.status())
                return
            if url.path != RULES_REVIEW_PATH:  # a question, not a write: the tests' writes are the objects'
                fake.responses.append((self.command, url.path, name, code))
            if answer is not None:
                self._send(code, answer)
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def write(event: dict) -> None:
                data = json.dumps(event).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            try:
                fake.stream_events(write=write, **watch)
                self.wfile.write(b"0\r\n\r\n")
            except OSError:  # the client closed the watch
                self.close_connection = True

        do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _serve

    return Handler
