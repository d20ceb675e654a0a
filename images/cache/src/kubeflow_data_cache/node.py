"""A data node: registers with the head, loads the rows it is assigned, serves them with DoGet."""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from kubeflow_data_cache import protocol
from kubeflow_data_cache.allocator import GatherReclaim, reclaim_gather_memory
from kubeflow_data_cache.client_statuses import InvalidArgument
from kubeflow_data_cache.config import NodeConfig, host_port, same_table_location
from kubeflow_data_cache.constants import (
    GATHER_AHEAD_BYTES,
    MAX_EXPANSION,
    READAHEAD_BATCHES,
    REGISTER_INTERVAL_SECONDS,
    REGISTER_WARN_AFTER_SECONDS,
    REGISTER_WARN_EVERY_SECONDS,
    RPC_TIMEOUT_SECONDS,
    SERVE_WINDOW_BATCHES,
    SERVE_WINDOW_BYTES,
)
from kubeflow_data_cache.errors import (
    BadRequestError,
    ClusterFormationError,
    MemoryBudgetError,
    NodeBusyError,
    NotReadyError,
    StaleTicketError,
    TableLoadError,
    UnsignedTicketError,
    first_line,
    shown,
)
from kubeflow_data_cache.filtering import FilterCache, matched_rows
from kubeflow_data_cache.load_progress import LoadProgress, load_totals
from kubeflow_data_cache.memory import LoadMemoryGuard, LoadMemoryWatch, ServeMemoryGuard, resident_bytes
from kubeflow_data_cache.offsets import has_offsets, rebaser
from kubeflow_data_cache.plan import Piece, arrow_schema, open_table, scan_tasks
from kubeflow_data_cache.readahead import Readahead
from kubeflow_data_cache.s3_settings import s3_properties_from_env
from kubeflow_data_cache.security import (
    CERTIFICATE_REFUSED,
    TLS_NAME_MISMATCH,
    TLS_SCHEME,
    RefusalWarnings,
    TokenAuthFactory,
    call_options,
    caller,
    key_matches,
    speaks_tls,
)
from kubeflow_data_cache.sent_bytes import sent_nbytes
from kubeflow_data_cache.service import (
    FAILED,
    LOADING,
    READY,
    STOPPING,
    WAITING,
    Lifecycle,
    Metrics,
    ReadOnlyFlight,
    meter_calls,
    parse_action_body,
)
from kubeflow_data_cache.sharding import (
    check_order_size,
    claim_order_build,
    endpoint_rows,
    node_rows,
    order_built,
    order_nbytes,
    release_order_claim,
    shard_size,
)
from kubeflow_data_cache.store import NodeStore, warm_reader

log = logging.getLogger(__name__)


def gather_ahead(batch_bytes: int) -> int:
    """Batches a gathering stream computes ahead of the one Flight is sending, the one being
    gathered included: as many as GATHER_AHEAD_BYTES holds, at most READAHEAD_BATCHES; none where
    not one fits (each batch is then gathered when Flight asks for it)."""
    return min(READAHEAD_BATCHES, GATHER_AHEAD_BYTES // max(1, batch_bytes))


def window_rows(row_bytes: float, max_bytes: int = SERVE_WINDOW_BYTES) -> int:
    """Rows in a serve window of about ``max_bytes``, for rows of ``row_bytes`` on average."""
    return max(1, int(max_bytes // row_bytes)) if row_bytes > 0 else max_bytes


def windows(
    batches: Iterator[pa.RecordBatch], max_rows: int, max_batches: int = SERVE_WINDOW_BATCHES
) -> Iterator[pa.Table]:
    """``batches`` grouped, in order, into tables of up to ``max_rows`` rows and ``max_batches``
    batches (at least one batch).

    Bounded by rows, not by each batch's ``nbytes``: for a slice with a string column that walks
    the slice's buffers, and cost as much as 1% of an in-order stream.
    """
    group: list[pa.RecordBatch] = []
    rows = 0
    for batch in batches:
        if group and (rows + batch.num_rows > max_rows or len(group) >= max_batches):
            yield pa.Table.from_batches(group)
            group, rows = [], 0
        group.append(batch)
        rows += batch.num_rows
    if group:
        yield pa.Table.from_batches(group)


def server_kwargs(cfg: NodeConfig, metrics: Metrics) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"location": f"{cfg.scheme}://{host_port(cfg.bind_host, cfg.flight_port)}"}
    if cfg.tls.certificates:
        kwargs["tls_certificates"] = cfg.tls.certificates
    if cfg.token:
        kwargs["middleware"] = {"auth": TokenAuthFactory(cfg.token, on_refused=metrics.token_refused)}
        metrics.count_token_refusals()
    return kwargs


# A data node's open DoGet streams, by kind: gathering (shuffled or filtered: ServeMemoryGuard.admit
# counts those) and in order (admit_in_order counts every stream).
STREAM_KINDS = ("gathering", "in_order")


class LoadSuperseded(Exception):
    """A newer assignment arrived while loading: this load stops."""


@dataclass(frozen=True)
class LoadOrder:
    """The head's `load` action body, checked whole before the node acts on any of it."""

    generation: str
    metadata_location: str
    snapshot_id: int | None
    global_start: int
    global_stop: int
    pieces: tuple[Piece, ...]
    table_rows: int | None = None  # absent from older heads' orders
    # Measured string/binary expansions by field id (plan.TablePlan.expansions); absent: none.
    expansions: dict[int, float] = dataclass_field(default_factory=dict)

    @classmethod
    def parse(cls, body: dict[str, Any]) -> LoadOrder:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise BadRequestError(f"load: {what}; this action is the head's, sent to data nodes it planned for")

        def integer(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value >= 0

        generation, location = body.get("generation"), body.get("metadata_location")
        need(isinstance(generation, str) and generation != "", "'generation' should be a non-empty string")
        need(isinstance(location, str) and location != "", "'metadata_location' should be a non-empty string")
        snapshot = body.get("snapshot_id")
        need(
            snapshot is None or (isinstance(snapshot, int) and not isinstance(snapshot, bool)),
            "'snapshot_id' should be an integer or null",
        )
        start, stop = body.get("global_start"), body.get("global_stop")
        need(
            integer(start) and integer(stop) and start <= stop,
            "'global_start' <= 'global_stop' should be integers >= 0",
        )
        raw = body.get("pieces")
        need(isinstance(raw, list), "'pieces' should be a list of {path, start, stop}")
        pieces = []
        for p in raw:
            ok = (
                isinstance(p, dict)
                and isinstance(p.get("path"), str)
                and integer(p.get("start"))
                and integer(p.get("stop"))
            )
            need(ok and p["start"] <= p["stop"], f"piece {p!r} should be {{path, start, stop}} with 0 <= start <= stop")
            file_rows = p.get("file_rows")
            need(
                file_rows is None or (integer(file_rows) and file_rows >= p["stop"]),
                f"piece {p!r}: 'file_rows' should be null or an integer >= its 'stop'",
            )
            pieces.append(Piece(p["path"], p["start"], p["stop"], file_rows))
        need(
            sum(p.stop - p.start for p in pieces) == stop - start,
            "the pieces' rows should add up to global_stop - global_start",
        )
        table_rows = body.get("table_rows")
        need(
            table_rows is None or (integer(table_rows) and table_rows >= stop),
            "'table_rows' should be null or an integer >= 'global_stop'",
        )
        raw_expansions = body.get("expansions") or {}
        need(isinstance(raw_expansions, dict), "'expansions' should be an object of field id -> number")
        expansions = {}
        for key, value in raw_expansions.items():
            # ASCII digits only ("²" is a digit to str.isdigit, not to int()); a ratio no estimate
            # could hold (1e308 overflowed the int of one) is no head's.
            ok = isinstance(key, str) and re.fullmatch(r"[0-9]{1,9}", key) is not None
            ok = ok and isinstance(value, int | float) and not isinstance(value, bool)
            need(
                ok and math.isfinite(value) and 0 < value <= MAX_EXPANSION,
                f"'expansions' entry {key!r}: {value!r} should be a number > 0 and <= {MAX_EXPANSION:g}",
            )
            expansions[int(key)] = float(value)
        return cls(generation, location, snapshot, start, stop, tuple(pieces), table_rows, expansions)


class DataNode(ReadOnlyFlight):
    def __init__(self, cfg: NodeConfig, metrics: Metrics | None = None):
        self.metrics = metrics or Metrics("data-node", f"{cfg.schema_name}.{cfg.table_name}")
        super().__init__(**server_kwargs(cfg, self.metrics))
        self.cfg = cfg
        self.lifecycle = Lifecycle()
        self.location = cfg.location(self.port)
        self.store: NodeStore | None = None
        self.table_rows: int | None = None  # the whole table's, from the head's load order
        self.metrics.follow(
            self.lifecycle,
            lambda: self.store.num_rows if self.store is not None else 0,
            lambda: self.store.nbytes if self.store is not None else 0,
        )
        self.filters: FilterCache | None = None
        self.generation: str | None = None
        self.load_seconds = 0.0
        self._progress: LoadProgress | None = None  # the latest load's
        self._gathers = GatherReclaim()
        self._serve_guard = ServeMemoryGuard(cfg.memory_limit, reclaim_gather_memory)
        self.metrics.follow_load(self._load_progress)
        self.metrics.follow_memory(cfg.memory_limit, self._open_streams_of, STREAM_KINDS)
        # `load` and `count` refused for their cluster key, and tickets for their signature: warned
        # of once a spell, with the caller. One per kind: a flood of refused counts must not hide a
        # refused load (a head whose key differs) for a minute, nor be counted with it.
        self._key_refusals = {
            what: RefusalWarnings(log) for what in (protocol.ACTION_LOAD, protocol.ACTION_COUNT, "ticket")
        }
        self._admitting = threading.Lock()  # a stream's order claim and its admission, together
        self._load_lock = threading.Lock()
        self._load_thread: threading.Thread | None = None
        self._tables: dict[str, Future] = {}
        self._preopened: Future | None = None  # start_registering's early open, before any plan
        self._first_location = ""  # what a node without METADATA_LOC was first told to load
        self._refusal: str | None = None  # why the head's last assignment was refused, while it stands
        self._opener = ThreadPoolExecutor(max_workers=1, thread_name_prefix="open")
        self._stop = threading.Event()
        # Set when the load ends (either way): re-register at once so the head need not poll for it.
        self._wake_register = threading.Event()
        self._registered = threading.Event()
        meter_calls(self, self.metrics)

    # --- cluster formation -------------------------------------------------------------------
    def start_registering(self) -> None:
        # Open the table now when we know it (METADATA_LOC is set on every cache pod), while the
        # cluster forms: the first open of a table in a process costs seconds of imports and
        # model set-up that would otherwise count as load time.
        if self.cfg.metadata_loc:
            self._preopened = self._opened(self.cfg.metadata_loc)
        threading.Thread(target=self._register_loop, name="register", daemon=True).start()

    def _opened(self, metadata_location: str, again: bool = False) -> Future:
        """(table, Arrow schema, scan tasks by path) for a location, opened once per process
        (``again``: listed anew, where the tasks kept are another load's, _keep_tasks). An open
        that failed is not kept: the next load tries again, as the storage may be back."""
        with self._load_lock:
            future = self._tables.get(metadata_location)
            if future is None or again or (future.done() and future.exception() is not None):
                future = self._tables[metadata_location] = self._opener.submit(self._open, metadata_location)
            return future

    def _opened_for_load(self, metadata_location: str) -> tuple[Any, pa.Schema, dict[str, Any]]:
        with self._load_lock:  # taken once: held on, it kept every file's scan tasks (_keep_tasks)
            early, self._preopened = self._preopened, None
        opened = self._opened(metadata_location)
        try:
            return opened.result()
        except Exception:
            if opened is not early:
                raise
            # The early open ran before the head planned, maybe before the storage could be
            # reached (DNS, a store still starting, credentials not yet mounted). The head has
            # read the table since: its failure is no longer news, so open it once more.
            log.info("the early open of %s failed; opening it again for the load", metadata_location)
            return self._opened(metadata_location, again=True).result()

    def _keep_tasks(self, metadata_location: str, paths: set[str]) -> None:
        """Keep only the scan tasks of ``paths`` (the files just loaded) of an opened table: a
        task carries its file's column statistics, ~70 KiB a file at 200 columns, and the whole
        table's stayed for the process's life (135 MiB beside 8 MiB of rows for 2,000 files). A
        load of other files lists them again."""
        with self._load_lock:
            future = self._tables.get(metadata_location)
            if future is None or not future.done() or future.exception() is not None:
                return
            table, schema, tasks = future.result()
            kept: Future = Future()
            kept.set_result((table, schema, {path: task for path, task in tasks.items() if path in paths}))
            self._tables[metadata_location] = kept

    @staticmethod
    def _open(metadata_location: str):
        table = open_table(metadata_location, s3_properties_from_env())
        tasks = scan_tasks(table, metadata_location)
        if tasks:
            # Beside the open, not in it: a load waits for the open, and a warm-up read that
            # stalls on storage must not hold the load (whose own reads are the ones named).
            args = (table, min(tasks.values(), key=lambda task: task.file.file_size_in_bytes))  # least to fetch
            threading.Thread(target=warm_reader, args=args, name="warm-reader", daemon=True).start()
        return table, arrow_schema(table), tasks

    def _tls_mismatch(self) -> str | None:
        """Why the head cannot be registered with, where it speaks TLS and this node not, or the
        other way round (a TLS Secret that reached only some of a group's pods): every call failed
        the handshake, and the node retried to its deadline saying "Socket closed"."""
        ours = self.cfg.tls.scheme == TLS_SCHEME
        theirs = speaks_tls(self.cfg.head_location)
        if theirs is None or theirs == ours:
            return None
        head, node = ("serves TLS", "does not") if theirs else ("does not serve TLS", "does")
        return (
            f"data node {self.cfg.node_index}: the head at {self.cfg.head_location} {head} and this data node "
            f"{node}: every pod of a cache serves TLS or none does. On Kubernetes its pods read the same TLS "
            "Secret (DATA_CACHE_TLS_DIR); one created or deleted after some of them started reaches only the "
            "later ones: delete the cache's pods (or its TrainJob) so that they all start again"
        )

    def _certificate_refused(self, error: str) -> str | None:
        """Why the head's certificate is refused, where gRPC's ``error`` says it is."""
        where = f"data node {self.cfg.node_index}: the head's certificate at {self.cfg.head_location}"
        if TLS_NAME_MISMATCH in error:
            return (
                f"{where} does not carry the name checked ({first_line(error)}): make the certificate for the "
                "address the nodes dial, or set DATA_CACHE_TLS_SERVER_NAME to a name it carries, in every process "
                "of the cache"
            )
        if CERTIFICATE_REFUSED in error:
            return (
                f"{where} does not verify ({first_line(error)}): every process of a cache serves the same "
                "certificate and trusts its ca.crt (on Kubernetes, one TLS Secret): check its dates and its CA"
            )
        return None

    def _register_loop(self) -> None:
        """Register with the head, then keep re-registering so a restarted head finds us again."""
        client = self.cfg.tls.client_for(self.cfg.head_location)
        deadline = time.monotonic() + self.cfg.startup_timeout
        delay, last_error = 0.1, ""
        failing_since: float | None = None
        warned_at = float("-inf")
        # Not once the node is stopping: its head, stopped first, is gone, and each node warned
        # "cannot register with the head" through the whole of its streams' grace.
        while not self._stop.is_set() and self.lifecycle.state != STOPPING:
            body = {
                "index": self.cfg.node_index,
                "location": self.location,
                "memory_limit": self.cfg.memory_limit,
                "load_threads": self.cfg.load_threads,
                "generation": self.generation,
                **protocol.cluster_key_field(self.cfg.cluster_key),
            }
            try:
                action = flight.Action(protocol.ACTION_REGISTER, json.dumps(body).encode())
                list(client.do_action(action, call_options(self.cfg.token, RPC_TIMEOUT_SECONDS)))
                if not self._registered.is_set():
                    log.info(
                        "registered with the head at %s as data node %d", self.cfg.head_location, self.cfg.node_index
                    )
                self._registered.set()
                # The head answers: no stale reason, but the refusal of its assignment stands (a
                # heartbeat turned /ready back to "waiting for the cluster to form" every 5 s).
                self.lifecycle.waiting_detail(self._refusal or "waiting for the cluster to form")
                delay, failing_since, warned_at = REGISTER_INTERVAL_SECONDS, None, float("-inf")
            except flight.FlightUnauthenticatedError as err:
                self.lifecycle.fail(f"the head at {self.cfg.head_location} refused our token: {err}")
                return
            except pa.ArrowNotImplementedError as err:  # a Flight server, but no head: final too
                self.lifecycle.fail(
                    f"data node {self.cfg.node_index}: {self.cfg.head_location} answers Flight but is not a data "
                    f"cache head ({first_line(err)}): point --head (or LWS_LEADER_ADDRESS and FLIGHT_PORT) at the "
                    "head's Flight port"
                )
                return
            except pa.ArrowInvalid as err:  # the head answered and refused (a wrong index): final
                self.lifecycle.fail(
                    f"data node {self.cfg.node_index}: the head at {self.cfg.head_location} refused to register "
                    f"it: {first_line(err)}"
                )
                return
            except Exception as err:  # head not up yet, or restarting: retry with backoff
                if self.lifecycle.state == STOPPING:
                    return
                last_error = first_line(err)
                if (mismatch := self._tls_mismatch()) is not None:
                    self.lifecycle.fail(mismatch)
                    return
                if not self._registered.is_set() and (refused := self._certificate_refused(str(err))):
                    # Retried to the startup deadline (600 s by default), where no retry changes a certificate.
                    self.lifecycle.fail(refused)
                    return
                # /ready says why (a TLS name mismatch shows here), also for a node the head
                # registered and then went away from before sending it rows.
                self.lifecycle.waiting_detail(
                    f"cannot register with the head at {self.cfg.head_location} yet: {last_error}"
                )
                now = time.monotonic()
                failing_since = now if failing_since is None else failing_since
                # Before it registers, the startup deadline; once registered but sent no rows, as
                # long again without its head (gone for good, it waited for ever); once loaded,
                # no deadline: it serves its rows and waits for a restarted head.
                if not self._registered.is_set():
                    gives_up: float | None = deadline
                else:
                    gives_up = failing_since + self.cfg.startup_timeout if self.lifecycle.state == WAITING else None
                if (
                    now - failing_since >= REGISTER_WARN_AFTER_SECONDS
                    and now - warned_at >= REGISTER_WARN_EVERY_SECONDS
                ):
                    log.warning(
                        "data node %d cannot register with the head at %s (failing for %.0fs%s): %s",
                        self.cfg.node_index,
                        self.cfg.head_location,
                        now - failing_since,
                        "" if gives_up is None else f"; gives up in {max(0.0, gives_up - now):.0f}s",
                        last_error,
                    )
                    warned_at = now
                if gives_up is not None and now > gives_up:
                    if self._registered.is_set():
                        why = (
                            f"the head at {self.cfg.head_location} registered this data node and then did not "
                            f"answer for {self.cfg.startup_timeout:.0f}s without sending it rows ({last_error}): "
                            "it stopped and did not come back; restart the cache"
                        )
                    else:
                        why = (
                            f"could not reach the head at {self.cfg.head_location} within "
                            f"{self.cfg.startup_timeout:.0f}s: {last_error}"
                        )
                    self.lifecycle.fail(str(ClusterFormationError(why)))
                    return
                delay = min(delay * 2, REGISTER_INTERVAL_SECONDS)
            self._wake_register.wait(delay)
            self._wake_register.clear()

    def stop(self) -> None:
        self._stop.set()
        self._wake_register.set()
        self.shutdown()

    def open_streams(self) -> int:
        return self._gathers.all_open_streams

    def _open_streams_of(self, kind: str) -> int:
        gathering = self._gathers.open_streams
        # In order: all the others. The two counts are read apart, so a gathering stream that
        # closed between the two reads would make this -1 for that scrape.
        return gathering if kind == "gathering" else max(0, self._gathers.all_open_streams - gathering)

    def _load_progress(self) -> tuple[int, int, float]:
        """(rows, bytes, oldest read's wait) of the load under way, as /ready and /status say them."""
        progress = self._progress
        return load_totals([progress.status()] if self.lifecycle.state == LOADING and progress is not None else [])

    def _require_key(self, action: str, body: dict[str, Any], context: Any) -> None:
        """Refuse the head's actions (``load``, ``count``) without its cluster key, where one is set."""
        if key_matches(self.cfg.cluster_key, body.get(protocol.CLUSTER_KEY_FIELD)):
            return
        self._key_refusals[action].refused(f"refused a {action} without the cluster key", caller(context))
        raise BadRequestError(
            f"{action}: the cluster key is missing or wrong: this action is the head's; give the head and every "
            "data node the same DATA_CACHE_CLUSTER_KEY"
        )

    # --- loading -----------------------------------------------------------------------------
    def _start_load(self, body: dict[str, Any], context: Any = None) -> None:
        # A load replaces what this node serves: only from the head (its key), and only the
        # table this node was given, so no caller can make it read (and serve) another one.
        self._require_key(protocol.ACTION_LOAD, body, context)
        order = LoadOrder.parse(body)  # before touching anything: a bad body changes nothing
        if self.lifecycle.state == STOPPING:  # its rows could never be served: the process is leaving
            raise NotReadyError(f"data node {self.cfg.node_index} is stopping: it takes no load")
        with self._load_lock:
            # A node started without METADATA_LOC serves the table of its first load from then on.
            own = self.cfg.metadata_loc or self._first_location
            if own and not same_table_location(order.metadata_location, own):
                where = "its METADATA_LOC" if self.cfg.metadata_loc else "its first load's; it has no METADATA_LOC"
                refusal = (
                    f"load: this data node serves the table at {own!r} ({where}), not {order.metadata_location!r}: "
                    "give the head and its data nodes the same METADATA_LOC"
                )
                # Said here too: the node waits on (the head may be the one to change), and its
                # /ready and log said only "waiting for the cluster to form". Logged once, not at
                # each of the head's resends (twice every 5 s until its deadline).
                why = f"refused the head's assignment: {refusal}"
                if why != self._refusal:
                    log.error("%s", why)
                self._refusal = why
                self.lifecycle.waiting_detail(why)
                raise BadRequestError(refusal)
            self._refusal = None
            self._first_location = own or order.metadata_location
            if self.generation == order.generation:
                return  # the head re-sent the same assignment: already loading or loaded
            self.generation = order.generation
            self.store, self.filters, self.table_rows = None, None, None
            previous = self._load_thread
            self.lifecycle.set(LOADING, "reading data files")
            # A newer assignment (a restarted head) supersedes a load still running: that one
            # stops at its next piece, and this one reads only once it has, so the node never
            # holds two loads at once (the memory check counts one). Until then the status shows
            # the old load's reads: one stuck on storage is what this load waits for.
            thread = threading.Thread(target=self._load, args=(order, previous), name="load", daemon=True)
            self._load_thread = thread
        # Said once, as it starts: the log showed "registered" and then nothing until ready or failed.
        log.info(
            "data node %d loading rows %d-%d (%d rows) from %d data file(s)",
            self.cfg.node_index,
            order.global_start,
            order.global_stop,
            order.global_stop - order.global_start,
            len({p.path for p in order.pieces}),
        )
        thread.start()

    def _current(self, order: LoadOrder) -> bool:
        return self.generation == order.generation

    def _fail_load(self, order: LoadOrder, err: Exception) -> None:
        """Fail the node with ``order``'s error. A superseded load's failure is not this node's
        state, and one the memory watch reported already keeps the figures it was reported with.
        Under the lock a newer assignment takes: one taken between the check and the failure was
        marked failed with the old load's reason (and FAILED is final)."""
        with self._load_lock:
            if self._current(order) and self.lifecycle.state != FAILED:
                self.lifecycle.fail(f"data node {self.cfg.node_index}: {err}")
                self._wake_register.set()

    def _load(self, order: LoadOrder, previous: threading.Thread | None) -> None:
        if previous is not None:
            previous.join()
        started = time.monotonic()

        def still_current() -> None:
            if not self._current(order):
                raise LoadSuperseded()

        rows = order.global_stop - order.global_start
        guard = LoadMemoryGuard(self.cfg.memory_limit, rows)
        progress = LoadProgress(
            still_current,
            on_batch=lambda: guard.check(
                progress.settled_rows,
                progress.settled_bytes,
                progress.settled_estimate,
                progress.expected_estimate,
                progress.rows,
            ),
        )
        self._progress = progress
        self.lifecycle.live_detail = progress.describe  # /ready and /status say what it waits on
        try:
            with progress.reading(f"the table's metadata at {order.metadata_location}"):
                table, schema, tasks = self._opened_for_load(order.metadata_location)
                if any(p.path not in tasks for p in order.pieces):  # kept for another load's files only
                    table, schema, tasks = self._opened(order.metadata_location, again=True).result()
            snapshot = table.current_snapshot()
            if (snapshot.snapshot_id if snapshot else None) != order.snapshot_id:
                raise TableLoadError("the table's snapshot differs from the head's plan; restart the cache")
            missing = [p.path for p in order.pieces if p.path not in tasks]
            if missing:
                raise TableLoadError(f"data files {missing[:3]} are not in the planned snapshot")

            def breached(err: MemoryBudgetError) -> None:
                # Said now, while the decode that passed the margin runs on: /ready, /status and
                # the head have the reason before the kernel might kill the process. The load
                # stops at its next batch.
                guard.breached = err
                self._fail_load(order, err)

            with LoadMemoryWatch(lambda: guard.check_resident(progress.settled_rows, progress.rows), breached):
                store = NodeStore.load(
                    table, tasks, schema, list(order.pieces), self.cfg.load_threads, progress, order.expansions
                )
            if store.num_rows != rows:
                raise TableLoadError(f"read {store.num_rows} rows, expected {rows}")
        except LoadSuperseded:
            log.info("load %s stopped: a newer assignment arrived", order.generation)
            return
        except Exception as err:
            self._fail_load(order, err)
            return
        with self._load_lock:
            if not self._current(order):
                return  # superseded by a newer assignment while loading
            if guard.breached is not None:
                return  # failed by the memory watch after the load's last check: its rows go
            self.store, self.filters = store, FilterCache(store)
            self.table_rows = order.table_rows
            self.load_seconds = time.monotonic() - started
            # Under the lock, as the store: a newer assignment taken just after it (its store
            # None, LOADING) was otherwise marked READY by this older load, holding no rows.
            self.lifecycle.set(READY, f"{store.num_rows} rows loaded")
        self.metrics.load_seconds.set(self.load_seconds)
        self._keep_tasks(order.metadata_location, {p.path for p in order.pieces})
        self._wake_register.set()
        log.info(
            "data node %d ready: %d rows, %.1f MiB in %.2fs (resident %.1f MiB)",
            self.cfg.node_index,
            store.num_rows,
            store.nbytes / 2**20,
            self.load_seconds,
            resident_bytes() / 2**20,
        )

    def status(self) -> dict[str, Any]:
        """What the health port's /status shows, without a token: the state, what is held and
        the load's progress, never the table's columns (``column_figures``)."""
        store = self.store
        state, progress = self.lifecycle.state, self._progress
        loading = state == LOADING and progress is not None
        return {
            "role": "data-node",
            "table": f"{self.cfg.schema_name}.{self.cfg.table_name}",
            "index": self.cfg.node_index,
            "location": self.location,
            "state": state,
            "detail": self.lifecycle.detail,
            "error": self.lifecycle.error,
            # What the load has read so far, and its oldest read in flight (a stalled storage read).
            "loading": progress.status() if loading else None,
            "generation": self.generation,
            "rows": store.num_rows if store else 0,
            "bytes": store.nbytes if store else 0,
            "resident_bytes": resident_bytes(),
            "memory_pool": pa.default_memory_pool().backend_name,
            "memory_limit": self.cfg.memory_limit,
            # Streams refused so far because the node was near its memory limit.
            "refused_streams": self._serve_guard.refused,
            "load_seconds": round(self.load_seconds, 3),
        }

    def column_figures(self) -> dict[str, Any]:
        """Per column: Arrow bytes held, nulls and list lengths, for the head's FlightInfo. Only
        in the `status` action, which takes the token: they name every column of the table, which
        the health port, open to anyone who reaches it, does not (docs/cache.md, Security)."""
        store = self.store
        return {
            "column_bytes": dict(store.column_bytes) if store else {},
            "null_counts": dict(store.null_counts) if store else {},
            "list_lengths": {name: list(b) for name, b in store.list_lengths.items()} if store else {},
            "inner_list_lengths": dict(store.inner_list_lengths) if store else {},
        }

    # --- Flight ------------------------------------------------------------------------------
    def _loaded(self) -> tuple[NodeStore, FilterCache, int | None, str | None]:
        """The load served now: store, filters, table rows and generation, read together (a
        reload swaps them under the same lock), or the not-ready error. Read apart, a reload
        between two reads gave a stream no store (an AttributeError for its reader)."""
        with self._load_lock:
            loaded = self.store, self.filters, self.table_rows, self.generation
        self.lifecycle.require_ready()
        if loaded[0] is None or loaded[1] is None:
            raise NotReadyError("the data node is reloading; retry shortly")
        return loaded  # type: ignore[return-value]

    def do_action(self, context, action):
        if action.type == protocol.ACTION_STATUS:
            return [json.dumps({**self.status(), **self.column_figures()}).encode()]
        if action.type == protocol.ACTION_LOAD:
            self._start_load(parse_action_body(action, bounded=False), context)  # lists every file the node loads
            return [b"{}"]
        if action.type == protocol.ACTION_COUNT:
            body = parse_action_body(action)
            # The head's too: it counts each new filter once for all its readers and keeps the
            # answer; a reader asking a node directly would run predicates of its choosing there,
            # past that, and push the filters readers use out of the node's FilterCache.
            self._require_key(protocol.ACTION_COUNT, body, context)
            predicate = body.get("filter")
            if not isinstance(predicate, str) or not predicate.strip():
                raise BadRequestError('count needs {"filter": "<SQL predicate>"}')
            _, filters, _, _ = self._loaded()
            # The matches' nulls and list lengths, for the readers' checks before their first batch.
            matches, figures = filters.matched(predicate)
            return [json.dumps({"rows": len(matches), **figures}).encode()]
        raise NotImplementedError(f"action {shown(action.type)} is not implemented by data nodes")

    def list_actions(self, context):
        return [(protocol.ACTION_STATUS, "JSON status of this data node")]

    def get_flight_info(self, context, descriptor):
        raise NotImplementedError("GetFlightInfo goes to the head (the cache's endpoint), not to a data node")

    def list_flights(self, context, criteria):
        raise NotImplementedError("ListFlights goes to the head (the cache's endpoint), not to a data node")

    def get_schema(self, context, descriptor):
        raise NotImplementedError("GetSchema goes to the head (the cache's endpoint), not to a data node")

    def do_get(self, context, ticket):
        t = protocol.Ticket.from_json(ticket.ticket)
        store, filters, table_rows, generation = self._loaded()
        if t.generation != generation or t.node != self.cfg.node_index:
            # Before the signature: a ticket of an earlier cache here (another key) is stale, and its
            # reader asks the head again; refused as unsigned, the read failed. Nothing is served.
            raise StaleTicketError(
                f"stale ticket: issued for data node {t.node} load {t.generation}, this is data node {self.cfg.node_index} "
                f"load {generation}: ask the head for a new FlightInfo"
            )
        try:
            protocol.check_ticket_signature(ticket.ticket, self.cfg.cluster_key)
        except UnsignedTicketError:
            self._key_refusals["ticket"].refused("refused a ticket its head did not sign", caller(context))
            raise
        if table_rows is not None and t.total > table_rows:
            # Heads place a ticket in the table's (or its filter's) rows; the row space sizes
            # the shuffle order built below, before any memory guard: hundreds of MiB at will.
            raise BadRequestError(
                f"the ticket places its rows in a space of {t.total} rows, more than the table's {table_rows}: "
                "tickets come from the head's GetFlightInfo, unchanged but for their skip"
            )
        req = t.request
        schema = store.project(req.columns)
        matches = filters.rows(req.filter) if req.filter else None
        held = len(matches) if matches is not None else store.num_rows
        if held != t.node_rows:
            raise StaleTicketError(
                f"stale ticket: it expects {t.node_rows} rows on this node, which holds {held}; ask the head again"
            )
        # The stream's rows, counted as the head counted them (not taken from the ticket, which a
        # client could change), where that is cheap: in order, or shuffled once the epoch's order
        # is built (counting takes it; it is built in the stream, once admitted). None: not yet.
        rows = (
            endpoint_rows([t.offset, t.offset + held], t.total, req)[0]
            if not req.shuffle or order_built(t.total, req)
            else None
        )
        # A skip past them sent an empty stream without a word, and a ticket that says other rows
        # than it holds is one changed since the head wrote it.
        if rows is not None and (t.skip > rows or (t.rows is not None and t.rows != rows)):
            raise BadRequestError(
                f"the ticket says its stream holds {t.rows} rows and skips {t.skip}; this stream holds "
                f"{rows}: tickets come from the head's GetFlightInfo, unchanged but for their skip"
            )
        if req.shuffle:
            # Refused here (too many blocks), not inside the stream; the order itself is built in the
            # stream, once admitted: built before, every refused or retried request built one.
            check_order_size(t.total, req)
        parts = node_rows(t.offset, held, t.total, req, t.skip)
        batch_rows = store.batch_rows(req.batch_size, req.columns)
        row_bytes = store.row_bytes(req.columns)
        if matches is None and not req.shuffle:
            slices = store.iter_rows(parts, batch_rows, req.columns)
            window = window_rows(row_bytes)
            admitted = None
            if has_offsets(schema):
                # Slices with rebased offsets (offsets.py), made as Flight's writer pulls their
                # window: only the window in flight holds rebased copies, which a reader that
                # stops reading keeps. Those count for the memory guard (~2 MiB a stream here).
                slices = map(rebaser(schema), slices)
                stream_rows = min(window, max(0, rows - t.skip))  # in order, the stream's rows are counted
                try:
                    admitted = self._serve_guard.admit_in_order(
                        store.rebased_bytes_of(stream_rows, req.columns),
                        self._gathers.all_open_streams,
                        self.cfg.node_index,
                    )
                except NodeBusyError:
                    self.metrics.streams_refused.inc()
                    raise
            # Zero-copy slices, a window at a time (constants.SERVE_WINDOW_BYTES), each sent by
            # Flight's C++ writer and counted as served when the writer takes it.
            return flight.GeneratorStream(
                schema, self._served(windows(slices, window), admitted=admitted, generation=generation)
            )
        # A gathering stream holds a few batches of its own: none is started that would take the
        # node into its last memory margin (memory.ServeMemoryGuard; the reader retries). Counted
        # at their largest rows where rows differ in size and a filter may keep only the largest.
        filtered = matches is not None
        batch_bytes = store.served_bytes_bound(batch_rows, req.columns, batch_rows=batch_rows, filtered=filtered)
        # What the memory guard may count the stream at: its rows, or until they can be counted,
        # the shard's size, which bounds them.
        stream_rows = max(0, (min(held, shard_size(t.total, req)) if rows is None else rows) - t.skip)
        # The first stream of an epoch builds its order (tiny blocks on a big table: tens of MiB),
        # so the guard counts it for that one; the others share the build.
        # Claimed and admitted in one step: a stream that saw another's claim, and was admitted
        # without the order, would otherwise build it uncounted once that claim was refused.
        with self._admitting:
            builds_order = req.shuffle and claim_order_build(t.total, req)
            order_bytes = order_nbytes(t.total, req) if builds_order else 0
            try:
                admitted = self._serve_guard.admit(
                    batch_bytes,
                    self._gathers.open_streams,
                    self.cfg.node_index,
                    store.served_bytes_bound(stream_rows, req.columns, filtered=filtered),
                    order_bytes=order_bytes,
                )
            except NodeBusyError:
                if builds_order:
                    release_order_claim(t.total, req)
                self.metrics.streams_refused.inc()
                raise
        if matches is not None:
            parts = matched_rows(parts, matches)
        # Gathers (shuffled or filtered) are computed batch by batch, a few ahead of the writer
        # where they are small (constants.GATHER_AHEAD_BYTES).
        gathered = store.iter_rows(parts, batch_rows, req.columns)
        return flight.GeneratorStream(
            schema,
            self._served(
                gathered,
                gathering=True,
                # By the average batch: a worst case of 4 MiB left text with one long document no read-ahead.
                ahead=gather_ahead(int(batch_rows * row_bytes)),
                admitted=admitted,
                generation=generation,
            ),
        )

    def _served(
        self,
        batches: Iterator[pa.RecordBatch] | Iterator[pa.Table],
        gathering: bool = False,
        ahead: int = 0,
        admitted: tuple[float, int] | None = None,
        generation: str | None = None,
    ) -> Iterator[pa.RecordBatch] | Iterator[pa.Table]:
        """``batches`` (or windows of them) as Flight's writer pulls them: counted, and a failure
        named for the client.

        A stream of load ``generation`` ends as a stale ticket at its next batch once the node
        has taken a newer assignment (a restarted head): it would otherwise keep the replaced
        rows in memory beside the new load's until it ended, and the load's memory guard counts
        what is resident. The reader resumes after the rows it has, with a ticket from the head.

        A stream counts as open (GatherReclaim; as a gathering one for the memory guard) from its
        first batch until it ends;
        ``ahead`` batches are gathered ahead of the writer, in a Readahead thread started here,
        not in the handler: a client that went away before the stream began (a deadline, a
        cancel) never starts this generator, and a thread started in the handler was left
        gathering for ever, unseen by the memory guard.
        """
        source: Iterator[pa.RecordBatch] = batches
        sent = 0
        # Here, not before: a generator never started never runs its finally.
        self._gathers.opened(gathering)
        try:
            if ahead:
                source = Readahead(batches, ahead, "gather", count_in_progress=True)
            for batch in source:
                if generation is not None and self.generation != generation:
                    raise StaleTicketError(
                        f"stale ticket: data node {self.cfg.node_index} took load {self.generation} while this stream "
                        f"of load {generation} was open, after {sent} rows: ask the head for a new FlightInfo"
                    )
                self.metrics.rows_served.inc(batch.num_rows)
                self.metrics.bytes_served.inc(sent_nbytes(batch))
                sent += batch.num_rows
                yield batch
                # Flight has written it: let it go while the next one is awaited, which for a
                # gathering stream is while the next one is gathered.
                del batch
        except StaleTicketError as err:
            self.metrics.errors.labels(method="DoGet", action="", code="INVALID_ARGUMENT").inc()
            log.info("%s", err)
            raise InvalidArgument(str(err)) from None
        except Exception as err:
            # Raised here, Python's error would reach the client as its whole traceback with no
            # status; this says which node failed and where, and the node's log has the rest.
            self.metrics.errors.labels(method="DoGet", action="", code="INTERNAL").inc()
            log.exception("DoGet failed after %d rows of its stream", sent)
            raise flight.FlightInternalError(
                f"data node {self.cfg.node_index} failed after {sent} rows of the stream: {type(err).__name__}: {err}"
            ) from None
        finally:  # the client went away mid-stream: stop the source (a Readahead gathering ahead)
            try:
                close = getattr(source, "close", None)
                if close is not None:
                    close()
            finally:
                self._gathers.closed(gathering)
                self._serve_guard.release(admitted)  # ServeMemoryGuard.admit's entry, if any
