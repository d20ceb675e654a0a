"""Fixtures: a strict fake API server (schemas and the initializer's Role enforced) and a cache simulator."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from kubeflow_cache_initializer.kube import with_bounded_retries
from kubeflow_cache_initializer.main import main
from kubeflow_cache_initializer.rbac import REQUIRED_PERMISSIONS

from .cluster_sim import CacheSim
from .fake_k8s import TOKEN, FakeKube
from .object_schemas import validate_sent_object


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    # The Role as installed by default, on a cluster without OwnerReferencesPermissionEnforcement.
    with FakeKube(validate=validate_sent_object, allowed=set(REQUIRED_PERMISSIONS)) as server:
        yield server


@pytest.fixture
def api_client(fake: FakeKube) -> Iterator[client.ApiClient]:
    configuration = with_bounded_retries(client.Configuration(host=fake.url))  # as main's _api_client
    configuration.api_key = {"authorization": TOKEN}
    configuration.api_key_prefix = {"authorization": "Bearer"}
    with client.ApiClient(configuration) as api:
        yield api


@pytest.fixture
def make_sim(fake: FakeKube) -> Iterator:
    sims: list[CacheSim] = []

    def make(scenario: str = "healthy") -> CacheSim:
        sims.append(CacheSim(fake, scenario))
        return sims[-1]

    yield make
    for sim in sims:
        sim.close()


@pytest.fixture
def run_initializer(api_client: client.ApiClient, tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """Run `cache-initializer`'s main against the fake; return (exit code, its error line or '')."""
    caplog.set_level(logging.INFO)

    def run(env: dict[str, str]) -> tuple[int, str]:
        termination_log = tmp_path / "termination-log"
        termination_log.write_text("")
        code = main(env=env, api_client=api_client, termination_log=termination_log)
        return code, termination_log.read_text().strip()

    return run
