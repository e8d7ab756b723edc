{{- define "lathe.fullname" -}}{{ .Release.Name }}-lathe{{- end -}}
{{- define "lathe.labels" -}}
app.kubernetes.io/name: lathe
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}
{{- define "lathe.image" -}}{{ .Values.image.repository }}:{{ .Values.image.tag }}{{- end -}}
{{- define "lathe.addr" -}}{{ include "lathe.fullname" .root }}-{{ .name }}:{{ .port }}{{- end -}}
