{{/* Names are cut to leave room for the longest component suffix ("-prefill-tls") within 63. */}}
{{- define "kvwarden.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels that select one component's pods: call with (dict "root" $ "component" NAME). */}}
{{- define "kvwarden.selectorLabels" -}}
app.kubernetes.io/name: {{ default .root.Chart.Name .root.Values.nameOverride | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvwarden.labels" -}}
{{ include "kvwarden.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kvwarden.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The name the router resolves to find a pool's nodes: its headless Service, fully qualified. */}}
{{- define "kvwarden.poolAddress" -}}
{{- $pool := index .root.Values .component -}}
dns:{{ include "kvwarden.fullname" .root }}-{{ .component }}.{{ .root.Release.Namespace }}.svc.{{ .root.Values.clusterDomain }}:{{ $pool.port }}
{{- end -}}

{{- define "kvwarden.modelPath" -}}
{{ required "model.file is required" .Values.model.file | printf "%s/%s" .Values.model.mountPath }}
{{- end -}}

{{/* One component's volumes: the model, and as TLS files the CA and its own certificate and
key, never another component's. */}}
{{- define "kvwarden.volumes" -}}
- name: tls
  secret:
    {{- if .root.Values.tls.certManager.enabled }}
    secretName: {{ include "kvwarden.fullname" .root }}-{{ .component }}-tls
    {{- else }}
    secretName: {{ required "tls.existingSecret is required when tls.certManager.enabled is false" .root.Values.tls.existingSecret }}
    {{- end }}
    # Readable by the pod's group (fsGroup), not by others.
    defaultMode: 0440
    items:
      {{- if .root.Values.tls.certManager.enabled }}
      - {key: ca.crt, path: ca.pem}
      - {key: tls.crt, path: cert.pem}
      - {key: tls.key, path: key.pem}
      {{- else }}
      - {key: ca.pem, path: ca.pem}
      - {key: {{ .component }}.pem, path: cert.pem}
      - {key: {{ .component }}.key, path: key.pem}
      {{- end }}
- name: model
  {{- toYaml .root.Values.model.volume | nindent 2 }}
{{- end -}}

{{- define "kvwarden.tlsArgs" -}}
- --tls-ca=/etc/kvwarden/tls/ca.pem
- --tls-cert=/etc/kvwarden/tls/cert.pem
- --tls-key=/etc/kvwarden/tls/key.pem
{{- end -}}

{{- define "kvwarden.tracingArgs" -}}
{{- if .Values.tracing.otlpEndpoint }}
- --otlp-endpoint={{ .Values.tracing.otlpEndpoint }}
{{- if .Values.tracing.tenantAttribute }}
- --otlp-tenant-attribute
{{- end }}
{{- end }}
{{- end -}}

{{- define "kvwarden.volumeMounts" -}}
- name: tls
  mountPath: /etc/kvwarden/tls
  readOnly: true
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end -}}

{{/* The image runs as uid 65532 with no shell; nothing in the pod needs to write or escalate. */}}
{{- define "kvwarden.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
fsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "kvwarden.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/* Pod settings shared by every component: call with (dict "root" $ "settings" VALUES). */}}
{{- define "kvwarden.podCommon" -}}
# kvwarden uses no Service-link variables: the environment holds only what the chart sets.
enableServiceLinks: false
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
# No pod talks to the Kubernetes API.
automountServiceAccountToken: false
terminationGracePeriodSeconds: {{ .root.Values.pod.terminationGracePeriodSeconds }}
securityContext:
  {{- include "kvwarden.podSecurityContext" . | nindent 2 }}
{{- with .settings.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .settings.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .settings.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Prometheus finds the metrics port of each pod by these annotations. */}}
{{- define "kvwarden.scrapeAnnotations" -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end -}}
