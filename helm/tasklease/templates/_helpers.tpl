{{- define "tasklease.fullname" -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end }}

{{/* On every object, pod templates included. */}}
{{- define "tasklease.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: tasklease
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tasklease
{{- end }}

{{- define "tasklease.selector" -}}
app.kubernetes.io/name: tasklease
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "tasklease.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}
{{- end }}

{{/* The API server for the chart's pods, when the in-cluster default cannot be used. */}}
{{- define "tasklease.apiServerEnv" -}}
{{- with .Values.apiServer.host }}
- name: KUBERNETES_SERVICE_HOST
  value: {{ . | quote }}
- name: KUBERNETES_SERVICE_PORT
  value: {{ $.Values.apiServer.port | quote }}
{{- end }}
{{- end }}

{{/* Namespaces the operator's namespaced permissions cover: its watch list and its own (leader election). */}}
{{- define "tasklease.operatorNamespaces" -}}
{{- uniq (append .Values.operator.watchNamespaces .Release.Namespace) | toJson }}
{{- end }}
