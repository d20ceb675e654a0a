"""A read from storage that stalls is named: in the node's status, the head's detail, and the
message of a cache that gives up. The stall is real: a data file replaced by a FIFO, whose open
blocks until a writer comes, as a read from an object store that accepts and never answers."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kubeflow_data_cache import load_progress
from kubeflow_data_cache.load_progress import LoadProgress, waiting_reads
from kubeflow_data_cache.plan import open_table, scan_tasks
from kubeflow_data_cache.sample import create_sample_table
from tests.cache.inprocess import get, wait_for
from tests.conftest import LocalCache


def test_progress_counts_batches_and_names_the_read_waiting_longest(monkeypatch):
    finished = []
    progress = LoadProgress(on_read=lambda: finished.append(progress.rows))
    assert progress.oldest() is None and progress.status()["oldest_read"] is None
    with progress.reading("a.parquet") as a:
        time.sleep(0.05)
        with progress.reading("b.parquet"):
            what, seconds = progress.oldest()
            assert what == "a.parquet" and seconds >= 0.05
            # A batch from a.parquet: that read is decoding, not waiting; b.parquet now waits longest.
            progress.batch(10, 2 << 20, a)
            assert progress.oldest()[0] == "b.parquet"
        progress.read()
    assert progress.oldest() is None and finished == [10]
    assert progress.describe() == "10 rows, 2 MiB read"
    monkeypatch.setattr(load_progress, "SLOW_READ_SECONDS", 0.0)
    with progress.reading("s3://b/t/c.parquet"):
        assert "waiting 0s on s3://b/t/c.parquet" in progress.describe()
        status = {"loading": progress.status()}
    assert waiting_reads([(1, status)]) == "data node 1 has waited 0s on a read of s3://b/t/c.parquet"
    assert waiting_reads([(1, status)], at_least=0, below=0) == ""
    assert waiting_reads([(1, {"loading": None}), (2, {})], at_least=0) == ""


def test_a_failing_on_read_stops_the_load_there():
    def stop():
        raise RuntimeError("superseded")

    progress = LoadProgress(on_read=stop)
    with pytest.raises(RuntimeError, match="superseded"):
        progress.read()


@contextlib.contextmanager
def stalled_file(path: Path) -> Iterator[str]:
    """Replace a data file with a FIFO; on exit, let the blocked reader through to an empty file
    (a failed read), so no thread stays stuck in this process."""
    path.unlink()
    os.mkfifo(path)
    try:
        yield path.name
    finally:
        # A writer opening and closing the FIFO ends every open() blocked on it (EOF). A reader
        # of this process may reach its open() only after that (a warm-up read in pyiceberg's
        # executor, whose thread interpreter shutdown joins): release until none has waited
        # for half a second.
        deadline, quiet_since = time.monotonic() + 10, time.monotonic()
        while time.monotonic() < deadline and time.monotonic() - quiet_since < 0.5:
            if _blocked_on_a_fifo():
                quiet_since = time.monotonic()
                with contextlib.suppress(OSError):
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            time.sleep(0.02)


def _blocked_on_a_fifo(pid: int | str = "self") -> bool:
    """Whether a thread of this process (or of ``pid``) sits in open() of a FIFO with no writer (Linux)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            if (task / "wchan").read_text() == "wait_for_partner":
                return True
    return False


def _poll(read, ok, failure: str, timeout: float = 30.0):
    """``read()`` once ``ok`` of it, within ``timeout`` seconds; else fail with ``failure`` and the last value."""
    deadline = time.monotonic() + timeout
    while not ok(value := read()):
        assert time.monotonic() < deadline, f"{failure}: {value}"
        time.sleep(0.05)
    return value


def a_data_file(metadata_location: str) -> Path:
    table = open_table(metadata_location, {})
    return Path(sorted(scan_tasks(table, metadata_location))[-1].removeprefix("file://"))


def test_the_head_names_a_node_waiting_on_a_read(cluster, tmp_path, monkeypatch):
    monkeypatch.setattr(load_progress, "SLOW_READ_SECONDS", 0.3)
    table = create_sample_table(str(tmp_path / "wh"), 3000, 3)
    with stalled_file(a_data_file(table.metadata_location)) as name:
        head, head_health, _node, node_health = cluster(table.metadata_location)

        def waits_on_it_alone(status):
            loading = status.get("loading") or {}
            oldest = loading.get("oldest_read") or {}
            return loading.get("rows") == 2000 and name in oldest.get("what", "") and oldest["seconds"] >= 0.5

        # The node has read the other two files and waits on this one alone, well past the
        # threshold (ages are rounded to 0.1 s in the status); then the head must name it.
        mine = _poll(
            lambda: json.loads(get(node_health.port, "/status")[1]),
            waits_on_it_alone,
            "data node 0 never read the other two files and waited 0.5s on the stalled one",
        )
        _poll(
            lambda: head.lifecycle.detail,
            lambda detail: "data node 0 has waited" in detail and name in detail,
            f"the head never named the read data node 0 waits on (node: {mine})",
        )
        status = json.loads(get(head_health.port, "/status")[1])
        assert status["state"] == "loading" and name in status["detail"]
        assert "data node 0 has waited" in status["detail"]
        code, body = get(head_health.port, "/ready")
        assert code == 503 and name in body
        mine = json.loads(get(node_health.port, "/status")[1])
        assert mine["state"] == "loading" and name in mine["loading"]["oldest_read"]["what"]
        assert mine["loading"]["rows"] == 2000, "the other two files were read"  # 1000 rows a file
        assert f"on {mine['loading']['oldest_read']['what']}" in mine["detail"]
        code, body = get(node_health.port, "/ready")  # the node's own readiness says it too
        assert code == 503 and "waiting" in body and name in body
        # Let the read through: the FIFO ends empty, and the load fails naming the file.
    wait_for(lambda: head.lifecycle.state == "failed")
    assert name in head.lifecycle.error and "cannot read data file" in head.lifecycle.error


def test_local_gives_up_naming_the_read_it_waits_on(tmp_path):
    table = create_sample_table(str(tmp_path / "wh"), 3000, 3)
    with stalled_file(a_data_file(table.metadata_location)) as name:
        # Long enough for the nodes to start and reach the read on a slow, busy machine (at 5 s
        # a CI run once gave up before any read had begun, so none was named).
        cache = LocalCache(table.metadata_location, 2, args=("--startup-timeout", "15"))
        message = cache.wait_failure(timeout=90)
        assert cache.proc.returncode == 1
    assert "not ready within 15s" in message or "did not finish within 15s" in message
    assert "has waited" in message and name in message


def test_a_stalled_warm_up_read_does_not_hold_the_open(tmp_path):
    """The node warms its Parquet reader on the first file while the cluster forms; that read
    stalling must not block the load, which then names the file rather than the metadata."""
    from kubeflow_data_cache.node import DataNode

    table = create_sample_table(str(tmp_path / "wh"), 3000, 3)
    tasks = scan_tasks(open_table(table.metadata_location, {}), table.metadata_location)
    first = Path(next(iter(tasks)).removeprefix("file://"))  # the file the warm-up reads
    with stalled_file(first):
        opened = threading.Thread(target=DataNode._open, args=(table.metadata_location,), daemon=True)
        opened.start()
        opened.join(30)
        assert not opened.is_alive(), "opening the table waited on the warm-up read"


def test_a_node_stuck_in_a_storage_read_still_exits_on_sigterm(tmp_path):
    """A read blocked on storage cannot be cancelled, and interpreter shutdown joins every
    executor thread: the node must exit at once anyway, not hang until someone SIGKILLs it (in
    a pod that stopped by itself after a failed load, nobody would)."""
    import signal

    import psutil

    table = create_sample_table(str(tmp_path / "wh"), 3000, 3)
    with stalled_file(a_data_file(table.metadata_location)):
        cache = LocalCache(table.metadata_location, 1, args=("--startup-timeout", "60"))
        try:
            wait_for(lambda: "data nodes ready" in cache.read_stderr(), timeout=30)  # started
            node = next(p for p in psutil.Process(cache.proc.pid).children() if "worker" in p.cmdline())
            wait_for(lambda: _blocked_on_a_fifo(node.pid), timeout=30)  # its load now waits on the FIFO
            node.send_signal(signal.SIGTERM)
            node.wait(timeout=10)  # raises TimeoutExpired if it is still there
            assert not node.is_running()
        finally:
            cache.stop()


def test_a_stalled_sample_or_footer_read_leaves_the_fixed_factor_after_its_wait(tmp_path, monkeypatch, caplog):
    """The head samples string columns from the largest data file while it plans: a read of it
    that stalls held the whole cache's formation (the test above waited for a load that never
    came), where the data node reading the file later is the one to name it."""
    from kubeflow_data_cache import expansion, footer_floors
    from kubeflow_data_cache.plan import arrow_schema

    monkeypatch.setattr(expansion, "SAMPLE_TIMEOUT_SECONDS", 0.5)
    monkeypatch.setattr(footer_floors, "FOOTER_TIMEOUT_SECONDS", 0.5)  # its footer is read beside it
    table_info = create_sample_table(str(tmp_path / "wh"), 30_000, 1)
    table = open_table(table_info.metadata_location, {})
    tasks = scan_tasks(table, table_info.metadata_location)
    fields = list(table.schema().fields)
    with stalled_file(a_data_file(table_info.metadata_location)), caplog.at_level("INFO"):
        started = time.monotonic()
        assert expansion.measure_expansions(table, tasks, arrow_schema(table), fields, ceiling=4.0) == {}
        assert time.monotonic() - started < 5
    assert "took over 0.5s; estimating them from the manifests" in caplog.text
    assert "took over 0.5s; sizing columns without it" in caplog.text
