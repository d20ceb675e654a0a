{{/* Names and labels shared by every template folder; each folder adds its own helpers. */}}

{{- define "trainer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{/* The prefix of every object name: the release name, plus the chart name unless it already holds it. */}}
{{- define "trainer.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := include "trainer.name" . }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "trainer.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object; `component` is added per folder. */}}
{{- define "trainer.labels" -}}
{{ include "trainer.labelsWithVersion" (list . .Chart.AppVersion) }}
{{- end }}

{{/*
trainer.labels with another app.kubernetes.io/version, for a part that ships at a version of its
own (the data cache): (list $ "<label value>").
*/}}
{{- define "trainer.labelsWithVersion" -}}
{{- $root := index . 0 }}
{{ include "trainer.selectorLabels" $root }}
{{- $labels := dict "helm.sh/chart" (include "trainer.chart" $root) "app.kubernetes.io/version" (index . 1) "app.kubernetes.io/managed-by" $root.Release.Service "app.kubernetes.io/part-of" "kubeflow" }}
{{- /* commonLabels win over the chart's non-selector labels (part-of, version...): one key, one value. */}}
{{- range $key, $value := merge (deepCopy ($root.Values.commonLabels | default dict)) $labels }}
{{ $key | quote }}: {{ $value | quote }}
{{- end }}
{{- end }}

{{/* Selector labels: name + instance, never `control-plane`, so no Service of ours can select JobSet's or LWS's pods. */}}
{{- define "trainer.selectorLabels" -}}
app.kubernetes.io/name: {{ include "trainer.name" . | quote }}
app.kubernetes.io/instance: {{ .Release.Name | quote }}
{{- end }}

{{/* The restricted Pod Security Standard, for every container of ours. */}}
{{- define "trainer.restrictedSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop:
    - ALL
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* "true" where this release installs LeaderWorkerSet (the subchart's condition: an explicit
dataCache.lws.install wins, else dataCache.enabled decides), "" otherwise. */}}
{{- define "trainer.dataCache.lwsInstalled" -}}
{{- if and .Values.dataCache.enabled (or (not (hasKey .Values.dataCache.lws "install")) .Values.dataCache.lws.install) }}true{{ end }}
{{- end }}

{{/* Chart-wide rules the schema cannot express; each message names the fix. */}}
{{- define "trainer.checks" -}}
{{- /* The JobSet and LWS subcharts write the release name and namespace unquoted, so one that
YAML reads as a number or a boolean makes their objects ones the API server refuses. */}}
{{- if or .Values.jobset.install (include "trainer.dataCache.lwsInstalled" .) }}
{{- range $what, $value := dict "release name" .Release.Name "namespace" .Release.Namespace }}
{{- if regexMatch "^(0o[0-7]+|0x[0-9a-f]+|0b[01]+|[0-9]+(\\.[0-9]*)?(e[-+]?[0-9]+)?|y|yes|n|no|on|off|true|false|null)$" $value }}
{{- fail (printf "the %s %q reads as a number or a boolean in YAML, and the JobSet and LeaderWorkerSet subcharts write it unquoted, so the API server would refuse their objects; choose another %s, or install JobSet and LWS on their own (jobset.install=false, dataCache.lws.install=false)" $what $value $what) }}
{{- end }}
{{- end }}
{{- end }}
{{- range $key := list "app.kubernetes.io/name" "app.kubernetes.io/instance" "app.kubernetes.io/component" }}
{{- if hasKey $.Values.commonLabels $key }}
{{- fail (printf "commonLabels cannot set %s: the chart sets it, and its Deployments and Services select pods by it; choose another key" $key) }}
{{- end }}
{{- end }}
{{- if hasKey .Values.commonLabels "app.kubernetes.io/managed-by" }}
{{- fail "commonLabels cannot set app.kubernetes.io/managed-by: Helm adopts only objects that carry managed-by=Helm, so the next upgrade after one that failed part way would refuse the objects it had created (\"invalid ownership metadata\"); choose another key" }}
{{- end }}
{{- range $path, $given := dict "manager.resources" .Values.manager.resources "lws.resources" .Values.lws.resources "dataCache.initializer.resources" .Values.dataCache.initializer.resources }}
{{- $resources := $given | default dict }}{{/* null: the defaults dropped (--set x.resources=null) */}}
{{- $limits := $resources.limits | default dict }}
{{- range $name, $request := $resources.requests | default dict }}
{{- if hasKey $limits $name }}
{{- if gt (float64 (include "trainer.quantityValue" $request)) (float64 (include "trainer.quantityValue" (get $limits $name))) }}
{{- $merged := ternary "" (printf " (what you set merges with the chart's defaults for %s in values.yaml)" $path) (hasPrefix "dataCache." $path) }}
{{- fail (printf "%s requests %s %v, more than its limit %v, and the API server refuses such a pod%s; raise the limit or lower the request" $path $name $request (get $limits $name) $merged) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- if eq .Values.dataCache.serviceAccount.name "default" }}
{{- fail "dataCache.serviceAccount.name cannot be `default`: every pod of a namespace that names no ServiceAccount runs as `default`, and each would get the initializer's rights (create LeaderWorkerSets, Services, ServiceAccounts and Secrets; patch LeaderWorkerSets and ServiceAccounts; delete LeaderWorkerSets); keep kubeflow-trainer-cache-initializer or choose a name of its own" }}
{{- end }}
{{- if hasKey .Values.lws "install" }}
{{- fail "lws.install is not a value of this chart (lws.* goes to the LeaderWorkerSet subchart as is): LeaderWorkerSet is installed with dataCache.enabled=true; to skip it, set dataCache.lws.install=false" }}
{{- end }}
{{- if and (gt (int .Values.manager.replicas) 1) (not .Values.manager.config.leaderElect) }}
{{- fail (printf "manager.replicas=%d with manager.config.leaderElect=false would run %d Trainer controllers at once, each acting on every TrainJob; keep leaderElect=true (the default) or set replicas to 1" (int .Values.manager.replicas) (int .Values.manager.replicas)) }}
{{- end }}
{{- $budget := .Values.manager.podDisruptionBudget }}
{{- if $budget.enabled }}
{{- $replicas := int .Values.manager.replicas }}
{{- /* A percentage is rounded up, as the disruption controller does. */}}
{{- $required := ternary (div (add (mul (atoi (trimSuffix "%" (toString $budget.minAvailable))) $replicas) 99) 100) (int $budget.minAvailable) (kindIs "string" $budget.minAvailable) }}
{{- if lt $replicas 2 }}
{{- fail (printf "manager.podDisruptionBudget.enabled with manager.replicas=%d would block every drain of the node the controller runs on (no replica may ever be evicted); set manager.replicas to 2 or more, or leave the budget off" $replicas) }}
{{- else if ge (int $required) $replicas }}
{{- fail (printf "manager.podDisruptionBudget.minAvailable=%v keeps all %d replicas, so no replica may ever be evicted and every drain of their nodes would block; set minAvailable below the replicas" $budget.minAvailable $replicas) }}
{{- end }}
{{- end }}
{{- /* LeaderWorkerSet's CRD comes with its subchart's templates, so turning LWS off deletes
it and with it every LeaderWorkerSet in the cluster. Seen only against a cluster (lookup is
empty in `helm template`); refused where this release installed the CRD. */}}
{{- if and (not (include "trainer.dataCache.lwsInstalled" .)) (not .Values.dataCache.lws.allowCrdRemoval) }}
{{- $crd := lookup "apiextensions.k8s.io/v1" "CustomResourceDefinition" "" "leaderworkersets.leaderworkerset.x-k8s.io" }}
{{- $owner := dig "metadata" "annotations" "meta.helm.sh/release-name" "" ($crd | default dict) }}
{{- $ownerNamespace := dig "metadata" "annotations" "meta.helm.sh/release-namespace" "" ($crd | default dict) }}
{{- if and (eq $owner .Release.Name) (eq $ownerNamespace .Release.Namespace) }}
{{- fail (printf "this upgrade turns LeaderWorkerSet off (dataCache.enabled=false or dataCache.lws.install=false), which would delete its CRD, installed by release %s, and with it every LeaderWorkerSet in the cluster (running caches, and any other team's); keep dataCache.enabled=true, or set dataCache.lws.allowCrdRemoval=true to remove them anyway" .Release.Name) }}
{{- end }}
{{- end }}
{{- if not (.Files.Glob "crds/*.yaml") }}
{{- fail "the chart's crds/ folder holds no CRDs, so the Trainer CRDs would not be installed: run `make sync-crds` (or hack/sync-crds.sh) in the source tree first; `helm dependency build` fetches the subcharts only" }}
{{- end }}
{{- if .Values.jobset.install }}
{{- /* The JobSet subchart's fullname, as its _helpers.tpl builds it; its Services add 16 characters. */}}
{{- $name := .Values.jobset.nameOverride | default "jobset" }}
{{- $jobset := .Values.jobset.fullnameOverride | default (ternary .Release.Name (printf "%s-%s" .Release.Name $name) (contains $name .Release.Name)) }}
{{- if gt (len $jobset) 47 }}
{{- fail (printf "release name %q is too long: the JobSet subchart would name its Service %s-webhook-service, over Kubernetes' 63 characters; use a release name of at most 40 characters, or set jobset.fullnameOverride to at most 47" .Release.Name $jobset) }}
{{- end }}
{{- end }}
{{- end }}

{{/* A Kubernetes quantity (500m, 2, 1.5Gi, 1e3, or a YAML number) in its base unit (cores,
bytes), to compare requests with limits. The schema has already checked its form. */}}
{{- define "trainer.quantityValue" -}}
{{- $quantity := trimPrefix "+" (toString .) }}
{{- $number := regexFind "^([0-9]+(\\.[0-9]*)?|\\.[0-9]+)" $quantity }}
{{- $suffix := trimPrefix $number $quantity }}
{{- $scale := dict "" 1.0 "n" 1e-9 "u" 1e-6 "m" 1e-3 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 }}
{{- if hasKey $scale $suffix }}
{{- mulf (float64 $number) (get $scale $suffix) }}
{{- else }}
{{- /* a decimal exponent (1e3, 2E-1), which float64 reads as it stands */}}
{{- float64 $quantity }}
{{- end }}
{{- end }}

{{/*
An image reference from {repository, tag, digest}: repo:tag, or repo:tag@digest when a digest
pins it (the tag stays for people reading the spec; the runtime pulls by the digest).
*/}}
{{- define "trainer.imageRef" -}}
{{ .repository }}:{{ .tag }}{{ with .digest }}@{{ . }}{{ end }}
{{- end }}
