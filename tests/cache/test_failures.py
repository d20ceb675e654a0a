"""Bad input ends with a clear message and a non-zero exit, never a hang or partial data."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from kubeflow_data_cache.sample import create_sample_table
from tests.cache.conftest import run_data_cache
from tests.conftest import LocalCache, running_cache

DEADLINE = 90


def data_cache(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_data_cache(*args, env=env, timeout=DEADLINE)


def failed_local(metadata_loc: str, *args: str) -> tuple[int, str]:
    cache = LocalCache(metadata_loc, 2, args=args)
    message = cache.wait_failure(timeout=DEADLINE)
    return cache.proc.returncode, message


def test_missing_metadata_location_fails_fast(tmp_path):
    code, stderr = failed_local(str(tmp_path / "nope" / "v1.metadata.json"))
    assert code == 1
    assert "METADATA_LOC" in stderr and "does not exist" in stderr


def test_a_failed_head_logs_its_reason_once_and_exits_after_the_grace(tmp_path):
    """Lifecycle.fail logs the reason; the exit that follows had logged it again in full."""
    missing = str(tmp_path / "nope" / "v1.metadata.json")
    done = data_cache("head", "--metadata-loc", missing, "--data-nodes", "1", "--port", "0", "--health-port", "0",
                      "--host", "127.0.0.1", "--failure-grace", "0.5")  # fmt: skip
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "does not exist" in errors[0], done.stderr
    assert "exiting in 0.5s; /ready and /status give the reason meanwhile" in done.stderr


def test_not_a_metadata_file(tmp_path):
    bogus = tmp_path / "v1.metadata.json"
    bogus.write_text("{not json")
    code, stderr = failed_local(str(bogus))
    assert code == 1 and f"METADATA_LOC {str(bogus)!r} is not Iceberg table metadata ('Invalid JSON" in stderr


def test_corrupt_data_file_fails_the_load(tmp_path):
    table = create_sample_table(str(tmp_path / "wh"), 2000, 2)
    victim = sorted(Path(tmp_path / "wh").rglob("*.parquet"))[0]
    victim.write_bytes(b"PAR1 this is not parquet")
    code, stderr = failed_local(table.metadata_location)
    assert code == 1
    assert "cannot read data file" in stderr and victim.name in stderr


def test_a_data_file_deleted_after_the_table_was_written_is_named_with_the_fix(tmp_path):
    """It named the file and errno 2 only: not why a file the metadata names can be gone."""
    table = create_sample_table(str(tmp_path / "wh"), 2000, 2)
    victim = sorted(Path(tmp_path / "wh").rglob("*.parquet"))[0]
    victim.unlink()
    code, stderr = failed_local(table.metadata_location)
    assert code == 1
    assert f"cannot read data file {victim}" in stderr or victim.name in stderr
    assert "it is gone, though the table's metadata names it" in stderr, stderr[-2000:]
    assert "snapshot expiry or orphan-file cleanup" in stderr


def test_memory_budget_refusal_says_what_is_needed(table_factory):
    table = table_factory(20_000, 3)
    # 402.375Mi leaves 2.375 MiB per node after the 400 MiB interpreter baseline: 2 nodes need ~2.6
    # MiB each (a share of the rows, a whole file's read scratch and the decode threads' buffers),
    # 3 nodes fit.
    code, stderr = failed_local(table.metadata_location, "--memory-limit", "402.375Mi")
    assert code == 1
    assert "needs about" in stderr and "use at least" in stderr and "data nodes" in stderr
    # Under `local`, the advice names its own flags, and small sizes read in MiB, not "0.00 GiB".
    assert "(--data-nodes " in stderr and "(--memory-limit)" in stderr and "CLUSTER_SIZE" not in stderr
    assert "can use 2.4 MiB" in stderr and "--data-nodes 3" in stderr


def test_rows_that_decode_far_past_their_estimate_stop_the_load_before_an_oom_kill(tmp_path):
    """One string repeated: its Parquet pages compress ~1000x, so the manifests' statistics say
    a few MiB where the rows decode to ~400 MiB (the sampled expansion, which only ever lowers the
    fixed factor, does not raise it, and the footers' uncompressed size is that of a one-entry
    dictionary). The pre-load check passes; the data node must stop at its
    limit with the reason, not load on into the kernel's OOM kill (here, with no cgroup limit, it
    would just have loaded past its --memory-limit)."""
    import pyarrow as pa

    from kubeflow_data_cache.sample import make_catalog

    catalog = make_catalog(str(tmp_path / "wh"), tmp_path / "catalog.db")
    catalog.create_namespace("demo")
    rows = 400_000
    data = pa.table({"id": pa.array(range(rows), pa.int64()), "text": pa.array(["y" * 1000] * rows)})
    table = catalog.create_table("demo.repeated", schema=data.schema)
    table.append(data)
    del data
    termination_log = tmp_path / "termination-log"  # what Kubernetes shows as the pod's message
    # One data node: with two, each decoding its half's whole row group at once on this 2-CPU
    # machine, one CI run saw a node's watch report past the limit (550 MiB of 500; docs/cache.md).
    cache = LocalCache(
        catalog.load_table("demo.repeated").metadata_location,
        1,
        env={"TERMINATION_LOG": str(termination_log)},
        args=("--memory-limit", "500Mi"),
    )
    stderr = cache.wait_failure(timeout=DEADLINE)
    code = cache.proc.returncode
    assert code == 1
    assert "stopped its load before the kernel's OOM kill" in stderr
    assert "stopped its load before the kernel's OOM kill" in termination_log.read_text()
    # Stopped inside its one row group (as the watch stops it), the message says more nodes would
    # each decode it all again; a stop at a batch (were the decode to fit) advises both settings.
    assert (
        "give each data node more memory (--memory-limit; more data nodes, --data-nodes, do not shrink" in stderr
        or "give each data node more memory (--memory-limit) or use more data nodes (--data-nodes)" in stderr
    )
    # Its one row group decodes to ~390 MiB: decoded whole, it was in memory before the first
    # batch came, and the node first reported itself at ~560 MiB, past the limit. Read batch by
    # batch now (parquet_batches), it stops at a batch (~460 MiB here), or at the watch's margin.
    reached = re.search(r"its resident memory reached ([\d.]+) MiB of its 500.0 MiB limit", stderr)
    assert reached and float(reached.group(1)) < 500, stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["head", "--data-nodes", "1"], "`METADATA_LOC` is required"),
        (["head", "--metadata-loc", "x"], "the head needs the number of data nodes"),
        (["worker"], "a data node needs its index"),
        (["worker", "--index", "0"], "a data node needs the head's address"),
        (
            ["head", "--metadata-loc", "x", "--data-nodes", "1", "--memory-limit", "lots"],
            "`MEMORY_LIMIT` (--memory-limit) should be",
        ),
        (["local", "--metadata-loc", "x", "--data-nodes", "0"], "--data-nodes should be from 1 to 256"),
    ],
)
def test_bad_settings_exit_2_with_the_fix(args, message):
    env = {"PATH": "/usr/bin:/bin"}  # no METADATA_LOC / LWS_* from the outer environment
    result = data_cache(*args, env=env)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


def test_lws_env_is_read(tmp_path):
    """LWS_GROUP_SIZE=1 means no data node: the head refuses with the variable's name."""
    result = data_cache("head", env={"PATH": "/usr/bin:/bin", "METADATA_LOC": "x", "LWS_GROUP_SIZE": "1"})
    assert result.returncode == 2 and "`LWS_GROUP_SIZE` should be >= 2" in result.stderr


def test_a_worker_indexed_by_lws_names_its_index_in_every_log_line():
    """In a pod the index comes from LWS_WORKER_INDEX, not --index: the log prefix follows it
    (it read `node-` for every data node, so their logs could not be told apart)."""
    import subprocess
    import sys
    import time

    from tests.conftest import free_port

    port = free_port()  # the node's own port and the head's (nobody answers there)
    env = {"PATH": "/usr/bin:/bin", "LWS_WORKER_INDEX": "3", "LWS_LEADER_ADDRESS": "127.0.0.1"}
    env |= {"FLIGHT_PORT": str(port), "HEALTH_PORT": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kubeflow_data_cache", "worker"], stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        deadline = time.monotonic() + 60
        line = ""
        while "serving Flight" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stderr.readline()
        assert "serving Flight" in line, line
        assert " node-2 INFO " in line
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (7, "has at least 1007 live row"),
        # Not "point METADATA_LOC at the current metadata": data files never change once committed.
        (-7, "has 993 row(s) after deletes, expected at least 1000 by the table's metadata (which counts 1000)"),
    ],
)
def test_a_data_file_changed_after_its_commit_fails_the_load(tmp_path, extra, message):
    """The head splits rows by the manifests' record counts. A file rewritten in place with
    more rows than its manifest counts was cut at the count: its last rows were left out of
    the cache without a word. The node reading a file's tail now reads on to its end."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = create_sample_table(str(tmp_path / "wh"), 2000, 2)
    victim = sorted(Path(tmp_path / "wh").rglob("*.parquet"))[-1]
    rows = pq.read_table(victim)  # keeps the Iceberg field ids the reader maps by
    assert rows.num_rows == 1000
    changed = pa.concat_tables([rows, rows.slice(0, extra)]) if extra > 0 else rows.slice(0, 1000 + extra)
    pq.write_table(changed, victim)
    code, stderr = failed_local(table.metadata_location)
    assert code == 1
    assert message in stderr and victim.name in stderr
    assert "Repair the table (rewrite the file through the catalog) and restart the cache" in stderr
    assert "point METADATA_LOC" not in stderr


def test_a_missing_manifest_names_the_fix(tmp_path):
    """A manifest the metadata names, gone (an expired snapshot's files removed): the load said
    only "cannot plan a scan ... Path does not exist"."""
    table = create_sample_table(str(tmp_path / "wh"), 2000, 2)
    for manifest in Path(tmp_path / "wh").rglob("*.avro"):
        if not manifest.name.startswith("snap-"):  # the manifests, not the manifest lists
            manifest.unlink()
    code, stderr = failed_local(table.metadata_location)
    assert code == 1
    assert "a manifest it names is gone" in stderr
    assert "point METADATA_LOC at the current metadata.json" in stderr


def test_the_advised_node_count_under_local_is_the_fewest_that_loads(tmp_path):
    """`data-cache local` splits this machine's CPUs among its nodes (fewer load threads, less read
    scratch, per node as nodes are added); the advice sized every count with the running nodes'
    threads, and named 4 data nodes where 3 loaded."""
    from kubeflow_data_cache.constants import BASELINE_MEMORY_BYTES
    from kubeflow_data_cache.memory import local_load_threads
    from kubeflow_data_cache.plan import assign_rows, estimated_node_memory, open_table, plan_table

    table = create_sample_table(str(tmp_path / "wh"), 1_000_000, 8)
    plan, _ = plan_table(open_table(table.metadata_location), table.metadata_location)

    def peak(nodes: int) -> int:
        return max(estimated_node_memory(plan, a, local_load_threads(nodes))[1] for a in assign_rows(plan, nodes))

    limit = BASELINE_MEMORY_BYTES + peak(2) + (1 << 20)  # two nodes fit, with a MiB to spare
    assert peak(1) > limit - BASELINE_MEMORY_BYTES
    cache = LocalCache(table.metadata_location, 1, args=("--memory-limit", str(limit)))
    message = cache.wait_failure(timeout=DEADLINE)
    assert "use at least 2 data nodes (--data-nodes 2)" in message, message
    with running_cache(table.metadata_location, 2, args=("--memory-limit", str(limit))) as loaded:
        assert loaded.endpoint.startswith("grpc://")


def test_the_default_termination_log_is_written_only_where_the_kubelet_mounted_it(tmp_path, monkeypatch):
    """Outside a container the default path does not exist, and a process run as root created
    /dev/termination-log on the machine, every failed `data-cache local` overwriting the last."""
    from kubeflow_data_cache import runner
    from kubeflow_data_cache.config import build_config

    default = tmp_path / "dev" / "termination-log"
    default.parent.mkdir()
    monkeypatch.setattr(runner, "TERMINATION_LOG", str(default))
    runner._write_termination_log(None, "the load failed")  # TERMINATION_LOG unset
    assert not default.exists()
    default.write_text("")  # mounted by the kubelet
    runner._write_termination_log(None, "the load failed")
    assert default.read_text() == "the load failed"
    for chosen in (tmp_path / "mine", tmp_path / "dev" / "again"):  # TERMINATION_LOG set: written wherever it is
        runner._write_termination_log(str(chosen), "the load failed")
        assert chosen.read_text() == "the load failed"
    assert build_config("head", {"metadata_loc": "/t/m.json", "data_nodes": 1}, env={}).termination_log is None
    given = build_config("head", {"metadata_loc": "/t/m.json", "data_nodes": 1}, env={"TERMINATION_LOG": str(default)})
    assert given.termination_log == str(default)  # the default path, set explicitly: written where it is
