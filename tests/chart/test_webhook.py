"""templates/webhook/: the admission webhook configurations and the certificate Secret."""

from tests.chart.rbac_rules import upstream_trainer_manifests
from tests.chart.render import NAMESPACE, build_kustomize, one, render_chart, select, selects

VALIDATOR = "validator.trainer.kubeflow.org"
DEFAULTER = "defaulter.trainer.kubeflow.org"
SERVICE = "kubeflow-trainer-controller-manager"


def shape(configuration):
    """What must match upstream: entry names, paths and rules (not namespaces or ports)."""
    return sorted(
        (w["name"], w["clientConfig"]["service"]["path"], str(w["rules"]), w["sideEffects"])
        for w in configuration["webhooks"]
    )


def upstream_validator():
    return next(o for o in upstream_trainer_manifests() if o["metadata"]["name"] == VALIDATOR)


def test_renders_the_validator_trainer_v2_1_0_serves(default_objects):
    validator = one(default_objects, "ValidatingWebhookConfiguration", VALIDATOR)
    assert shape(validator) == shape(upstream_validator())
    for hook in validator["webhooks"]:
        assert hook["clientConfig"]["service"] == {
            "name": SERVICE,
            "namespace": NAMESPACE,
            "path": hook["clientConfig"]["service"]["path"],
            "port": 443,
        }
        assert hook["failurePolicy"] == "Fail"
    one(default_objects, "Service", SERVICE)


def test_kustomize_validator_matches_upstream():
    objects = build_kustomize("overlays/manager")
    validator = one(objects, "ValidatingWebhookConfiguration", VALIDATOR)
    assert shape(validator) == shape(upstream_validator())
    assert {h["clientConfig"]["service"]["namespace"] for h in validator["webhooks"]} == {NAMESPACE}


def test_webhooks_follow_the_release_namespace():
    objects = render_chart(namespace="ml-platform")
    validator = one(objects, "ValidatingWebhookConfiguration", VALIDATOR)
    assert {h["clientConfig"]["service"]["namespace"] for h in validator["webhooks"]} == {"ml-platform"}


def test_renders_the_defaulter_only_when_webhook_defaulter_enabled_is_set(default_objects):
    assert select(default_objects, "MutatingWebhookConfiguration", DEFAULTER) == []
    objects = render_chart({"webhook": {"defaulter": {"enabled": True}, "failurePolicy": "Ignore"}})
    defaulter = one(objects, "MutatingWebhookConfiguration", DEFAULTER)
    assert [h["name"] for h in defaulter["webhooks"]] == ["defaulter.trainjob.trainer.kubeflow.org"]
    assert defaulter["webhooks"][0]["failurePolicy"] == "Ignore"


def test_certificate_secret_starts_empty_for_the_controller_to_fill(default_objects):
    secret = one(default_objects, "Secret", "kubeflow-trainer-webhook-cert")
    assert secret["metadata"]["namespace"] == NAMESPACE
    assert not secret.get("data") and not secret.get("stringData")


def test_shipped_runtime_skips_the_validator_so_one_pass_installs_it(cache_objects):
    """Helm 4 and `kubectl apply -k` create the validator before the controller serves it; with
    failurePolicy Fail the runtime would be refused unless the validator leaves it out."""
    chart_validator = one(cache_objects, "ValidatingWebhookConfiguration", VALIDATOR)
    kustomize_validator = one(build_kustomize("overlays/manager"), "ValidatingWebhookConfiguration", VALIDATOR)
    runtime = one(cache_objects, "ClusterTrainingRuntime", "torch-distributed-with-cache")
    for validator in (chart_validator, kustomize_validator):
        hooks = {h["name"]: h for h in validator["webhooks"]}
        runtimes = hooks.pop("validator.clustertrainingruntime.trainer.kubeflow.org")
        assert not selects(runtimes.get("objectSelector"), runtime["metadata"]["labels"])
        assert selects(runtimes.get("objectSelector"), {"trainer.kubeflow.org/framework": "torch"})
        # TrainJobs and namespaced runtimes are always validated.
        assert all("objectSelector" not in h for h in hooks.values())
