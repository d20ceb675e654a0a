"""The base install is the training-side client: no Iceberg, DataFusion or Prometheus.

An interpreter where the server extra's modules cannot be imported stands in for a trainer image
built with `pip install "./images/cache[torch]"`: it streams a real cache through
DataCacheDataset, and every `data-cache` command refuses to start, naming the extra.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import tomllib

import pytest

from kubeflow_data_cache.extras import SERVER_INSTALL, SERVER_MODULES
from tests.conftest import REPO_ROOT

PYPROJECT = tomllib.loads((REPO_ROOT / "images/cache/pyproject.toml").read_text())["project"]

# Run first in the child: the server extra's modules import as absent (sys.modules[name] = None
# is how Python marks a module that must not be imported), as in an install without them.
BLOCK = textwrap.dedent(
    f"""
    import sys
    for name in {SERVER_MODULES!r}:
        sys.modules[name] = None
    try:
        import datafusion
    except ImportError:
        pass
    else:
        raise SystemExit("the blocker did not block")
    """
)


def _distribution(requirement: str) -> str:
    """'pyiceberg[pyarrow]>=0.9' -> 'pyiceberg'; 'prometheus-client>=1' -> 'prometheus_client'."""
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].replace("-", "_").lower()


def _run(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
    )


def test_the_server_extra_is_what_the_check_looks_for_and_the_base_install_has_none_of_it():
    server = {_distribution(r) for r in PYPROJECT["optional-dependencies"]["server"]}
    base = {_distribution(r) for r in PYPROJECT["dependencies"]}
    assert server == set(SERVER_MODULES)
    assert not base & server, f"the base install pulls server libraries: {sorted(base & server)}"


def test_a_client_only_install_streams_every_row(cache_factory):
    cache = cache_factory(2503, 3, 2)
    code = f"""
    import json
    from torch.utils.data import DataLoader
    from kubeflow_data_cache.dataset import DataCacheDataset

    dataset = DataCacheDataset({cache.endpoint!r}, batch_size=100, columns=["id"], shuffle=True)
    ids = [int(i) for batch in DataLoader(dataset, batch_size=None) for i in batch["id"]]
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in {SERVER_MODULES!r} and sys.modules[m])
    print(json.dumps({{"ids": ids, "loaded": loaded}}))
    """
    done = _run(code)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(result["ids"]) == list(range(2503))
    assert result["loaded"] == []


@pytest.mark.parametrize(
    "argv",
    [
        ["head", "--metadata-loc", "/nowhere/metadata.json"],
        ["worker", "--metadata-loc", "/nowhere/metadata.json", "--index", "0", "--head", "grpc://127.0.0.1:1"],
        ["local", "--metadata-loc", "/nowhere/metadata.json", "--data-nodes", "1"],
        ["sample-table", "--warehouse", "/nowhere"],
    ],
    ids=lambda argv: argv[0],
)
def test_every_server_command_refuses_a_client_only_install_naming_the_extra(argv):
    done = _run(f"from kubeflow_data_cache.cli import main\nraise SystemExit(main({argv!r}))", timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"`data-cache {argv[0]}` runs the cache server" in done.stderr
    assert SERVER_INSTALL in done.stderr
    assert "pyiceberg, datafusion, prometheus_client" in done.stderr
