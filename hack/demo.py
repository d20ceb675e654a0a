"""`make demo`: a sample Iceberg table, a local cache, and a 2-rank torchrun job streaming from it.

1. writes a sample table (a few hundred thousand rows, several files) in a temporary warehouse;
2. starts `data-cache local` (a head and 2 data nodes) on a free port and waits for READY;
3. runs hack/demo_train.py under `torchrun --nproc-per-node 2` (gloo, CPU) for 2 shuffled
   epochs, each rank reading in its own process (`--workers N`: N DataLoader workers per rank),
   which checks that every epoch delivered every row exactly once and reports how long the
   training loop waited for data.

Every process runs in its own process group and is stopped on the way out, also on Ctrl-C or a
failure; a cache that exits while training runs fails the demo at once, with its log. The exit
code is the training job's (non-zero when the exactly-once check fails; 128 + the signal's number
when torchrun was killed); 1 when the cache failed; 128 + the signal's number when the demo was
stopped by Ctrl-C, SIGTERM or SIGHUP. Each rank ends with torchrun, however torchrun ends.
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

from kubeflow_data_cache.cli import at_least
from kubeflow_data_cache.config import seconds_setting
from kubeflow_data_cache.errors import ConfigError, DataCacheError
from kubeflow_data_cache.local import LOCAL_STARTUP_TIMEOUT_SECONDS
from kubeflow_data_cache.processes import die_with_parent, exit_status, handle_signals, stop_processes
from kubeflow_data_cache.sample import create_sample_table

HERE = Path(__file__).resolve().parent
# `local` gives up by itself at its startup timeout, saying why; the demo's wait is a backstop past it.
READY_GRACE_SECONDS = 30.0
TRAIN_TIMEOUT_SECONDS = 300.0
STOP_TIMEOUT_SECONDS = 10.0
# How often the training job and the cache are looked at while training runs.
WATCH_SECONDS = 0.2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=at_least(1), default=300_000)
    p.add_argument("--files", type=at_least(1), default=6)
    p.add_argument("--data-nodes", type=at_least(1), default=2)
    p.add_argument("--ranks", type=at_least(1), default=2)
    p.add_argument("--epochs", type=at_least(1), default=2)
    p.add_argument("--batch-size", type=at_least(1), default=1024)
    # 0: each rank reads in its own process, as docs/dataset.md recommends where the step needs
    # no worker processes; torch's hand-off of every batch from a worker costs more than it saves.
    p.add_argument("--workers", type=at_least(0), default=0, help="DataLoader workers per rank (0: read in the rank)")
    p.add_argument(
        "--train-timeout",
        type=at_least(1),
        default=int(TRAIN_TIMEOUT_SECONDS),
        help=f"seconds the training job may run (default {TRAIN_TIMEOUT_SECONDS:.0f}; more for large --rows)",
    )
    return p.parse_args(argv)


def ready_timeout(env: dict[str, str]) -> float:
    """How long to wait for READY: `local`'s own startup timeout (from the environment it
    inherits), and a grace past it for its error to arrive."""
    variable = "DATA_CACHE_STARTUP_TIMEOUT_SECONDS"
    try:  # read as `local` reads it
        timeout = seconds_setting(variable, env.get(variable), LOCAL_STARTUP_TIMEOUT_SECONDS)
    except ConfigError:  # `local` refuses it at once, naming it
        timeout = LOCAL_STARTUP_TIMEOUT_SECONDS
    return timeout + READY_GRACE_SECONDS


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
    waited = ready_timeout(dict(os.environ))
    endpoint = wait_ready(cache, waited)
    if endpoint is None:
        how = f"within {waited:.0f}s" if cache.poll() is None else f"(it {exit_status(cache.returncode)})"
        print(f"the cache did not become ready {how}; its log:\n{log.read_text()[-4000:]}", file=sys.stderr)
        return 1
    step(f"cache ready at {endpoint}", started)

    step(f"torchrun: {args.ranks} ranks (gloo, CPU), {args.epochs} shuffled epochs", started)
    train_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}"]
    # torchrun's own logs go in the demo's folder, removed with it; by default every run left a
    # /tmp/torchelastic_* folder behind.
    train_cmd += ["--log-dir", str(workdir / "torchrun")]
    train_cmd += [str(HERE / "demo_train.py"), "--endpoint", endpoint, "--rows", str(args.rows)]
    train_cmd += ["--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--workers", str(args.workers)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "WARNING"}
    # The ranks report on stdout; stderr (torchrun's and the ranks' tracebacks and warnings) goes
    # to a log shown when training fails. Shown always, a stop asked for (Ctrl-C) ended in
    # torchrun's own traceback of the SIGTERM we send it.
    train_log = workdir / "train.log"
    with train_log.open("w") as train_err:
        train = subprocess.Popen(
            train_cmd, env=env, stderr=train_err, start_new_session=True, preexec_fn=die_with_parent()
        )
    procs.append(train)
    code = watch(train, cache, args.train_timeout)
    if code is None:
        print(f"training did not finish within {args.train_timeout}s (--train-timeout); its log:", file=sys.stderr)
        print(train_log.read_text()[-4000:], file=sys.stderr)
        return 1
    if cache.poll() is not None:
        # Watched throughout: the ranks would otherwise retry a cache that is gone until their
        # own deadline, minutes later.
        print(
            f"the cache ended during training (it {exit_status(cache.returncode)}); its log:\n{log.read_text()[-4000:]}",
            file=sys.stderr,
        )
        return 1
    if code != 0:
        # torchrun ended by a signal: "exit code -9" said nothing, and sys.exit(-9) exited 247.
        how = f"torchrun {exit_status(code)}"
        print(f"training failed ({how}); its log:\n{train_log.read_text()[-4000:]}", file=sys.stderr)
        step(f"training failed ({how})", started)
        return code if code > 0 else 128 - code  # as a shell says a signal's end: 137 for SIGKILL
    step("demo passed", started)
    return 0


def watch(train: subprocess.Popen, cache: subprocess.Popen, timeout: float) -> int | None:
    """The training job's exit code once it ends, or as soon as the cache exits (the caller
    tells which); None when neither happened within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = train.poll()
        if code is not None or cache.poll() is not None:
            return code if code is not None else 1
        time.sleep(WATCH_SECONDS)
    return None


class Interrupted(KeyboardInterrupt):
    """A stop signal, unwinding like Ctrl-C; the exit code says which one (128 + its number)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum: int, frame: object) -> None:
    raise Interrupted(signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (e.g. from a CI runner) and SIGHUP (the terminal closed) unwind like Ctrl-C,
    # through the cleanup below; under `nohup` SIGHUP stays ignored, for the whole demo.
    handle_signals(_interrupt, (signal.SIGTERM, signal.SIGHUP))
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="data-cache-demo-") as tmp:
        try:
            return run(args, Path(tmp), procs)
        except DataCacheError as err:  # a setting the sample table cannot use (a TMPDIR holding '#', say)
            print(f"error: {err}", file=sys.stderr)
            return 2
        except KeyboardInterrupt as stop_signal:
            signum = getattr(stop_signal, "signum", signal.SIGINT)
            print(
                f"interrupted ({signal.Signals(signum).name}); stopping the cache and the training job",
                file=sys.stderr,
            )
            return 128 + signum
        finally:
            # A second Ctrl-C (or SIGTERM) must not cut the cleanup short and leave processes.
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
            stop(procs)


if __name__ == "__main__":
    sys.exit(main())
