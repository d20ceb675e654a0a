"""`helm lint` (through hack/helm.py, as `make lint` runs it) is clean, offline, from a fresh clone."""

import shutil
import subprocess
import sys

import helm_python
import pytest

from tests.chart.render import CHART_DIR, REPO_ROOT, prepared_chart


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"dataCache": {"enabled": True}},
        {"dataCache": {"enabled": True, "metrics": {"podMonitor": {"enabled": True}}}},
    ],
)
def test_helm_lint_strict_is_clean(values):
    report = helm_python.lint(prepared_chart(), values, strict=True, kube_version="v1.31.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == []


def test_lint_cli_fills_the_subcharts_of_a_fresh_clone(tmp_path):
    chart = tmp_path / "kubeflow-trainer"
    shutil.copytree(CHART_DIR, chart, symlinks=False, ignore=shutil.ignore_patterns("crds", "charts"))
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "hack" / "helm.py"), "lint", str(chart)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no failures" in result.stdout
    assert sorted(p.name for p in (chart / "charts").glob("*.tgz")) == ["jobset-0.10.1.tgz", "lws-0.7.0.tgz"]


def test_lint_cli_fails_on_a_broken_template(tmp_path):
    chart = tmp_path / "kubeflow-trainer"
    shutil.copytree(prepared_chart(), chart)
    (chart / "templates" / "broken.yaml").write_text("kind: ConfigMap\nmetadata: {{ .Values.nope.nope }}\n")
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "hack" / "helm.py"), "lint", str(chart)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    assert "broken.yaml" in result.stdout


def test_template_cli_names_a_values_file_it_cannot_read(tmp_path):
    missing = tmp_path / "nope.yaml"
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "hack" / "helm.py"), "template", str(prepared_chart()), "-f", str(missing)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip() == f"error: cannot read values file {missing}: No such file or directory"
