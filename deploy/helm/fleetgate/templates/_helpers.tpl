{{/*
Names: the release name when it already says fleetgate (helm install fleetgate ...), so the
objects carry the kustomize base's names; else <release>-fleetgate.
*/}}
{{- define "fleetgate.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "fleetgate.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "fleetgate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The gateway pods: what the Deployment, the Services, the PDB and the NetworkPolicy select. */}}
{{- define "fleetgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fleetgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end }}

{{/* Every object's labels, less the component (each object adds its own). */}}
{{- define "fleetgate.commonLabels" -}}
app.kubernetes.io/name: {{ include "fleetgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: fleetgate
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ include "fleetgate.chart" . }}
{{- end }}

{{- define "fleetgate.labels" -}}
{{ include "fleetgate.commonLabels" . }}
app.kubernetes.io/component: gateway
{{- end }}

{{- define "fleetgate.serviceAccountName" -}}
{{- default (include "fleetgate.fullname" .) .Values.serviceAccount.name }}
{{- end }}

{{- define "fleetgate.keysSecret" -}}
{{- default (printf "%s-keys" (include "fleetgate.fullname" .)) .Values.keys.secretName }}
{{- end }}

{{/* config.server with the gateway's defaults for what the chart reads from it. */}}
{{- define "fleetgate.server" -}}
{{- $server := .Values.config.server | default dict -}}
{{- if not $server.admin_port -}}
{{- fail "config.server.admin_port: set it; the chart serves /metrics and /admin/* from it (the admin Service, the ServiceMonitor, the NetworkPolicy)" -}}
{{- end -}}
{{- toYaml (dict "port" ($server.port | default 8080) "admin_port" $server.admin_port "drain_delay_s" ($server.drain_delay_s | default 0) "shutdown_grace_s" ($server.shutdown_grace_s | default 30)) -}}
{{- end }}

{{/* config.yaml's redis_url from the redis values; empty for none. */}}
{{- define "fleetgate.redisUrl" -}}
{{- $r := .Values.redis -}}
{{- if and $r.url $r.cluster.nodes -}}
{{- fail "redis: set url or cluster.nodes, not both" -}}
{{- end -}}
{{- if $r.cluster.nodes -}}
{{- printf "%s://%s" (ternary "rediss+cluster" "redis+cluster" (default false $r.cluster.tls)) (join "," $r.cluster.nodes) -}}
{{- else -}}
{{- $r.url -}}
{{- end -}}
{{- end }}

{{/* The whole config.yaml: config, with redis_url and the password's variable from redis. */}}
{{- define "fleetgate.config" -}}
{{- $config := deepCopy .Values.config -}}
{{- $url := include "fleetgate.redisUrl" . -}}
{{- if $url -}}
{{- if hasKey $config "redis_url" -}}
{{- fail "config.redis_url: leave it unset and use the redis values (url, cluster.nodes or urlSecretKey)" -}}
{{- end -}}
{{- $_ := set $config "redis_url" $url -}}
{{- end -}}
{{- if .Values.redis.passwordSecretKey -}}
{{- $redis := get $config "redis" | default dict -}}
{{- $_ := set $redis "password_env" "FLEETGATE_REDIS_PASSWORD" -}}
{{- $_ := set $config "redis" $redis -}}
{{- end -}}
{{- toYaml $config -}}
{{- end }}

{{/* The namespaces whose EndpointSlices the gateway watches, one per line. */}}
{{- define "fleetgate.discoveryNamespaces" -}}
{{- $namespaces := list -}}
{{- range $model := .Values.config.models | default list -}}
{{- range $replica := $model.replicas | default list -}}
{{- if $replica.kubernetes -}}
{{- $namespaces = append $namespaces ($replica.kubernetes.namespace | default $.Release.Namespace) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $namespaces | uniq | sortAlpha | join "\n" -}}
{{- end }}
