"""RBAC rules as (api group, resource, verb) sets, so coverage checks are plain set algebra."""

from __future__ import annotations

import functools

import yaml

from tests.chart.render import shared_dir

Permission = tuple[str, str, str]


def grants(rules: list[dict]) -> set[Permission]:
    """Every (group, resource, verb) a ClusterRole's rules grant, wildcards left as '*'."""
    out = set()
    for rule in rules:
        for group in rule.get("apiGroups", []):
            for resource in rule.get("resources", []):
                for verb in rule.get("verbs", []):
                    out.add((group, resource, verb))
    return out


def covered(granted: set[Permission], needed: set[Permission]) -> set[Permission]:
    """The needed permissions that `granted` does not cover (wildcards honoured)."""
    missing = set()
    for group, resource, verb in needed:
        if not any(g in (group, "*") and r in (resource, "*") and v in (verb, "*") for g, r, v in granted):
            missing.add((group, resource, verb))
    return missing


@functools.cache
def upstream_trainer_manifests() -> tuple[dict, ...]:
    """Trainer v2.1.0's `overlays/manager`, rendered: the reference for RBAC and webhooks."""
    text = (shared_dir() / "third-party" / "trainer-v2.1.0-manager-manifests.yaml").read_text()
    return tuple(d for d in yaml.load_all(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) if d)
