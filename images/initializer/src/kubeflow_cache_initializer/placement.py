"""Where the cache pods may run: `CACHE_NODE_SELECTOR` and `CACHE_TOLERATIONS`.

Cache pods are CPU and memory pods; on a cluster whose GPU nodes are tainted, or whose
memory-optimised pool is selected by a label, the admin steers them there. Both settings are
checked here as the API server would check them, so a typo fails the initializer at once with
the variable named, rather than leaving pods Pending until the unschedulable grace runs out.
"""

from __future__ import annotations

import json
import re
from typing import Any

NODE_SELECTOR_FORM = "comma-separated key=value node labels, or a JSON object of them"
TOLERATIONS_FORM = (
    'a JSON list of tolerations, e.g. [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]'
)

# Label syntax (k8s.io/apimachinery validation): a name part of at most 63 characters,
# optionally prefixed by a DNS subdomain and "/"; values the same as a name, or empty.
_LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)$")
# A DNS-1123 subdomain: label key prefixes, and (in config) Secret names.
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_MAX = 63
_PREFIX_MAX = 253

TOLERATION_FIELDS = ("key", "operator", "value", "effect", "tolerationSeconds")
OPERATORS = ("Equal", "Exists")
EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def label_key_problem(key: str) -> str | None:
    """Why ``key`` is not a valid label key, or None."""
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > _PREFIX_MAX or not DNS_SUBDOMAIN.fullmatch(prefix)):
        return f"label key {key!r} has a prefix that is not a DNS subdomain"
    if not name or len(name) > _LABEL_MAX or not _LABEL_NAME.fullmatch(name):
        return f"label key {key!r} is not a name of at most 63 letters, digits, '-', '_' and '.'"
    return None


def label_value_problem(key: str, value: str) -> str | None:
    if value and (len(value) > _LABEL_MAX or not _LABEL_NAME.fullmatch(value)):
        return f"label value {value!r} of {key!r} is not at most 63 letters, digits, '-', '_' and '.'"
    return None


def parse_node_selector(raw: str) -> dict[str, str]:
    """``a=b,c=d`` or ``{"a": "b"}`` -> {"a": "b", ...}; ValueError saying what is wrong."""
    raw = raw.strip()
    if not raw:
        return {}
    if raw.startswith(("[", '"')):  # JSON, but not an object: `k=v` parsing would only confuse
        raise ValueError('a JSON value that is not an object; give {"key": "value", ...} or key=value,...')
    if raw.startswith("{"):
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError as err:
            raise ValueError(f"not valid JSON ({err.msg})") from None
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in parsed.items()):
            raise ValueError("every label value must be a string (quote numbers and booleans)")
        selector = parsed
    else:
        selector = {}
        for pair in (p.strip() for p in raw.split(",")):
            key, eq, value = pair.partition("=")
            if not eq or not pair:
                raise ValueError(f"{pair!r} is not key=value")
            if key.strip() in selector:
                raise ValueError(f"label {key.strip()!r} is given twice")
            selector[key.strip()] = value.strip()
    for key, value in selector.items():
        problem = label_key_problem(key) or label_value_problem(key, value)
        if problem:
            raise ValueError(problem)
    return selector


def _toleration(i: int, item: Any) -> dict[str, Any]:
    """One toleration, checked as the API server checks it (core/v1 validation)."""
    where = f"toleration {i}"
    if not isinstance(item, dict):
        raise ValueError(f"{where} is not an object")
    unknown = sorted(set(item) - set(TOLERATION_FIELDS))
    if unknown:
        raise ValueError(f"{where} has unknown field(s) {', '.join(unknown)} (known: {', '.join(TOLERATION_FIELDS)})")
    for field in ("key", "operator", "value", "effect"):
        if field in item and not isinstance(item[field], str):
            raise ValueError(f"{where}: {field} must be a string")
    key, operator = item.get("key", ""), item.get("operator", "") or "Equal"
    value, effect = item.get("value", ""), item.get("effect", "")
    if operator not in OPERATORS:
        raise ValueError(f"{where}: operator {operator!r} is not one of {', '.join(OPERATORS)}")
    if key:
        problem = label_key_problem(key)
        if problem:
            raise ValueError(f"{where}: {problem}")
    elif operator != "Exists":
        raise ValueError(f"{where}: an empty key tolerates every taint and needs operator Exists")
    if operator == "Exists" and value:
        raise ValueError(f"{where}: operator Exists takes no value")
    if operator == "Equal":
        problem = label_value_problem(key, value)
        if problem:
            raise ValueError(f"{where}: {problem}")
    if effect and effect not in EFFECTS:
        raise ValueError(f"{where}: effect {effect!r} is not one of {', '.join(EFFECTS)} (or empty for all)")
    if "tolerationSeconds" in item:
        seconds = item["tolerationSeconds"]
        if isinstance(seconds, bool) or not isinstance(seconds, int):
            raise ValueError(f"{where}: tolerationSeconds must be an integer")
        if not -(2**63) <= seconds < 2**63:  # the API's int64: past it the create is refused (422)
            raise ValueError(f"{where}: tolerationSeconds {seconds} is past the API's 64-bit integer range")
        if effect != "NoExecute":
            raise ValueError(f"{where}: tolerationSeconds applies to effect NoExecute only")
    return {field: item[field] for field in TOLERATION_FIELDS if field in item}


def parse_tolerations(raw: str) -> tuple[dict[str, Any], ...]:
    """A JSON list of tolerations, each checked; ValueError saying which one and why."""
    raw = raw.strip()
    if not raw:
        return ()
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON ({err.msg})") from None
    if isinstance(parsed, dict):
        parsed = [parsed]  # one toleration alone is clear enough to accept
    if not isinstance(parsed, list):
        raise ValueError("not a list")
    return tuple(_toleration(i, item) for i, item in enumerate(parsed))
