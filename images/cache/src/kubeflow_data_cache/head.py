"""The head: waits for its data nodes, plans the table, assigns rows, answers GetFlightInfo."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from kubeflow_data_cache import protocol
from kubeflow_data_cache.config import NodeConfig, dialable
from kubeflow_data_cache.constants import (
    CACHED_FILTER_COUNTS,
    COUNT_TIMEOUT_SECONDS,
    LOAD_POLL_SECONDS,
    LOAD_UNREACHABLE_SECONDS,
    REGISTER_PROBE_SECONDS,
    RPC_TIMEOUT_SECONDS,
    SUPERVISE_POLL_SECONDS,
)
from kubeflow_data_cache.daemon_call import DaemonCall
from kubeflow_data_cache.errors import (
    BadRequestError,
    ClusterFormationError,
    DataCacheError,
    NotReadyError,
    first_line,
    server_message,
    shown,
)
from kubeflow_data_cache.load_progress import load_totals, waiting_reads
from kubeflow_data_cache.memory import check_fits, local_load_threads, under_local
from kubeflow_data_cache.node import server_kwargs
from kubeflow_data_cache.plan import (
    TablePlan,
    assign_rows,
    estimated_node_memory,
    open_table,
    plan_table,
)
from kubeflow_data_cache.s3_settings import s3_properties_from_env
from kubeflow_data_cache.security import TLS_SCHEME, RefusalWarnings, call_options, caller, is_tls, key_matches
from kubeflow_data_cache.service import (
    DEGRADED,
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
from kubeflow_data_cache.sharding import endpoint_rows

log = logging.getLogger(__name__)


# The states the head's /status gives a data node (``nodes[].state``): a node's own (its Lifecycle's,
# which is never degraded), or the head's word for one it has not heard from. Each is a series of
# data_cache_data_nodes, always.
NODE_STATES = ("unregistered", "unreachable", WAITING, LOADING, READY, FAILED, STOPPING)


def _unreachable_status(err: BaseException) -> dict[str, Any]:
    """A data node's entry in the head's status while the head cannot reach it."""
    return {"state": "unreachable", "error": first_line(err), "rows": 0, "bytes": 0}


def _state_and_error(status: dict[str, Any]) -> str:
    """'loading', or 'unreachable: <why>': a node's last status, for a message."""
    return status.get("state", "unknown") + (f": {status['error']}" if status.get("error") else "")


def summed_figures(statuses: Iterable[dict]) -> dict[str, dict[str, Any]]:
    """The data nodes' per-column figures (their status: the table's; their ``count`` answers: a
    filter's matches') as one, by FlightInfo's app_metadata keys: the nulls of each column that
    has any, summed; and the fewest and most values of each list column, or of each level of a
    list of lists, kept only where they differ (what a reader that stacks tensors refuses)."""
    nulls: dict[str, int] = {}
    lists: dict[str, list[int]] = {}
    inner: dict[str, list[list[int] | None]] = {}
    for s in statuses:
        for name, n in (s.get(protocol.INFO_NULL_COUNTS) or {}).items():
            nulls[name] = nulls.get(name, 0) + n
        for name, (low, high) in (s.get(protocol.INFO_LIST_LENGTHS) or {}).items():
            lists[name] = protocol.widen(lists.get(name), low, high)
        for name, bounds in (s.get(protocol.INFO_INNER_LIST_LENGTHS) or {}).items():
            seen = inner.setdefault(name, [None] * len(bounds))
            for level, b in enumerate(bounds[: len(seen)]):
                if b is not None:
                    seen[level] = protocol.widen(seen[level], *b)
    return {
        protocol.INFO_NULL_COUNTS: {name: n for name, n in nulls.items() if n},
        protocol.INFO_LIST_LENGTHS: {name: b for name, b in lists.items() if b[0] != b[1]},
        protocol.INFO_INNER_LIST_LENGTHS: {
            name: levels for name, levels in inner.items() if any(b is not None and b[0] != b[1] for b in levels)
        },
    }


@dataclass(frozen=True)
class FilterCount:
    """What the head keeps of a filter's count (CACHED_FILTER_COUNTS of them): each data node's
    matches, and their figures summed over the nodes. The nodes' answers, kept whole, held each
    column's figures once per node: 300 filters over 2,000 columns with nulls took a head of two
    nodes from 137 to 264 MiB, and would have taken one of 16 nodes to about 1 GB."""

    rows: tuple[int, ...]
    figures: dict[str, dict[str, Any]]

    @classmethod
    def of(cls, answers: list[dict]) -> FilterCount:
        return cls(tuple(int(answer["rows"]) for answer in answers), summed_figures(answers))


class Head(ReadOnlyFlight):
    def __init__(self, cfg: NodeConfig, metrics: Metrics | None = None):
        self.metrics = metrics or Metrics("head", f"{cfg.schema_name}.{cfg.table_name}")
        super().__init__(**server_kwargs(cfg, self.metrics))
        self.cfg = cfg
        self.lifecycle = Lifecycle()
        self.location = cfg.location(self.port)
        self.registered: dict[int, dict[str, Any]] = {}
        self._planning = False  # while the head plans the scan (the nodes may register meanwhile)
        self.node_status: dict[int, dict[str, Any]] = {}
        # What the nodes hold now, as /status sums it (a node gone or reloading holds nothing).
        self.metrics.follow(self.lifecycle, lambda: self._held("rows"), lambda: self._held("bytes"))
        self.metrics.follow_load(self._load_progress)
        self.metrics.follow_data_nodes(self._node_states, NODE_STATES)
        # Registrations refused for their cluster key: warned of once a spell, with the caller.
        self._key_refusals = RefusalWarnings(log)
        self.plan: TablePlan | None = None
        self.snapshot_id: int | None = None  # the planned snapshot's, once planned
        self.assignments = []
        self.generation = uuid.uuid4().hex[:12]
        self.load_seconds = 0.0
        self.plan_seconds = 0.0
        self._filter_counts: OrderedDict[str, FilterCount] = OrderedDict()  # LRU, CACHED_FILTER_COUNTS
        self._counting: dict[str, Future] = {}  # predicates being counted now (_filter_count)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # Set by every registration (nodes re-register when their load ends): wakes the waits below.
        self._nodes_changed = threading.Event()
        # Set by a registration that is news once serving (a restarted node, one back with its
        # rows, one that moved): supervision looks at once instead of at its next poll.
        self._supervise_now = threading.Event()
        self._clients: dict[str, flight.FlightClient] = {}
        # When each node that restarted was sent its rows again, until it holds them: a reload
        # gets the startup deadline, as the first load does.
        self._reloads: dict[int, float] = {}
        self._reload_errors: dict[int, str] = {}  # why the last send of its rows failed
        # Since when each node has not held its rows, once serving, with no reload under way
        # (unreachable, frozen, stopping): the startup deadline again, then the head fails.
        self._lost_since: dict[int, float] = {}
        meter_calls(self, self.metrics)

    # --- internal calls to data nodes --------------------------------------------------------
    def _call(
        self, location: str, action: str, body: dict | None = None, timeout: float = RPC_TIMEOUT_SECONDS
    ) -> dict[str, Any]:
        with self._lock:
            client = self._clients.get(location)
            if client is None:
                client = self._clients[location] = self.cfg.tls.client_for(location)
        payload = json.dumps(body or {}).encode()
        results = list(client.do_action(flight.Action(action, payload), call_options(self.cfg.token, timeout)))
        return json.loads(results[0].body.to_pybytes()) if results else {}

    def _location(self, node: int) -> str:
        return self.registered[node]["location"]

    def _send_load(self, node: int) -> None:
        a = self.assignments[node]
        self._call(
            self._location(node),
            protocol.ACTION_LOAD,
            {
                "generation": self.generation,
                "metadata_location": self.plan.metadata_location,
                "snapshot_id": self.plan.snapshot_id,
                "global_start": a.global_start,
                "global_stop": a.global_stop,
                # The whole table's rows: a node refuses tickets placed in a larger row space,
                # which no head issues (a hand-made one sized the node's shuffle order at will).
                "table_rows": max(b.global_stop for b in self.assignments),
                "pieces": [p.to_dict() for p in a.pieces],
                # JSON keys are strings: the field ids as text.
                "expansions": {str(k): v for k, v in self.plan.expansions.items()},
                **protocol.cluster_key_field(self.cfg.cluster_key),
            },
        )

    def _send_load_or_explain(self, node: int) -> None:
        """Send a node its assignment. One that registered but does not answer where it said is
        tried for LOAD_UNREACHABLE_SECONDS, at its latest location: it may have crashed and come
        back elsewhere (its replacement registers again). Past that, its advertised address is the
        likelier cause."""
        unreachable_since, delay, warned = time.monotonic(), 0.5, False
        while True:
            location = self._location(node)
            try:
                self._send_load(node)
                return
            except pa.ArrowInvalid as err:  # the node refused its assignment: say why, not a traceback
                raise ClusterFormationError(
                    f"data node {node} at {location} refused its assignment: {server_message(err)}"
                ) from None
            except flight.FlightUnauthenticatedError:
                # A node that takes no token accepts any: this head has none, or another one.
                sent = "this head has none" if self.cfg.token is None else "this head's is another one"
                raise ClusterFormationError(
                    f"data node {node} at {location} refused the head's token ({sent}): give the head "
                    "and every data node the same DATA_CACHE_TOKEN (or DATA_CACHE_TOKEN_FILE)"
                ) from None
            except flight.FlightUnavailableError as err:
                if self._stop.is_set():
                    raise
                waited = time.monotonic() - unreachable_since
                if not warned:  # said once in the log
                    log.warning("data node %d at %s does not answer (%s); retrying", node, location, first_line(err))
                    warned = True
                # Said while it lasts (/ready, /status), as the load's own polls say it.
                self.node_status[node] = _unreachable_status(err)
                self.lifecycle.set(
                    LOADING,
                    f"sending data node {node} its rows: {location} has not answered for {waited:.0f}s "
                    f"({first_line(err)}); trying for up to {LOAD_UNREACHABLE_SECONDS:.0f}s",
                )
                if waited >= LOAD_UNREACHABLE_SECONDS:
                    raise ClusterFormationError(
                        f"data node {node} registered at {location} but has not answered there for "
                        f"{LOAD_UNREACHABLE_SECONDS:.0f}s ({first_line(err)}): the address it advertises (POD_IP, "
                        "or --advertise-host) must be reachable from the head, or the node stopped and did not "
                        "come back (check that pod)"
                    ) from None
                self._wait_for_news(delay)  # woken by a registration: perhaps its new location
                delay = min(delay * 2, 4.0)
            except flight.FlightTimedOutError:
                # Connected, and no answer: not a wrong address but a node that is frozen (a
                # stopped process, a hung pod) or far too busy. Retrying would not unfreeze it.
                raise ClusterFormationError(
                    f"data node {node} at {location} did not answer its assignment within "
                    f"{RPC_TIMEOUT_SECONDS:.0f}s: it is frozen or overloaded; check that pod (its log, its CPU)"
                ) from None

    # --- formation and load ------------------------------------------------------------------
    def start(self) -> None:
        # Imported before the clock starts, as on the nodes.
        import pyiceberg.io.pyarrow
        import pyiceberg.table  # noqa: F401

        threading.Thread(target=self._run, name="formation", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self._nodes_changed.set()
        self._supervise_now.set()
        self.shutdown()

    def _run(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout
        try:
            # Plan while the data nodes start: a bad METADATA_LOC fails at once, and planning
            # overlaps the pods' start-up instead of following it.
            # Still forming (waiting) until every node registered, so the state never goes back
            # from loading to waiting; the detail says both what the head does and who is missing.
            planning = time.monotonic()
            self._planning = True
            self.lifecycle.set(WAITING, self._forming_detail())
            plan = self._by_deadline(deadline, self._plan, "planning the table scan")
            self._planning = False
            self.lifecycle.waiting_detail(self._forming_detail())  # planned: no longer "planning"
            self.plan_seconds = time.monotonic() - planning
            # Said from now on, the fit check's failure included (self.plan waits for the loads).
            self.snapshot_id = plan.snapshot_id
            self._wait_for_nodes(deadline)
            started = time.monotonic()
            assignments = assign_rows(plan, self.cfg.data_nodes)
            memory = [  # (loaded, peak) per node
                estimated_node_memory(plan, a, self.registered[a.node].get("load_threads", 1)) for a in assignments
            ]
            threads = max(self.registered[k].get("load_threads", 1) for k in range(self.cfg.data_nodes))

            def threads_for(nodes: int) -> int:
                # A pod keeps its CPUs whatever the group's size, as local's nodes keep a LOAD_THREADS
                # local was given (it hands it to every node); else local's nodes share this machine's.
                return local_load_threads(nodes) if under_local() and not os.environ.get("LOAD_THREADS") else threads

            check_fits(
                [loaded for loaded, _ in memory],
                [peak for _, peak in memory],
                [self.registered[k].get("memory_limit") for k in range(self.cfg.data_nodes)],
                peaks_for=lambda n: [estimated_node_memory(plan, a, threads_for(n))[1] for a in assign_rows(plan, n)],
            )
            self.plan, self.assignments = plan, assignments
            # Said once, as the load starts: a pod's log showed nothing more until ready or failed.
            log.info(
                "loading snapshot %s: %d rows in %d data file(s), about %.1f MiB in memory, on %d data node(s)",
                plan.snapshot_id,
                plan.rows,
                len(plan.files),
                plan.estimated_bytes / 2**20,
                self.cfg.data_nodes,
            )
            self.lifecycle.set(LOADING, f"sending {self.cfg.data_nodes} data node(s) their rows")
            for node in range(self.cfg.data_nodes):
                self._send_load_or_explain(node)
            self._wait_for_loads(deadline)
        except Exception as err:
            if self._stop.is_set():  # stopped before ready (Ctrl-C, SIGTERM): not a load failure
                log.info("stopped before the cache was ready")
                return
            self.lifecycle.fail(str(err) if isinstance(err, DataCacheError) else f"{type(err).__name__}: {err}")
            return
        # Planning to ready, without the wait for pods to register.
        self.load_seconds = self.plan_seconds + time.monotonic() - started
        rows = self._held("rows")
        self.metrics.load_seconds.set(self.load_seconds)
        self.lifecycle.set(READY, f"{rows} rows on {self.cfg.data_nodes} data node(s)")
        log.info("cache ready: %d rows on %d data node(s) in %.2fs", rows, self.cfg.data_nodes, self.load_seconds)
        self._supervise()

    def _held(self, key: str) -> int:
        """Rows or bytes the data nodes hold, by their latest status (a copy: the supervising
        thread replaces entries while a scrape reads them)."""
        return sum(s.get(key, 0) for s in list(self.node_status.values()))

    def _load_progress(self) -> tuple[int, int, float]:
        """What the nodes loading read so far, summed, and the longest any of their oldest
        reads has waited, by their latest status (as /ready's detail says it)."""
        return load_totals(s["loading"] for s in list(self.node_status.values()) if s.get("loading"))

    def _node_states(self) -> list[str]:
        """Each data node's state, as /status gives it."""
        return [self._node_state(k) for k in range(self.cfg.data_nodes)]

    def _node_state(self, node: int) -> str:
        default = "unregistered" if node not in self.registered else WAITING
        return self.node_status.get(node, {}).get("state", default)

    def _plan(self):
        table = open_table(self.cfg.metadata_loc, s3_properties_from_env())
        return plan_table(table, self.cfg.metadata_loc)[0]

    def _by_deadline(self, deadline: float, work: Callable[[], Any], what: str) -> Any:
        """``work()`` in a daemon thread, given up at ``deadline`` (or on stop).

        A filesystem call can block for ever (an object store endpoint that never answers, a
        scheme whose client waits on a metadata server); it cannot be cancelled, so the thread is
        left behind and the head fails, which ends the process."""
        call = DaemonCall(work, what)
        while not call.done and not self._stop.is_set() and time.monotonic() < deadline:
            call.wait(min(0.2, deadline - time.monotonic()))
        if not call.done:
            if self._stop.is_set():
                raise ClusterFormationError("stopped")
            raise DataCacheError(
                f"{what} did not finish within {self.cfg.startup_timeout:g}s (METADATA_LOC "
                f"{self.cfg.metadata_loc!r}): its storage does not answer; check the location's scheme "
                "(s3://, s3a://, file:// or a path), the endpoint and the network"
            )
        return call.result()

    def _wait_for_nodes(self, deadline: float) -> None:
        want = self.cfg.data_nodes
        while len(self.registered) < want:
            if self._stop.is_set():
                raise ClusterFormationError("stopped")
            missing = self._unregistered()
            if time.monotonic() > deadline:
                raise ClusterFormationError(
                    f"only {len(self.registered)}/{want} data node(s) registered within "
                    f"{self.cfg.startup_timeout:.0f}s ({missing}); check those data node pods' logs"
                )
            self.lifecycle.set(WAITING, self._forming_detail(missing))
            self._wait_for_news()

    def _forming_detail(self, missing: str | None = None) -> str:
        """/ready's reason while the cluster forms: the plan under way, if it is, and the
        nodes registered so far."""
        want = self.cfg.data_nodes
        count = f"{len(self.registered)}/{want} data nodes registered"
        if len(self.registered) < want:
            count += f" ({missing or self._unregistered()})"
        return f"planning the table scan; {count}" if self._planning else count

    def _unregistered(self) -> str:
        """'data node 3 not registered', or the first few indexes of many (LWS worker index - 1)."""
        missing = [k for k in range(self.cfg.data_nodes) if k not in self.registered]
        shown = ", ".join(map(str, missing[:8])) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        return f"data node{'s' if len(missing) > 1 else ''} {shown} not registered"

    def _wait_for_news(self, seconds: float = LOAD_POLL_SECONDS) -> None:
        """Until a node registers or reports its load done, or ``seconds`` pass (the poll stays
        the fallback: a lost registration costs a poll interval, not the load)."""
        self._nodes_changed.wait(seconds)
        self._nodes_changed.clear()

    def _poll_nodes(self) -> None:
        def one(node: int) -> tuple[int, dict[str, Any]]:
            try:
                return node, self._call(self._location(node), protocol.ACTION_STATUS)
            except Exception as err:
                return node, _unreachable_status(err)

        with ThreadPoolExecutor(max_workers=min(16, self.cfg.data_nodes)) as pool:
            for node, status in pool.map(one, range(self.cfg.data_nodes)):
                self.node_status[node] = status

    def _wait_for_loads(self, deadline: float) -> None:
        while True:
            if self._stop.is_set():  # a stopped head must not keep re-sending assignments
                raise ClusterFormationError("stopped")
            self._poll_nodes()
            failed = [(k, s) for k, s in self.node_status.items() if s.get("state") == FAILED]
            if failed:
                k, s = failed[0]
                raise DataCacheError(f"data node {k} ({self._location(k)}) failed to load: {s.get('error')}")
            ready = sum(1 for s in self.node_status.values() if s.get("state") == READY)
            # Rows held by ready nodes, and read so far by loading ones.
            rows = sum(s.get("rows", 0) + (s.get("loading") or {}).get("rows", 0) for s in self.node_status.values())
            counts = f"{ready}/{self.cfg.data_nodes} data nodes ready"
            lost, nodes = self._unreachable(), sorted(self.node_status.items())
            self.lifecycle.set(
                LOADING, "; ".join(filter(None, [f"{counts}, {rows} rows loaded", lost, waiting_reads(nodes)]))
            )
            if ready == self.cfg.data_nodes and all(
                s.get("generation") == self.generation for s in self.node_status.values()
            ):
                return
            self._reload_restarted()  # a node that restarted mid-load starts over, not never
            if time.monotonic() > deadline:
                # At the deadline, any read still in flight is worth naming, however young.
                why = "; ".join(filter(None, [counts, lost, waiting_reads(nodes, at_least=0)]))
                raise DataCacheError(f"the load did not finish within {self.cfg.startup_timeout:.0f}s ({why})")
            self._wait_for_news()

    def _reload_restarted(self) -> None:
        """Re-send the assignment to any data node that restarted and lost its rows."""
        lost = [
            k
            for k, s in self.node_status.items()
            if s.get("state") not in ("unreachable", FAILED) and s.get("generation") != self.generation
        ]
        for node in lost:
            # Said once per restart, and a refusal once until it changes: the head tries again
            # every poll (5 s) until the reload deadline, which logged both lines each time.
            if node not in self._reloads:
                log.warning("data node %d restarted; sending its assignment again", node)
            # From the first try: a node that refuses its rows every time is as stuck as one
            # whose reload hangs.
            self._reloads.setdefault(node, time.monotonic())
            try:
                self._send_load(node)
                self._reload_errors.pop(node, None)
            except Exception as err:
                if self._reload_errors.get(node) != first_line(err):
                    log.warning("could not reload data node %d: %s", node, err)
                self._reload_errors[node] = first_line(err)

    def _describe_nodes(self, which: Callable[[dict[str, Any]], bool]) -> str:
        """'data node 1 (grpc://...) unreachable: <why>; ...' for each node whose last status ``which`` picks."""
        return "; ".join(
            f"data node {k} ({self._location(k)}) {s.get('state')}" + (f": {s['error']}" if s.get("error") else "")
            for k, s in sorted(self.node_status.items())
            if which(s)
        )

    def _unreachable(self) -> str:
        return self._describe_nodes(lambda s: s.get("state") == "unreachable")

    def _supervise(self) -> None:
        """Keep the nodes loaded; while one is not (down, restarted, reloading, failed), the head
        is DEGRADED: /ready answers 503 and GetFlightInfo UNAVAILABLE naming the node, so clients
        retry instead of reading endpoints that cannot answer."""
        while True:
            # A restarted node was sent its rows up to a poll after it registered, and the head
            # turned ready again up to a poll after the node reported them loaded: ~10 s degraded
            # beyond the reload itself, every reader retrying meanwhile.
            self._supervise_now.wait(SUPERVISE_POLL_SECONDS)
            self._supervise_now.clear()
            if self._stop.is_set():
                return
            try:
                self._poll_nodes()
                self._reload_restarted()
                late = self._late_reload() or self._lost_too_long()  # first: it forgets reloaded nodes' errors
                self._update_health()
            except Exception:  # one bad round must not end supervision, leaving READY unwatched
                log.exception("supervising the data nodes failed; trying again in %gs", SUPERVISE_POLL_SECONDS)
                continue
            if late:
                # Serving again needs every node's rows; a reload stuck past the deadline (storage
                # that stopped answering), or a node that stays unreachable (its process frozen,
                # its Flight calls hung while /live still answers), would keep the cache degraded
                # for good. Failing exits the head, so the LeaderWorkerSet recreates the group and
                # it loads afresh.
                self.lifecycle.fail(late)
                return

    def _late_reload(self) -> str:
        """Why the cache failed, where a node sent its rows again failed to load them, or was
        sent them longer ago than the startup deadline and does not hold them yet; '' otherwise."""
        now = time.monotonic()
        for node, sent in sorted(self._reloads.items()):
            status = self.node_status.get(node, {})
            if self._holds_rows(status):
                del self._reloads[node]
                self._reload_errors.pop(node, None)
            elif status.get("state") == FAILED:
                # Final, as in the first load: the node exits, and its reason with it. Waiting out
                # the deadline ended in "unreachable: Connection refused", the cause lost.
                return f"data node {node} ({self._location(node)}) failed to load its rows again: {status.get('error')}"
            elif now - sent > self.cfg.startup_timeout:
                state = _state_and_error(status)
                refused = self._reload_errors.get(node)
                return "; ".join(
                    filter(
                        None,
                        [
                            f"data node {node} ({self._location(node)}) restarted and did not hold its rows again "
                            f"within {self.cfg.startup_timeout:.0f}s of being sent them ({state})",
                            f"sending them last failed: {refused}" if refused else "",
                            waiting_reads([(node, status)], at_least=0),
                        ],
                    )
                )
        return ""

    def _holds_rows(self, status: dict[str, Any]) -> bool:
        """Whether a node's last status says it serves this load's rows."""
        return status.get("state") == READY and status.get("generation") == self.generation

    def _lost_too_long(self) -> str:
        """Why the cache failed, where a data node has not held its rows for longer than the
        startup deadline while no reload of it is under way (a reload has its own deadline,
        `_late_reload`); '' otherwise."""
        now = time.monotonic()
        for node, status in sorted(self.node_status.items()):
            if node in self._reloads or (self._holds_rows(status)):
                self._lost_since.pop(node, None)
                continue
            if now - self._lost_since.setdefault(node, now) > self.cfg.startup_timeout:
                state = _state_and_error(status)
                return (
                    f"data node {node} ({self._location(node)}) has not served its rows for "
                    f"{self.cfg.startup_timeout:.0f}s ({state}); the head exits so that the group is "
                    "recreated and loads afresh"
                )
        return ""

    def _update_health(self) -> None:
        why = self._describe_nodes(lambda s: not self._holds_rows(s))
        # A node that refuses its rows (started with another METADATA_LOC) reads as "waiting":
        # what it answered is the reason, and /ready showed it nowhere until the reload deadline.
        unsent = "; ".join(
            f"sending data node {k} its rows failed: {e}" for k, e in sorted(self._reload_errors.items())
        )
        why = "; ".join(filter(None, [why, unsent]))
        if why:
            if self.lifecycle.state == READY:
                log.warning("not serving until every data node holds its rows again: %s", why)
            self.lifecycle.set(DEGRADED, f"{why}; serving again once it is back and reloaded")
        elif self.lifecycle.state == DEGRADED:
            log.info("every data node holds its rows again; serving")
            self.lifecycle.set(
                READY, f"{sum(a.rows for a in self.assignments)} rows on {self.cfg.data_nodes} data node(s)"
            )

    # --- Flight ------------------------------------------------------------------------------
    def _request(self, descriptor: flight.FlightDescriptor) -> protocol.ShardRequest:
        if descriptor.descriptor_type == flight.DescriptorType.PATH:
            return protocol.ShardRequest.from_path(descriptor.path)
        if descriptor.descriptor_type == flight.DescriptorType.CMD:
            return protocol.ShardRequest.from_json(descriptor.command)
        raise BadRequestError("the descriptor should be a PATH [shard_index, shard_count] or a JSON CMD")

    def _projected_schema(self, columns) -> pa.Schema:
        schema = self.plan.schema
        if columns is None:
            return schema
        names = set(schema.names)  # a new list on each access: asked per column, wide tables took seconds
        unknown = [c for c in columns if c not in names]
        if unknown:
            raise BadRequestError(f"unknown column(s) {shown(unknown)}; the table has {schema.names}")
        return pa.schema([schema.field(c) for c in columns])

    def _node_rows(self, predicate: str | None) -> list[int]:
        """Rows per data node in the request's virtual space (all rows, or the filter's matches)."""
        if predicate is None:
            return [a.rows for a in self.assignments]
        return list(self._filter_count(predicate).rows)

    def _filter_count(self, predicate: str) -> FilterCount:
        """The data nodes' ``count`` answers for ``predicate``: each node's matches, and their
        nulls and list lengths per column (NodeStore.figures_of) summed over the nodes."""
        with self._lock:
            cached = self._filter_counts.get(predicate)
            if cached is not None:
                self._filter_counts.move_to_end(predicate)
                return cached
            # One count per predicate at a time: every rank asks for a new filter at the start of
            # an epoch, and each miss sent its own count to every node (24 at once took a node
            # 250 MiB past its memory limit). The others wait for that one's answer or its error.
            pending = self._counting.get(predicate)
            counting = pending is None
            if counting:
                pending = self._counting[predicate] = Future()
        if not counting:
            try:
                return pending.result(timeout=COUNT_TIMEOUT_SECONDS)
            except FutureTimeout:
                raise NotReadyError(
                    f"the data nodes are still counting filter {shown(predicate)}'s rows; retry shortly"
                ) from None
        try:
            answers = FilterCount.of(self._count_on_nodes(predicate))
        except BaseException as err:
            with self._lock:
                del self._counting[predicate]
            pending.set_exception(err)
            raise
        with self._lock:
            del self._counting[predicate]
            self._filter_counts[predicate] = answers
            while len(self._filter_counts) > CACHED_FILTER_COUNTS:
                self._filter_counts.popitem(last=False)
        pending.set_result(answers)
        return answers

    def _count_on_nodes(self, predicate: str) -> list[dict]:
        """Ask every data node to count ``predicate``'s rows, in parallel; their answers."""

        def count(node: int) -> dict:
            location = self._location(node)
            try:
                # With the cluster key, as `load`: a node counts only for its head (node.py).
                body = {
                    "filter": predicate,
                    **protocol.cluster_key_field(self.cfg.cluster_key),
                }
                answer = self._call(location, protocol.ACTION_COUNT, body, COUNT_TIMEOUT_SECONDS)
                int(answer["rows"])  # a node that answers without a count fails here, not later
                return answer
            except pa.ArrowInvalid as err:  # the data node's message says what is wrong with the filter
                raise BadRequestError(server_message(err)) from None
            except (flight.FlightUnavailableError, flight.FlightTimedOutError) as err:
                # Frozen, gone or restarting: the supervisor will know soon; the reader retries.
                raise NotReadyError(
                    f"data node {node} ({location}) did not count the filter's rows: {first_line(err)}; retry shortly"
                ) from None
            except flight.FlightError as err:
                raise DataCacheError(
                    f"data node {node} ({location}) failed to count the filter's rows: {first_line(err)}"
                ) from None

        with ThreadPoolExecutor(max_workers=min(16, self.cfg.data_nodes)) as pool:
            return list(pool.map(count, range(self.cfg.data_nodes)))

    def _ready(self) -> None:
        if self.lifecycle.state != READY:
            self.lifecycle.require_ready()
        if self.plan is None:
            raise NotReadyError("the cache has no plan yet")

    def get_flight_info(self, context, descriptor):
        req = self._request(descriptor)
        self._ready()
        schema = self._projected_schema(req.columns)
        counts = self._node_rows(req.filter)
        offsets = [0]
        for n in counts:
            offsets.append(offsets[-1] + n)
        total = offsets[-1]
        endpoints = []
        per_node = endpoint_rows(offsets, total, req)
        for node, streamed in enumerate(per_node):
            if streamed:
                order = protocol.ORDER_VERSION if req.shuffle else None
                ticket = protocol.Ticket(
                    self.generation, node, offsets[node], counts[node], total, req, rows=streamed, order=order
                )
                endpoints.append(flight.FlightEndpoint(ticket.to_json(self.cfg.cluster_key), [self._location(node)]))
        rows = sum(per_node)
        # What readers that stack columns into tensors must refuse before their first batch.
        summed = (
            summed_figures(self.node_status.values()) if req.filter is None else self._filter_count(req.filter).figures
        )
        names = set(schema.names)
        figures: dict[str, Any] = {
            key: {name: value for name, value in by_column.items() if name in names}
            for key, by_column in summed.items()
        }
        figures = {key: value for key, value in figures.items() if value}
        # Always, 0 included: no matching row is what a reader most needs to be told.
        figures[protocol.INFO_MATCHING_ROWS] = total
        figures[protocol.INFO_SNAPSHOT_ID] = self.snapshot_id
        metadata = json.dumps(figures).encode()
        return flight.FlightInfo(
            schema, descriptor, endpoints, rows, round(rows * self._row_bytes(schema)), app_metadata=metadata
        )

    def _row_bytes(self, schema: pa.Schema) -> float:
        col_bytes: dict[str, int] = {}  # the nodes' column sizes, summed
        for s in self.node_status.values():
            for name, n in (s.get("column_bytes") or {}).items():
                col_bytes[name] = col_bytes.get(name, 0) + n
        rows = max(1, sum(a.rows for a in self.assignments))
        return sum(col_bytes.get(name, 0) for name in schema.names) / rows

    def get_schema(self, context, descriptor):
        req = self._request(descriptor)
        self._ready()
        schema = self._projected_schema(req.columns)
        # The schema does not depend on the filter, but a request GetFlightInfo would refuse is
        # refused here too: the nodes judge it (and keep its counts for the GetFlightInfo to come).
        self._node_rows(req.filter)
        return flight.SchemaResult(schema)

    def list_flights(self, context, criteria):
        # Not a generator: errors must rise here, inside the status mapping, not while streaming.
        self._ready()
        descriptor = flight.FlightDescriptor.for_path("0", "1")
        # The class's method, not the instance's metered wrapper: one call counted and timed once.
        return iter([Head.get_flight_info(self, context, descriptor)])

    def do_get(self, context, ticket):
        raise NotImplementedError(
            "DoGet goes to a data node: send each ticket of GetFlightInfo's endpoints to that endpoint's location"
        )

    def do_action(self, context, action):
        if action.type == protocol.ACTION_STATUS:
            return [json.dumps(self.status()).encode()]
        if action.type == protocol.ACTION_REGISTER:
            self._register(parse_action_body(action), caller(context))
            return [b"{}"]
        raise NotImplementedError(f"action {shown(action.type)} is not implemented; try 'status'")

    def list_actions(self, context):
        return [(protocol.ACTION_STATUS, "JSON status of the cache: load state, rows, bytes, per-node detail")]

    def _register(self, body: dict[str, Any], peer: str = "") -> None:
        if not key_matches(self.cfg.cluster_key, body.get(protocol.CLUSTER_KEY_FIELD)):
            # Who registers decides where readers are sent: only a node holding our key may.
            self._key_refusals.refused(
                f"refused a data node registration without this head's cluster key (index {body.get('index')!r:.40})",
                peer,
            )
            raise BadRequestError(
                "register: the cluster key is missing or wrong: give the head and every data node the same "
                "DATA_CACHE_CLUSTER_KEY"
            )
        index, location = body.get("index"), body.get("location")
        # Checked here, not coerced: a location of null or 5 was kept as "None" or "5", and the
        # load then failed as "data node 0 refused its assignment" when the head dialed it.
        if type(index) is not int or not isinstance(location, str) or not dialable(location):
            raise BadRequestError(
                "register needs 'index' (an integer) and 'location' (a grpc:// or grpc+tls:// URI with a host and "
                f"a port), got index {index!r} and location {location!r}"
            )
        if is_tls(location) != (self.cfg.scheme == TLS_SCHEME):
            # The head's load (with the token and cluster key) and every reader's DoGet would go
            # to this location: a plain one beside a TLS head would send them, and the rows, in clear.
            ours = "serves TLS (grpc+tls://)" if self.cfg.scheme == TLS_SCHEME else "serves plain grpc://"
            raise BadRequestError(
                f"register: this head {ours} and data node {index} registered at {location!r}: every pod of "
                "a cache serves TLS or none does; give them all the same TLS Secret (DATA_CACHE_TLS_DIR) and "
                "restart the ones started without it"
            )
        if not 0 <= index < self.cfg.data_nodes:
            raise BadRequestError(
                f"data node index {index} is out of range [0, {self.cfg.data_nodes}): this head expects "
                f"{self.cfg.data_nodes} data node(s)"
            )
        memory_limit, load_threads = body.get("memory_limit"), body.get("load_threads", 1)
        if memory_limit is not None and (type(memory_limit) is not int or memory_limit < 0):
            raise BadRequestError(f"register: 'memory_limit' should be a byte count or null, got {memory_limit!r}")
        if type(load_threads) is not int or load_threads < 1:
            raise BadRequestError(f"register: 'load_threads' should be an integer >= 1, got {load_threads!r}")
        previous = self.registered.get(index)
        if previous is not None and previous["location"] != location and self._answers_as(previous["location"], index):
            # Two data nodes with one index (a second worker started by hand, a stale pod) would
            # take the slot in turns, and readers would be sent to whichever registered last.
            log.warning(
                "refused data node %d at %s: the one registered at %s still answers as data node %d",
                index,
                location,
                previous["location"],
                index,
            )
            raise BadRequestError(
                f"data node index {index} is taken: the data node at {previous['location']} still answers as data "
                f"node {index} (two data nodes were started with the same index; this one is at {location})"
            )
        generation = body.get("generation")
        self.registered[index] = {
            "location": location,
            "memory_limit": memory_limit,
            "load_threads": load_threads,
            "generation": generation,
        }
        if (
            previous is not None
            and previous["location"] == location
            and (
                previous.get("generation") != generation
                or self.node_status.get(index, {}).get("state") == "unreachable"
            )
        ):
            # Back at its old address (a container restarted in place) with another load, or
            # after the head lost it: the channel to that address is still backing off from
            # the outage, and every call on it failed at once as "unreachable" until the backoff
            # ran out. The round this registration starts found the node so and skipped it,
            # and the node waited a heartbeat (5 s) to be sent its rows. A new channel dials now.
            with self._lock:
                self._clients.pop(location, None)
        self._nodes_changed.set()
        self.lifecycle.waiting_detail(self._forming_detail())  # while forming: one more registered
        # Heartbeats of a node the head knows serving its rows are not news (every node sends one
        # every REGISTER_INTERVAL_SECONDS: a round for each would poll every node N times as often).
        serving = self.node_status.get(index, {}).get("state") == READY and generation == self.generation
        if not serving or previous is None or previous["location"] != location:
            self._supervise_now.set()
        if previous is None:
            log.info("data node %d registered at %s", index, location)
        elif previous["location"] != location:
            log.warning(
                "data node %d moved from %s to %s (the old one no longer answers)",
                index,
                previous["location"],
                location,
            )
            with self._lock:
                self._clients.pop(previous["location"], None)

    def _answers_as(self, location: str, index: int) -> bool:
        """Whether the data node at ``location`` still answers, as data node ``index`` that stays."""
        try:
            status = self._call(location, protocol.ACTION_STATUS, timeout=REGISTER_PROBE_SECONDS)
        except Exception:  # gone, frozen or not a data node: the slot is free to take
            return False
        # One stopping (SIGTERM, its streams' grace) or failed (its failure grace) is on its way out:
        # its replacement, started meanwhile, takes the slot rather than failing for good.
        leaving = status.get("state") in (STOPPING, FAILED)
        return status.get("role") == "data-node" and status.get("index") == index and not leaving

    def status(self) -> dict[str, Any]:
        nodes = []
        for k in range(self.cfg.data_nodes):
            s = self.node_status.get(k, {})
            nodes.append(
                {
                    "index": k,
                    "location": self.registered.get(k, {}).get("location"),
                    "state": self._node_state(k),
                    "rows": s.get("rows", 0),
                    "bytes": s.get("bytes", 0),
                    "resident_bytes": s.get("resident_bytes"),
                    "memory_pool": s.get("memory_pool"),
                    "load_seconds": s.get("load_seconds"),
                    "error": s.get("error"),
                    "loading": s.get("loading"),
                }
            )
        return {
            "role": "head",
            # Which process answered: `data-cache local` tells its own head from another that
            # took its port meanwhile (a "ready" from there was printed as its own READY).
            "pid": os.getpid(),
            "table": f"{self.cfg.schema_name}.{self.cfg.table_name}",
            "metadata_location": self.cfg.metadata_loc,
            # Which snapshot that metadata's current one is: a METADATA_LOC that is not the table's
            # latest serves older data, and says so here (null: the table has none, or not planned yet).
            "snapshot_id": self.snapshot_id,
            "state": self.lifecycle.state,
            "detail": self.lifecycle.detail,
            "error": self.lifecycle.error,
            "rows": sum(n["rows"] for n in nodes),
            "bytes": sum(n["bytes"] for n in nodes),
            "plan_seconds": round(self.plan_seconds, 3),
            "load_seconds": round(self.load_seconds, 3),
            "nodes": nodes,
        }
