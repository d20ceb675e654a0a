"""`python -m bench [--quick | --full | --smoke] [--out DIR] [--no-readme]`: see docs/benchmarks.md."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from bench import report
from bench.config import CONFIGS
from bench.run import run
from bench.stats import Progress

REPO_ROOT = Path(__file__).resolve().parents[1]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    grid = parser.add_mutually_exclusive_group()
    grid.add_argument("--quick", dest="grid", action="store_const", const="quick", help="a few minutes (default)")
    grid.add_argument("--full", dest="grid", action="store_const", const="full", help="the growth grid to 1e7 rows")
    grid.add_argument("--smoke", dest="grid", action="store_const", const="smoke", help="tiny, for the tests")
    parser.set_defaults(grid="quick")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results", help="results folder")
    parser.add_argument(
        "--no-readme",
        action="store_true",
        help="leave the tables alone (README's quick one, docs/benchmarks.md's full one)",
    )
    parser.add_argument("--readme", type=Path, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = CONFIGS[args.grid]
    command = (
        "make bench" + (" FULL=1" if cfg.name == "full" else "") if cfg.name != "smoke" else "python -m bench --smoke"
    )
    progress = Progress()
    # A SIGTERM (a CI timeout, `kill`) would end this process without run()'s clean-up, and the
    # clusters and moto it started live in sessions of their own: make it an interrupt.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        result = run(cfg, progress)
    except KeyboardInterrupt:
        progress("interrupted: every process the run started has been stopped")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    # Only a real grid replaces its latest.json/png (full-latest.* for the full grid); smoke never does.
    latest = report.latest_name(cfg.name) if cfg.name != "smoke" else None
    json_path = report.write_json(result, args.out, stamp, latest)
    png_path = report.write_png(result, args.out, stamp, latest)
    progress(f"wrote {json_path} and {png_path} in {result['duration_seconds']:.0f}s")
    block = report.markdown(result, command)
    for h in report.headline(result):
        measured = "n/a" if h["measured"] is None else f"{h['measured']:.2f}"
        progress(f"target {h['figure']}: {measured} ({h['target']}): met {report.verdict_text(h)}")
    if args.no_readme or cfg.name == "smoke":  # a smoke run's figures never replace a published table
        return 0
    # The quick grid's table is README's performance section; the full grid's is in docs/benchmarks.md.
    full = cfg.name == "full"
    target = args.readme or REPO_ROOT / ("docs/benchmarks.md" if full else "README.md")
    markers = (report.FULL_START_MARKER, report.FULL_END_MARKER) if full else (report.START_MARKER, report.END_MARKER)
    if report.update_readme(target, block, *markers):
        progress(f"updated the performance table in {target}")
    else:
        print(block)
        progress(f"{target} has no {markers[0]} ... {markers[1]} markers: table printed above")
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
