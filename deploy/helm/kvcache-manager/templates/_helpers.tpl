{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "kvcache-manager.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full object name: RELEASE-CHART unless the release name already holds the chart name. */}}
{{- define "kvcache-manager.fullname" -}}
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

{{- define "kvcache-manager.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that select the pods: stable across upgrades, never add to them. */}}
{{- define "kvcache-manager.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvcache-manager.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels on every object. component=kvcached also names the scrape job (jobLabel). */}}
{{- define "kvcache-manager.labels" -}}
helm.sh/chart: {{ include "kvcache-manager.chart" . }}
{{ include "kvcache-manager.selectorLabels" . }}
app.kubernetes.io/component: kvcached
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvcache-manager
{{- end }}

{{- define "kvcache-manager.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvcache-manager.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* repository:tag or repository@digest; the cuda backend's default tag ends in -cuda. */}}
{{- define "kvcache-manager.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- $tag := .Values.image.tag }}
{{- if not $tag }}
{{- $tag = .Chart.AppVersion }}
{{- if eq .Values.daemon.backend "cuda" }}
{{- $tag = printf "%s-cuda" $tag }}
{{- end }}
{{- end }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/* True when the Prometheus Operator's CRDs are served (ServiceMonitor, PrometheusRule). */}}
{{- define "kvcache-manager.hasMonitoringAPI" -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" }}true{{ end }}
{{- end }}

{{/* The daemon's command-line flags, one list item each; null values are left out. */}}
{{- define "kvcache-manager.args" -}}
{{- $d := .Values.daemon }}
- --listen=0.0.0.0:{{ .Values.ports.grpc }}
- --metrics_listen=0.0.0.0:{{ .Values.ports.metrics }}
- --backend={{ $d.backend }}
{{- $flags := list
  (list "max_sequences" $d.maxSequences)
  (list "idle_timeout" $d.idleTimeout)
  (list "drain_deadline" $d.drainDeadline)
  (list "max_message_bytes" $d.maxMessageBytes)
  (list "max_streams" $d.maxStreams)
  (list "keepalive_time" $d.keepaliveTime)
  (list "keepalive_timeout" $d.keepaliveTimeout)
  (list "pool_memory_bytes" $d.poolMemoryBytes)
  (list "tp_ranks" $d.tpRanks)
  (list "kv_layers" $d.kvLayers)
  (list "kv_heads" $d.kvHeads)
  (list "kv_head_dim" $d.kvHeadDim)
  (list "kv_tokens_per_block" $d.kvTokensPerBlock)
  (list "kv_dtype" $d.kvDtype)
  (list "kv_shared_memory" $d.kvSharedMemory)
  (list "max_sequence_tokens" $d.maxSequenceTokens)
  (list "memory_limit_bytes" $d.memoryLimitBytes)
  (list "stream_idle_timeout" $d.streamIdleTimeout)
  (list "max_connections" $d.maxConnections)
  (list "listener_probe_interval" $d.listenerProbeInterval)
  (list "diagnostics_every" $d.diagnosticsEvery)
  (list "diagnostics_sample" $d.diagnosticsSample)
  (list "tenant_max_sequences" $d.tenantMaxSequences)
  (list "tenant_memory_share" $d.tenantMemoryShare) }}
{{- range $flags }}
{{- $value := index . 1 }}
{{- if not (kindIs "invalid" $value) }}
{{- if and (kindIs "float64" $value) (eq $value (float64 (int64 $value))) }}
{{- /* YAML numbers arrive as float64: whole ones as integers, fractions as they are */}}
{{- $value = int64 $value }}
{{- end }}
- --{{ index . 0 }}={{ $value }}
{{- end }}
{{- end }}
{{- if .Values.tls.secretName }}
- --tls_cert_file=/etc/kvcached/tls/tls.crt
- --tls_key_file=/etc/kvcached/tls/tls.key
{{- if .Values.tls.requireClientCertificates }}
- --tls_client_ca_file=/etc/kvcached/client-ca/ca.crt
{{- end }}
- --health_listen=0.0.0.0:{{ .Values.ports.health }}
{{- end }}
{{- if .Values.auth.tokensSecretName }}
- --auth_tokens_file=/etc/kvcached/auth/tokens
{{- end }}
{{- if include "kvcache-manager.keepsState" . }}
- --state_dir=/var/lib/kvcached
{{- end }}
{{- if include "kvcache-manager.handoff" . }}
{{- $h := .Values.handoff }}
- --peer_listen=0.0.0.0:{{ $h.port }}
- --kv_transfer={{ $h.kvTransfer }}
{{- if not (kindIs "invalid" $h.maxImportBytesInFlight) }}
- --max_import_bytes_in_flight={{ int64 $h.maxImportBytesInFlight }}
{{- end }}
{{- if $h.peerToken.secretName }}
- --peer_token_file=/etc/kvcached/peer-token/token
{{- end }}
{{- if include "kvcache-manager.peerCaSource" . }}
- --peer_ca_file=/etc/kvcached/peer-ca/ca.crt
{{- end }}
{{- end }}
{{- range $d.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/* The port the kubelet's gRPC probes use: plaintext health beside a TLS gRPC port. */}}
{{- define "kvcache-manager.probePort" -}}
{{- if .Values.tls.secretName }}{{ .Values.ports.health }}{{ else }}{{ .Values.ports.grpc }}{{ end }}
{{- end }}

{{/* True when the drain's snapshot is kept: only host pools in shared memory (or none)
survive the process, so kvcached refuses --state_dir with cuda or private pools. */}}
{{- define "kvcache-manager.keepsState" -}}
{{- $d := .Values.daemon }}
{{- if and .Values.state.enabled (ne $d.backend "cuda") (ne (toString $d.kvSharedMemory) "false") }}true{{ end }}
{{- end }}

{{/* True when the daemon serves the disaggregated hand-off (KvPeer on the peer port). */}}
{{- define "kvcache-manager.handoff" -}}
{{- with .Values.handoff }}{{ if .enabled }}true{{ end }}{{ end }}
{{- end }}

{{/* Where the peer CA comes from: secret, configMap, or "" for none. */}}
{{- define "kvcache-manager.peerCaSource" -}}
{{- with .Values.handoff.peerCa }}
{{- if .secretName }}secret{{ else if .configMapName }}configMap{{ end }}
{{- end }}
{{- end }}

{{/* UCX_TCP_PORT_RANGE ("start-end") when handoff.ucxTcpPortRange sets both ends, else "". */}}
{{- define "kvcache-manager.ucxTcpPortRange" -}}
{{- with .Values.handoff.ucxTcpPortRange }}
{{- if and (not (kindIs "invalid" .start)) (not (kindIs "invalid" .end)) }}
{{- printf "%d-%d" (int64 .start) (int64 .end) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Refuses hand-off values the schema cannot compare: ports that collide, a half or
reversed UCX port range, UCX_TCP_PORT_RANGE set twice. Renders nothing. */}}
{{- define "kvcache-manager.validateHandoff" -}}
{{- if include "kvcache-manager.handoff" . }}
{{- $h := .Values.handoff }}
{{- $taken := dict (toString .Values.ports.grpc) "ports.grpc" (toString .Values.ports.metrics) "ports.metrics" }}
{{- if .Values.tls.secretName }}
{{- $_ := set $taken (toString .Values.ports.health) "ports.health" }}
{{- end }}
{{- with get $taken (toString $h.port) }}
{{- fail (printf "handoff.port %v is also %s: the peer port needs its own" $h.port .) }}
{{- end }}
{{- $r := default dict $h.ucxTcpPortRange }}
{{- if ne (kindIs "invalid" $r.start) (kindIs "invalid" $r.end) }}
{{- fail "handoff.ucxTcpPortRange: set both start and end, or neither" }}
{{- end }}
{{- with $range := include "kvcache-manager.ucxTcpPortRange" . }}
{{- if gt (int64 $r.start) (int64 $r.end) }}
{{- fail (printf "handoff.ucxTcpPortRange: start %v is above end %v" $r.start $r.end) }}
{{- end }}
{{- range $port, $what := set $taken (toString $h.port) "handoff.port" }}
{{- if and (ge (int64 $port) (int64 $r.start)) (le (int64 $port) (int64 $r.end)) }}
{{- fail (printf "handoff.ucxTcpPortRange %s holds %s (%s)" $range $what $port) }}
{{- end }}
{{- end }}
{{- if hasKey (default dict $h.ucxEnv) "UCX_TCP_PORT_RANGE" }}
{{- fail "handoff.ucxEnv.UCX_TCP_PORT_RANGE and handoff.ucxTcpPortRange: set one of them" }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
