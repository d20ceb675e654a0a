"""Summaries over repeats, paired ratios, machine facts and the progress line."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import psutil


def summary(values: list[float]) -> dict[str, float]:
    """min / median / max over repeats (one value gives the same figure three times)."""
    if not values:
        raise ValueError("no values to summarise")
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def paired_ratio(num: list[float], den: list[float]) -> list[float]:
    """Ratios of measurements taken side by side (repeat i with repeat i), so drift cancels.

    With unequal counts (different repeat schedules) it falls back to the ratio of medians.
    """
    if len(num) == len(den):
        return [a / b for a, b in zip(num, den, strict=True) if b > 0]
    return [statistics.median(num) / statistics.median(den)]


@dataclass
class CaseResult:
    """One row of results: a case at one point of the grid, each figure over its repeats."""

    case: str  # serve, epoch, load, memory, memory-baseline
    variant: str  # what was measured (doget, cache, pyiceberg, ...)
    rows: int
    nodes: int | None = None
    clients: int | None = None
    shuffled: bool | None = None
    source: str = "file"  # where the table lives: file or s3 (moto)
    raw: dict[str, list[float]] = field(default_factory=dict)
    notes: str = ""

    def add(self, name: str, value: float) -> None:
        self.raw.setdefault(name, []).append(float(value))

    def as_dict(self) -> dict[str, Any]:
        figures = {name: summary(values) for name, values in self.raw.items() if values}
        return {
            "case": self.case,
            "variant": self.variant,
            "rows": self.rows,
            "nodes": self.nodes,
            "clients": self.clients,
            "shuffled": self.shuffled,
            "source": self.source,
            "figures": figures,
            "raw": self.raw,
            "notes": self.notes,
        }


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def _git_dirty() -> bool | None:
    """Whether the tree differs from the commit (results of uncommitted code say so)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_facts() -> dict[str, Any]:
    """What a reader needs to judge the figures: the box, the load on it, the versions."""
    import numpy
    import pyarrow
    import pyiceberg
    import torch

    return {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "load_average_start": list(os.getloadavg()),
        "versions": {
            "pyarrow": pyarrow.__version__,
            "pyiceberg": pyiceberg.__version__,
            "torch": torch.__version__,
            "numpy": numpy.__version__,
        },
        "git_commit": _git_commit(),
        "git_dirty": _git_dirty(),
    }


class Progress:
    """One line per case on stderr, with the time since the run started."""

    def __init__(self, stream=None) -> None:
        self.started = time.monotonic()
        self.stream = stream or sys.stderr

    def __call__(self, message: str) -> None:
        print(f"[bench {time.monotonic() - self.started:6.1f}s] {message}", file=self.stream, flush=True)


def gb(nbytes: float) -> float:
    return nbytes / 1e9
