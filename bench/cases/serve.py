"""Serve: N client processes each read the whole table with DoGet, against loopback TCP.

After one untimed read, each repeat reads the table enough times in a row to move about
``repeat_bytes`` per client (BenchConfig.serve_repeat_bytes). The loopback limit is measured in the same repeat, just after the
DoGet reads: N TCP connections on 127.0.0.1 moving the same number of bytes with large sends,
so both figures see the same machine load; the fastest of LOOPBACK_TRIES runs is the ceiling.

Beside the rates, each repeat records the CPU time the servers spent per GB they sent: the
cache's processes (`data-cache local`, its head and its data nodes) and the bare Flight server.
On a 2-CPU machine where client and server share the cores, throughput swings by 10% between
repeats; CPU per GB is what a data node costs to feed a reader, and moves far less.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import psutil

from bench.config import CHILD_TIMEOUT_SECONDS
from bench.procs import CacheProcess, read_line, stop_process
from bench.stats import CaseResult, gb, paired_ratio
from kubeflow_data_cache.processes import stop_processes

CHUNK_BYTES = 4 << 20  # large sends: what the kernel can move, not Python's per-call cost
# The sender walks through a buffer much larger than the CPU caches, as a data node sends rows
# that are not in cache: a 4 MiB buffer sent again and again would stay cache-hot and overstate
# the ceiling. The receiver reuses one CHUNK_BYTES buffer, as a DoGet client reuses its batch
# buffers (allocator.tune_glibc_malloc): receiving into a 64 MiB ring, never in cache, made
# the ceiling ~30% lower than the loopback a Flight client sees (a bare Flight server beat it).
SPAN_BYTES = 64 << 20
# Loopback runs per repeat; the fastest is the ceiling.
LOOPBACK_TRIES = 3


def serve_passes(table_bytes: int, repeat_bytes: int) -> int:
    """Whole-table reads per timed repeat: enough to move ``repeat_bytes``, at least one."""
    return max(1, -(-repeat_bytes // max(1, table_bytes)))


def _buffer(nbytes: int) -> memoryview:
    """A buffer written so every page is backed before the clock starts."""
    return memoryview(bytearray(b"\x01" * nbytes))


# One loopback sender, a process of its own as a data node is (in the client's process, the two
# sides' threads shared one interpreter, and the ceiling read ~4% lower than the pair of processes
# DoGet runs between): it backs its buffer's pages, connects (saying it is ready), waits for one
# byte (the start), sends ``nbytes`` from a SPAN_BYTES buffer in CHUNK_BYTES sends and closes.
_SENDER = """
import socket, sys
port, nbytes, span, chunk = map(int, sys.argv[1:])
payload = memoryview(bytearray(b"\\x01" * span))
conn = socket.create_connection(("127.0.0.1", port))
conn.recv(1)
left, at = nbytes, 0
while left > 0:
    n = min(left, chunk, span - at)
    conn.sendall(payload[at : at + n])
    left -= n
    at = (at + n) % span
conn.shutdown(socket.SHUT_WR)
conn.recv(1)
"""


def _drain(conn: socket.socket, nbytes: int, got: list[int], buf: memoryview) -> None:
    total = 0
    while total < nbytes:
        n = conn.recv_into(buf)
        if n == 0:
            break
        total += n
    got.append(total)


def loopback_seconds(nbytes: int, streams: int = 1, timeout: float = CHILD_TIMEOUT_SECONDS) -> float:
    """Seconds for ``streams`` loopback TCP connections, each from a sender process of its own to
    this one, to each move ``nbytes`` (GIL-free syscalls on both sides)."""
    with ExitStack() as stack:
        server = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
        server.listen(streams)
        server.settimeout(timeout)
        port = server.getsockname()[1]
        argv = [sys.executable, "-c", _SENDER, str(port), str(nbytes), str(SPAN_BYTES), str(CHUNK_BYTES)]
        senders = [subprocess.Popen(argv) for _ in range(streams)]
        stack.callback(stop_processes, senders, 5)
        conns = [stack.enter_context(server.accept()[0]) for _ in range(streams)]  # each ready
        got: list[int] = []
        threads = [
            threading.Thread(target=_drain, args=(conn, nbytes, got, _buffer(CHUNK_BYTES)), daemon=True)
            for conn in conns
        ]
        for t in threads:
            t.start()
        start = time.perf_counter()
        for conn in conns:
            conn.sendall(b"g")
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        elapsed = time.perf_counter() - start
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.sendall(b"x")  # let the sender exit
        if any(t.is_alive() for t in threads) or sum(got) != nbytes * streams:
            raise RuntimeError(f"loopback TCP moved {sum(got)} of {nbytes * streams} bytes within {timeout:.0f}s")
        return elapsed


def tree_cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` and its live descendants (a cache's
    `local`, head and data nodes), threads included. A descendant that exits between two
    readings takes its time with it; the cache's processes live through every repeat."""
    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def cpu_ratios(cache_cpu: list[float], bare_cpu: list[float]) -> list[float]:
    """The cache's CPU per GB over the bare server's, per repeat. CPU time is counted in clock
    ticks (10 ms): a tiny read may show none on either side, and its repeat gets no ratio (a 0
    there is the clock's, not a server that spent nothing)."""
    return [c / b for c, b in zip(cache_cpu, bare_cpu, strict=True) if c > 0 and b > 0]


def _child_env() -> dict[str, str]:
    """`python -m bench.serve_client` must import bench wherever the suite was started from."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


class Clients:
    """N `bench.serve_client` processes, released together for each repeat."""

    def __init__(self, endpoint: str, n: int, bare: bool = False) -> None:
        self.endpoint, self.n, self.bare = endpoint, n, bare
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Clients:
        try:
            for _ in range(self.n):
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "bench.serve_client", self.endpoint, *(["--bare"] if self.bare else [])],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                        start_new_session=True,
                        env=_child_env(),
                    )
                )
            deadline = time.monotonic() + CHILD_TIMEOUT_SECONDS
            for proc in self.procs:
                if read_line(proc, deadline, "serve client").strip() != "ready":
                    raise RuntimeError("serve client did not say ready")
        except BaseException:
            self.__exit__()
            raise
        return self

    def read(self, passes: int = 1) -> list[dict[str, float]]:
        """Every client reads the whole table ``passes`` times; their reports."""
        for proc in self.procs:
            proc.stdin.write(f"go {passes}\n")
            proc.stdin.flush()
        deadline = time.monotonic() + CHILD_TIMEOUT_SECONDS
        return [json.loads(read_line(proc, deadline, "serve client")) for proc in self.procs]

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.stdin and not proc.stdin.closed:
                with contextlib.suppress(OSError):
                    proc.stdin.close()  # EOF: the client leaves its loop and exits
        # All at once, under one deadline: one that will not stop must not spare the others.
        stop_processes(self.procs, 10, kill_group=True)


class BareFlight:
    """`bench.bare_flight`: the same table in a bare pyarrow Flight server."""

    def __init__(self, metadata_loc: str) -> None:
        self.metadata_loc = metadata_loc

    def __enter__(self) -> BareFlight:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.bare_flight", self.metadata_loc],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=_child_env(),
        )
        try:
            line = read_line(self.proc, time.monotonic() + CHILD_TIMEOUT_SECONDS, "bare Flight server")
            self.endpoint = f"grpc://127.0.0.1:{int(line.split()[1])}"
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        stop_process(self.proc, grace=10)


def run(
    cache: CacheProcess, rows: int, nodes: int, clients: int, repeats: int, repeat_bytes: int, progress
) -> CaseResult:
    result = CaseResult("serve", "doget", rows, nodes, clients)
    loop_seconds: list[float] = []
    get_seconds: list[float] = []
    bare_seconds: list[float] = []
    with (
        Clients(cache.endpoint, clients) as procs,
        BareFlight(cache.metadata_loc) as bare_server,
        Clients(bare_server.endpoint, clients, bare=True) as bare_procs,
    ):
        # One untimed read each: a trainer reads for many epochs, so the first read's one-off
        # costs (first connection to each data node, first-touch memory) are not the rate.
        warm = procs.read()
        bare_procs.read()
        passes = serve_passes(int(warm[0]["bytes"]), repeat_bytes)
        for _ in range(repeats):
            cpu_before = tree_cpu_seconds(cache.proc.pid)
            reads = procs.read(passes)
            cache_cpu = tree_cpu_seconds(cache.proc.pid) - cpu_before
            nbytes = int(reads[0]["bytes"])
            if any(int(r["rows"]) != rows for r in reads):
                raise RuntimeError(f"a serve client read {[r['rows'] for r in reads]} rows, expected {rows}")
            wall = max(r["end"] for r in reads) - min(r["start"] for r in reads)
            cpu_before = tree_cpu_seconds(bare_server.proc.pid)
            bare = bare_procs.read(passes)
            bare_cpu = tree_cpu_seconds(bare_server.proc.pid) - cpu_before
            if any(int(r["rows"]) != rows for r in bare):
                raise RuntimeError(f"a bare Flight client read {[r['rows'] for r in bare]} rows, expected {rows}")
            bare_wall = max(r["end"] for r in bare) - min(r["start"] for r in bare)
            # The ceiling is the best the machine did in this repeat: a loopback run slowed by
            # a neighbour would read as DoGet beating it (ratios above 100% were seen).
            loop = min(loopback_seconds(nbytes * passes, clients) for _ in range(LOOPBACK_TRIES))
            get_seconds.append(wall)
            loop_seconds.append(loop)
            bare_seconds.append(bare_wall)
            result.add("seconds", wall)
            result.add("passes", passes)
            result.add("rows_per_s", rows * passes * clients / wall)
            result.add("gb_per_s", gb(nbytes * passes * clients / wall))
            result.add("loopback_gb_per_s", gb(nbytes * passes * clients / loop))
            result.add("bare_flight_gb_per_s", gb(int(bare[0]["bytes"]) * passes * clients / bare_wall))
            result.add("bytes_per_client", nbytes)
            sent_gb = nbytes * passes * clients / 1e9
            result.add("server_cpu_s_per_gb", cache_cpu / sent_gb)
            result.add("bare_cpu_s_per_gb", bare_cpu / sent_gb)
    # Throughput ratio = inverse time ratio, taken per repeat.
    for r in paired_ratio(loop_seconds, get_seconds):
        result.add("ratio_to_loopback", r)
    for r in paired_ratio(bare_seconds, get_seconds):
        result.add("ratio_to_bare_flight", r)
    for r in cpu_ratios(result.raw["server_cpu_s_per_gb"], result.raw["bare_cpu_s_per_gb"]):
        result.add("cpu_ratio_to_bare_flight", r)
    f = result.as_dict()["figures"]
    progress(
        f"serve rows={rows:,} nodes={nodes} clients={clients}: {f['gb_per_s']['median']:.2f} GB/s, "
        f"loopback {f['loopback_gb_per_s']['median']:.2f} GB/s ({f['ratio_to_loopback']['median']:.0%}), "
        f"bare pyarrow Flight {f['bare_flight_gb_per_s']['median']:.2f} GB/s ({f['ratio_to_bare_flight']['median']:.0%}); "
        f"server CPU {f['server_cpu_s_per_gb']['median']:.2f} s/GB, bare Flight {f['bare_cpu_s_per_gb']['median']:.2f} s/GB"
    )
    return result
