{{- define "trainer.manager.name" -}}
{{ include "trainer.fullname" . }}-controller-manager
{{- end }}

{{- define "trainer.manager.labels" -}}
{{ include "trainer.labels" . }}
app.kubernetes.io/component: manager
{{- end }}

{{- define "trainer.manager.selectorLabels" -}}
{{ include "trainer.selectorLabels" . }}
app.kubernetes.io/component: manager
{{- end }}

{{- define "trainer.manager.configMap.name" -}}
{{ include "trainer.fullname" . }}-config
{{- end }}

{{- define "trainer.manager.image" -}}
{{- $image := .Values.manager.image }}
{{- include "trainer.imageRef" (dict "repository" $image.repository "tag" ($image.tag | default .Chart.AppVersion) "digest" $image.digest) }}
{{- end }}

{{/* Ports of the controller, as its config file sets them. */}}
{{- define "trainer.manager.webhookPort" -}}9443{{- end }}
{{- define "trainer.manager.metricsPort" -}}8443{{- end }}
{{- define "trainer.manager.healthPort" -}}8081{{- end }}
