{{/* Names: <release>-pagedserve, cut so that "-controlplane-<hash>" pod names stay valid. */}}
{{- define "pagedserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end }}

{{- define "pagedserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end }}

{{- define "pagedserve.controlplane.fullname" -}}
{{- printf "%s-controlplane" (include "pagedserve.fullname" .) -}}
{{- end }}

{{- define "pagedserve.dataplane.fullname" -}}
{{- printf "%s-dataplane" (include "pagedserve.fullname" .) -}}
{{- end }}

{{- define "pagedserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end }}

{{- define "pagedserve.labels" -}}
helm.sh/chart: {{ include "pagedserve.chart" . }}
app.kubernetes.io/name: {{ include "pagedserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pagedserve
{{- end }}

{{/* Selector labels of one component: include with (dict "ctx" $ "component" "dataplane"). */}}
{{- define "pagedserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagedserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "pagedserve.componentLabels" -}}
{{ include "pagedserve.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "pagedserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pagedserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end }}

{{/* Images: the CPU image for control planes and CPU data planes, the CUDA one for GPU data planes. */}}
{{- define "pagedserve.image.cpu" -}}
{{- printf "%s:%s" .Values.image.repository (default (printf "%s-cpu" .Chart.AppVersion) .Values.image.cpuTag) -}}
{{- end }}

{{- define "pagedserve.image.controlplane" -}}
{{- printf "%s:%s" .Values.image.repository (default (printf "%s-controlplane" .Chart.AppVersion) .Values.image.controlplaneTag) -}}
{{- end }}

{{- define "pagedserve.image.dataplane" -}}
{{- if gt (int .Values.dataplane.gpusPerPod) 0 -}}
{{- printf "%s:%s" .Values.image.repository (default (printf "%s-cuda" .Chart.AppVersion) .Values.image.cudaTag) -}}
{{- else -}}
{{- include "pagedserve.image.cpu" . -}}
{{- end -}}
{{- end }}

{{/* The data planes' discovery name: the headless Service, fully qualified, with its port. */}}
{{- define "pagedserve.dataplane.dnsName" -}}
{{- printf "%s.%s.svc.%s" (include "pagedserve.dataplane.fullname" .) .Release.Namespace .Values.clusterDomain -}}
{{- end }}

{{- define "pagedserve.apiKeys.secretName" -}}
{{- if .Values.apiKeys.existingSecret -}}
{{- .Values.apiKeys.existingSecret -}}
{{- else if .Values.apiKeys.keys -}}
{{- printf "%s-api-keys" (include "pagedserve.fullname" .) -}}
{{- end -}}
{{- end }}

{{- define "pagedserve.dataplaneToken.secretName" -}}
{{- if .Values.dataplaneAuth.token.enabled -}}
{{- default (printf "%s-dataplane-token" (include "pagedserve.fullname" .)) .Values.dataplaneAuth.token.existingSecret -}}
{{- end -}}
{{- end }}

{{/* The data planes' token file (empty when the token is off). */}}
{{- define "pagedserve.dataplaneToken.file" -}}
{{- if .Values.dataplaneAuth.token.enabled -}}
{{- printf "%s/%s" (include "pagedserve.paths.dataplaneToken" .) .Values.dataplaneAuth.token.secretKey -}}
{{- end -}}
{{- end }}

{{/* Paths where Secrets are mounted. */}}
{{- define "pagedserve.paths.dataplaneToken" -}}/etc/pagedserve/dataplane-token{{- end }}
{{- define "pagedserve.paths.apiKeys" -}}/etc/pagedserve/api-keys{{- end }}
{{- define "pagedserve.paths.publicTLS" -}}/etc/pagedserve/tls/public{{- end }}
{{- define "pagedserve.paths.serverTLS" -}}/etc/pagedserve/tls/dataplane-server{{- end }}
{{- define "pagedserve.paths.clientTLS" -}}/etc/pagedserve/tls/dataplane-client{{- end }}
{{- define "pagedserve.paths.hooks" -}}/etc/pagedserve/hooks{{- end }}

{{/* Checks that fail the render with a message instead of a broken install. */}}
{{- define "pagedserve.validate" -}}
{{- $device := toString (default "cpu" .Values.engine.device) -}}
{{- if and (gt (int .Values.dataplane.gpusPerPod) 0) (eq $device "cpu") -}}
{{- fail "dataplane.gpusPerPod > 0 needs engine.device=cuda (the engine would run on the CPU and leave the GPU idle)" -}}
{{- end -}}
{{- if and (eq (int .Values.dataplane.gpusPerPod) 0) (hasPrefix "cuda" $device) -}}
{{- fail "engine.device=cuda needs dataplane.gpusPerPod >= 1 (no GPU would be allocated to the pod)" -}}
{{- end -}}
{{- if and .Values.tls.public.enabled (not .Values.tls.public.secretName) -}}
{{- fail "tls.public.enabled needs tls.public.secretName (a kubernetes.io/tls Secret)" -}}
{{- end -}}
{{- if and .Values.tls.dataplane.enabled (not .Values.tls.dataplane.serverSecretName) -}}
{{- fail "tls.dataplane.enabled needs tls.dataplane.serverSecretName (the data planes' certificate and key, and ca.crt)" -}}
{{- end -}}
{{- if and .Values.tls.dataplane.enabled (not .Values.tls.dataplane.clientSecretName) -}}
{{- fail "tls.dataplane.enabled needs tls.dataplane.clientSecretName (ca.crt, and tls.crt/tls.key for mutual TLS)" -}}
{{- end -}}
{{- $mutual := and .Values.tls.dataplane.enabled .Values.tls.dataplane.mutual -}}
{{- if not (or .Values.dataplaneAuth.token.enabled $mutual .Values.dataplaneAuth.allowInsecure) -}}
{{- fail "data planes need their callers to authenticate: keep dataplaneAuth.token.enabled, or use mutual TLS (tls.dataplane), or set dataplaneAuth.allowInsecure on a trusted network" -}}
{{- end -}}
{{- if and .Values.apiKeys.existingSecret .Values.apiKeys.keys -}}
{{- fail "give apiKeys.existingSecret or apiKeys.keys, not both" -}}
{{- end -}}
{{- if and (eq .Values.controlplane.discovery "static") (lt (int .Values.dataplane.replicas) 1) -}}
{{- fail "controlplane.discovery=static needs dataplane.replicas >= 1 (the control planes would have no data plane)" -}}
{{- end -}}
{{- if le (int .Values.dataplane.terminationGracePeriodSeconds) (int .Values.dataplane.drainMarginSeconds) -}}
{{- fail "dataplane.terminationGracePeriodSeconds must exceed dataplane.drainMarginSeconds (the drain needs time)" -}}
{{- end -}}
{{- end }}

{{/* Environment both planes share. */}}
{{- define "pagedserve.env" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: PAGEDSERVE_MODEL_HOME
  value: {{ .Values.models.mountPath | quote }}
- name: PAGEDSERVE_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
# The root filesystem is read-only: caches (torch extensions, Triton) go to the /tmp volume.
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
{{- with .Values.otel }}
{{- if .endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_INSECURE
  value: {{ .insecure | toString | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ .sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .samplerArg | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE)%s" (ternary (printf ",%s" .resourceAttributes) "" (ne .resourceAttributes "")) | quote }}
{{- if .headersSecret.name }}
- name: OTEL_EXPORTER_OTLP_HEADERS
  valueFrom:
    secretKeyRef:
      name: {{ .headersSecret.name }}
      key: {{ .headersSecret.key }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* The model store volume of the control-plane pods (data planes may use a claim template). */}}
{{- define "pagedserve.models.volume" -}}
- name: models
{{- if .Values.models.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.models.existingClaim }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end }}

{{/* The init container that fills the store: `pagedserve models pull <engine.model>`. */}}
{{- define "pagedserve.models.pullContainer" -}}
{{- if .ctx.Values.models.pull.enabled }}
- name: models-pull
  image: {{ .image }}
  imagePullPolicy: {{ .ctx.Values.image.pullPolicy }}
  args:
    - models
    - pull
    - {{ required "engine.model names the model to pull" .ctx.Values.engine.model | quote }}
    - --model-home
    - {{ .ctx.Values.models.mountPath | quote }}
    - --quiet
  env:
    {{- include "pagedserve.env" .ctx | nindent 4 }}
  {{- with .ctx.Values.models.pull.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml .ctx.Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: models
      mountPath: {{ .ctx.Values.models.mountPath }}
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end }}

{{/* Prometheus scrape annotations. */}}
{{- define "pagedserve.scrapeAnnotations" -}}
{{- if .ctx.Values.metrics.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
prometheus.io/scheme: {{ .scheme }}
{{- end }}
{{- end }}

{{/* Preferred/required spreading of a component's pods over nodes. */}}
{{- define "pagedserve.antiAffinity" -}}
{{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" (include "pagedserve.selectorLabels" (dict "ctx" .ctx "component" .component) | fromYaml)) -}}
podAntiAffinity:
{{- if eq .mode "hard" }}
  requiredDuringSchedulingIgnoredDuringExecution:
    - {{- toYaml $term | nindent 6 }}
{{- else }}
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        {{- toYaml $term | nindent 8 }}
{{- end }}
{{- end }}
