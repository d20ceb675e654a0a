{{/* The controller looks these two configurations up by name: they cannot follow the release name. */}}
{{- define "trainer.webhook.validating.name" -}}validator.trainer.kubeflow.org{{- end }}
{{- define "trainer.webhook.mutating.name" -}}defaulter.trainer.kubeflow.org{{- end }}

{{- define "trainer.webhook.secret.name" -}}
{{ include "trainer.fullname" . }}-webhook-cert
{{- end }}

{{- define "trainer.webhook.labels" -}}
{{ include "trainer.labels" . }}
app.kubernetes.io/component: webhook
{{- end }}

{{/* One webhook entry: (list $ "name" "path" "resource" [skippable]). A skippable entry leaves
out objects labelled trainer.kubeflow.org/webhook-validation=disabled: the runtimes this chart
ships, which Helm 4 creates after the webhook configuration and before the controller serves it
(with failurePolicy Fail, the install would be refused). They are checked in CI against the
Trainer CRDs instead. */}}
{{- define "trainer.webhook.entry" -}}
{{- $root := index . 0 -}}
- name: {{ index . 1 }}
  admissionReviewVersions: [v1]
  sideEffects: None
  failurePolicy: {{ $root.Values.webhook.failurePolicy }}
  clientConfig:
    service:
      name: {{ include "trainer.manager.name" $root }}
      namespace: {{ $root.Release.Namespace | quote }}
      path: {{ index . 2 }}
      port: 443
  rules:
    - apiGroups: [trainer.kubeflow.org]
      apiVersions: [v1alpha1]
      operations: [CREATE, UPDATE]
      resources: [{{ index . 3 }}]
  {{- if gt (len .) 4 }}
  objectSelector:
    matchExpressions:
      - key: trainer.kubeflow.org/webhook-validation
        operator: NotIn
        values: [disabled]
  {{- end }}
{{- end }}
