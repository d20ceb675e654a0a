"""`data-cache`: head, worker (data node), local cluster and sample-table commands."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

from kubeflow_data_cache.errors import ConfigError, DataCacheError
from kubeflow_data_cache.extras import require_server

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _node_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metadata-loc", help="Iceberg metadata.json location (env METADATA_LOC)")
    p.add_argument("--schema-name", help="schema (namespace) name reported by the cache (env SCHEMA_NAME)")
    p.add_argument("--table-name", help="table name reported by the cache (env TABLE_NAME)")
    p.add_argument("--host", help="address to bind (env BIND_HOST, default 0.0.0.0)")
    p.add_argument("--port", type=int, help="Flight port (env FLIGHT_PORT, default 50051; 0 picks a free one)")
    p.add_argument(
        "--health-port", type=int, help="HTTP /ready /live /status /metrics port (env HEALTH_PORT, default 8080)"
    )
    p.add_argument("--advertise-host", help="address others reach this node at (env POD_IP, default hostname)")
    p.add_argument("--memory-limit", help="memory budget, e.g. 4Gi (env MEMORY_LIMIT, default the cgroup limit)")
    p.add_argument(
        "--token",
        help="bearer token every call must carry (env DATA_CACHE_TOKEN); shows in the process list, so "
        "prefer the env or --token-file",
    )
    p.add_argument("--token-file", help="file holding the token (env DATA_CACHE_TOKEN_FILE)")
    p.add_argument("--tls-cert", help="TLS certificate file (env DATA_CACHE_TLS_CERT)")
    p.add_argument("--tls-key", help="TLS private key file (env DATA_CACHE_TLS_KEY)")
    p.add_argument(
        "--tls-dir",
        help="folder of a TLS Secret: tls.crt, tls.key, ca.crt; empty serves plaintext (env DATA_CACHE_TLS_DIR)",
    )
    p.add_argument(
        "--tls-server-name",
        help="name checked in peers' certificates instead of their address (env DATA_CACHE_TLS_SERVER_NAME)",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        help="seconds to form the cluster and load (env DATA_CACHE_STARTUP_TIMEOUT_SECONDS, default 600)",
    )
    p.add_argument(
        "--failure-grace",
        type=float,
        help="seconds to keep reporting a failed load before exiting (env DATA_CACHE_FAILURE_GRACE_SECONDS, default 30)",
    )
    p.add_argument("--load-threads", type=int, help="parallel file reads (env LOAD_THREADS, default the CPU count)")


def at_least(minimum: int):
    """An argparse type: an integer >= ``minimum``, refused at parsing (exit 2, naming the flag)
    rather than as a traceback from deep inside the command (also used by hack/demo.py, where
    --epochs 0 ended, after the table, the cache and torchrun had started, in a ZeroDivisionError)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"should be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"should be >= {minimum}, got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    from kubeflow_data_cache import __version__

    parser = argparse.ArgumentParser(prog="data-cache", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--log-level",
        default=os.environ.get("LOG_LEVEL") or "INFO",  # empty counts as unset, as for every setting
        help=f"one of {', '.join(LOG_LEVELS)} (env LOG_LEVEL, default INFO)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    head = sub.add_parser("head", help="run the head (LeaderWorkerSet leader)")
    _node_flags(head)
    head.add_argument(
        "--data-nodes", type=int, help="data nodes to expect (env DATA_NODES, default LWS_GROUP_SIZE - 1)"
    )

    worker = sub.add_parser("worker", help="run a data node (LeaderWorkerSet worker)")
    _node_flags(worker)
    worker.add_argument("--index", type=int, help="0-based data node index (default LWS_WORKER_INDEX - 1)")
    worker.add_argument("--head", help="head location, e.g. grpc://10.0.0.5:50051 (default from LWS_LEADER_ADDRESS)")

    local = sub.add_parser("local", help="run a head and N data nodes on this machine")
    local.add_argument(
        "--metadata-loc",
        default=os.environ.get("METADATA_LOC"),
        required="METADATA_LOC" not in os.environ,
        help="the table's metadata.json: s3://, s3a://, file:// or a path (default env METADATA_LOC)",
    )
    local.add_argument("--data-nodes", type=int, default=2, help="data node processes to start (default 2)")
    local.add_argument(
        "--port", type=int, default=50051, help="the head's Flight port (default 50051; 0 picks a free one)"
    )
    local.add_argument("--host", default="127.0.0.1", help="address every process binds (default 127.0.0.1)")
    local.add_argument(
        "--advertise-host",
        help="address readers reach the cache at, in READY and the data nodes' endpoints "
        "(default --host; this machine's hostname when --host is 0.0.0.0 or ::)",
    )
    local.add_argument(
        "--health-port",
        type=int,
        default=0,
        help="the head's /ready /live /status /metrics port (default 0: a free one)",
    )
    local.add_argument(
        "--memory-limit", help="each data node's memory budget, e.g. 2Gi (env MEMORY_LIMIT, default the cgroup limit)"
    )
    local.add_argument("--schema-name", help="schema (namespace) name the cache reports (env SCHEMA_NAME)")
    local.add_argument("--table-name", help="table name the cache reports (env TABLE_NAME)")
    local.add_argument(
        "--startup-timeout",
        type=float,
        help="seconds to start and load before giving up (env DATA_CACHE_STARTUP_TIMEOUT_SECONDS, default 300)",
    )

    sample = sub.add_parser("sample-table", help="write a sample Iceberg table and print its metadata location")
    sample.add_argument("--warehouse", required=True, help="warehouse folder (or s3://bucket/prefix)")
    sample.add_argument("--rows", type=at_least(0), default=100_000, help="rows to write (default 100000)")
    sample.add_argument("--files", type=at_least(1), default=4, help="data files to split them into (default 4)")
    sample.add_argument(
        "--schema-name",
        default="demo",
        help="schema (namespace) of the table (default demo; give `local` the same --schema-name)",
    )
    sample.add_argument(
        "--table-name", default="events", help="table name (default events; give `local` the same --table-name)"
    )
    return parser


def _log_format(role: str) -> str:
    return f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s"


def _setup_logging(level: str, role: str) -> None:
    logging.basicConfig(level=level, stream=sys.stderr, format=_log_format(role))
    # Library chatter (botocore retries, pyiceberg warnings) would drown the progress lines.
    for noisy in ("botocore", "urllib3", "s3fs", "aiobotocore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _log_level(raw: str) -> str:
    level = raw.strip().upper()
    if level not in LOG_LEVELS:
        raise ConfigError(f"`LOG_LEVEL` (--log-level) should be one of {', '.join(LOG_LEVELS)}, got {raw!r}")
    return level


def _reopen_closed_standard_streams() -> None:
    """Put /dev/null on stdin, stdout or stderr where the caller closed it (``2>&-``).

    Python starts with ``sys.stderr = None`` then: logging and faulthandler failed in every node,
    which exited 1 with nothing said, and the next file or socket opened took the free fd 2, so
    anything written to "stderr" went into it.
    """
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))  # noqa: SIM115 (the process's own)


def main(argv: list[str] | None = None) -> int:
    _reopen_closed_standard_streams()
    restore_signals = None
    try:
        args = build_parser().parse_args(argv)
        if args.command in ("head", "worker", "local"):
            from kubeflow_data_cache.processes import keep_early_stop_signals

            # Until run_node / run_local handle them: their imports take a second.
            restore_signals = keep_early_stop_signals()
        return _main(args)
    except KeyboardInterrupt:
        # Ctrl-C before a command's own handlers are in (its imports take a while): a stop asked
        # for, not a traceback. Nothing was started yet.
        return 130
    finally:
        if restore_signals is not None:
            restore_signals()


def _sample_table(args: argparse.Namespace) -> int:
    """``data-cache sample-table``: write the table, print its metadata location."""
    from kubeflow_data_cache.iceberg_reader import is_remote
    from kubeflow_data_cache.s3_settings import s3_properties_from_env, store_trouble, trust_aws_ca_bundle
    from kubeflow_data_cache.sample import create_sample_table

    remote = is_remote(args.warehouse)
    if remote:
        # An s3:// warehouse is reached with the standard AWS settings, its CA included, as the
        # cache reads it (pyiceberg alone ignores AWS_ENDPOINT_URL: a MinIO warehouse went to
        # AWS's hosts; and a store behind a private CA was written by no one but read by the cache).
        trust_aws_ca_bundle(os.environ)
    properties = s3_properties_from_env() if remote else None
    code = 1
    try:
        table = create_sample_table(
            args.warehouse, args.rows, args.files, args.schema_name, args.table_name, properties=properties
        )
    except OSError as err:  # a warehouse path that is a file, or under one that cannot be written
        trouble = store_trouble(err, (properties or {}).get("s3.endpoint")) if remote else None
        reason = f"{trouble.problem}: {trouble.fix} ({err})" if trouble else str(err)
        print(f"error: cannot write the sample table under --warehouse {args.warehouse!r}: {reason}", file=sys.stderr)
        code = 2
    except BaseException as err:
        if not remote:
            raise  # main reports it
        # Said here: the exit below ends the process before main could.
        if isinstance(err, KeyboardInterrupt):
            code = 130  # a stop asked for, as main answers it
        elif isinstance(err, DataCacheError):
            code = 2
            print(f"error: {err}", file=sys.stderr)
        else:
            print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
    else:
        try:
            print(table.metadata_location, flush=True)
            code = 0
        except OSError as err:  # the table is written; only its location could not be printed
            print(f"error: wrote the table, but could not print its metadata location: {err}", file=sys.stderr)
            # What stays buffered would fail again at exit, turning the exit code into 120.
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if remote:
        # pyarrow's S3 client can hang for ever finalizing at interpreter exit once the AWS SDK
        # has tried a web-identity (IRSA) exchange: the command printed its result and never
        # ended. Leave at once, however it ended, as the cache's processes do.
        from kubeflow_data_cache.processes import exit_now

        exit_now(code)
    return code


def _main(args: argparse.Namespace) -> int:
    role = args.command if args.command != "worker" else f"node-{args.index if args.index is not None else ''}"
    try:
        _setup_logging(_log_level(args.log_level), role)
        require_server(args.command)  # every command runs or writes for the server
        if args.command in ("head", "worker"):
            from kubeflow_data_cache import allocator

            # Before pyarrow loads (it reads the pool choice once) and before threads start.
            if args.command == "worker":
                allocator.prepare_data_node()
            else:
                allocator.prepare_head()
            from kubeflow_data_cache.config import build_config
            from kubeflow_data_cache.runner import run_node
            from kubeflow_data_cache.s3_settings import trust_aws_ca_bundle

            # Once, before any S3 client exists in this process (head and data nodes open the
            # table with it); `local` hands its environment to the processes it starts.
            trust_aws_ca_bundle(os.environ)

            cfg = build_config(args.command, vars(args))
            if args.command == "worker":
                # The index may come from LWS_WORKER_INDEX (a pod) rather than --index.
                for handler in logging.getLogger().handlers:
                    handler.setFormatter(logging.Formatter(_log_format(f"node-{cfg.node_index}")))
            return run_node(cfg)
        if args.command == "local":
            from kubeflow_data_cache.local import MAX_LOCAL_DATA_NODES, LocalCluster, run_local

            if not 1 <= args.data_nodes <= MAX_LOCAL_DATA_NODES:
                raise DataCacheError(
                    f"--data-nodes should be from 1 to {MAX_LOCAL_DATA_NODES} (processes on this machine, "
                    f"each an interpreter), got {args.data_nodes}"
                )
            # Given to every process, so /status and data_cache_info name the table (the env's
            # SCHEMA_NAME / TABLE_NAME reach them anyway).
            names = (("--schema-name", args.schema_name), ("--table-name", args.table_name))
            extra = tuple(part for flag, value in names if value for part in (flag, value))
            return run_local(
                LocalCluster(
                    args.metadata_loc,
                    args.data_nodes,
                    args.port,
                    args.host,
                    args.memory_limit,
                    args.startup_timeout,
                    extra_args=extra,
                    advertise_host=args.advertise_host,
                    health_port=args.health_port,
                )
            )
        return _sample_table(args)
    except DataCacheError as err:
        # Printed once: logging it as well showed every config error twice.
        print(f"error: {err}", file=sys.stderr)
        return 2
