"""`make demo`: a sample Iceberg table, a local cache, and a 2-rank torchrun job streaming from it.

1. writes a sample table (a few hundred thousand rows, several files) in a temporary warehouse;
2. starts `data-cache local` (a head and 2 data nodes) on a free port and waits for READY;
3. runs hack/demo_train.py under `torchrun --nproc-per-node 2` (gloo, CPU) for 2 shuffled
   epochs, each rank reading in its own process (`--workers N`: N DataLoader workers per rank),
   which checks that every epoch delivered every row exactly once and reports how long the
   training loop waited for data.

Every process runs in its own process group and is stopped on the way out, also on Ctrl-C or a
failure. The exit code is the training job's (non-zero when the exactly-once check fails).
"""

from __future__ import annotations

import argparse
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from pathlib import Path

import psutil

from kubeflow_data_cache.processes import die_with_parent, stop_processes
from kubeflow_data_cache.sample import create_sample_table

HERE = Path(__file__).resolve().parent
READY_TIMEOUT_SECONDS = 120.0
TRAIN_TIMEOUT_SECONDS = 300.0
STOP_TIMEOUT_SECONDS = 10.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=300_000)
    p.add_argument("--files", type=int, default=6)
    p.add_argument("--data-nodes", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=1024)
    # 0: each rank reads in its own process, as docs/dataset.md recommends where the step needs
    # no worker processes; torch's hand-off of every batch from a worker costs more than it saves.
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers per rank (0: read in the rank)")
    return p.parse_args(argv)


def step(message: str, started: float) -> None:
    print(f"[{time.monotonic() - started:5.1f}s] {message}", flush=True)


def wait_ready(proc: subprocess.Popen, timeout: float) -> str | None:
    """The cache's READY line, or None if it exited or the deadline passed."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while (remaining := deadline - time.monotonic()) > 0:
            if sel.select(timeout=min(remaining, 0.5)):
                line = proc.stdout.readline()
                if line.startswith("READY "):
                    return line.split()[1]
                if not line and proc.poll() is not None:
                    return None
        return None
    finally:
        sel.close()


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each process group, then SIGKILL whatever is left after the grace period.

    torchrun puts its workers in process groups of their own, so every descendant is
    collected first and killed too if it outlives the grace period.
    """
    descendants: list[psutil.Process] = []
    for proc in procs:
        with suppress(psutil.Error):
            descendants += psutil.Process(proc.pid).children(recursive=True)
    deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
    stop_processes(procs, STOP_TIMEOUT_SECONDS, term_group=True, kill_group=True)
    _, alive = psutil.wait_procs(descendants, timeout=max(0.1, deadline - time.monotonic()))
    for child in alive:
        with suppress(psutil.Error):
            child.kill()


def run(args: argparse.Namespace, workdir: Path, procs: list[subprocess.Popen]) -> int:
    started = time.monotonic()
    step(f"writing a sample Iceberg table: {args.rows:,} rows in {args.files} files", started)
    table = create_sample_table(str(workdir / "warehouse"), rows=args.rows, files=args.files)

    step(f"starting data-cache local: a head and {args.data_nodes} data nodes", started)
    log = workdir / "cache.log"
    cache_cmd = [sys.executable, "-m", "kubeflow_data_cache", "local", "--metadata-loc", table.metadata_location]
    # Port 0: the cache picks a free port itself and names it in its READY line (a port picked
    # here and freed again could be taken before the cache binds it).
    cache_cmd += ["--data-nodes", str(args.data_nodes), "--port", "0"]
    with log.open("w") as err:
        cache = subprocess.Popen(
            cache_cmd,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
            preexec_fn=die_with_parent(),  # SIGTERM when this process dies, however (SIGKILL, SIGHUP)
        )
    procs.append(cache)
    endpoint = wait_ready(cache, READY_TIMEOUT_SECONDS)
    if endpoint is None:
        print(f"the cache did not become ready; its log:\n{log.read_text()[-4000:]}", file=sys.stderr)
        return 1
    step(f"cache ready at {endpoint}", started)

    step(f"torchrun: {args.ranks} ranks (gloo, CPU), {args.epochs} shuffled epochs", started)
    train_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}"]
    train_cmd += [str(HERE / "demo_train.py"), "--endpoint", endpoint, "--rows", str(args.rows)]
    train_cmd += ["--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--workers", str(args.workers)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "WARNING"}
    train = subprocess.Popen(train_cmd, env=env, start_new_session=True, preexec_fn=die_with_parent())
    procs.append(train)
    try:
        code = train.wait(timeout=TRAIN_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        print(f"training did not finish within {TRAIN_TIMEOUT_SECONDS:.0f}s", file=sys.stderr)
        return 1
    if cache.poll() is not None:
        print(f"the cache exited early; its log:\n{log.read_text()[-4000:]}", file=sys.stderr)
        return 1
    step("demo passed" if code == 0 else f"training failed (exit code {code})", started)
    return code


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (e.g. from a CI runner) and SIGHUP (the terminal closed) unwind like Ctrl-C,
    # through the cleanup below.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="data-cache-demo-") as tmp:
        try:
            return run(args, Path(tmp), procs)
        except KeyboardInterrupt:
            print("interrupted; stopping the cache and the training job", file=sys.stderr)
            return 130
        finally:
            # A second Ctrl-C (or SIGTERM) must not cut the cleanup short and leave processes.
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
            stop(procs)


if __name__ == "__main__":
    sys.exit(main())
