"""Resource budgets: the container's memory and CPU limits, resident size, the pre-load check,
the guard that stops a load before the kernel's OOM kill, and the one that holds back new
gathering streams near it."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from decimal import Decimal, localcontext
from pathlib import Path

import psutil

from kubeflow_data_cache.constants import (
    BASELINE_MEMORY_BYTES,
    BATCHWISE_MIN_GROUP_BYTES,
    BATCHWISE_MIN_GROUP_ROWS,
    MAX_DATA_NODES,
)
from kubeflow_data_cache.errors import ConfigError, MemoryBudgetError, NodeBusyError

log = logging.getLogger(__name__)

# Kubernetes quantity suffixes (case matters: `m` is a thousandth, `M` a million).
_UNITS = {
    "": 1,
    "k": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
    "P": 1000**5,
    "E": 1000**6,
    "Ki": 1024,
    "Mi": 1024**2,
    "Gi": 1024**3,
    "Ti": 1024**4,
    "Pi": 1024**5,
    "Ei": 1024**6,
}
_FRACTIONS = {"m": "a thousandth", "u": "a millionth", "n": "a billionth"}
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:([eE][+-]?[0-9]+)|([KMGTPE]i|[numkMGTPE]))?$")


def parse_bytes(text: str, name: str = "`MEMORY_LIMIT`") -> int:
    """A Kubernetes memory quantity in bytes: ``4Gi``, ``512Mi``, ``2G``, ``1e9``, ``1073741824``.

    As Kubernetes reads it (the container's limit reaches a pod as a byte count): ``m`` is a
    thousandth, so ``500m`` is half a byte and refused, not 500 MB; ``4gi`` or ``2GB`` are not
    quantities at all.
    """
    raw = str(text).strip()
    match = _QUANTITY.match(raw)
    if not match:
        raise ConfigError(
            f"{name} should be a byte count or a Kubernetes quantity such as 4Gi, 512Mi or 2G "
            f"(suffixes are case-sensitive, with no B), got {text!r}"
        )
    number, exponent, suffix = match.groups()
    if suffix in ("n", "u", "m"):
        raise ConfigError(
            f"{name} {text!r} is a fraction of a byte ({suffix} means {_FRACTIONS[suffix]}): "
            f"write {number}Mi or {number}M"
        )
    # Exact (a float turned 1.5 into 1 byte and lost digits of large counts), and rounded up as
    # Kubernetes rounds a quantity with a fraction of a byte: 1.5 is 2 bytes.
    with localcontext() as exact:
        exact.prec = 100  # the default 28 digits rounded 1.0000000000000000000000000001 to 1
        amount = Decimal(number + exponent) if exponent else Decimal(number) * _UNITS[suffix or ""]
        # 0 means "no limit given" (the cgroup limit applies); less than a byte is a typo, not that.
        if 0 < amount < 1:
            raise ConfigError(f"{name} {text!r} is less than one byte: give a size such as 4Gi or 512Mi")
        value = math.ceil(amount)
    if value >= 1 << 63:
        raise ConfigError(f"{name} {text!r} is too large to be a memory size")
    return value


def container_memory_limit() -> int | None:
    """The cgroup (v2 or v1) memory limit, or None when unlimited or not in a container."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = Path(path).read_text().strip()
        except OSError:
            continue
        if raw == "max":
            return None
        limit = int(raw)
        # cgroup v1 reports "unlimited" as a huge page-aligned number.
        return limit if limit < (1 << 60) else None
    return None


def available_cpus() -> int:
    """CPUs this process may use: the cgroup v2 quota when set (a pod's CPU limit), else its affinity."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            return max(1, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return len(os.sched_getaffinity(0))


def resident_bytes() -> int:
    return psutil.Process().memory_info().rss


def usable_bytes(budget: int | None) -> int | None:
    return None if budget is None else max(budget - BASELINE_MEMORY_BYTES, 0)


def _fmt(n: float) -> str:
    # Small budgets (a laptop's `local`) would all read "0.00 GiB".
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


# Set by `data-cache local` in its nodes' env: the refusal then names its flags, not the pod's knobs.
LOCAL_ENV = "DATA_CACHE_LOCAL"


def under_local() -> bool:
    return os.environ.get(LOCAL_ENV) == "1"


def local_load_threads(data_nodes: int) -> int:
    """Load threads of each of ``data_nodes`` nodes under `data-cache local`: they share this
    machine's CPUs, so fewer nodes read with more threads each (and more read scratch). (A
    LOAD_THREADS that local was started with is every node's instead: local and the head read it.)"""
    return max(1, available_cpus() // max(1, data_nodes))


MAX_ADVISED_NODES = MAX_DATA_NODES


def _fewest_nodes(peaks_for: Callable[[int], list[int]], nodes: int, usable: int) -> int | None:
    """The fewest data nodes (more than ``nodes``) whose every peak fits ``usable``, or None
    when even MAX_ADVISED_NODES would not (a single file's scratch is too large)."""

    def fits(n: int) -> bool:
        return max(peaks_for(n)) <= usable

    low, high = nodes, nodes + 1  # low does not fit; find a high that does, doubling the step
    while not fits(high):
        if high >= MAX_ADVISED_NODES:
            return None
        low, high = high, min(MAX_ADVISED_NODES, high * 2)
    while high - low > 1:  # peaks shrink as nodes are added: bisect between a miss and a fit
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high


def check_fits(
    need_per_node: list[int],
    peak_per_node: list[int],
    budgets: list[int | None],
    peaks_for: Callable[[int], list[int]],
    local: bool | None = None,
) -> None:
    """Refuse a load that would not fit, saying how many nodes or how much memory it needs.

    ``need_per_node`` is each node's rows once loaded, ``peak_per_node`` the most it holds while
    loading (plan.estimated_node_memory): the peak is what must fit, or the node is
    OOM-killed half way through its load. ``local`` (default: run by `data-cache local`) names
    that command's flags instead of the Kubernetes settings. ``peaks_for(n)``, the peaks with
    ``n`` data nodes, lets the advice name a node count that does fit (read scratch does not
    shrink with the share, so scaling the summed peaks could name one that is refused again).
    """
    local = under_local() if local is None else local
    over = [
        (node, need, peak, usable_bytes(budget))
        for node, (need, peak, budget) in enumerate(zip(need_per_node, peak_per_node, budgets, strict=True))
        if budget is not None and peak > (usable_bytes(budget) or 0)
    ]
    if not over:
        return
    total = sum(need_per_node)
    nodes = len(need_per_node)
    known = [usable_bytes(b) for b in budgets if b is not None]
    usable = min(known) if known else 0
    needed_nodes = _fewest_nodes(peaks_for, len(need_per_node), usable) if usable else None
    peak_max = max(peak_per_node)
    node, need, peak, have = over[0]
    if local:
        nodes_knob, memory_knob = f"--data-nodes {needed_nodes}", "--memory-limit"
    else:
        nodes_knob, memory_knob = f"CLUSTER_SIZE={(needed_nodes or 0) + 1}", "WORKER_MEM / --memory-limit"
    if not usable:  # no node count helps a limit that does not even hold the interpreter
        advice = f"no number of data nodes fits a limit at or below the {_fmt(BASELINE_MEMORY_BYTES)} kept for the interpreter"
    elif needed_nodes:
        advice = f"use at least {needed_nodes} data nodes ({nodes_knob})"
    else:
        advice = "more data nodes alone would not fit it (one file's read scratch is too large), so raise their memory"
    raise MemoryBudgetError(
        f"the table needs about {_fmt(total)} in memory (estimated from manifest statistics, a decoded sample of its strings and its files' footers); "
        f"data node {node} would hold {_fmt(need)}, {_fmt(peak)} at its peak while loading (decoding "
        f"its files and merging them), but can use {_fmt(have or 0)} "
        f"(its limit minus {_fmt(BASELINE_MEMORY_BYTES)} for the interpreter). "
        f"With {nodes} data node(s), {advice}, or give each data node at least "
        f"{_fmt(peak_max + BASELINE_MEMORY_BYTES)} ({memory_knob})"
    )


# A load stops once the node's resident memory comes within this margin of its limit: 10% of
# it, but no more than 128 MiB. A load as large as the pre-load check estimated stays clear of
# it: that check keeps BASELINE_MEMORY_BYTES (400 MiB) aside for an interpreter that takes
# 150-250 MiB here. But the check works from manifest statistics, which cannot see how far
# strings decode (a repeated value compresses to almost nothing); the kernel's OOM kill would
# leave only "OOMKilled" and a restart loop, where stopping first leaves the reason and the fix.
# The check runs after each decoded batch (pyiceberg decodes up to 131,072 rows at once), so
# one batch of very wide rows can still overshoot the margin: hence also the projection below.
LOAD_GUARD_SHARE = 0.1
LOAD_GUARD_MAX_MARGIN = 128 << 20
# The projection waits for this share of the node's rows: one wide file read first must not
# speak for all of them.
LOAD_GUARD_PROJECT_AFTER = 0.1


def load_guard_threshold(limit: int) -> int:
    """The resident size at which a load with this memory limit stops."""
    return int(limit - min(limit * LOAD_GUARD_SHARE, LOAD_GUARD_MAX_MARGIN))


def _knobs(local: bool) -> tuple[str, str]:
    """The settings that give data nodes more count and memory: `data-cache local`'s flags, or the pod's."""
    return ("--data-nodes", "--memory-limit") if local else ("CLUSTER_SIZE", "WORKER_MEM / --memory-limit")


class LoadMemoryGuard:
    """Checks, as a load decodes, that the node's rows will fit and that it stays out of its
    limit's last margin.

    The projection (the Arrow bytes decoded so far, per row, times the node's rows, on top of
    what the process held when the load began) stops a load at its first batches when the rows
    decode far larger than estimated, long before memory runs out; Arrow bytes, not resident
    growth, because decode scratch would inflate the early rate. The resident check catches
    the rest (rows whose width differs from file to file, merge copies).
    """

    def __init__(self, limit: int | None, rows: int, local: bool | None = None):
        self.limit, self.rows = limit, rows
        self.local = under_local() if local is None else local
        self.start = resident_bytes()  # the interpreter, and rows a superseded load may still hold
        # Set by LoadMemoryWatch's breach: the next check stops the load with it, even where
        # memory has come back under the margin since (a decode's peak passed).
        self.breached: MemoryBudgetError | None = None

    def check(
        self,
        rows_read: int,
        bytes_read: int = 0,
        estimate_read: float = 0.0,
        estimate_all: int = 0,
        decoded: int | None = None,
    ) -> None:
        """``estimate_read`` and ``estimate_all``: the manifests' estimate of the rows read and of
        all the node's rows. Where given, the projection scales what the rows read decoded to by
        how far they were estimated to go (rows of 1 MiB images read first, among short ones,
        had the per-row projection stop a load that fits at 3x its size); else by rows.
        ``decoded``: rows decoded so far, settled or not (a read in column groups settles its rows
        once all its groups are in), where it differs from ``rows_read``."""
        if self.breached is not None:
            raise self.breached
        if self.limit is None:
            return
        threshold = load_guard_threshold(self.limit)
        resident = resident_bytes()
        if estimate_read > 0 and estimate_all > 0:
            projected = self.start + bytes_read / estimate_read * estimate_all
            early = estimate_read < estimate_all * LOAD_GUARD_PROJECT_AFTER
        else:
            projected = self.start + bytes_read / rows_read * self.rows if rows_read else 0
            early = rows_read < self.rows * LOAD_GUARD_PROJECT_AFTER  # too early to extrapolate
        if resident <= threshold and (early or projected <= threshold):
            return
        self._refuse(rows_read, resident, threshold, projected, early, decoded)

    def check_resident(self, rows_read: int, decoded: int | None = None) -> None:
        """The resident check alone, for LoadMemoryWatch between batches (the projection's
        figures change together only at a batch), at the watch's narrower margin."""
        if self.limit is None:
            return
        threshold = load_watch_threshold(self.limit)
        resident = resident_bytes()
        if resident > threshold:
            self._refuse(rows_read, resident, threshold, None, True, decoded)

    def _refuse(
        self,
        rows_read: int,
        resident: int,
        threshold: int,
        projected: float | None,
        early: bool,
        decoded: int | None = None,
    ) -> None:
        share = rows_read / self.rows if self.rows else 0.0
        nodes_knob, memory_knob = _knobs(self.local)
        if resident > threshold:
            what = f"its resident memory reached {_fmt(resident)} of its {_fmt(self.limit)} limit"
        else:
            what = f"its resident memory is {_fmt(resident)} of its {_fmt(self.limit)} limit"
        rate = ""
        if rows_read and projected is not None:
            rate = f"; at this rate its rows need about {_fmt(projected)}, more at the load's peak"
        if rows_read and projected is not None and not early and projected <= threshold:
            # The rows are on course to fit: what passes the limit is held beside them.
            why = (
                "The load holds more than its rows while it reads: decode buffers, and a little per column of "
                "every batch read until they are merged, which adds up where the table has many small files "
                "(compacting them into fewer helps)"
            )
        elif early:  # too early to tell the rows' size from what else the load holds
            why = (
                "The rows decode larger than the manifests' statistics suggest (highly compressible strings do "
                "this), or the load holds more beside them (a little per column of every batch read, which adds "
                "up where the table has many small files: compacting them helps)"
            )
        else:
            why = "The rows decode larger than the manifests' statistics suggest (highly compressible strings do this)"
        if not (rows_read if decoded is None else decoded):
            # No rows, so no rate: the first row group alone decoded past the limit. pyarrow decodes
            # a small row group's columns whole (parquet_batches: a large one a batch at a time),
            # whatever share of it a node keeps, so the advice to add data nodes (all there was) did
            # not help: three nodes each decoded a 386 MiB group.
            raise MemoryBudgetError(
                f"stopped its load before the kernel's OOM kill: {what} before any of its {self.rows} rows "
                "were read. One row group decoded past it: pyarrow decodes a row group of up to "
                f"{BATCHWISE_MIN_GROUP_ROWS} rows and {_fmt(BATCHWISE_MIN_GROUP_BYTES)} stored whole, and "
                "values repeated in a Parquet dictionary (or that compress very well) decode to each copy, "
                f"far past the manifests' statistics; give each data node more memory ({memory_knob}; more "
                f"data nodes, {nodes_knob}, do not shrink a row group), or write the table with smaller row "
                "groups (pyiceberg's write.parquet.row-group-limit)"
            )
        raise MemoryBudgetError(
            f"stopped its load before the kernel's OOM kill: {what} with {share:.0%} of its {self.rows} "
            f"rows read{rate}. {why}; give each data node more memory ({memory_knob}) or use more "
            f"data nodes ({nodes_knob})"
        )


# How often a load's resident memory is looked at between its batches. pyarrow decodes a row
# group, and row groups ahead of it, before it hands out a batch: rows far wider than estimated
# passed a node's limit inside one such step (a reviewer's table reached 3 GiB under a 1 GiB
# limit before the first batch was checked), where the kernel's OOM kill would leave no reason.
# Each look costs ~25 us.
LOAD_WATCH_SECONDS = 0.005
# The watch's margin, narrower than the per-batch check's: it looks every few ms, so it can wait
# until the limit is near, and a decode's passing peak that stays clear of the limit is left to
# run. At the per-batch margin it stopped loads that fit: 100 images of 1 MiB decoded, a file's
# row groups ahead at once, to 570 MiB of a 632 MiB limit for a moment (the per-batch checks,
# between those moments, had never seen it). A decode grows by ~5 MiB in one interval here.
LOAD_WATCH_SHARE = 0.04
LOAD_WATCH_MAX_MARGIN = 64 << 20


def load_watch_threshold(limit: int) -> int:
    """The resident size at which LoadMemoryWatch stops a load with this memory limit."""
    return int(limit - min(limit * LOAD_WATCH_SHARE, LOAD_WATCH_MAX_MARGIN))


class LoadMemoryWatch:
    """While a load runs (``with``), calls ``check`` (the guard's resident check) every
    LOAD_WATCH_SECONDS in a daemon thread, and hands the first MemoryBudgetError it raises to
    ``on_breach``: the node reports its reason while the read that brought it there is still
    decoding (a decode cannot be interrupted); ``on_breach`` sets the guard's ``breached`` too, so
    the load stops at its next batch whatever memory is by then."""

    def __init__(
        self,
        check: Callable[[], None],
        on_breach: Callable[[MemoryBudgetError], None],
        interval: float = LOAD_WATCH_SECONDS,
    ) -> None:
        self._check, self._on_breach, self._interval = check, on_breach, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-memory-watch", daemon=True)

    def __enter__(self) -> LoadMemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._check()
            except MemoryBudgetError as err:
                self._on_breach(err)
                return


# What one gathering stream (shuffled or filtered) may hold on its node at once, in batches: the
# ones it gathers ahead (node.gather_ahead: at most READAHEAD_BATCHES, the one being gathered
# included), the one gRPC is sending, what gRPC buffered, and the allocator's pages around them.
# A shuffled all-column stream of 3.8 MB batches that its reader stopped reading measured 31-39
# MiB on its node when it gathered 4 ahead (docs/cache.md); it gathers none ahead now, and the
# count is kept as the margin it was.
GATHER_STREAM_BATCHES = 10
# A stream's batches take a moment to show in the node's resident memory, and readers open their
# streams together at each epoch's start: a stream admitted this recently still counts at its
# full size on top of what is resident, so a burst cannot all be let in on one reading of it.
GATHER_STREAM_RAMP_SECONDS = 2.0


class ServeMemoryGuard:
    """Admits a new gathering stream only while the node's memory has room for its batches.

    The pre-load check keeps BASELINE_MEMORY_BYTES aside for the interpreter and for serving,
    but every open shuffled or filtered stream holds a few gathered batches: with wide rows and
    many readers they could push a node into the kernel's OOM kill, which ends every stream on
    it and has the whole cache group reload. A stream whose batches would bring the node's
    resident memory into the load guard's last margin (load_guard_threshold), counting streams
    admitted in the last GATHER_STREAM_RAMP_SECONDS at their full size, is first met with a
    reclaim of freed serving memory, and refused if that is not enough: UNAVAILABLE, which
    readers retry with backoff while open streams finish and free their batches. A stream with
    none other open or starting is always admitted, since waiting would free nothing. In-order
    reads send zero-copy slices of the rows; where they have strings or lists, each holds the
    rebased offsets of the window being sent (offsets.py, ~2 MiB for the sample table's two such
    columns), and counts for that (``admit_in_order``): 300 stalled ones took a node from ~160
    to ~740 MiB, past its 600 MiB limit, uncounted.
    """

    def __init__(
        self,
        limit: int | None,
        reclaim: Callable[[], None],
        resident: Callable[[], int] | None = None,
        local: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.limit = limit
        self._reclaim = reclaim
        self._resident = resident or (lambda: resident_bytes())  # looked up per call
        self.local = under_local() if local is None else local
        self._clock = clock
        self._lock = threading.Lock()  # one reclaim at a time; admissions far from the limit are cheap
        self._recent: deque[tuple[float, int]] = deque()  # (admitted at, its size), oldest first
        self._refusing = False
        self.refused = 0

    def release(self, admitted: tuple[float, int] | None) -> None:
        """A stream ended: it no longer counts as starting (its memory is freed, or shows)."""
        if admitted is None:
            return
        with self._lock, contextlib.suppress(ValueError):  # already past the ramp, and dropped
            self._recent.remove(admitted)

    def _ramping(self) -> int:
        """The size of streams admitted too recently to show in resident memory yet."""
        horizon = self._clock() - GATHER_STREAM_RAMP_SECONDS
        while self._recent and self._recent[0][0] < horizon:
            self._recent.popleft()
        return sum(size for _, size in self._recent)

    def admit(
        self, batch_bytes: int, open_streams: int, node: int, stream_bytes: int | None = None, order_bytes: int = 0
    ) -> tuple[float, int] | None:
        """Return if a stream of ``batch_bytes`` batches fits, else raise NodeBusyError.

        ``stream_bytes``, the whole stream's rows, caps what it is counted at: a short stream
        (one of many readers' parts of an epoch) cannot hold ten batches of the requested size,
        and counting it so refused streams at a third of the limit. Twice its bytes: its
        gathered copies and what gRPC buffered of them. ``order_bytes``: the epoch order the
        stream will build, where no stream holds it yet. The value returned goes to ``release``
        once the stream ends."""
        if self.limit is None:
            return None
        need = batch_bytes * GATHER_STREAM_BATCHES
        if stream_bytes is not None:
            need = max(1, min(need, 2 * stream_bytes))
        return self._admit(need + order_bytes, open_streams, node, order_bytes, "shuffled or filtered")

    def admit_in_order(self, held_bytes: int, open_streams: int, node: int) -> tuple[float, int] | None:
        """``admit`` for an in-order stream that holds ``held_bytes`` of its own (the rebased
        offsets of a window), ``open_streams`` of any kind open."""
        if self.limit is None or held_bytes <= 0:
            return None
        return self._admit(held_bytes, open_streams, node, 0, "in-order")

    def _admit(self, need: int, open_streams: int, node: int, order_bytes: int, kind: str) -> tuple[float, int]:
        assert self.limit is not None
        threshold = load_guard_threshold(self.limit)
        with self._lock:
            ramping = self._ramping()
            resident = self._resident()
            if resident + ramping + need > threshold:
                self._reclaim()
                resident = self._resident()
            # With no other stream open or starting, nothing would free memory for a reader that
            # waits: one stream at a time always goes (the load check left room for it).
            alone = open_streams == 0 and not ramping
            if alone or resident + ramping + need <= threshold:
                admitted = (self._clock(), need)
                self._recent.append(admitted)
                if self._refusing:
                    self._refusing = False
                    log.info(
                        "memory back to %s of %s: starting streams again",
                        _fmt(resident),
                        _fmt(self.limit),
                    )
                return admitted
            self.refused += 1
            first = not self._refusing
            self._refusing = True
            just_started = f" ({len(self._recent)} just started)" if ramping else ""
        builds = f" (this one would also build its epoch's shuffle order, ~{_fmt(order_bytes)})" if order_bytes else ""
        nodes_knob, memory_knob = _knobs(self.local)
        such = "" if kind == "in-order" else "such "  # in-order streams count every open stream
        message = (
            f"data node {node} is too near its memory limit to start another {kind} stream: "
            f"{_fmt(resident)} resident of {_fmt(self.limit)}, with {open_streams} {such}stream(s) open, each "
            f"holding up to ~{_fmt(need - order_bytes)}{just_started}{builds}; retry shortly (readers retry UNAVAILABLE). If it persists, give data "
            f"nodes more memory ({memory_knob}), use more of them ({nodes_knob}), or read with fewer "
            "DataLoader workers or fewer columns"
        )
        if first:  # once per spell of refusals: readers retrying would otherwise flood the log
            log.warning("%s", message)
        raise NodeBusyError(message)
