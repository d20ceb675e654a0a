"""Validate Kubernetes objects offline, the way an API server with strict field validation would.

    from tests.schemas import validate_object, ObjectInvalid
    validate_object(obj)        # raises ObjectInvalid naming the object, the field path and the rule

Custom resources (TrainJob, ClusterTrainingRuntime, JobSet, LeaderWorkerSet, ...) are checked against
the openAPIV3Schema of the pinned CRDs in ../shared/crds (or $SHARED_DIR/crds), made strict the way
`kubectl apply --validate=strict` is: unknown fields fail unless the schema preserves them. Built-in
kinds go to the `kubernetes-validate` package's strict schemas for KUBERNETES_VERSION. CEL rules
(`x-kubernetes-validations`) are not evaluated. A kind known to neither raises SchemaNotFound.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

__all__ = ["KUBERNETES_VERSION", "ObjectInvalid", "SchemaNotFound", "crd_kinds", "validate_object", "validate_objects"]

KUBERNETES_VERSION = "1.31"
REPO_ROOT = Path(__file__).resolve().parents[1]

# Label syntax from k8s.io/apimachinery/pkg/util/validation.
_LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)$")
_LABEL_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


# The CRDs' integer formats, checked as the API server's decoding does (a Go int32 field refuses a
# larger number); no other format is checked.
_INTEGER_FORMATS = jsonschema.FormatChecker(formats=())


@_INTEGER_FORMATS.checks("int32")
def _int32(value) -> bool:
    return not isinstance(value, int) or -(1 << 31) <= value < 1 << 31


@_INTEGER_FORMATS.checks("int64")
def _int64(value) -> bool:
    return not isinstance(value, int) or -(1 << 63) <= value < 1 << 63


class ObjectInvalid(AssertionError):
    """An object breaks its schema; the message names the object, the field and the rule."""


class SchemaNotFound(LookupError):
    """No pinned CRD and no built-in schema knows this apiVersion and kind."""


def shared_dir() -> Path:
    return Path(os.environ.get("SHARED_DIR") or REPO_ROOT / ".." / "shared").resolve()


def _strict(schema: dict) -> dict:
    """OpenAPI v3 (CRD dialect) -> JSON Schema that rejects unknown fields and honours `nullable`."""
    schema = dict(schema)
    if schema.pop("nullable", False) and "type" in schema:
        schema["type"] = [schema["type"], "null"]
    if "properties" in schema:
        schema["properties"] = {k: _strict(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    if isinstance(schema.get("additionalProperties"), dict):
        schema["additionalProperties"] = _strict(schema["additionalProperties"])
    if isinstance(schema.get("items"), dict):
        schema["items"] = _strict(schema["items"])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in schema:
            schema[key] = [_strict(s) for s in schema[key]]
    return schema


@functools.cache
def _crd_validators() -> dict[tuple[str, str], tuple[jsonschema.protocols.Validator, str]]:
    """(apiVersion, kind) -> (validator, scope) for every served version of every pinned CRD."""
    validators = {}
    for path in sorted((shared_dir() / "crds").rglob("*.yaml")):
        for doc in yaml.load_all(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec["versions"]:
                if not version.get("served", True):
                    continue
                schema = _strict(version["schema"]["openAPIV3Schema"])
                # metadata is checked as ObjectMeta below; the CRD only says `type: object`.
                schema["properties"]["metadata"] = {"type": "object"}
                api_version = f"{spec['group']}/{version['name']}"
                validators[(api_version, spec["names"]["kind"])] = (
                    jsonschema.Draft7Validator(schema, format_checker=_INTEGER_FORMATS),
                    spec["scope"],
                )
    return validators


def crd_kinds() -> set[tuple[str, str]]:
    """The (apiVersion, kind) pairs the pinned CRDs define."""
    return set(_crd_validators())


def _name(obj: dict) -> str:
    meta = obj.get("metadata") or {}
    where = f"{meta['namespace']}/" if meta.get("namespace") else ""
    return f"{obj.get('kind')}/{where}{meta.get('name')}"


def _check_labels(obj: dict) -> None:
    meta = obj.get("metadata") or {}
    for field in ("labels",):
        for key, value in (meta.get(field) or {}).items():
            prefix, _, name = key.rpartition("/")
            if not _LABEL_NAME.match(name) or (prefix and (len(prefix) > 253 or not _LABEL_PREFIX.match(prefix))):
                raise ObjectInvalid(f"{_name(obj)}: metadata.labels: invalid key {key!r}")
            if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
                raise ObjectInvalid(f"{_name(obj)}: metadata.labels.{key}: invalid value {value!r}")


def _validate_builtin(obj: dict) -> None:
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.utils.SchemaNotFoundError as exc:
        raise SchemaNotFound(f"{_name(obj)}: {exc.message}") from None
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        raise ObjectInvalid(f"{_name(obj)}: {path}: {exc.message}") from None


def validate_object(obj: dict) -> None:
    """Raise ObjectInvalid (or SchemaNotFound) unless `obj` would pass strict API validation."""
    # Large objects (CRDs) recur across renders; an identical object passed before passes again.
    key = json.dumps(obj, sort_keys=True, default=str)
    if key in _PASSED:
        return
    _validate(obj)
    _PASSED.add(key)


_PASSED: set[str] = set()


def _validate(obj: dict) -> None:
    if not isinstance(obj, dict) or not obj.get("apiVersion") or not obj.get("kind"):
        raise ObjectInvalid(f"not a Kubernetes object (apiVersion and kind are required): {str(obj)[:200]}")
    if not (obj.get("metadata") or {}).get("name"):
        raise ObjectInvalid(f"{_name(obj)}: metadata.name is required")
    _check_labels(obj)
    found = _crd_validators().get((obj["apiVersion"], obj["kind"]))
    if found is None:
        _validate_builtin(obj)
        return
    validator, scope = found
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
    if errors:
        details = "; ".join(f"{'.'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message}" for e in errors[:5])
        raise ObjectInvalid(f"{_name(obj)}: {details}")
    if scope == "Cluster" and obj["metadata"].get("namespace"):
        raise ObjectInvalid(f"{_name(obj)}: {obj['kind']} is cluster-scoped but has metadata.namespace")
    # ObjectMeta, through the built-in schema of an object that has nothing but metadata.
    shell = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": copy.deepcopy(obj["metadata"])}
    try:
        kubernetes_validate.validate(shell, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        raise ObjectInvalid(f"{_name(obj)}: metadata.{'.'.join(str(p) for p in exc.path)}: {exc.message}") from None


def validate_objects(objects: list[dict]) -> None:
    """Validate each object; one error message listing every invalid object."""
    problems = []
    for obj in objects:
        try:
            validate_object(obj)
        except (ObjectInvalid, SchemaNotFound) as exc:
            problems.append(str(exc))
    if problems:
        raise ObjectInvalid(f"{len(problems)} invalid object(s):\n" + "\n".join(problems))
