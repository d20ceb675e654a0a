"""`cache-initializer`: set up logging, read the env, run, exit 0 only with a ready cache."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

from kubernetes import client, config

from kubeflow_cache_initializer import constants as c
from kubeflow_cache_initializer import termination
from kubeflow_cache_initializer.config import load_config
from kubeflow_cache_initializer.errors import InitializerError
from kubeflow_cache_initializer.health import describe_status
from kubeflow_cache_initializer.initializer import run
from kubeflow_cache_initializer.kube import Kube, with_bounded_retries

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
    return client.ApiClient(with_bounded_retries(client.Configuration.get_default_copy()))


def _write_termination_message(path: Path, message: str) -> None:
    """Kubernetes mounts this file in a container and shows its text in the pod's status."""
    try:
        if path.is_file():
            path.write_text(message + "\n")
    except OSError:
        log.debug("could not write the termination message to %s", path)


def _said(err: BaseException) -> str:
    """The error and its notes (what its cleanup left undone), on one line."""
    return "; ".join([str(err), *getattr(err, "__notes__", ())])


def main(
    *,
    env: Mapping[str, str] | None = None,
    api_client: client.ApiClient | None = None,
    termination_log: Path = Path(c.TERMINATION_LOG),
) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    # SIGTERM becomes an error raised where the run is, so that it ends as any failure does: what
    # this run made is deleted, and the reason goes to the log and the termination message. (It
    # ended the process at once, with neither, its cache pods left holding their resources.)
    termination.start()
    previous = (
        signal.signal(signal.SIGTERM, termination.on_sigterm)
        if threading.current_thread() is threading.main_thread()
        else None
    )
    try:
        cfg = load_config(os.environ if env is None else env)
        ready = run(Kube(api_client or _api_client()), cfg)
    except InitializerError as err:
        log.error("%s", _said(err))
        _write_termination_message(termination_log, _said(err))
        return err.exit_code
    except Exception as err:  # a bug, or a failure no one foresaw: still one line
        log.exception("the initializer failed unexpectedly")
        _write_termination_message(
            termination_log, f"the initializer failed unexpectedly: {type(err).__name__}: {_said(err)}"
        )
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    detail = (
        describe_status(ready.status)
        if ready.status is not None
        else "every cache pod passed its readiness probe (the head's /status could not be read from here)"
    )
    log.info("cache %s ready at %s: %s", ready.cache, ready.flight_url, detail)
    return 0


_DESCRIPTION = """\
Start (or join) the data cache of a TrainJob's Iceberg table and exit 0 once it serves.
It runs as the dataset-initializer step of the torch-distributed-with-cache runtime and takes
its settings from the environment, as the Kubeflow SDK's DataCacheInitializer sets them:

  STORAGE_URI     cache://<schema>/<table>                     (required)
  METADATA_LOC    the table's metadata.json (s3://, s3a://, file://) (required)
  TRAIN_JOB_NAME  the TrainJob's name                          (required)
  CACHE_IMAGE     the data cache image                         (required)
  CLUSTER_SIZE, HEAD_CPU, HEAD_MEM, WORKER_CPU, WORKER_MEM, IAM_ROLE, DATA_CACHE_SHARED,
  CACHE_READY_TIMEOUT_SECONDS, ...: see docs/initializer.md for every variable.

Exit status: 0 the cache serves; 2 bad settings (every one named); 143 stopped by SIGTERM;
1 any other failure, with the reason in the log and the pod's termination message.
"""


def cli(argv: list[str] | None = None) -> int:
    """The console script: options are for people (--help, --version); settings come from env."""
    from kubeflow_cache_initializer import __version__

    parser = argparse.ArgumentParser(
        prog="cache-initializer", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.parse_args(argv)  # exits 2 on any argument: a setting passed as a flag would be ignored
    return main()


if __name__ == "__main__":
    sys.exit(cli())
