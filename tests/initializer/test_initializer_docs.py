"""docs/initializer.md documents every variable the initializer reads and every permission it needs."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from kubeflow_cache_initializer import config
from kubeflow_cache_initializer.rbac import ADMISSION_PERMISSIONS, REQUIRED_PERMISSIONS

DOC = Path(__file__).resolve().parents[2] / "docs" / "initializer.md"


def test_every_env_variable_read_is_documented():
    readers = (config.load_config, config._namespace)  # the optional Secrets are named in load_config
    source = "".join(inspect.getsource(reader) for reader in readers)
    read = set(re.findall(r'"([A-Z][A-Z0-9_]{2,})"', source))
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]{2,})`", DOC.read_text()))

    assert {"CLUSTER_SIZE", "POD_NAMESPACE", "CACHE_TOKEN_SECRET", "CACHE_TLS_SECRET"} <= read
    assert read - documented == set()


def test_every_required_permission_is_in_the_rbac_table():
    text = DOC.read_text()
    rows = [[cell.strip().strip("`") for cell in line.split("|")[1:4]] for line in text.splitlines() if "|" in line]
    # The calls' table, then the admission table (its header says so): each verb in its own.
    admission_at = next(i for i, row in enumerate(rows) if row[2] == "verbs (admission only)")
    for permissions, table in (
        (REQUIRED_PERMISSIONS, rows[:admission_at]),
        (ADMISSION_PERMISSIONS, rows[admission_at:]),
    ):
        for group, resource, verb in permissions:
            verbs = [v for g, r, v in table if g == (group or '""') and resource in r.replace("`", "").split(", ")]
            assert len(verbs) == 1 and verb in verbs[0].split(", "), (group, resource, verb)
