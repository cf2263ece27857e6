{{/* Chart name, truncated to 63 characters (a DNS label). */}}
{{- define "specgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release-chart, unless the release name already contains the chart name. */}}
{{- define "specgate.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "specgate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object. */}}
{{- define "specgate.labels" -}}
helm.sh/chart: {{ include "specgate.chart" . }}
app.kubernetes.io/name: {{ include "specgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specgate
{{- end }}

{{/* Selector labels of one component: include with (dict "ctx" $ "component" "gateway"). */}}
{{- define "specgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specgate.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "specgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specgate.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "specgate.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "specgate.adminSecretName" -}}
{{- default (printf "%s-admin" (include "specgate.fullname" .)) .Values.admin.existingSecret }}
{{- end }}

{{- define "specgate.routingConfigMapName" -}}
{{- default (printf "%s-routing" (include "specgate.fullname" .)) .Values.routing.existingConfigMap }}
{{- end }}

{{/* Name of the in-chart vLLM Deployment / Service of a pool: include with (dict "ctx" $ "pool" "speculative"). */}}
{{- define "specgate.poolName" -}}
{{- printf "%s-vllm-%s" (include "specgate.fullname" .ctx) .pool | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The environment variable holding a pool's API key in the gateway (routing YAML api_key_env). */}}
{{- define "specgate.poolKeyEnv" -}}
{{- printf "VLLM_%s_API_KEY" (upper .) }}
{{- end }}

{{/* Endpoints of a pool in the routing YAML: the in-chart Service, or the external URLs. Returns YAML. */}}
{{- define "specgate.poolEndpoints" -}}
{{- $pool := index .ctx.Values.pools .pool }}
{{- if $pool.deploy }}
- url: {{ printf "http://%s:%d" (include "specgate.poolName" .) (int .ctx.Values.vllm.port) }}
  weight: 1
{{- else }}
{{- if not $pool.externalEndpoints }}
{{- fail (printf "pools.%s: set deploy: true or give externalEndpoints" .pool) }}
{{- end }}
{{- toYaml $pool.externalEndpoints }}
{{- end }}
{{- end }}

{{/* The routing YAML the ConfigMap carries. */}}
{{- define "specgate.routingYaml" -}}
{{- if .Values.routing.rules }}
{{- .Values.routing.rules }}
{{- else }}
{{- $rules := .Files.Get "files/routing-default.yaml" | fromYaml }}
{{- if hasKey $rules "Error" }}
{{- fail (printf "files/routing-default.yaml: %s" $rules.Error) }}
{{- end }}
{{- $pools := list }}
{{- range $name := list "speculative" "standard" }}
{{- $p := index $.Values.pools $name }}
{{- $base := dict }}
{{- range $fp := $rules.pools }}{{- if eq $fp.name $name }}{{- $base = omit $fp "endpoints" "api_key_env" "speculative" }}{{- end }}{{- end }}
{{- $pool := merge (dict "name" $name "kind" $name "models" $p.models "timeouts" $p.timeouts) $base }}
{{- $_ := set $pool "api_key_env" (include "specgate.poolKeyEnv" $name) }}
{{- $_ := set $pool "endpoints" (include "specgate.poolEndpoints" (dict "ctx" $ "pool" $name) | fromYamlArray) }}
{{- if eq $name "speculative" }}
{{- $spec := dict "method" $p.speculativeConfig.method "num_speculative_tokens" $p.speculativeConfig.num_speculative_tokens }}
{{- if $p.speculativeConfig.model }}
{{- $_ := set $spec "draft_model" $p.speculativeConfig.model }}
{{- end }}
{{- $_ := set $pool "speculative" $spec }}
{{- end }}
{{- $pools = append $pools $pool }}
{{- end }}
{{- $_ := set $rules "pools" $pools }}
{{- range $k, $v := .Values.routing.overrides }}
{{- if and (kindIs "map" $v) (kindIs "map" (get $rules $k)) }}
{{- $_ := set $rules $k (mergeOverwrite (deepCopy (get $rules $k)) $v) }}
{{- else }}
{{- $_ := set $rules $k $v }}
{{- end }}
{{- end }}
{{- $rules | toYaml }}
{{- end }}
{{- end }}

{{/* The Redis URL source: "bundled", "secret", "url" or "". */}}
{{- define "specgate.redisMode" -}}
{{- if .Values.redis.enabled }}bundled{{- else if .Values.redis.existingSecret }}secret{{- else if .Values.redis.url }}url{{- end }}
{{- end }}
