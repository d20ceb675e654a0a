"""The benchmark suite's machinery on a tiny grid: every case runs and reports; no timing asserted.

Speed and memory are measured by `make bench`, never asserted here: figures on a shared
machine are noise. What is pinned: each case appears with positive figures, the JSON and PNG
are written, and the README table keeps its columns and touches only the text between markers.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # `bench` lives at the repo root, outside the installed packages
    sys.path.insert(0, str(REPO_ROOT))

from bench import report  # noqa: E402
from bench.cases.serve import cpu_ratios, serve_passes  # noqa: E402
from bench.config import SMOKE, epochs_per_repeat  # noqa: E402
from bench.run import run  # noqa: E402

EPOCH_METHODS = ("cache", "pyiceberg", "pyarrow.dataset", "pyiceberg-s3")
# (resident - baseline) may dip below zero for a table of a few KiB, at ready, idle after serving
# or at the peak: one idle node reads a couple of MiB away from another. Finite is all that holds.
MAY_BE_NEGATIVE = {
    "overhead_ratio",
    "overhead_ratio_peak_loading",
    "overhead_ratio_after_serve",
    "overhead_ratio_peak_serving",
}
# CPU time comes in clock ticks (10 ms): a tiny table's read may take none of them.
MAY_BE_ZERO = {"server_cpu_s_per_gb", "bare_cpu_s_per_gb"}


@pytest.fixture(scope="module")
def smoke_result() -> dict:
    return run(SMOKE, progress=lambda message: None)


def test_every_case_runs_with_positive_figures(smoke_result, tmp_path):
    data = json.loads(report.write_json(smoke_result, tmp_path, "smoke", latest=None).read_text())
    seen = {(c["case"], c["variant"], c["shuffled"]) for c in data["cases"]}
    expected = {("memory-baseline", "idle-node", None), ("serve", "doget", False), ("load", "cache", None)}
    expected |= {("memory", "data-node", None)}
    expected |= {("epoch", m, s) for m in EPOCH_METHODS for s in (False, True)}
    expected |= {("resume", m, s) for m in ("node-skip", "client-drop") for s in (False, True)}
    # serve results carry shuffled=None; compare on what each case defines.
    seen = {(k, v, s if k in ("epoch", "resume") else None) for k, v, s in seen}
    expected = {(k, v, s if k in ("epoch", "resume") else None) for k, v, s in expected}
    assert seen == expected
    for case in data["cases"]:
        assert case["figures"], case
        for name, fig in case["figures"].items():
            assert fig["min"] <= fig["median"] <= fig["max"], (case["case"], name)
            if name in MAY_BE_NEGATIVE:
                assert math.isfinite(fig["median"])
            elif name in MAY_BE_ZERO:
                assert fig["min"] >= 0, (case["case"], name, fig)
            else:
                assert fig["min"] > 0, (case["case"], case["variant"], name, fig)
    assert {"cpus", "memory_bytes", "versions", "load_average_end"} <= data["machine"].keys()


def test_core_figures_are_present(smoke_result):
    serve = report.find(smoke_result, case="serve")
    assert {"rows_per_s", "gb_per_s", "loopback_gb_per_s", "ratio_to_loopback"} <= serve["figures"].keys()
    assert {"server_cpu_s_per_gb", "bare_cpu_s_per_gb"} <= serve["figures"].keys()
    assert serve["figures"]["passes"]["median"] == 1  # the smoke grid asks for one pass per repeat
    load = report.find(smoke_result, case="load", source="file")
    assert {
        "head_load_seconds",
        "ready_wall_seconds",
        "to_arrow_seconds",
        "to_arrow_fresh_call_seconds",
        "ratio_head_to_warm",
        "ratio_head_to_fresh_call",
    } <= load["figures"].keys()
    # The fresh process's call is part of that process's whole run.
    figures = load["figures"]
    assert 0 < figures["to_arrow_fresh_call_seconds"]["max"] < figures["to_arrow_cold_seconds"]["min"]
    memory = report.find(smoke_result, case="memory")
    assert {
        "resident_bytes",
        "arrow_bytes",
        "baseline_bytes",
        "resident_bytes_after_serve",
        "overhead_ratio_after_serve",
        "overhead_ratio_peak_serving",
    } <= memory["figures"].keys()

    epoch = report.find(smoke_result, case="epoch", variant="pyiceberg", shuffled=False)
    assert "cache_speedup" in epoch["figures"]


def test_ratios_are_the_right_way_round_in_every_repeat(smoke_result):
    """Each paired ratio, recomputed from its own repeat's two measurements: a swapped pair
    (a ratio upside down) still gave positive figures, and nothing else would have noticed."""

    def raw(case: dict, name: str) -> list[float]:
        return case["raw"][name]

    serve = report.find(smoke_result, case="serve")
    pairs = zip(raw(serve, "ratio_to_loopback"), raw(serve, "gb_per_s"), raw(serve, "loopback_gb_per_s"), strict=True)
    for ratio, doget, loopback in pairs:
        assert ratio == pytest.approx(doget / loopback, rel=1e-6)  # a share of loopback: DoGet over it
    cpu = zip(raw(serve, "server_cpu_s_per_gb"), raw(serve, "bare_cpu_s_per_gb"), strict=True)
    # The cache's CPU over the bare server's, for the repeats where both show (clock ticks).
    assert serve["raw"].get("cpu_ratio_to_bare_flight", []) == pytest.approx([c / b for c, b in cpu if b > 0 and c > 0])
    for shuffled in (False, True):
        cache = report.find(smoke_result, case="epoch", variant="cache", shuffled=shuffled)
        for method in EPOCH_METHODS:
            other = report.find(smoke_result, case="epoch", variant=method, shuffled=shuffled)
            expected = [a / b for a, b in zip(raw(other, "seconds"), raw(cache, "seconds"), strict=True)]
            assert raw(other, "cache_speedup") == pytest.approx(expected)  # the method's time over the cache's
    for source in ("file", "s3"):
        load = report.find(smoke_result, case="load", source=source)
        head, fresh = raw(load, "head_load_seconds"), raw(load, "to_arrow_fresh_call_seconds")
        assert raw(load, "ratio_head_to_fresh_call") == pytest.approx([a / b for a, b in zip(head, fresh, strict=True)])
    for head in report.headline(smoke_result):  # every target finds its figure: none reads n/a
        assert head["measured"] is not None and head["repeats"] >= 1, head


def test_png_is_written(smoke_result, tmp_path):
    path = report.write_png(smoke_result, tmp_path, "smoke", latest=None)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_readme_table_has_the_columns_and_stays_between_markers(smoke_result, tmp_path):
    block = report.markdown(smoke_result, "python -m bench --smoke")
    header = next(line for line in block.splitlines() if line.startswith("| case |"))
    assert [cell.strip() for cell in header.strip("|").split("|")] == list(report.TABLE_COLUMNS)
    assert "`python -m bench --smoke`" in block
    body_rows = [line for line in block.splitlines() if line.startswith("| epoch |")]
    assert len(body_rows) == len(EPOCH_METHODS) * 2

    readme = tmp_path / "README.md"
    before, after = "# Title\n\n## Performance\n\n", "\n\n## Next section\nkept as is\n"
    readme.write_text(f"{before}{report.START_MARKER}\nold table\n{report.END_MARKER}{after}")
    assert report.update_readme(readme, block)
    text = readme.read_text()
    assert text.startswith(before + report.START_MARKER) and text.endswith(report.END_MARKER + after)
    assert "old table" not in text and block.strip() in text


def test_markers_quoted_in_prose_are_not_the_table(tmp_path):
    doc = tmp_path / "benchmarks.md"
    prose = f"The table goes between `{report.FULL_START_MARKER}` and `{report.FULL_END_MARKER}` below.\n"
    doc.write_text(f"{prose}\n{report.FULL_START_MARKER}\nold\n{report.FULL_END_MARKER}\n")
    assert report.update_readme(doc, "new", report.FULL_START_MARKER, report.FULL_END_MARKER)
    assert doc.read_text() == f"{prose}\n{report.FULL_START_MARKER}\nnew\n{report.FULL_END_MARKER}\n"


def test_readme_without_markers_is_left_alone(smoke_result, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# Title\nno markers here\n")
    assert not report.update_readme(readme, report.markdown(smoke_result, "make bench"))
    assert readme.read_text() == "# Title\nno markers here\n"
    assert not report.update_readme(tmp_path / "missing.md", "x")


def test_full_grid_keeps_its_own_latest_files_and_table(smoke_result, tmp_path):
    assert report.latest_name("quick") == "latest" and report.latest_name("full") == "full-latest"
    report.write_json(smoke_result, tmp_path, "stamp", latest=report.latest_name("full"))
    assert (tmp_path / "full-latest.json").exists() and not (tmp_path / "latest.json").exists()

    doc = tmp_path / "benchmarks.md"
    quick = f"{report.START_MARKER}\nquick table\n{report.END_MARKER}"
    doc.write_text(f"# Benchmarks\n{quick}\n{report.FULL_START_MARKER}\nold\n{report.FULL_END_MARKER}\n")
    assert report.update_readme(doc, "new full table", report.FULL_START_MARKER, report.FULL_END_MARKER)
    text = doc.read_text()
    assert "new full table" in text and "old" not in text and quick in text  # the quick table is untouched


def test_serve_repeats_read_the_table_enough_times_to_move_the_asked_bytes():
    assert serve_passes(table_bytes=100, repeat_bytes=0) == 1
    assert serve_passes(table_bytes=100, repeat_bytes=100) == 1
    assert serve_passes(table_bytes=100, repeat_bytes=101) == 2
    assert serve_passes(table_bytes=117 << 20, repeat_bytes=256 << 20) == 3


def test_epoch_repeats_time_whole_epochs_enough_to_read_the_asked_rows():
    assert epochs_per_repeat(rows=3_000, repeat_rows=0) == 1
    assert epochs_per_repeat(rows=2_000_000, repeat_rows=10_000_000) == 5
    assert epochs_per_repeat(rows=200_000, repeat_rows=10_000_000) == 50
    assert epochs_per_repeat(rows=3_000_000, repeat_rows=10_000_000) == 4
    assert epochs_per_repeat(rows=0, repeat_rows=10) == 10  # an empty table: still a whole number of epochs


def test_timed_epochs_read_each_epoch_in_its_own_order_and_report_one_epochs_time():
    """Every epoch of a repeat is its own epoch number (its own shuffle order), and the figure is
    per epoch, not per repeat; an epoch short of rows fails the run."""
    import torch

    from bench.cases.epoch import _timed_epochs

    asked = []

    def make(shuffled, number):
        asked.append((shuffled, number))
        return iter([{"x": torch.zeros(4, dtype=torch.float64)}, {"x": torch.zeros(2, dtype=torch.float64)}])

    seconds, nbytes = _timed_epochs(make, "m", True, range(10, 15), rows=6)
    assert asked == [(True, n) for n in range(10, 15)]
    assert nbytes == 6 * 8 and seconds > 0
    with pytest.raises(RuntimeError, match="epoch 3 via m yielded 6 rows, expected 7"):
        _timed_epochs(make, "m", False, range(3, 5), rows=7)


@pytest.mark.parametrize(
    ("values", "op", "target", "met"),
    [
        ([0.7, 0.65, 0.8, 0.62, 0.9], ">=", 0.6, True),
        ([0.7, 0.55, 0.58, 0.62, 0.9], ">=", 0.6, True),  # median 0.62: met, by 3 of 5 repeats
        ([0.5, 0.55, 0.58, 0.62, 0.4], ">=", 0.6, False),
        # A median far from the target is a miss however the repeats spread (74.8% of a bare
        # Flight server against 90% read "within noise" when the verdict went by a share of them).
        ([0.92, 0.73, 0.75, 0.68, 1.02], ">=", 0.9, False),
        ([1.1], "<=", 1.3, True),
        ([1.4], "<=", 1.3, False),
        ([1.95, 1.2, 1.25], "<=", 1.3, True),
        ([], "<=", 1.3, None),
        # A memory ratio below zero (a baseline above the node) is a broken measurement, not met.
        ([0.9, -9.49, 1.0], "<=", 1.3, None),
    ],
)
def test_a_verdict_goes_by_the_median_of_the_repeats(values, op, target, met):
    assert report.verdict(values, op, target) == met


_PEAK_SCRIPT = """
import sys
block = bytearray(200 << 20)  # written (zeroed): 200 MiB resident, then freed
del block
print("freed", flush=True)
sys.stdin.readline()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/PID/clear_refs")
def test_the_peak_while_serving_starts_at_the_reset_not_at_the_load():
    """A load's decode peak must not count as a serving peak: reset_peak starts the mark afresh."""
    from bench.cases.memory import peak_bytes, reset_peak

    proc = subprocess.Popen(
        [sys.executable, "-c", _PEAK_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "freed"
        before = peak_bytes(proc.pid)
        reset_peak(proc.pid)
        after = peak_bytes(proc.pid)
    finally:
        proc.communicate("\n", timeout=30)
    assert before > 200 << 20
    assert after < 100 << 20, f"the high-water mark stayed at {after / 2**20:.0f} MiB after the reset"


def test_a_run_started_on_a_busy_machine_says_so(smoke_result):
    cpus = smoke_result["machine"]["cpus"]
    quiet = {**smoke_result, "machine": {**smoke_result["machine"], "load_average_start": [cpus - 0.5, 0, 0]}}
    busy = {**smoke_result, "machine": {**smoke_result["machine"], "load_average_start": [cpus + 1.0, 0, 0]}}
    assert "Busy machine" not in report.markdown(quiet, "make bench")
    assert f"load average was {cpus + 1.0:.1f} on {cpus} CPUs" in report.markdown(busy, "make bench")


@pytest.mark.parametrize(("grid", "writes"), [("--smoke", False), ("--quick", True)])
def test_only_a_real_grid_replaces_the_readme_table(smoke_result, tmp_path, monkeypatch, grid, writes):
    """A smoke run's 3,000-row figures once replaced the published table when `--no-readme`
    was left out. The run itself is the smoke result already measured (real figures), handed to
    the command line as if its grid had produced them."""
    import bench.__main__ as cli

    monkeypatch.setattr(cli, "run", lambda cfg, progress: smoke_result)
    readme = tmp_path / "README.md"
    readme.write_text(f"{report.START_MARKER}\npublished\n{report.END_MARKER}\n")
    assert cli.main([grid, "--out", str(tmp_path / "out"), "--readme", str(readme)]) == 0
    assert ("published" not in readme.read_text()) is writes


def test_a_terminated_run_stops_every_process_it_started(tmp_path):
    """SIGTERM (a CI timeout, `kill`) ended the run without its clean-up: the clusters and moto
    live in sessions of their own, so they and the temp folder outlived it."""
    import contextlib
    import os
    import signal
    import time

    import psutil

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    started: list[psutil.Process] = []
    bench = subprocess.Popen(
        [sys.executable, "-m", "bench", "--smoke", "--out", str(tmp_path / "out")],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and bench.poll() is None:
            started = psutil.Process(bench.pid).children(recursive=True)
            if any("data-cache" in " ".join(p.cmdline()) for p in started if p.is_running()):
                break
            time.sleep(0.2)
        assert bench.poll() is None and started, "the run ended before it started a cluster"
        started = psutil.Process(bench.pid).children(recursive=True)  # the cluster's own processes too
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 130
        _, alive = psutil.wait_procs(started, timeout=15)
        assert not alive, [" ".join(p.cmdline()) for p in alive]
        assert not list(tmp_path.glob("data-cache-bench-*")), "the run's temp folder was left behind"
    finally:  # whatever the outcome, nothing of this run outlives the test
        for proc in [bench, *(p for p in started if p.is_running())]:
            with contextlib.suppress(Exception):
                proc.kill()


def test_a_cluster_that_loaded_fewer_rows_than_the_table_fails_the_run():
    """Load and memory figures of a cache that loaded part of the table would read as a fast
    load and a lean node; the run stops instead."""
    from bench.cases.load import record_cluster
    from bench.stats import CaseResult
    from bench.tables import BenchTable
    from kubeflow_data_cache.sample import SampleTable

    table = BenchTable(SampleTable("file:///t/metadata.json", "demo", "events", rows=1000, files=1), "file", {}, {})
    status = {"rows": 999, "bytes": 10, "load_seconds": 0.1, "nodes": []}
    with pytest.raises(RuntimeError, match="loaded 999 rows of a 1000-row table"):
        record_cluster(CaseResult("load", "cache", 1000, 2), object(), status, table)


def test_a_repeat_whose_cpu_time_read_no_clock_tick_on_either_side_gets_no_ratio():
    """A tiny read can take less than one 10 ms tick: a ratio of 0 (or a division by 0) is the
    clock's, and read as a server that spent nothing (the smoke grid failed on such a 0)."""
    assert cpu_ratios([0.4, 0.0, 0.3, 0.0], [0.2, 0.5, 0.0, 0.0]) == [2.0]
