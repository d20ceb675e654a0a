"""`make demo` end to end (a real 2-rank torchrun over gloo), and its exactly-once check failing."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow

RUN_TIMEOUT_SECONDS = 240


def _torchrun_log_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "torchelastic_*")))


def test_demo_sees_every_row_once_per_shuffled_epoch_and_cleans_up():
    cmd = [sys.executable, str(REPO_ROOT / "hack" / "demo.py"), "--rows", "20001", "--files", "3"]
    cmd += ["--batch-size", "512", "--workers", "1"]  # ranks x loader workers (the demo's default is 0)
    before = _torchrun_log_dirs()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_SECONDS)
    assert run.returncode == 0, run.stdout + run.stderr
    # torchrun's logs went in the demo's own folder: every run left a torchelastic_* folder.
    assert _torchrun_log_dirs() <= before
    epochs = re.findall(r"epoch (\d): ([\d,]+) rows .* exactly once: yes", run.stdout)
    assert epochs == [("0", "20,001"), ("1", "20,001")], run.stdout
    assert "training on 2 ranks x 1 loader workers = 2 shards" in run.stdout
    assert "summary: 40,002 rows over 2 epochs" in run.stdout and "demo passed" in run.stdout
    waited = re.search(r"through the training loop, (\d+)% of its time waiting for data", run.stdout)
    assert waited and 0 < int(waited.group(1)) <= 100, run.stdout
    port = int(re.search(r"cache ready at grpc://127\.0\.0\.1:(\d+)", run.stdout).group(1))
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.1", port))  # the cache's head is gone


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--epochs", "0"], "argument --epochs: should be >= 1, got 0"),
        (["--workers", "-1"], "argument --workers: should be >= 0, got -1"),
        (["--batch-size", "x"], "argument --batch-size: should be an integer, got 'x'"),
        (["--train-timeout", "0"], "argument --train-timeout: should be >= 1, got 0"),
    ],
)
def test_demo_settings_that_cannot_work_are_refused_before_anything_starts(args, says):
    """--epochs 0 started the table, the cache and torchrun, then a rank died dividing by zero."""
    run = subprocess.run(
        [sys.executable, str(REPO_ROOT / "hack" / "demo.py"), *args], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2 and says in run.stderr, run.stderr
    assert "writing a sample Iceberg table" not in run.stdout


def test_a_temporary_folder_the_sample_table_cannot_use_is_one_error_line(tmp_path):
    """A TMPDIR holding '#' (URI syntax to pyiceberg) ended the demo in a traceback."""
    odd = tmp_path / "a#b"
    odd.mkdir()
    run = subprocess.run(
        [sys.executable, str(REPO_ROOT / "hack" / "demo.py"), "--rows", "10"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "TMPDIR": str(odd)},
    )
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    assert run.stderr.startswith("error: the warehouse folder") and "choose a folder without them" in run.stderr
    assert list(odd.iterdir()) == []  # the demo's folder went with it


def test_the_demo_waits_for_ready_past_the_caches_own_startup_timeout():
    """It gave up at 120 s while `local` itself allows 300 (or DATA_CACHE_STARTUP_TIMEOUT_SECONDS):
    `local` says why when it gives up, so the demo waits for that."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo", REPO_ROOT / "hack" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    grace = demo.READY_GRACE_SECONDS
    assert demo.ready_timeout({}) == 300 + grace
    assert demo.ready_timeout({"DATA_CACHE_STARTUP_TIMEOUT_SECONDS": "900"}) == 900 + grace
    for refused in ("nope", "-1", "nan", ""):  # `local` refuses these itself, at once
        assert demo.ready_timeout({"DATA_CACHE_STARTUP_TIMEOUT_SECONDS": refused}) == 300 + grace


@contextlib.contextmanager
def demo_in_training(rows: int = 200_000) -> Iterator[tuple[subprocess.Popen, list]]:
    """A demo far longer than the test (50 epochs), once both ranks are up and reading: the demo
    and its descendants (the cache, its head and 2 data nodes; torchrun and 2 ranks), all killed
    on the way out."""
    import time

    import psutil

    cmd = [sys.executable, str(REPO_ROOT / "hack" / "demo.py"), "--rows", str(rows), "--files", "2"]
    cmd += ["--epochs", "50"]
    # A demo killed outright leaves its folder (table, logs: 4.5 MB) where it was: in ours.
    tmp = tempfile.TemporaryDirectory(prefix="demo-in-training-")
    env = {**os.environ, "TMPDIR": tmp.name}
    demo = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    descendants: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_SECONDS
        for line in demo.stdout:  # each rank's first line comes once both are up and reading
            if line.startswith("training on 2 ranks") or time.monotonic() > deadline:
                break
        assert line.startswith("training on 2 ranks"), line
        descendants = psutil.Process(demo.pid).children(recursive=True)
        assert len(descendants) >= 6, [p.cmdline() for p in descendants]
        yield demo, descendants
    finally:
        for process in descendants:
            with contextlib.suppress(psutil.Error):
                process.kill()
        if demo.poll() is None:
            demo.kill()
        demo.stdout.close()
        demo.wait()
        tmp.cleanup()


def test_a_demo_killed_outright_takes_its_cache_and_training_job_with_it():
    """SIGKILL (as a closed terminal's SIGHUP once did) skips the demo's own cleanup: its children,
    each in a session of its own, get SIGTERM from the kernel instead (PR_SET_PDEATHSIG)."""
    import psutil

    with demo_in_training() as (demo, descendants):
        demo.kill()
        demo.wait(timeout=10)
        _, alive = psutil.wait_procs(descendants, timeout=60)
        assert not alive, f"left running: {[p.cmdline() for p in alive]}"


def test_a_torchrun_killed_outright_takes_its_ranks_with_it():
    """torchrun stops its ranks only if it lives through its own shutdown: SIGKILLed, or given
    another SIGTERM meanwhile (a dying demo sends one per thread it had), it left them training
    on, out of the demo's reach. Each rank ends with it now (end_with_parent)."""
    import psutil

    with demo_in_training() as (demo, descendants):
        (torchrun,) = [p for p in descendants if p.cmdline()[1:3] == ["-m", "torch.distributed.run"]]
        ranks = [p for p in descendants if p.cmdline()[2].endswith("demo_train.py")]
        assert len(ranks) == 2, [p.cmdline() for p in descendants]
        torchrun.kill()
        rest = demo.communicate(timeout=60)[0]
        assert demo.returncode == 128 + 9, rest  # as a shell says SIGKILL's end (it exited 247)
        assert "training failed (torchrun was killed by SIGKILL)" in rest, rest
        _, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive, f"left running: {[p.cmdline() for p in alive]}"


def test_a_demo_whose_cache_dies_during_training_fails_at_once_naming_it():
    """The ranks would retry a cache that is gone until their own deadline (minutes); the demo
    watches the cache while training runs, and stops everything with its log."""
    import time

    import psutil

    with demo_in_training() as (demo, descendants):
        (cache,) = [p for p in descendants if p.cmdline()[2:4] == ["kubeflow_data_cache", "local"]]
        cache.kill()
        killed = time.monotonic()
        rest = demo.communicate(timeout=60)[0]
        assert time.monotonic() - killed < 30, "the demo waited on training with its cache gone"
        assert demo.returncode == 1
        assert "the cache ended during training (it was killed by SIGKILL); its log:" in rest, rest
        _, alive = psutil.wait_procs(descendants, timeout=30)
        assert not alive, f"left running: {[p.cmdline() for p in alive]}"


def test_a_demo_stopped_during_training_stops_quietly():
    """Its stop of the training job is asked for: torchrun's own traceback of the SIGTERM (25-40
    lines after "interrupted; stopping ...") is no news, and is not shown."""
    import signal

    import psutil

    with demo_in_training() as (demo, descendants):
        demo.send_signal(signal.SIGINT)  # as Ctrl-C does, to the demo's own group
        rest = demo.communicate(timeout=60)[0]
        assert demo.returncode == 128 + signal.SIGINT
        assert "interrupted (SIGINT); stopping the cache and the training job" in rest
        assert "Traceback" not in rest and "SignalException" not in rest, rest
        _, alive = psutil.wait_procs(descendants, timeout=30)
        assert not alive, f"left running: {[p.cmdline() for p in alive]}"


def test_a_demo_stopped_by_sigterm_exits_with_the_signals_code():
    """128 + the signal's number, as a shell reports it: 143 for SIGTERM (it said 130, Ctrl-C's)."""
    import signal

    cmd = [sys.executable, str(REPO_ROOT / "hack" / "demo.py"), "--rows", "3000000", "--files", "2"]
    demo = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "writing a sample Iceberg table" in demo.stdout.readline()
        demo.send_signal(signal.SIGTERM)
        _, err = demo.communicate(timeout=60)
        assert demo.returncode == 128 + signal.SIGTERM, err
        assert "interrupted (SIGTERM); stopping the cache and the training job" in err
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.communicate()


def test_the_check_fails_when_a_row_is_missing(small_cache, tmp_path):
    # The table has 10,000 rows; claiming 10,001 means id 10,000 is never seen. One rank is
    # enough for the check's verdict (the demo test runs the 2-rank all-gather), and each rank
    # is an interpreter importing torch.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    cmd += ["--log-dir", str(tmp_path / "torchrun")]
    cmd += [str(REPO_ROOT / "hack" / "demo_train.py"), "--endpoint", small_cache.endpoint, "--rows", "10001"]
    cmd += ["--epochs", "1", "--workers", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_SECONDS, env=env)
    assert run.returncode != 0
    assert "exactly once: NO" in run.stdout and "1 row(s) never seen, 0 seen more than once" in run.stdout, (
        run.stdout + run.stderr
    )


@pytest.mark.parametrize(("even", "promise"), [("drop", "at most once"), ("pad", "at least once")])
def test_the_check_of_an_even_split_is_what_that_split_promises(small_cache, tmp_path, even, promise):
    """--even-split failed every run whose rows did not divide by the shards: the demo checked
    exactly once, which an even split does not promise. 10,000 rows over 3 shards: "drop"
    leaves one row out, "pad" reads two twice, and each rank reads as many batches."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    cmd += ["--log-dir", str(tmp_path / "torchrun")]
    cmd += [str(REPO_ROOT / "hack" / "demo_train.py"), "--endpoint", small_cache.endpoint, "--rows", "10000"]
    cmd += ["--epochs", "1", "--workers", "3", "--even-split", even]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_SECONDS, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = "9,999" if even == "drop" else "10,002"
    assert re.search(rf"epoch 0: {rows} rows .* {promise}: yes", run.stdout), run.stdout
    assert "summary: " in run.stdout and "as the even split promises: yes" in run.stdout


def _epoch_verdict():
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_train", REPO_ROOT / "hack" / "demo_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.epoch_verdict


@pytest.mark.parametrize(
    ("seen", "even", "ok"),
    [
        ([1, 1, 1, 1, 1], None, True),
        ([1, 1, 1, 1, 0], None, False),
        ([1, 1, 1, 1, 0], "drop", True),  # 5 rows over 2 shards: 2 each, one left out
        ([1, 1, 1, 0, 0], "drop", False),  # two left out: more than the split drops
        ([2, 1, 1, 1, 0], "drop", False),  # a row twice is never dropping
        ([2, 1, 1, 1, 1], "pad", True),  # 3 each: one read twice
        ([2, 2, 1, 1, 0], "pad", False),  # a row never read is never padding
        ([3, 1, 1, 1, 1], "pad", False),  # two repeats: more than the split pads
    ],
)
def test_the_epoch_verdict_of_each_split(seen, even, ok):
    import torch

    counts = torch.tensor([*seen, 0], dtype=torch.int32)
    assert _epoch_verdict()(counts, rows=5, shards=2, even=even)[0] is ok
    counts[-1] = 1  # an id outside the table fails every split
    assert _epoch_verdict()(counts, rows=5, shards=2, even=even)[0] is False


# Two ranks from mp.spawn with a tcp:// process group and no RANK/WORLD_SIZE in the environment,
# each reading through spawn DataLoader workers: the workers have no process group to ask.
_MP_SPAWN_SCRIPT = """
import sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader
from kubeflow_data_cache.dataset import DataCacheDataset

def rank_main(rank, endpoint, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ds = DataCacheDataset(endpoint, batch_size=500, columns=["id"])
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn", timeout=120)
    ids = torch.cat([b["id"] for b in loader])
    torch.save(ids, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()

if __name__ == "__main__":
    endpoint, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    mp.spawn(rank_main, args=(endpoint, port, out), nprocs=2)
"""


@pytest.mark.parametrize("launcher_env", [{}, {"RANK": "0", "WORLD_SIZE": "1"}], ids=["no env", "other env"])
def test_spawn_workers_of_a_hand_made_process_group_read_their_rank_share(small_cache, tmp_path, launcher_env):
    """Also where the env holds a launcher's RANK/WORLD_SIZE that are not the group's (one
    process per pod, then mp.spawn): the workers took the env's rank 0 of 1 over the group's,
    and every rank read the whole table."""
    import torch

    from tests.conftest import free_port

    script = tmp_path / "mp_spawn.py"
    script.write_text(_MP_SPAWN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    env.update(launcher_env)
    cmd = [sys.executable, str(script), small_cache.endpoint, str(free_port()), str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_SECONDS, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    ids = torch.cat([torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)])
    assert len(ids) == 10_000  # not 20,000: each rank read its half
    assert torch.equal(ids.sort().values, torch.arange(10_000))
