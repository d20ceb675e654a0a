"""Chart and kustomize tests: renders come from render.py, schemas from tests/schemas.py."""

import sys
from pathlib import Path

import pytest

# tests/ holds the shared validator (schemas.py); this folder holds render.py.
for path in (Path(__file__).resolve().parents[1], Path(__file__).resolve().parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import render  # noqa: E402

DATA_CACHE = {"dataCache": {"enabled": True}}


@pytest.fixture(scope="session", autouse=True)
def _shared_present():
    if not (render.shared_dir() / "crds").is_dir():
        pytest.fail(f"pinned upstream data not found at {render.shared_dir()} (set SHARED_DIR)")


@pytest.fixture(scope="session")
def default_objects():
    return render.render_chart()


@pytest.fixture(scope="session")
def cache_objects():
    return render.render_chart(DATA_CACHE)
