{{/* Names and labels shared by every manifest of the chart. */}}

{{- define "llm-stream.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "llm-stream.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "llm-stream.selectorLabels" -}}
app.kubernetes.io/name: {{ include "llm-stream.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "llm-stream.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "llm-stream.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: llm-stream
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" "gateway") */}}
{{- define "llm-stream.componentSelector" -}}
{{ include "llm-stream.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "llm-stream.componentLabels" -}}
{{ include "llm-stream.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "llm-stream.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "llm-stream.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "llm-stream.authSecret" -}}
{{- default (printf "%s-auth" (include "llm-stream.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{- define "llm-stream.redisHost" -}}
{{- printf "%s-redis" (include "llm-stream.fullname" .) -}}
{{- end -}}

{{/* Secret and key holding REDIS_URL. */}}
{{- define "llm-stream.redisUrlSecret" -}}
{{- if and .Values.redis.external.enabled .Values.redis.external.existingSecret -}}
{{- .Values.redis.external.existingSecret -}}
{{- else -}}
{{- printf "%s-redis-url" (include "llm-stream.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "llm-stream.redisUrlKey" -}}
{{- if and .Values.redis.external.enabled .Values.redis.external.existingSecret -}}
{{- .Values.redis.external.existingSecretKey -}}
{{- else -}}
url
{{- end -}}
{{- end -}}

{{/* The request stream KEDA reads: shared/streams.py Keys.requests. */}}
{{- define "llm-stream.requestStream" -}}
{{- printf "%s:{q}:requests" (.Values.settings.STREAM_PREFIX | default "llm") -}}
{{- end -}}

{{- define "llm-stream.image" -}}
{{- printf "%s:%s" .image.repository (.image.tag | default .default) -}}
{{- end -}}

{{/* Environment every gateway and worker gets: settings, then REDIS_URL and the secrets. */}}
{{- define "llm-stream.commonEnv" -}}
{{- range $name, $value := .Values.settings }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
- name: REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "llm-stream.redisUrlSecret" . }}
      key: {{ include "llm-stream.redisUrlKey" . }}
- name: API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ include "llm-stream.authSecret" . }}
      key: API_KEYS
- name: ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "llm-stream.authSecret" . }}
      key: ADMIN_TOKEN
- name: AUTH_REQUIRED
  value: {{ .Values.auth.required | toString | quote }}
{{- end -}}

{{/* Peers allowed to scrape /metrics: Prometheus's namespace, or any. */}}
{{- define "llm-stream.prometheusPeer" -}}
{{- if .Values.metrics.prometheusNamespace }}
- namespaceSelector:
    matchLabels:
      kubernetes.io/metadata.name: {{ .Values.metrics.prometheusNamespace }}
{{- else }}
- namespaceSelector: {}
{{- end }}
{{- end -}}
