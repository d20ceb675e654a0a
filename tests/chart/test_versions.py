"""Trainer, JobSet and LWS versions: Chart.yaml is the reference, every other pin must agree."""

import re

import yaml

from tests.chart.render import CHART_DIR, MANIFESTS_DIR, REPO_ROOT


def chart_versions():
    meta = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    deps = {d["name"]: d["version"] for d in meta["dependencies"]}
    return meta["appVersion"], f"v{deps['jobset']}", f"v{deps['lws']}"


def test_defaults_target_trainer_2_1_0_jobset_0_10_1_lws_0_7_0():
    assert chart_versions() == ("v2.1.0", "v0.10.1", "v0.7.0")


def test_every_pin_agrees_with_chart_yaml():
    trainer, jobset, lws = chart_versions()
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    third_party = MANIFESTS_DIR / "third-party"
    pins = {
        "values.yaml jobset.image.tag": (values["jobset"]["image"]["tag"], jobset),
        "values.yaml lws.image.manager.tag": (values["lws"]["image"]["manager"]["tag"], lws),
        "manifests/base/manager image": (
            yaml.safe_load((MANIFESTS_DIR / "base" / "manager" / "kustomization.yaml").read_text())["images"][0][
                "newTag"
            ],
            trainer,
        ),
        "manifests/base app.kubernetes.io/version": (
            yaml.safe_load((MANIFESTS_DIR / "base" / "kustomization.yaml").read_text())["labels"][1]["pairs"][
                "app.kubernetes.io/version"
            ],
            trainer,
        ),
    }
    for name, version in (("trainer-crds", trainer), ("jobset", jobset), ("lws", lws)):
        kustomization = yaml.safe_load((third_party / name / "kustomization.yaml").read_text())
        refs = re.findall(r"(?:ref=|download/)(v[\d.]+)", " ".join(kustomization["resources"]))
        pins[f"third-party/{name} resource"] = (refs, [version])
        for image in kustomization.get("images", []):
            pins[f"third-party/{name} image {image['name']}"] = (image["newTag"], version)
    sums = re.findall(r"^(v[\d.]+) trainer\.kubeflow\.org_", (REPO_ROOT / "hack" / "sync-crds.sh").read_text(), re.M)
    pins["hack/sync-crds.sh sums"] = (trainer in sums, True)
    drifted = {name: got for name, (got, want) in pins.items() if got != want}
    assert drifted == {}, f"pins that disagree with Chart.yaml ({trainer}, jobset {jobset}, lws {lws}): {drifted}"
