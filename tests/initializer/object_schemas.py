"""Validate every body the initializer sends, as strictly as an API server would and then some.

`tests.schemas.validate_object` checks the object against its pinned CRD (LeaderWorkerSet from
`../shared/crds/lws-v0.7.0`, made strict: fields the API server would silently prune fail) or,
for built-in kinds, `kubernetes-validate`'s strict schemas. A CRD's pod templates are only as
strict as the CRD; here each LeaderWorkerSet pod template is also checked against the Kubernetes
core `PodTemplateSpec` schema.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
from referencing import Registry, Resource

from tests.schemas import KUBERNETES_VERSION, ObjectInvalid, validate_object

__all__ = ["ObjectInvalid", "validate_sent_object"]

_DEFS = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{KUBERNETES_VERSION}.0-local-strict"
_DEFS_ID = "/api/_definitions.json"


@cache
def _pod_template_validator() -> jsonschema.Draft202012Validator:
    defs = json.loads((_DEFS / "_definitions.json").read_text())
    registry = Registry().with_resource(_DEFS_ID, Resource.from_contents(defs))
    schema = {"$ref": f"{_DEFS_ID}#/$defs/io.k8s.api.core.v1.PodTemplateSpec"}
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate_sent_object(obj: dict) -> None:
    """Raise `ObjectInvalid` naming the field unless the API server would take `obj` as it is."""
    validate_object(obj)
    if obj.get("kind") != "LeaderWorkerSet":
        return
    template = obj["spec"]["leaderWorkerTemplate"]
    for name in ("leaderTemplate", "workerTemplate"):
        if name in template:
            for error in _pod_template_validator().iter_errors(template[name]):
                path = ".".join(str(p) for p in error.absolute_path) or "(root)"
                raise ObjectInvalid(f"LeaderWorkerSet {name} (core PodTemplateSpec): {path}: {error.message}")
