{{- define "trainer.rbac.serviceAccount.name" -}}
{{ include "trainer.manager.name" . }}
{{- end }}

{{- define "trainer.rbac.labels" -}}
{{ include "trainer.labels" . }}
app.kubernetes.io/component: rbac
{{- end }}
