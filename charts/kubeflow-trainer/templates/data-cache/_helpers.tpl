{{/*
The data cache's labels: app.kubernetes.io/version is the data cache's version, not Trainer's
(commonLabels still win over it, as over trainer.labels' own).
*/}}
{{- define "trainer.dataCache.labels" -}}
{{ include "trainer.labelsWithVersion" (list . (include "trainer.dataCache.version" .)) }}
app.kubernetes.io/component: data-cache
{{- end }}

{{/*
The data cache's version: the initializer image tag, which the runtime pins (the chart's appVersion
if it is empty), as a label value: a character a label cannot hold (`+` of semver build metadata...)
becomes `_`, at most 63 characters, letters or digits at both ends.
*/}}
{{- define "trainer.dataCache.version" -}}
{{- $version := regexReplaceAll "[^-A-Za-z0-9_.]" (.Values.dataCache.initializer.image.tag | default .Chart.AppVersion | toString) "_" | trunc 63 }}
{{- regexReplaceAll "^[^A-Za-z0-9]+|[^A-Za-z0-9]+$" $version "" }}
{{- end }}

{{/* The ClusterRole the per-namespace RoleBindings grant to the initializer's ServiceAccount. */}}
{{- define "trainer.dataCache.clusterRole.name" -}}
{{ include "trainer.fullname" . }}-cache-initializer
{{- end }}

{{/* The PodMonitor's name and namespace: its template and the NOTES both name it. */}}
{{- define "trainer.dataCache.podMonitor.name" -}}
{{ include "trainer.fullname" . }}-data-cache
{{- end }}

{{- define "trainer.dataCache.podMonitor.namespace" -}}
{{ .Values.dataCache.metrics.podMonitor.namespace | default .Release.Namespace }}
{{- end }}

{{- define "trainer.dataCache.initializerImage" -}}
{{- include "trainer.imageRef" .Values.dataCache.initializer.image }}
{{- end }}

{{- define "trainer.dataCache.cacheImage" -}}
{{- include "trainer.imageRef" .Values.dataCache.cache.image }}
{{- end }}

{{/*
The initializer env that carries dataCache.cache's pull policy, pull secrets and placement to the cache pods
it creates (YAML, name: value); a value left empty is not set, so the runtime's own stands.
*/}}
{{- define "trainer.dataCache.cachePodEnv" -}}
{{- with .Values.dataCache.cache }}
{{- with .image.pullPolicy }}
CACHE_IMAGE_PULL_POLICY: {{ . | quote }}
{{- end }}
{{- with .imagePullSecrets }}
{{- $names := list }}
{{- range . }}{{- $names = append $names .name }}{{- end }}
CACHE_IMAGE_PULL_SECRETS: {{ join "," $names | quote }}
{{- end }}
{{- with .nodeSelector }}
CACHE_NODE_SELECTOR: {{ toJson . | quote }}
{{- end }}
{{- with .tolerations }}
CACHE_TOLERATIONS: {{ toJson . | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* Rules between values that the schema cannot express; each message names the values. */}}
{{- define "trainer.dataCache.checks" -}}
{{- $lwsInstall := .Values.dataCache.lws.install }}
{{- if and (kindIs "bool" $lwsInstall) $lwsInstall (not .Values.dataCache.enabled) }}
{{- fail "dataCache.lws.install=true requires dataCache.enabled=true: LeaderWorkerSet is only installed for the data cache (leave dataCache.lws.install unset, or set dataCache.enabled=true)" }}
{{- end }}
{{- with .Values.dataCache.metrics.podMonitor }}
{{- if and .enabled (not $.Values.dataCache.enabled) }}
{{- fail "dataCache.metrics.podMonitor.enabled=true requires dataCache.enabled=true: the PodMonitor scrapes the cache pods (set dataCache.enabled=true, or leave the PodMonitor off)" }}
{{- end }}
{{- if and .enabled (not .allNamespaces) (not $.Values.dataCache.namespaces) }}
{{- fail "dataCache.metrics.podMonitor scrapes the cache pods of dataCache.namespaces, which is empty: list the namespaces that run cached TrainJobs there, or set dataCache.metrics.podMonitor.allNamespaces=true" }}
{{- end }}
{{- end }}
{{- end }}
