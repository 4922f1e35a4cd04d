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
Ports. The Registry (where workers register) is on the router's internal port
(--internal-port), apart from the public one: the internal Services, the workers'
--router and the NetworkPolicy all read it here.
*/}}
{{- define "pdserve.router.registryPort" -}}
{{- .Values.router.ports.internal }}
{{- end }}

{{/* The headless Service whose name stands for every ready router. */}}
{{- define "pdserve.router.registryService" -}}
{{- include "pdserve.componentName" (dict "root" . "component" "router-registry") }}
{{- end }}

{{/* The workers' --router: the headless Service's DNS name (every router) and port. */}}
{{- define "pdserve.router.registryAddress" -}}
{{- printf "%s.%s.svc:%s" (include "pdserve.router.registryService" .) .Release.Namespace (include "pdserve.router.registryPort" .) }}
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
The router's arguments: `pdserve router` and its flags: the public port, the
internal (Registry) port and the metrics port of its container, the engine limits
the cluster shares, and the credentials mounted from Secrets.
*/}}
{{- define "pdserve.router.args" -}}
{{- if .Values.router.config.saltCacheByKey }}
{{- if not (include "pdserve.secret.apiKeys" .) }}
{{- fail "router.config.saltCacheByKey: needs API keys (credentials.apiKeys.existingSecret or credentials.apiKeys.generate)" }}
{{- end }}
{{- end }}
{{- $p := .Values.router.ports }}
{{- $ports := list (int $p.grpc) (int $p.internal) (int $p.metrics) }}
{{- if $p.http }}{{ $ports = append $ports (int $p.http) }}{{ end }}
{{- if ne (len $ports) (len (uniq $ports)) }}
{{- fail (printf "router.ports: grpc (%v), internal (%v), metrics (%v) and http (%v) must differ" $p.grpc $p.internal $p.metrics $p.http) }}
{{- end }}
{{- $set := dict
  "model" (include "pdserve.modelPath" .)
  "servedModelName" .Values.model.servedModelName
  "host" "0.0.0.0"
  "port" $p.grpc
  "internalHost" "0.0.0.0"
  "internalPort" $p.internal
  "metricsHost" "0.0.0.0"
  "metricsPort" $p.metrics
  "blockSize" .Values.engine.blockSize
  "maxModelLen" .Values.engine.maxModelLen
  "maxN" .Values.engine.maxN
  "maxLogprobs" .Values.engine.maxLogprobs
  "structuredOutputsMaxBytes" .Values.engine.structuredOutputsMaxBytes
  "structuredOutputsMaxDepth" .Values.engine.structuredOutputsMaxDepth }}
{{- if $p.http }}
{{- $_ := set $set "httpHost" "0.0.0.0" }}
{{- $_ := set $set "httpPort" $p.http }}
{{- end }}
{{- if .Values.router.chatTemplate }}
{{- $_ := set $set "chatTemplate" (include "pdserve.router.chatTemplatePath" .) }}
{{- end }}
{{- $set = include "pdserve.overlay" (dict "dst" $set "src" (include "pdserve.credentials.flags" (dict "root" . "component" "router") | fromJson)) | fromJson }}
{{- $flags := include "pdserve.overlay" (dict "dst" .Values.router.config "src" $set) | fromJson }}
- router
{{- include "pdserve.flags" $flags }}
{{- with .Values.router.extraArgs }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Where the router's chat template (router.chatTemplate, a ConfigMap) is mounted. */}}
{{- define "pdserve.router.chatTemplateDir" -}}/etc/pdserve/chat-template{{- end }}
{{- define "pdserve.router.chatTemplatePath" -}}{{ include "pdserve.router.chatTemplateDir" . }}/chat_template.jinja{{- end }}

{{/*
A worker's arguments: `pdserve prefill|decode` and its flags; dict "root" $ "pool"
"prefill"|"decode". Its id is its pod's name, it advertises its pod IP, registers
with every router (--router: the headless registry Service's name, which resolves to
each ready router), serves metrics on its container's metrics port.
The model's storage (model.quantization, model.kvCacheDtype) is the release's, never
a pool's: both pools get the same --quantization and --kv-cache-dtype.
*/}}
{{- define "pdserve.worker.args" -}}
{{- $root := .root }}
{{- $pool := index $root.Values .pool }}
{{- if eq (int $pool.ports.grpc) (int $pool.ports.metrics) }}
{{- fail (printf "%s.ports: grpc and metrics (%v) must differ" .pool $pool.ports.grpc) }}
{{- end }}
{{- $engine := include "pdserve.overlay" (dict "dst" $root.Values.engine "src" $pool.engine) | fromJson }}
{{- $flags := include "pdserve.overlay" (dict "dst" $engine "src" $pool.config) | fromJson }}
{{- /* An EAGLE head runs on prefill workers too: they ship its state for the prompt, and
       workers pair only with the same head. Other methods stay on the decode pool. */}}
{{- $spec := $root.Values.decode.config.speculativeConfig }}
{{- $parsed := $spec }}
{{- if kindIs "string" $spec }}{{ $parsed = fromJson $spec }}{{ end }}
{{- if and (eq .pool "prefill") (kindIs "map" $parsed) (has (get $parsed "method") (list "eagle" "eagle3")) }}
{{- $_ := set $flags "speculativeConfig" $spec }}
{{- end }}
{{- $set := dict
  "model" (include "pdserve.modelPath" $root)
  "servedModelName" $root.Values.model.servedModelName
  "quantization" $root.Values.model.quantization
  "kvCacheDtype" $root.Values.model.kvCacheDtype
  "host" "0.0.0.0"
  "port" $pool.ports.grpc
  "router" (include "pdserve.router.registryAddress" $root)
  "workerId" "$(POD_NAME)"
  "advertiseHost" "$(POD_IP)"
  "metricsHost" "0.0.0.0"
  "metricsPort" $pool.ports.metrics }}
{{- $set = include "pdserve.overlay" (dict "dst" $set "src" (include "pdserve.credentials.flags" (dict "root" $root "component" .pool) | fromJson)) | fromJson }}
{{- $diskBytes := $flags.kvOffloadDiskBytes | default 0 }}
{{- if $pool.kvOffloadVolume.enabled }}
{{- if not $diskBytes }}
{{- fail (printf "%s.kvOffloadVolume is enabled: set %s.config.kvOffloadDiskBytes, the disk KV tier's bytes" .pool .pool) }}
{{- end }}
{{- $_ := set $set "kvOffloadDir" (include "pdserve.kvOffload.mountPath" $root) }}
{{- else if $diskBytes }}
{{- fail (printf "%s.config.kvOffloadDiskBytes needs a volume: enable %s.kvOffloadVolume" .pool .pool) }}
{{- end }}
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
makes); "" when it is off. Each is mounted read-only where the flags below point
(only the keys used, so a Secret that lacks one fails the pod's start, naming it).
*/}}
{{- define "pdserve.secret.cluster" -}}
{{- $c := .Values.credentials.cluster }}
{{- if or $c.token $c.mtls }}
{{- if $c.existingSecret }}{{ $c.existingSecret }}{{ else if $c.generate }}{{ include "pdserve.fullname" . }}-cluster{{ end }}
{{- end }}
{{- end }}

{{- define "pdserve.secret.kvCurve" -}}
{{- $c := .Values.credentials.kvCurve }}
{{- if $c.existingSecret }}{{ $c.existingSecret }}{{ else if $c.generate }}{{ include "pdserve.fullname" . }}-kv-curve{{ end }}
{{- end }}

{{- define "pdserve.secret.apiKeys" -}}
{{- $c := .Values.credentials.apiKeys }}
{{- if $c.existingSecret }}{{ $c.existingSecret }}{{ else if $c.generate }}{{ include "pdserve.fullname" . }}-api-keys{{ end }}
{{- end }}

{{/* Whether internal RPCs use mTLS ("true" or ""). */}}
{{- define "pdserve.mtls" -}}
{{- if and (include "pdserve.secret.cluster" .) .Values.credentials.cluster.mtls }}true{{ end }}
{{- end }}

{{/*
The mounts of a component's credentials (dict "root" $ "component" ...), as JSON:
[{name, secret, path, keys}]. The router gets the cluster credentials, the API keys and
the public TLS certificate; a worker the cluster credentials and the KV channel's
CURVE key. Workers never see the public port's keys, the router never the CURVE key.
*/}}
{{- define "pdserve.credentials.mounts" -}}
{{- $root := .root }}
{{- $c := $root.Values.credentials }}
{{- $mounts := list }}
{{- with include "pdserve.secret.cluster" $root }}
{{- $keys := list }}
{{- if $c.cluster.token }}{{ $keys = append $keys "token" }}{{ end }}
{{- if $c.cluster.mtls }}{{ $keys = concat $keys (list "ca.crt" "tls.crt" "tls.key") }}{{ end }}
{{- $mounts = append $mounts (dict "name" "cluster-credentials" "secret" . "path" "/etc/pdserve/cluster" "keys" $keys) }}
{{- end }}
{{- if eq .component "router" }}
{{- with include "pdserve.secret.apiKeys" $root }}
{{- $mounts = append $mounts (dict "name" "api-keys" "secret" . "path" "/etc/pdserve/api-keys" "keys" (list "api-keys")) }}
{{- end }}
{{- with $c.tls.existingSecret }}
{{- $mounts = append $mounts (dict "name" "tls" "secret" . "path" "/etc/pdserve/tls" "keys" (list "tls.crt" "tls.key")) }}
{{- end }}
{{- else }}
{{- with include "pdserve.secret.kvCurve" $root }}
{{- $mounts = append $mounts (dict "name" "kv-curve" "secret" . "path" "/etc/pdserve/kv-curve" "keys" (list "cluster.key")) }}
{{- end }}
{{- end }}
{{- toJson $mounts }}
{{- end }}

{{/* The credential flags of a component (dict "root" $ "component" ...), as JSON. */}}
{{- define "pdserve.credentials.flags" -}}
{{- $c := .root.Values.credentials }}
{{- $flags := dict }}
{{- range $m := include "pdserve.credentials.mounts" . | fromJsonArray }}
{{- if eq $m.name "cluster-credentials" }}
{{- if has "token" $m.keys }}{{ $_ := set $flags "clusterTokenFile" (printf "%s/token" $m.path) }}{{ end }}
{{- if has "ca.crt" $m.keys }}
{{- $_ := set $flags "clusterCa" (printf "%s/ca.crt" $m.path) }}
{{- $_ := set $flags "clusterCert" (printf "%s/tls.crt" $m.path) }}
{{- $_ := set $flags "clusterKey" (printf "%s/tls.key" $m.path) }}
{{- with $c.cluster.serverName }}{{ $_ := set $flags "clusterServerName" . }}{{ end }}
{{- end }}
{{- else if eq $m.name "api-keys" }}
{{- $_ := set $flags "apiKeysFile" (printf "%s/api-keys" $m.path) }}
{{- else if eq $m.name "tls" }}
{{- $_ := set $flags "tlsCert" (printf "%s/tls.crt" $m.path) }}
{{- $_ := set $flags "tlsKey" (printf "%s/tls.key" $m.path) }}
{{- else if eq $m.name "kv-curve" }}
{{- $_ := set $flags "kvCurveClusterKey" (printf "%s/cluster.key" $m.path) }}
{{- end }}
{{- end }}
{{- toJson $flags }}
{{- end }}

{{/* Secret volumes of a component (dict "root" $ "component" ...). */}}
{{- define "pdserve.credentials.volumes" -}}
{{- range $m := include "pdserve.credentials.mounts" . | fromJsonArray }}
- name: {{ $m.name }}
  secret:
    secretName: {{ $m.secret }}
    # Group-readable: the files belong to root and the pod's fsGroup (10001).
    defaultMode: 0440
    items:
      {{- range $key := $m.keys }}
      - {key: {{ $key }}, path: {{ $key }}}
      {{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.credentials.volumeMounts" -}}
{{- range $m := include "pdserve.credentials.mounts" . | fromJsonArray }}
- name: {{ $m.name }}
  mountPath: {{ $m.path }}
  readOnly: true
{{- end }}
{{- end }}

{{/*
What the probes call (dict "root" $ "component" ... "values" ...): Kubernetes' native
gRPC probe speaks plaintext only. A worker's gRPC port is plaintext unless the
cluster uses mTLS; the router's public port unless it has a TLS certificate, and then
its internal port (the same process's health) unless that is mTLS. A TLS-only pod
gets a TCP probe of its gRPC port.
*/}}
{{- define "pdserve.probe.target" -}}
{{- $mtls := include "pdserve.mtls" .root }}
{{- if ne .component "router" }}
{{- if $mtls }}tcpSocket{{ else }}grpc{{ end }}: {port: {{ .values.ports.grpc }}}
{{- else if not .root.Values.credentials.tls.existingSecret }}grpc: {port: {{ .values.ports.grpc }}}
{{- else if not $mtls }}grpc: {port: {{ .values.ports.internal }}}
{{- else }}tcpSocket: {port: {{ .values.ports.grpc }}}
{{- end }}
{{- end }}

{{/*
Where a worker's disk KV tier lives (--kv-offload-dir): its pool's kvOffloadVolume.
*/}}
{{- define "pdserve.kvOffload.mountPath" -}}/var/lib/pdserve/kv-offload{{- end }}

{{/* The disk KV tier's volume in a pod (an emptyDir; a pvc comes from the StatefulSet's claim template). */}}
{{- define "pdserve.kvOffload.emptyDir" -}}
{{- $vol := .kvOffloadVolume | default dict }}
{{- if and $vol.enabled (eq $vol.type "emptyDir") }}
- name: kv-offload
  emptyDir:
    sizeLimit: {{ $vol.sizeLimit }}
{{- end }}
{{- end }}

{{/*
The pod template of every component: dict "root" $ "component" name "values" the
component's values block "args" its rendered arguments.
*/}}
{{- define "pdserve.podTemplate" -}}
{{- $root := .root }}
{{- $v := .values }}
{{- $worker := ne .component "router" }}
{{- $needed := addf $v.preStopSleepSeconds $v.drainTimeoutSeconds 10 }}
{{- if lt (float64 $v.terminationGracePeriodSeconds) $needed }}
{{- fail (printf "%s.terminationGracePeriodSeconds (%v) must be at least preStopSleepSeconds + drainTimeoutSeconds + 10 (%v): the kubelet kills the pod when it ends" .component $v.terminationGracePeriodSeconds $needed) }}
{{- end -}}
metadata:
  labels:
    {{- include "pdserve.labels" (dict "root" $root "component" .component) | nindent 4 }}
    {{- with $v.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- $annotations := deepCopy ($v.podAnnotations | default dict) }}
  {{- if and (not $worker) $v.chatTemplate }}
  {{- /* the router reads its template at start: a new one rolls the pod */}}
  {{- $_ := set $annotations "pdserve.io/chat-template-sha256" ($v.chatTemplate | sha256sum) }}
  {{- end }}
  {{- with $annotations }}
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
        {{- end }}
        # How long in-flight requests may finish after SIGTERM (--drain-timeout, read
        # from the environment like every flag; ignored by a pdserve without it).
        - name: PDSERVE_DRAIN_TIMEOUT
          value: {{ $v.drainTimeoutSeconds | toJson | quote }}
        {{- with $v.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: grpc
          containerPort: {{ $v.ports.grpc }}
          protocol: TCP
        {{- if not $worker }}
        {{- with $v.ports.http }}
        - name: http
          containerPort: {{ . }}
          protocol: TCP
        {{- end }}
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
      {{- $probe := include "pdserve.probe.target" . }}
      startupProbe:
        {{ $probe }}
        {{- toYaml $v.probes.startup | nindent 8 }}
      readinessProbe:
        {{ $probe }}
        {{- toYaml $v.probes.readiness | nindent 8 }}
      livenessProbe:
        {{ $probe }}
        {{- toYaml $v.probes.liveness | nindent 8 }}
      # The pod leaves its Services' endpoints while this sleeps; SIGTERM comes after
      # it, and the process drains (drainTimeoutSeconds) before it stops.
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
        {{- if dig "kvOffloadVolume" "enabled" false $v }}
        - name: kv-offload
          mountPath: {{ include "pdserve.kvOffload.mountPath" $root }}
        {{- end }}
        {{- end }}
        {{- with include "pdserve.model.volumeMounts" $root | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with include "pdserve.credentials.volumeMounts" . | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- if and (not $worker) $v.chatTemplate }}
        - name: chat-template
          mountPath: {{ include "pdserve.router.chatTemplateDir" $root }}
          readOnly: true
        {{- end }}
  volumes:
    - name: tmp
      emptyDir: {}
    {{- if $worker }}
    - name: shm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $v.shmSizeLimit }}
    {{- with include "pdserve.kvOffload.emptyDir" $v | trim }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- end }}
    {{- with include "pdserve.model.volumes" $root | trim }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with include "pdserve.credentials.volumes" . | trim }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- if and (not $worker) $v.chatTemplate }}
    - name: chat-template
      configMap:
        name: {{ include "pdserve.componentName" (dict "root" $root "component" "router-chat-template") }}
    {{- end }}
{{- end }}
