"""Chart and kustomize tests: renders come from render.py, schemas from tests/schemas.py."""

import pytest

from tests.chart import render
from tests.chart.render import DATA_CACHE


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
