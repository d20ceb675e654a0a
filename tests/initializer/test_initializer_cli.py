"""The `cache-initializer` console script: --help and --version answer without touching a cluster."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kubeflow_cache_initializer import __version__
from kubeflow_cache_initializer.main import cli

SCRIPT = Path(sys.executable).parent / "cache-initializer"


def test_help_lists_the_required_settings_and_runs_nothing():
    # Without a kubeconfig or the env, a run would fail; --help must exit 0 before any of it.
    done = subprocess.run([str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60, env={})
    assert done.returncode == 0, done.stderr
    for name in ("STORAGE_URI", "METADATA_LOC", "TRAIN_JOB_NAME", "CACHE_IMAGE", "docs/initializer.md"):
        assert name in done.stdout
    assert done.stderr == ""


@pytest.mark.parametrize("command", [[str(SCRIPT)], [sys.executable, "-m", "kubeflow_cache_initializer"]])
def test_version(command):
    done = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=60, env={})
    assert done.returncode == 0 and done.stdout.strip() == f"cache-initializer {__version__}"


def test_python_m_runs_the_initializer_and_fails_on_missing_settings():
    done = subprocess.run(
        [sys.executable, "-m", "kubeflow_cache_initializer"], capture_output=True, text=True, timeout=60, env={}
    )
    assert done.returncode == 2
    assert "STORAGE_URI" in done.stderr


def test_a_setting_passed_as_a_flag_is_refused_not_ignored(capsys):
    with pytest.raises(SystemExit) as exited:
        cli(["--cluster-size", "3"])
    assert exited.value.code == 2
    assert "unrecognized arguments: --cluster-size 3" in capsys.readouterr().err
