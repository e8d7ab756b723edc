{{- /*
Shared names, labels and pod settings of the Lathe chart. Every object is named <release>-lathe-<part> and
labelled app.kubernetes.io/{name,instance,component}; a pool's objects also carry lathe.dev/pool, and the Services
the gateway discovers carry lathe.dev/role (Kubernetes copies a Service's labels onto its EndpointSlices).
*/ -}}

{{- define "lathe.fullname" -}}{{ printf "%s-lathe" .Release.Name | trunc 40 | trimSuffix "-" }}{{- end -}}

{{- define "lathe.labels" -}}
app.kubernetes.io/name: lathe
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- /* (dict "root" $ "component" "gateway") */ -}}
{{- define "lathe.selector" -}}
app.kubernetes.io/name: lathe
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- /* (dict "root" $ "service" "trainer" "gpu" true): <registry>/lathe-<service>[-cuda]:<tag> */ -}}
{{- define "lathe.image" -}}
{{- $v := .root.Values.image -}}
{{ printf "%s/lathe-%s%s:%s" $v.registry .service (ternary "-cuda" "" (default false .gpu)) $v.tag }}
{{- end -}}

{{- define "lathe.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
fsGroup: {{ .Values.securityContext.fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "lathe.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{- /* pod annotations for Prometheus' kubernetes_sd scrape config: (dict "root" $ "port" 9090) */ -}}
{{- define "lathe.scrapeAnnotations" -}}
{{- if .root.Values.monitoring.annotations -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}

{{- define "lathe.imagePullSecrets" -}}
{{- with .Values.image.pullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "lathe.internalTokenSecret" -}}{{ .Values.secrets.internalTokenSecret | default (printf "%s-internal" (include "lathe.fullname" .)) }}{{- end -}}
{{- define "lathe.apiKeysSecret" -}}{{ .Values.secrets.apiKeysSecret | default (printf "%s-api-keys" (include "lathe.fullname" .)) }}{{- end -}}
{{- define "lathe.checkpointsAddress" -}}{{ include "lathe.fullname" . }}-checkpoints:{{ .Values.checkpoints.port }}{{- end -}}

{{- /* The shared secret, from the environment (never argv): every Lathe container gets it. */ -}}
{{/* A container's allocator settings (poolDefaults.malloc, checkpoints.malloc), or nothing when empty. */}}
{{- define "lathe.poolMalloc" -}}
{{- with .malloc -}}
- name: GLIBC_TUNABLES
  value: {{ . | quote }}
{{- end -}}
{{- end -}}

{{- define "lathe.internalTokenEnv" -}}
- name: LATHE_INTERNAL_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "lathe.internalTokenSecret" . }}
      key: token
- name: HOME
  value: /tmp
{{- end -}}

{{- /* gRPC probes on the standard grpc.health.v1 service: (dict "port" 8510 "startup" 60) */ -}}
{{- define "lathe.grpcProbes" -}}
startupProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: 10
  failureThreshold: {{ .startup | default 30 }}
readinessProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: 5
  failureThreshold: 3
livenessProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: 20
  timeoutSeconds: 5
  failureThreshold: 6
{{- end -}}

{{- /*
A secret value generated once and kept across upgrades: (dict "root" $ "name" SECRET "key" KEY "length" 32).
Renders the base64 value: the live Secret's when it exists, else a fresh random one.
*/ -}}
{{- define "lathe.keptRandom" -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .name -}}
{{- if and $existing (hasKey ($existing.data | default dict) .key) -}}
{{ index $existing.data .key }}
{{- else -}}
{{ randAlphaNum (int (.length | default 32)) | b64enc }}
{{- end -}}
{{- end -}}

{{- /* The pools with poolDefaults merged under each entry. Returns YAML: "pools: [...]". */ -}}
{{- define "lathe.pools" -}}
{{- $out := list -}}
{{- range $p := .Values.pools -}}
{{- $out = append $out (mergeOverwrite (deepCopy $.Values.poolDefaults) (deepCopy $p)) -}}
{{- end -}}
{{ toYaml (dict "pools" $out) }}
{{- end -}}

{{- /* Volumes of a pool's pods (a merged pool): scratch /tmp, the model cache, /dev/shm on GPUs, model dirs. */ -}}
{{- define "lathe.poolVolumes" -}}
- name: tmp
  emptyDir: {}
- name: cache
  emptyDir:
    sizeLimit: {{ .cacheSize }}
{{- if .gpu }}
- name: dshm
  emptyDir:
    medium: Memory
{{- end }}
{{- with .modelVolume }}
- name: models
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "lathe.poolMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /cache
{{- if .gpu }}
- name: dshm
  mountPath: /dev/shm
{{- end }}
{{- if .modelVolume }}
- name: models
  mountPath: /models
  readOnly: true
{{- end }}
{{- end -}}

{{- /* Egress of trainer and sampler: the release's own pods (checkpoints, other ranks) and DNS, nothing else. */ -}}
{{- define "lathe.inReleaseEgress" -}}
- to:
    - podSelector:
        matchLabels:
          app.kubernetes.io/name: lathe
          app.kubernetes.io/instance: {{ .Release.Name }}
- ports:
    - port: 53
      protocol: UDP
    - port: 53
      protocol: TCP
{{- end -}}

{{- /* A NetworkPolicy peer: the pods of one component, (dict "root" $ "component" "gateway") */ -}}
{{- define "lathe.from" -}}
- podSelector:
    matchLabels:
      {{- include "lathe.selector" . | nindent 6 }}
{{- end -}}
