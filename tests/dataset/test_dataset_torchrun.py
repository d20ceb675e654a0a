"""`make demo` end to end (a real 2-rank torchrun over gloo), and its exactly-once check failing."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow

RUN_TIMEOUT_SECONDS = 240


def test_demo_sees_every_row_once_per_shuffled_epoch_and_cleans_up():
    cmd = [sys.executable, str(REPO_ROOT / "hack" / "demo.py"), "--rows", "20001", "--files", "3"]
    cmd += ["--batch-size", "512"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_SECONDS)
    assert run.returncode == 0, run.stdout + run.stderr
    epochs = re.findall(r"epoch (\d): ([\d,]+) rows .* exactly once: yes", run.stdout)
    assert epochs == [("0", "20,001"), ("1", "20,001")], run.stdout
    assert "summary: 40,002 rows over 2 epochs" in run.stdout and "demo passed" in run.stdout
    port = int(re.search(r"data nodes on port (\d+)", run.stdout).group(1))
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.1", port))  # the cache's head is gone


def test_the_check_fails_when_a_row_is_missing(small_cache):
    # The table has 10,000 rows; claiming 10,001 means id 10,000 is never seen.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(REPO_ROOT / "hack" / "demo_train.py"), "--endpoint", small_cache.endpoint, "--rows", "10001"]
    cmd += ["--epochs", "1", "--workers", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_SECONDS, env=env)
    assert run.returncode != 0
    assert "exactly once: NO" in run.stdout and "1 row(s) never seen, 0 seen more than once" in run.stdout, (
        run.stdout + run.stderr
    )
