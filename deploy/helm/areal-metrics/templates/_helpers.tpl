{{- define "areal.fullname" -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "areal.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "areal.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "areal.secretName" -}}
{{- default (printf "%s-secrets" (include "areal.fullname" .)) .Values.secrets.existingSecret -}}
{{- end -}}

{{- define "areal.stackImage" -}}
{{ .Values.images.stack.repository }}:{{ .Values.images.stack.tag }}
{{- end -}}

{{/* what every service of ours reads: where Kafka is, the topics, the store (docs/SETTINGS.md) */}}
{{- define "areal.kafkaEnv" -}}
- name: AREAL_KAFKA_BOOTSTRAP
  value: {{ required "kafka.bootstrap: host:port of the external Kafka brokers" .Values.kafka.bootstrap | quote }}
- name: AREAL_TOPIC_PREFIX
  value: {{ .Values.kafka.topicPrefix | quote }}
- name: AREAL_HOME
  value: /data
{{- end -}}

{{/* non-empty when Grafana gets a webhook contact point: from the values, or a key of existingSecret */}}
{{- define "areal.hasWebhook" -}}
{{- if or .Values.secrets.alertWebhook (and .Values.secrets.existingSecret .Values.secrets.existingSecretHasWebhook) }}yes{{ end -}}
{{- end -}}
