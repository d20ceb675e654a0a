"""`cache-initializer`: set up logging, read the env, run, exit 0 only with a ready cache."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from kubernetes import client, config

from kubeflow_cache_initializer import constants as c
from kubeflow_cache_initializer.config import load_config
from kubeflow_cache_initializer.errors import InitializerError
from kubeflow_cache_initializer.health import describe_status
from kubeflow_cache_initializer.initializer import run
from kubeflow_cache_initializer.kube import Kube

log = logging.getLogger("kubeflow_cache_initializer")


def _api_client() -> client.ApiClient:
    """In a pod, its ServiceAccount; elsewhere (development), the current kubeconfig context."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as err:
            raise InitializerError(f"no Kubernetes credentials: not in a pod and no usable kubeconfig ({err})") from err
    return client.ApiClient()


def _write_termination_message(path: Path, message: str) -> None:
    """Kubernetes mounts this file in a container and shows its text in the pod's status."""
    try:
        if path.is_file():
            path.write_text(message + "\n")
    except OSError:
        log.debug("could not write the termination message to %s", path)


def main(
    *,
    env: Mapping[str, str] | None = None,
    api_client: client.ApiClient | None = None,
    termination_log: Path = Path(c.TERMINATION_LOG),
) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    try:
        cfg = load_config(os.environ if env is None else env)
        ready = run(Kube(api_client or _api_client()), cfg)
    except InitializerError as err:
        log.error("%s", err)
        _write_termination_message(termination_log, str(err))
        return err.exit_code
    log.info("cache %s ready at %s: %s", ready.cache, ready.flight_url, describe_status(ready.status))
    return 0


if __name__ == "__main__":
    sys.exit(main())
