"""runtimes/torch-distributed-with-cache.yaml: the single source, and the chart and kustomize renders of it."""

import shutil

import helm_python
import pytest
import yaml

from tests.chart.render import (
    DATA_CACHE,
    RUNTIMES_DIR,
    build_kustomize,
    container,
    env_of,
    one,
    prepared_chart,
    replicated_job,
)
from tests.schemas import ObjectInvalid, validate_object

RUNTIME = "torch-distributed-with-cache"
SOURCE = RUNTIMES_DIR / f"{RUNTIME}.yaml"
JOBSET_NAME_FIELD = "metadata.labels['jobset.sigs.k8s.io/jobset-name']"


def source():
    return yaml.safe_load(SOURCE.read_text())


def without_added_labels(runtime, added_prefix):
    """The runtime minus the labels a render adds (helm.sh/*, app.kubernetes.io/*)."""
    labels = runtime["metadata"]["labels"]
    runtime["metadata"]["labels"] = {k: v for k, v in labels.items() if not k.startswith(added_prefix)}
    return runtime


def test_chart_renders_the_source_unchanged_with_default_values(cache_objects):
    rendered = one(cache_objects, "ClusterTrainingRuntime", RUNTIME)
    rendered["metadata"]["labels"] = {
        k: v for k, v in rendered["metadata"]["labels"].items() if not k.startswith(("app.kubernetes.io/", "helm.sh/"))
    }
    assert rendered == source()


def test_kustomize_applies_the_source_unchanged_but_for_the_recommended_labels():
    rendered = one(build_kustomize("overlays/data-cache"), "ClusterTrainingRuntime", RUNTIME)
    assert rendered["metadata"]["labels"]["app.kubernetes.io/component"] == "data-cache"
    assert without_added_labels(rendered, "app.kubernetes.io/") == source()


def test_initializer_step_meets_the_contract():
    init_job = replicated_job(source(), "dataset-initializer")
    assert init_job["replicas"] == 1
    assert (
        init_job["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"]
        == "dataset-initializer"
    )
    pod = init_job["template"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "kubeflow-trainer-cache-initializer"
    env = env_of(container(pod, "dataset-initializer"))
    assert env["CACHE_IMAGE"]["value"] == "ghcr.io/kubeflow-data-cache/cache:v0.1.0"
    assert env["TRAIN_JOB_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == JOBSET_NAME_FIELD


def test_node_step_waits_for_the_initializer_and_can_find_the_cache():
    node = replicated_job(source(), "node")
    assert node["dependsOn"] == [{"name": "dataset-initializer", "status": "Complete"}]
    assert node["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    env = env_of(container(node["template"]["spec"]["template"]["spec"], "node"))
    # DataCacheDataset dials grpc://$(TRAIN_JOB_NAME)-cache-service:50051.
    assert env["TRAIN_JOB_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == JOBSET_NAME_FIELD


def test_chart_refuses_a_source_without_the_initializer_container(tmp_path):
    """A drifted source fails the render with a message, instead of a runtime with stale images."""
    chart = tmp_path / "kubeflow-trainer"
    shutil.copytree(prepared_chart(), chart)
    runtime_file = chart / "files" / "runtimes" / f"{RUNTIME}.yaml"
    runtime_file.write_text(
        runtime_file.read_text().replace(
            "- name: dataset-initializer\n                      image", "- name: init\n                      image"
        )
    )
    with (
        helm_python.Chart.load(chart) as loaded,
        pytest.raises(helm_python.HelmRenderError, match="container named dataset-initializer"),
    ):
        loaded.render(DATA_CACHE, name="kubeflow-trainer", namespace="kubeflow-system")


def test_chart_reads_the_runtime_through_a_symlink_to_the_source():
    link = SOURCE.parents[1] / "charts" / "kubeflow-trainer" / "files" / "runtimes" / f"{RUNTIME}.yaml"
    assert link.is_symlink() and link.resolve() == SOURCE.resolve()


TLS_DIR = "/etc/data-cache/tls"
# The trainer's projection of the TLS Secret: the certificates, never the private key.
TRAINER_TLS_VOLUME = {
    "name": "data-cache-tls",
    "secret": {
        "secretName": "data-cache-tls",
        "optional": True,
        "items": [{"key": "ca.crt", "path": "ca.crt"}, {"key": "tls.crt", "path": "tls.crt"}],
    },
}


def trainer_pod(runtime: dict) -> dict:
    return replicated_job(runtime, "node")["template"]["spec"]["template"]["spec"]


def rendered_runtimes(cache_objects) -> dict[str, dict]:
    """The runtime as each install path delivers it: the source, the chart and kustomize."""
    return {
        "source": source(),
        "chart": one(cache_objects, "ClusterTrainingRuntime", RUNTIME),
        "kustomize": one(build_kustomize("overlays/data-cache"), "ClusterTrainingRuntime", RUNTIME),
    }


def test_trainers_mount_only_the_certificates_of_the_namespaces_tls_secret(cache_objects):
    """Optional, like the token: a namespace without the Secret gets an empty folder and plain
    grpc://. `items` keeps tls.key out of every trainer pod; optional also lets a Secret without
    ca.crt (`kubectl create secret tls`) mount its tls.crt alone."""
    for path, runtime in rendered_runtimes(cache_objects).items():
        pod = trainer_pod(runtime)
        assert [v for v in pod["volumes"] if v["name"] == "data-cache-tls"] == [TRAINER_TLS_VOLUME], path
        assert "tls.key" not in str(pod), path
        node = container(pod, "node")
        assert node["volumeMounts"] == [{"name": "data-cache-tls", "mountPath": TLS_DIR, "readOnly": True}], path
        env = env_of(node)
        assert env["DATA_CACHE_TLS_DIR"] == {"name": "DATA_CACHE_TLS_DIR", "value": TLS_DIR}, path
        assert env["DATA_CACHE_TLS_SERVER_NAME"]["value"] == "data-cache", path
        validate_object(runtime)


def test_trainers_and_cache_pods_agree_on_the_tls_secret_its_folder_and_name():
    """The trainer side here and the cache side the initializer builds read one Secret, at one
    path, checking one name: a drift would leave a trainer dialling plaintext to a TLS cache."""
    from kubeflow_cache_initializer import constants as c

    pod = trainer_pod(source())
    (volume,) = [v for v in pod["volumes"] if v["name"] == c.TLS_VOLUME]
    assert volume["secret"]["secretName"] == c.DEFAULT_TLS_SECRET
    env = env_of(container(pod, "node"))
    assert env[c.TLS_DIR_ENV]["value"] == c.TLS_MOUNT_PATH
    assert env[c.TLS_SERVER_NAME_ENV]["value"] == c.TLS_SERVER_NAME


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda v: v["secret"].update(optinal=True), "optinal"),
        (lambda v: v["secret"]["items"][0].pop("path"), "path"),
    ],
)
def test_the_validator_catches_a_broken_trainer_tls_volume(mutate, message):
    """Guards the guard: the Trainer CRD checks the runtime's pod volumes this deep."""
    runtime = source()
    (volume,) = [v for v in trainer_pod(runtime)["volumes"] if v["name"] == "data-cache-tls"]
    mutate(volume)
    with pytest.raises(ObjectInvalid, match=message):
        validate_object(runtime)


def test_a_bad_setting_fails_the_initializer_job_without_its_retry():
    """The initializer exits with ConfigError's code for a bad setting, which no retry can fix:
    the Job's podFailurePolicy fails at once on that code (and on no other), which it can only
    do with restartPolicy Never; an evicted pod does not use up the one retry."""
    from kubeflow_cache_initializer.errors import ConfigError, InitializerError

    job = replicated_job(source(), "dataset-initializer")["template"]["spec"]
    assert job["template"]["spec"]["restartPolicy"] == "Never"
    fail, ignore = job["podFailurePolicy"]["rules"]
    assert fail["action"] == "FailJob"
    assert fail["onExitCodes"] == {
        "containerName": "dataset-initializer",
        "operator": "In",
        "values": [ConfigError.exit_code],
    }
    assert InitializerError.exit_code not in fail["onExitCodes"]["values"]  # other failures keep their retry
    assert ignore == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
