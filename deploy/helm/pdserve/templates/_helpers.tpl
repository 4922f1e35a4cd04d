{{/* Names and labels. */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.fullname" -}}
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

{{/* The name of a component's objects: <fullname>-router, -prefill, -decode. */}}
{{- define "pdserve.componentName" -}}
{{- printf "%s-%s" (include "pdserve.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end }}

{{/* Labels of every object; dict "root" $ "component" "router"|"prefill"|"decode"|"" */}}
{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end }}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "pdserve.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion .Values.image.variant) }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/*
Ports. The Registry (where workers register) is on the router's public port until
the router serves it apart (issue 9's --internal-port): then this returns
.Values.router.ports.internal and pdserve.router.args passes --internal-port. The
internal Service, the workers' --router and the NetworkPolicy all read it here.
*/}}
{{- define "pdserve.router.registryPort" -}}
{{- .Values.router.ports.grpc }}
{{- end }}

{{- define "pdserve.router.registryAddress" -}}
{{- printf "%s-internal.%s.svc:%s" (include "pdserve.componentName" (dict "root" . "component" "router")) .Release.Namespace (include "pdserve.router.registryPort" .) }}
{{- end }}

{{/* Where the model directory is inside every pod. */}}
{{- define "pdserve.modelPath" -}}
{{- if eq .Values.model.source "embedded" }}
{{- .Values.model.embeddedPath }}
{{- else }}
{{- trimSuffix "/" (printf "/models/%s" (.Values.model.dir | trimPrefix "/")) }}
{{- end }}
{{- end }}

{{/*
Command-line flags from a dict of camelCase field names (one field of the config
dataclass each, services/common/flags.py): `--kebab-case value`; true is `--flag`,
false `--no-flag`; null leaves the flag out. Numbers go through toJson, which never
writes an exponent (8589934592, not 8.589934592e+09).
*/}}
{{- define "pdserve.flags" -}}
{{- range $key, $value := . }}
{{- if kindIs "bool" $value }}
- {{ printf "--%s%s" (ternary "" "no-" $value) (kebabcase $key) | quote }}
{{- else if not (kindIs "invalid" $value) }}
- {{ printf "--%s" (kebabcase $key) | quote }}
- {{ ternary $value (toJson $value) (kindIs "string" $value) | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* dst with every key of src set on it (false and 0 included, unlike mergeOverwrite). */}}
{{- define "pdserve.overlay" -}}
{{- $out := deepCopy .dst }}
{{- range $key, $value := .src }}
{{- $_ := set $out $key $value }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/*
The router's arguments: `pdserve router` and its flags. Flags still to come, with the
values they take (see the README's "Wiring still to do"):
  --internal-port .Values.router.ports.internal                  (issue 9)
  --cluster-token-file /etc/pdserve/cluster/token                (issue 9)
  --cluster-ca/--cluster-cert/--cluster-key /etc/pdserve/cluster/{ca.crt,tls.crt,tls.key}
  --api-keys-file /etc/pdserve/api-keys/api-keys                 (issue 9)
  --tls-cert/--tls-key /etc/pdserve/tls/{tls.crt,tls.key}        (issue 9)
  --metrics-port .Values.router.ports.metrics                    (issue 10)
*/}}
{{- define "pdserve.router.args" -}}
{{- $set := dict
  "model" (include "pdserve.modelPath" .)
  "servedModelName" .Values.model.servedModelName
  "host" "0.0.0.0"
  "port" .Values.router.ports.grpc
  "blockSize" .Values.engine.blockSize
  "maxModelLen" .Values.engine.maxModelLen
  "maxN" .Values.engine.maxN }}
{{- $flags := include "pdserve.overlay" (dict "dst" .Values.router.config "src" $set) | fromJson }}
- router
{{- include "pdserve.flags" $flags }}
{{- with .Values.router.extraArgs }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
A worker's arguments: `pdserve prefill|decode` and its flags; dict "root" $ "pool"
"prefill"|"decode". Flags still to come: --metrics-port <pool>.ports.metrics
(issue 10); --cluster-token-file / --cluster-ca / --cluster-cert / --cluster-key
(issue 9, files under /etc/pdserve/cluster); CURVE keys as files if issue 9 moves
them from the PDSERVE_KV_CURVE_* environment to flags.
*/}}
{{- define "pdserve.worker.args" -}}
{{- $root := .root }}
{{- $pool := index $root.Values .pool }}
{{- $engine := include "pdserve.overlay" (dict "dst" $root.Values.engine "src" $pool.engine) | fromJson }}
{{- $flags := include "pdserve.overlay" (dict "dst" $engine "src" $pool.config) | fromJson }}
{{- $set := dict
  "model" (include "pdserve.modelPath" $root)
  "servedModelName" $root.Values.model.servedModelName
  "host" "0.0.0.0"
  "port" $pool.ports.grpc
  "router" (include "pdserve.router.registryAddress" $root)
  "workerId" "$(POD_NAME)"
  "advertiseHost" "$(POD_IP)" }}
{{- $flags = include "pdserve.overlay" (dict "dst" $flags "src" $set) | fromJson }}
- {{ .pool }}
{{- include "pdserve.flags" $flags }}
{{- with $pool.extraArgs }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Model: the volume, its mount and the init container that fills it. */}}
{{- define "pdserve.model.volumes" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ $m.hostPath.path }}
    type: {{ $m.hostPath.type }}
{{- else if or (eq $m.source "image") (eq $m.source "url") }}
- name: model
  emptyDir:
    sizeLimit: {{ $m.emptyDir.sizeLimit }}
{{- end }}
{{- end }}

{{- define "pdserve.model.volumeMounts" -}}
{{- $m := .Values.model }}
{{- if ne $m.source "embedded" }}
- name: model
  mountPath: /models
  readOnly: true
  {{- if and (eq $m.source "pvc") $m.pvc.subPath }}
  subPath: {{ $m.pvc.subPath }}
  {{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.model.initContainers" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "image" }}
- name: model
  image: {{ printf "%s:%s" $m.image.repository $m.image.tag | quote }}
  imagePullPolicy: {{ $m.image.pullPolicy }}
  command: ["cp", "-R", "{{ trimSuffix "/" $m.image.path }}/.", "/models/"]
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: /models
{{- else if eq $m.source "url" }}
- name: model
  image: {{ $m.url.image | quote }}
  command:
    {{- toYaml $m.url.command | nindent 4 }}
  env:
    - name: MODEL_URL
      value: {{ $m.url.url | quote }}
    - name: MODEL_DIR
      value: /models
    - name: HOME
      value: /tmp
    {{- with $m.url.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $m.url.credentialsSecret }}
  envFrom:
    - secretRef:
        name: {{ . }}
  {{- end }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: /models
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end }}

{{/*
Credentials: the Secret each comes from (existing by name, or the one secrets.yaml
makes); "" when it is off.
*/}}
{{- define "pdserve.secret.cluster" -}}
{{- $c := .Values.credentials.cluster }}
{{- if $c.existingSecret }}{{ $c.existingSecret }}{{ else if $c.generate }}{{ include "pdserve.fullname" . }}-cluster{{ end }}
{{- end }}

{{- define "pdserve.secret.apiKeys" -}}
{{- $c := .Values.credentials.apiKeys }}
{{- if $c.existingSecret }}{{ $c.existingSecret }}{{ else if $c.generate }}{{ include "pdserve.fullname" . }}-api-keys{{ end }}
{{- end }}

{{/* Secret volumes of a component (dict "root" $ "component" ...). */}}
{{- define "pdserve.credentials.volumes" -}}
{{- with include "pdserve.secret.cluster" .root }}
- name: cluster-credentials
  secret:
    secretName: {{ . }}
    defaultMode: 0440
{{- end }}
{{- if eq .component "router" }}
{{- with include "pdserve.secret.apiKeys" .root }}
- name: api-keys
  secret:
    secretName: {{ . }}
    defaultMode: 0440
{{- end }}
{{- with .root.Values.credentials.tls.existingSecret }}
- name: tls
  secret:
    secretName: {{ . }}
    defaultMode: 0440
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.credentials.volumeMounts" -}}
{{- if include "pdserve.secret.cluster" .root }}
- name: cluster-credentials
  mountPath: /etc/pdserve/cluster
  readOnly: true
{{- end }}
{{- if eq .component "router" }}
{{- if include "pdserve.secret.apiKeys" .root }}
- name: api-keys
  mountPath: /etc/pdserve/api-keys
  readOnly: true
{{- end }}
{{- if .root.Values.credentials.tls.existingSecret }}
- name: tls
  mountPath: /etc/pdserve/tls
  readOnly: true
{{- end }}
{{- end }}
{{- end }}

{{/*
The KV channel's CURVE keys, in the environment kvtransfer.zmq.CurveConfig.from_env
reads: one keypair for the cluster, so every sender knows the receivers' public key
and every receiver admits exactly that key.
*/}}
{{- define "pdserve.kvCurve.env" -}}
{{- with .Values.credentials.kvCurve.existingSecret }}
{{- $secret := . }}
{{- range $name, $key := dict "PUBLIC_KEY" "public.key" "SECRET_KEY" "secret.key" "SERVER_KEY" "public.key" "AUTHORIZED_KEYS" "public.key" }}
- name: PDSERVE_KV_CURVE_{{ $name }}
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ $key }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The pod template of every component: dict "root" $ "component" name "values" the
component's values block "args" its rendered arguments.
*/}}
{{- define "pdserve.podTemplate" -}}
{{- $root := .root }}
{{- $v := .values }}
{{- $worker := ne .component "router" -}}
metadata:
  labels:
    {{- include "pdserve.labels" (dict "root" $root "component" .component) | nindent 4 }}
    {{- with $v.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $v.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  serviceAccountName: {{ include "pdserve.serviceAccountName" $root }}
  automountServiceAccountToken: false
  enableServiceLinks: false
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $root.Values.podSecurityContext | nindent 4 }}
  terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
  {{- with $v.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $v.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with include "pdserve.model.initContainers" $root | trim }}
  initContainers:
    {{- . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ .component }}
      image: {{ include "pdserve.image" $root | quote }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      args:
        {{- .args | trim | nindent 8 }}
      env:
        - name: POD_NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        - name: POD_IP
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
        - name: HOME
          value: /tmp
        {{- if $worker }}
        # The address a decode worker's KV receiver binds and advertises (pod IP).
        - name: PDSERVE_KV_HOST
          value: $(POD_IP)
        {{- with include "pdserve.kvCurve.env" $root | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- end }}
        {{- with $v.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: grpc
          containerPort: {{ $v.ports.grpc }}
          protocol: TCP
        {{- if and (not $worker) (ne (include "pdserve.router.registryPort" $root) (toString $v.ports.grpc)) }}
        - name: internal
          containerPort: {{ include "pdserve.router.registryPort" $root }}
          protocol: TCP
        {{- end }}
        - name: metrics
          containerPort: {{ $v.ports.metrics }}
          protocol: TCP
      # gRPC health checking (grpc.health.v1, the overall server ""): the port opens
      # once the model is loaded, NOT_SERVING again from the moment the process
      # starts shutting down. The startup probe covers the model's loading time.
      startupProbe:
        grpc: {port: {{ $v.ports.grpc }}}
        {{- toYaml $v.probes.startup | nindent 8 }}
      readinessProbe:
        grpc: {port: {{ $v.ports.grpc }}}
        {{- toYaml $v.probes.readiness | nindent 8 }}
      livenessProbe:
        grpc: {port: {{ $v.ports.grpc }}}
        {{- toYaml $v.probes.liveness | nindent 8 }}
      lifecycle:
        preStop:
          sleep:
            seconds: {{ $v.preStopSleepSeconds }}
      {{- with $v.resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.securityContext | nindent 8 }}
      volumeMounts:
        - name: tmp
          mountPath: /tmp
        {{- if $worker }}
        - name: shm
          mountPath: /dev/shm
        {{- end }}
        {{- with include "pdserve.model.volumeMounts" $root | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with include "pdserve.credentials.volumeMounts" . | trim }}
        {{- . | nindent 8 }}
        {{- end }}
  volumes:
    - name: tmp
      emptyDir: {}
    {{- if $worker }}
    - name: shm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $v.shmSizeLimit }}
    {{- end }}
    {{- with include "pdserve.model.volumes" $root | trim }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with include "pdserve.credentials.volumes" . | trim }}
    {{- . | nindent 4 }}
    {{- end }}
{{- end }}
