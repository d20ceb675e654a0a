"""hack/sync-crds.sh: pinned CRDs into crds/ (sha256-checked), subcharts into charts/, offline too."""

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from tests.chart.render import CHART_DIR, REPO_ROOT, shared_dir

SCRIPT = REPO_ROOT / "hack" / "sync-crds.sh"
CRD_FILES = [
    "trainer.kubeflow.org_clustertrainingruntimes.yaml",
    "trainer.kubeflow.org_trainingruntimes.yaml",
    "trainer.kubeflow.org_trainjobs.yaml",
]


def fresh_chart(tmp_path: Path, *, with_subcharts: bool = False) -> Path:
    """A chart as a fresh clone has it; with_subcharts keeps the subchart step off the network."""
    chart = tmp_path / "kubeflow-trainer"
    shutil.copytree(CHART_DIR, chart, symlinks=True, ignore=shutil.ignore_patterns("crds", "charts"))
    if with_subcharts:
        (chart / "charts").mkdir()
        for package in (shared_dir() / "charts").glob("*.tgz"):
            shutil.copy2(package, chart / "charts")
    return chart


def sync(chart: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT)],
        capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "PY": sys.executable, "CHART_DIR": str(chart), "SHARED_DIR": str(shared_dir()), **env},
    )  # fmt: skip


def test_offline_copies_the_pinned_crds_and_subcharts(tmp_path):
    chart = fresh_chart(tmp_path)
    result = sync(chart, OFFLINE="1")
    assert result.returncode == 0, result.stderr
    assert "offline copy" in result.stdout
    for name in CRD_FILES:
        assert (chart / "crds" / name).read_bytes() == (shared_dir() / "crds" / "trainer-v2.1.0" / name).read_bytes()
    assert sorted(p.name for p in (chart / "charts").glob("*.tgz")) == ["jobset-0.10.1.tgz", "lws-0.7.0.tgz"]


def test_download_is_checked_against_the_recorded_sums(tmp_path):
    mirror = tmp_path / "mirror"
    shutil.copytree(shared_dir() / "crds" / "trainer-v2.1.0", mirror)
    chart = fresh_chart(tmp_path, with_subcharts=True)
    result = sync(chart, TRAINER_CRDS_URL=f"file://{mirror}")
    assert result.returncode == 0, result.stderr
    assert f"from file://{mirror}" in result.stdout


def test_a_download_with_the_wrong_sum_fails_instead_of_falling_back(tmp_path):
    mirror = tmp_path / "mirror"
    shutil.copytree(shared_dir() / "crds" / "trainer-v2.1.0", mirror)
    with (mirror / CRD_FILES[2]).open("a") as crd:
        crd.write("# tampered\n")
    chart = fresh_chart(tmp_path, with_subcharts=True)
    result = sync(chart, TRAINER_CRDS_URL=f"file://{mirror}")
    assert result.returncode != 0
    assert f"{CRD_FILES[2]} has sha256" in result.stderr
    assert not (chart / "crds").exists()


def test_a_failed_download_falls_back_to_shared_and_says_so(tmp_path):
    chart = fresh_chart(tmp_path, with_subcharts=True)
    result = sync(chart, TRAINER_CRDS_URL=f"file://{tmp_path}/nowhere")
    assert result.returncode == 0, result.stderr
    assert "falling back" in result.stderr and "offline copy" in result.stdout


def test_an_unpinned_version_is_refused(tmp_path):
    chart = fresh_chart(tmp_path)
    meta = chart / "Chart.yaml"
    meta.write_text(meta.read_text().replace("appVersion: v2.1.0", "appVersion: v9.9.9"))
    result = sync(chart, OFFLINE="1")
    assert result.returncode != 0
    assert "no sha256 sums recorded for Trainer v9.9.9" in result.stderr


def sync_with_helm(tmp_path: Path, helm_script: str) -> tuple[Path, subprocess.CompletedProcess]:
    """sync-crds on an admin's machine: no Python venv, ``helm_script`` as the helm CLI on PATH
    (the real binary cannot run here: no network, not installed), the CRDs from a local mirror."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "helm").write_text(helm_script)
    (bin_dir / "helm").chmod(0o755)
    chart = fresh_chart(tmp_path)
    mirror = tmp_path / "mirror"
    shutil.copytree(shared_dir() / "crds" / "trainer-v2.1.0", mirror)
    result = sync(chart, PY=str(tmp_path / "no-venv" / "python"), PATH=f"{bin_dir}:/usr/bin:/bin",
                  TRAINER_CRDS_URL=f"file://{mirror}")  # fmt: skip
    return chart, result


def test_without_the_venv_the_helm_cli_fills_the_subcharts(tmp_path):
    calls = tmp_path / "helm-calls"
    chart, result = sync_with_helm(tmp_path, f'#!/bin/sh\necho "$@" >> {calls}\necho "Saving 2 charts"\n')
    assert result.returncode == 0, result.stderr
    assert calls.read_text().split() == ["dependency", "build", str(chart)]
    assert "subcharts: Saving 2 charts" in result.stdout
    assert sorted(p.name for p in (chart / "crds").iterdir()) == CRD_FILES


def test_without_the_venv_offline_the_pinned_subcharts_are_copied(tmp_path):
    chart = fresh_chart(tmp_path)
    result = sync(chart, OFFLINE="1", PY=str(tmp_path / "no-venv" / "python"))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (chart / "charts").glob("*.tgz")) == ["jobset-0.10.1.tgz", "lws-0.7.0.tgz"]
    assert result.stdout.count("(offline copy)") == 3  # the CRDs, then each subchart


def test_without_the_venv_a_failing_helm_falls_back_to_the_pinned_subcharts(tmp_path):
    chart, result = sync_with_helm(tmp_path, '#!/bin/sh\necho "Error: no route to registry.k8s.io" >&2\nexit 1\n')
    assert result.returncode == 0, result.stderr
    assert "helm dependency build failed (Error: no route to registry.k8s.io" in result.stderr
    assert sorted(p.name for p in (chart / "charts").glob("*.tgz")) == ["jobset-0.10.1.tgz", "lws-0.7.0.tgz"]


def test_without_the_venv_helm_or_pinned_subcharts_the_error_names_the_ways_out(tmp_path):
    shared = tmp_path / "shared"
    shutil.copytree(shared_dir() / "crds", shared / "crds")  # the CRDs, but no subchart packages
    chart = fresh_chart(tmp_path)
    result = sync(chart, OFFLINE="1", PY=str(tmp_path / "no-venv" / "python"), SHARED_DIR=str(shared))
    assert result.returncode == 1
    assert "subchart jobset-0.10.1.tgz is in neither" in result.stderr
    assert "helm CLI" in result.stderr and "make setup" in result.stderr


def test_package_replaces_crds_left_by_an_earlier_version(tmp_path):
    """`hack/helm.py package` syncs every time: CRDs already in crds/ (an earlier appVersion's, or
    a file edited by hand) never ship in a chart that names another version."""
    chart = fresh_chart(tmp_path, with_subcharts=True)
    # The chart's runtime file links into the repo's runtimes/: packaged, the copy needs the file.
    for link in [p for p in chart.rglob("*") if p.is_symlink()]:
        target = (CHART_DIR / link.relative_to(chart)).resolve()
        link.unlink()
        shutil.copy2(target, link)
    (chart / "crds").mkdir()
    (chart / "crds" / CRD_FILES[0]).write_text("# the CRD of an earlier Trainer version\n")
    (chart / "crds" / "trainer.kubeflow.org_retired.yaml").write_text("# a CRD that release dropped\n")
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "hack" / "helm.py"), "package", str(chart), "--destination", str(tmp_path / "dist")],
        capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "PY": sys.executable, "SHARED_DIR": str(shared_dir()), "OFFLINE": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (packaged,) = (tmp_path / "dist").glob("kubeflow-trainer-*.tgz")
    with tarfile.open(packaged) as archive:
        crds = {
            Path(m.name).name: archive.extractfile(m).read()
            for m in archive
            if m.name.startswith("kubeflow-trainer/crds/") and m.isfile()
        }
    pinned = shared_dir() / "crds" / "trainer-v2.1.0"
    assert crds == {name: (pinned / name).read_bytes() for name in CRD_FILES}


def test_package_without_the_pinned_crds_offline_fails_naming_the_step_not_a_traceback(tmp_path):
    chart = fresh_chart(tmp_path, with_subcharts=True)
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "hack" / "helm.py"), "package", str(chart), "--destination", str(tmp_path / "dist")],
        capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "PY": sys.executable, "SHARED_DIR": str(tmp_path / "none"), "OFFLINE": "1"},
    )  # fmt: skip
    assert result.returncode == 1
    assert "error: hack/sync-crds.sh failed (exit 1): the chart was not packaged" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "dist").exists()
