"""The API server's rules the fake applies: failures as Status, merge patch, selectors, validation."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable

_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


class ApiFailure(Exception):
    def __init__(self, code: int, reason: str, message: str, details: dict | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def status(self) -> dict:
        # As the API server answers: details name the object a 404 did not find (none for a kind
        # it does not serve).
        return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": self.message,
                "reason": self.reason, "code": self.code, **({"details": self.details} if self.details else {})}  # fmt: skip


def merge_patch(target, patch):
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def parse_selector(text: str, fields: bool) -> list[tuple[str, str]]:
    pairs = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = term.partition("==" if "==" in term else "=")
        if not sep or "!" in key:
            raise ApiFailure(400, "BadRequest", f"unsupported selector term {term!r}")
        if fields and key.strip() not in ("metadata.name", "metadata.namespace"):
            raise ApiFailure(400, "BadRequest", f"field label not supported: {key}")
        pairs.append((key.strip(), value.strip()))
    return pairs


def matches(obj: dict | None, labels: list, fields: list) -> bool:
    if obj is None:
        return False
    have = obj["metadata"].get("labels") or {}
    if any(have.get(k) != v for k, v in labels):
        return False
    meta = obj["metadata"]
    return all(meta.get(k.split(".", 1)[1]) == v for k, v in fields)


def object_problems(plural: str, kind: str, obj: dict, ns: str, validate: Callable[[dict], None] | None) -> list[str]:
    """What the API server's validation would say about `obj` (400 for a kind or namespace mismatch)."""
    meta = obj.get("metadata") or {}
    name = meta.get("name", "")
    if obj.get("kind") != kind:
        raise ApiFailure(400, "BadRequest", f"kind {obj.get('kind')!r} does not match {plural}")
    if meta.get("namespace", ns) != ns:
        raise ApiFailure(400, "BadRequest", "the namespace of the object does not match the request")
    problems = []
    if not name or not _SUBDOMAIN.match(name) or len(name) > 253:
        problems.append(f"metadata.name: Invalid value: {name!r}")
    if plural == "services" and (not _DNS1035.match(name) or len(name) > 63):
        problems.append(f"metadata.name: Invalid value: {name!r}: a DNS-1035 label of at most 63 chars")
    for key, value in (meta.get("labels") or {}).items():
        if len(value) > 63 or not _LABEL_VALUE.match(value):
            problems.append(f"metadata.labels[{key}]: Invalid value: {value!r}")
    refs = meta.get("ownerReferences") or []
    for ref in refs:
        missing = [f for f in ("apiVersion", "kind", "name", "uid") if not ref.get(f)]
        if missing:
            problems.append(f"metadata.ownerReferences: Required value: {missing}")
    if sum(1 for r in refs if r.get("controller")) > 1:
        problems.append("metadata.ownerReferences: Only one reference can have Controller set to true")
    if len({r.get("uid") for r in refs}) != len(refs):
        problems.append("metadata.ownerReferences: Duplicate value: the same uid twice")
    if validate:
        try:
            validate(obj)
        except Exception as err:
            problems.append(f"schema: {err}")
    return problems
