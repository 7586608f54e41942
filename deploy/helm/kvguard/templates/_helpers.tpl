{{/* Names and labels */}}
{{- define "kvguard.name" -}}{{ .Release.Name | trunc 50 | trimSuffix "-" }}{{- end }}

{{- define "kvguard.labels" -}}
app.kubernetes.io/name: {{ include "kvguard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: kvguard
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end }}

{{- define "kvguard.selector" -}}
app.kubernetes.io/name: {{ include "kvguard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
The pod's security context: no container runs as root, the runtime's seccomp profile; the
fsGroup (kvguard's group) reads the Secret files and lets the inference container, whatever
its user, reach the sidecar's socket (mode 0660).
*/}}
{{- define "kvguard.podSecurityContext" -}}
runAsNonRoot: true
fsGroup: {{ .Values.kvguard.uid }}
seccompProfile: {type: RuntimeDefault}
{{- end }}

{{/* Every kvguard container: the image's user, read-only root, no capability, no escalation */}}
{{- define "kvguard.securityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.kvguard.uid }}
runAsGroup: {{ .Values.kvguard.uid }}
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
privileged: false
capabilities: {drop: [ALL]}
seccompProfile: {type: RuntimeDefault}
{{- end }}

{{/*
The kubelet gives a Secret's files to root and the pod's fsGroup, mode 0440 whatever
defaultMode says (kubernetes/kubernetes#57923); kvguard refuses a key its group can read
and libpq ignores such a pgpass file: an init container copies them into memory, 0400,
for the kvguard user. Arguments: the root context, the Secret volumes' names (list), the
files to copy (list of paths under /run/kvguard-secret).
*/}}
{{- define "kvguard.copySecrets" -}}
- name: kvguard-secrets
  image: {{ .root.Values.kvguard.image }}
  imagePullPolicy: {{ .root.Values.kvguard.imagePullPolicy }}
  command: [sh, -c, "install -m 0400 {{ range .files }}/run/kvguard-secret/{{ . }} {{ end }}/etc/kvguard/key/"]
  securityContext:
    {{- include "kvguard.securityContext" .root | nindent 4 }}
  resources:
    requests: {cpu: 10m, memory: 16Mi}
    limits: {memory: 32Mi}
  volumeMounts:
    {{- range .volumes }}
    - {name: {{ .name }}, mountPath: /run/kvguard-secret/{{ .dir }}, readOnly: true}
    {{- end }}
    - {name: kvguard-key, mountPath: /etc/kvguard/key}
{{- end }}
