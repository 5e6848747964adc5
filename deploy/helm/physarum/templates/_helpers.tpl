{{/* Names, labels, images, env and the guards shared by every template. */}}

{{/* Release-wide prefix, at most 40 characters so that "<prefix>-trainer-headless" and pod names stay under 63. */}}
{{- define "physarum.fullname" -}}
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
{{- end -}}

{{/* "<fullname>-<component>"; call with (dict "root" $ "component" "buffer"). */}}
{{- define "physarum.name" -}}
{{- printf "%s-%s" (include "physarum.fullname" .root) .component -}}
{{- end -}}

{{- define "physarum.selectorLabels" -}}
app.kubernetes.io/name: {{ default .root.Chart.Name .root.Values.nameOverride | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "physarum.labels" -}}
{{ include "physarum.selectorLabels" . }}
app.kubernetes.io/part-of: physarum
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* A Physarum image: (dict "root" $ "image" .Values.buffer.image "gpu" false); "gpu" picks the CUDA build (<tag>-gpu). */}}
{{- define "physarum.image" -}}
{{- $img := .root.Values.image -}}
{{- $tag := default .root.Chart.AppVersion $img.tag -}}
{{- printf "%s/%s:%s%s" (trimSuffix "/" $img.registry) .image.repository $tag (ternary "-gpu" "" (default false .gpu)) -}}
{{- end -}}

{{/* podSecurityContext and securityContext: the release's, overridden by the component's. */}}
{{- define "physarum.podSecurityContext" -}}
{{- toYaml (mergeOverwrite (deepCopy .root.Values.podSecurityContext) (default dict .values.podSecurityContext)) -}}
{{- end -}}
{{- define "physarum.securityContext" -}}
{{- toYaml (mergeOverwrite (deepCopy .root.Values.securityContext) (default dict .values.securityContext)) -}}
{{- end -}}

{{/* One env value as the services' load_config reads it: lists comma-joined, whole numbers without exponent. */}}
{{- define "physarum.envValue" -}}
{{- if kindIs "slice" . -}}
{{- $items := list -}}
{{- range . }}{{ $items = append $items (include "physarum.envValue" .) }}{{ end -}}
{{- join "," $items -}}
{{- else if and (kindIs "float64" .) (eq (float64 (int64 .)) .) -}}
{{- printf "%d" (int64 .) -}}
{{- else -}}
{{- toString . -}}
{{- end -}}
{{- end -}}

{{/* PHYSARUM_<SERVICE>_<FIELD> entries from a `config` map: (dict "service" "buffer" "config" .Values.buffer.config). */}}
{{- define "physarum.configEnv" -}}
{{- $service := .service -}}
{{- range $field, $value := .config }}
- name: {{ printf "PHYSARUM_%s_%s" $service $field | upper }}
  value: {{ include "physarum.envValue" $value | toJson }}
{{- end }}
{{- end -}}

{{/* HOME and the Hugging Face settings every Python container shares. */}}
{{- define "physarum.commonEnv" -}}
- name: HOME
  value: /tmp
- name: HF_HOME
  value: /tmp/huggingface
{{- with .Values.models.hfEndpoint }}
- name: HF_ENDPOINT
  value: {{ . | toJson }}
{{- end }}
{{- with .Values.models.hfTokenSecret }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ . }}, key: HF_TOKEN}
{{- end }}
{{- end -}}

{{- define "physarum.secretName" -}}
{{- include "physarum.fullname" . -}}
{{- end -}}

{{- define "physarum.redisSecretName" -}}
{{- default (include "physarum.secretName" .) .Values.redis.existingSecret -}}
{{- end -}}

{{/* REDIS_PASSWORD from the chart's Secret (or redis.existingSecret), for the Redis URL and redis-cli (REDISCLI_AUTH). */}}
{{- define "physarum.redisPasswordEnv" -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef: {name: {{ include "physarum.redisSecretName" .root }}, key: redis-password}
{{- end -}}

{{- define "physarum.tokenSecretName" -}}
{{- default (include "physarum.secretName" .) .Values.jobApi.existingSecret -}}
{{- end -}}

{{/* The buffer's Redis URL: the chart's Redis with the password from REDIS_PASSWORD (an env var set before it), or
     the external URL. */}}
{{- define "physarum.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://:$(REDIS_PASSWORD)@%s:6379/0" (include "physarum.name" (dict "root" . "component" "redis")) -}}
{{- else -}}
{{- required "redis.externalUrl is required when redis.enabled is false (e.g. redis://my-redis:6379/0)" .Values.redis.externalUrl -}}
{{- end -}}
{{- end -}}

{{/* host:port of a component's Service. */}}
{{- define "physarum.addr" -}}
{{- printf "%s:%d" (include "physarum.name" (dict "root" .root "component" .component)) (int .port) -}}
{{- end -}}

{{/* DNS name of trainer rank 0 through the headless Service: MASTER_ADDR and the weight-sync master address. */}}
{{- define "physarum.trainerMaster" -}}
{{- $trainer := include "physarum.name" (dict "root" . "component" "trainer") -}}
{{- printf "%s-0.%s-headless.%s.svc.%s" $trainer $trainer .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{/* Resources with the GPUs as a limit (extended resources: requests default to limits): (dict "root" $ "values" .Values.trainer "gpus" N). */}}
{{- define "physarum.resources" -}}
{{- $res := deepCopy (default dict .values.resources) -}}
{{- if gt (int .gpus) 0 -}}
{{- $limits := default dict $res.limits -}}
{{- $_ := set $limits .root.Values.gpuResourceName (int .gpus) -}}
{{- $_ := set $res "limits" $limits -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/* /dev/shm as a memory-backed emptyDir with a size limit (containers get 64 MiB otherwise). */}}
{{- define "physarum.shmVolume" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ . }}
{{- end -}}

{{- define "physarum.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSize }}
{{- end -}}

{{- define "physarum.modelsVolume" -}}
{{- if .Values.models.persistence.enabled -}}
- name: models
  persistentVolumeClaim:
    claimName: {{ default (include "physarum.name" (dict "root" . "component" "models")) .Values.models.persistence.existingClaim }}
    readOnly: true
{{- end }}
{{- end -}}

{{/* The checkpoints PVC as a pod volume (the trainer writes it; engines read weight snapshots from it). */}}
{{- /* "true" where pods besides the trainer may mount the checkpoints volume read-only (a claim, not ReadWriteOnce):
     the buffer and the rollout manager read a job's files there, e.g. a model an SFT job saved */ -}}
{{- define "physarum.checkpointsShared" -}}
{{- $p := .Values.checkpoints.persistence }}
{{- if and $p.enabled (ne $p.accessMode "ReadWriteOnce") }}true{{ end }}
{{- end -}}

{{- define "physarum.checkpointsReadOnlyMount" -}}
{{- if include "physarum.checkpointsShared" . }}
- {name: checkpoints, mountPath: {{ .Values.checkpoints.mountPath }}, readOnly: true}
{{- end }}
{{- end -}}

{{- define "physarum.checkpointsReadOnlyVolume" -}}
{{- if include "physarum.checkpointsShared" . }}
{{ include "physarum.checkpointsVolume" (dict "root" . "readOnly" true) }}
{{- end }}
{{- end -}}

{{- define "physarum.checkpointsVolume" -}}
- name: checkpoints
  persistentVolumeClaim:
    claimName: {{ default (include "physarum.name" (dict "root" .root "component" "checkpoints")) .root.Values.checkpoints.persistence.existingClaim }}
    {{- if .readOnly }}
    readOnly: true
    {{- end }}
{{- end -}}

{{- define "physarum.modelsMount" -}}
{{- if .Values.models.persistence.enabled -}}
- name: models
  mountPath: {{ .Values.models.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* topologySpreadConstraints with the component's selector filled in where a constraint has none. */}}
{{- define "physarum.spread" -}}
{{- $selector := fromYaml (include "physarum.selectorLabels" .) -}}
{{- $out := list -}}
{{- range .values.topologySpreadConstraints -}}
{{- $c := deepCopy . -}}
{{- if not (hasKey $c "labelSelector") -}}
{{- $_ := set $c "labelSelector" (dict "matchLabels" $selector) -}}
{{- end -}}
{{- $out = append $out $c -}}
{{- end -}}
{{- with $out }}
topologySpreadConstraints:
{{ toYaml . | indent 2 }}
{{- end }}
{{- end -}}

{{/* nodeSelector, tolerations, affinity and the optional scheduling fields of a component. */}}
{{- define "physarum.scheduling" -}}
{{- with .runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .schedulerName }}
schedulerName: {{ . }}
{{- end }}
{{- with .nodeSelector }}
nodeSelector:
{{ toYaml . | indent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
{{ toYaml . | indent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
{{ toYaml . | indent 2 }}
{{- end }}
{{- end -}}

{{/* Restart pods when what they read from the Secret changes (not the generated token: it is kept on upgrades). */}}
{{- define "physarum.checksum" -}}
checksum/secret: {{ list .Values.jobApi .Values.redis.existingSecret (include "physarum.redisUrl" .) | toJson | sha256sum }}
{{- end -}}

{{/* gRPC health probes (grpc.health.v1, numeric port): startup and readiness; liveness only checks the port is open,
     so that a dependency outage (Redis, the router) makes the pod unready, not restarted. */}}
{{- define "physarum.grpcProbes" -}}
startupProbe:
  grpc: {port: {{ int .port }}}
  periodSeconds: {{ .probes.startup.periodSeconds }}
  timeoutSeconds: {{ .probes.startup.timeoutSeconds }}
  failureThreshold: {{ .probes.startup.failureThreshold }}
readinessProbe:
  grpc: {port: {{ int .port }}}
  periodSeconds: {{ .probes.readiness.periodSeconds }}
  timeoutSeconds: {{ .probes.readiness.timeoutSeconds }}
  failureThreshold: {{ .probes.readiness.failureThreshold }}
livenessProbe:
  tcpSocket: {port: {{ int .port }}}
  periodSeconds: {{ .probes.liveness.periodSeconds }}
  timeoutSeconds: {{ .probes.liveness.timeoutSeconds }}
  failureThreshold: {{ .probes.liveness.failureThreshold }}
{{- end -}}

{{/* Probe timings of the CPU services (buffer, reward, rollout manager). */}}
{{- define "physarum.serviceProbes" -}}
{{- toYaml (dict
  "startup" (dict "periodSeconds" 5 "timeoutSeconds" 5 "failureThreshold" 60)
  "readiness" (dict "periodSeconds" 10 "timeoutSeconds" 5 "failureThreshold" 3)
  "liveness" (dict "periodSeconds" 20 "timeoutSeconds" 5 "failureThreshold" 6)) -}}
{{- end -}}

{{/* The pod-spec fields shared by every Physarum workload: (dict "root" $ "component" "buffer" "values" .Values.buffer). */}}
{{- define "physarum.podCommon" -}}
enableServiceLinks: false
{{- include "physarum.initContainers" . }}
securityContext:
  {{- include "physarum.podSecurityContext" . | nindent 2 }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- include "physarum.scheduling" .values }}
{{- include "physarum.spread" . }}
{{- end -}}

{{/* A label map as a selector string: "k1=v1,k2=v2" (sorted keys). */}}
{{- define "physarum.selectorString" -}}
{{- $pairs := list -}}
{{- range $k, $v := . }}{{ $pairs = append $pairs (printf "%s=%s" $k $v) }}{{ end -}}
{{- join "," $pairs -}}
{{- end -}}

{{/* Trainer probes. The ranks share one pod template but only rank 0 serves (gRPC health on the numeric port); a
     worker (rank > 0) serves nothing and is its container's only process, so its probes pass while it runs. Hence
     exec probes: a gRPC health check (startup, readiness) or a port check (liveness) on rank 0. */}}
{{- define "physarum.trainerProbeCommand" -}}
- python
- -c
- |
  import os, sys
  if os.environ["RANK"] != "0":
      sys.exit(0)
  {{- if or (eq .check "grpc") (eq .check "queue") }}
  import grpc
  from grpc_health.v1 import health_pb2, health_pb2_grpc
  request = health_pb2.HealthCheckRequest(service={{ ternary "physarum.v1.Jobs.queue" "" (eq .check "queue") | quote }})
  with grpc.insecure_channel("127.0.0.1:{{ int .port }}") as channel:
      reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout={{ .timeout }})
  sys.exit(reply.status != health_pb2.HealthCheckResponse.SERVING)
  {{- else }}
  import socket
  socket.create_connection(("127.0.0.1", {{ int .port }}), timeout={{ .timeout }}).close()
  {{- end }}
{{- end -}}

{{- define "physarum.trainerProbes" -}}
{{- /* liveness: the job queue's own health, NOT_SERVING only when its worker is stuck (a restart resumes the jobs);
     a drain turns readiness off, never liveness */ -}}
{{- range $kind, $check := dict "startupProbe" "grpc" "readinessProbe" "grpc" "livenessProbe" "queue" }}
{{- $timing := get $.probes (trimSuffix "Probe" $kind) }}
{{ $kind }}:
  exec:
    command:
      {{- include "physarum.trainerProbeCommand" (dict "check" $check "port" $.port "timeout" (sub (int $timing.timeoutSeconds) 1 | max 1)) | nindent 6 }}
  periodSeconds: {{ $timing.periodSeconds }}
  timeoutSeconds: {{ $timing.timeoutSeconds }}
  failureThreshold: {{ $timing.failureThreshold }}
{{- end }}
{{- end -}}

{{/* Pod metadata: the component's labels and podLabels; the annotations given (a map) and podAnnotations.
     (dict "root" $ "component" "buffer" "values" .Values.buffer "annotations" (dict ...)) */}}
{{- define "physarum.podMetadata" -}}
labels:
  {{- include "physarum.labels" . | nindent 2 }}
  {{- with .values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with mergeOverwrite (deepCopy (default dict .annotations)) (default dict .values.podAnnotations) }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A Physarum service's or Redis's image with an optional digest: repository[:tag][@digest]. */}}
{{- define "physarum.pinnedImage" -}}
{{- .repository -}}{{- with .tag }}:{{ . }}{{ end -}}{{- with .digest }}@{{ . }}{{ end -}}
{{- end -}}


{{/* NetworkPolicy peers for a component's pods (dict "root" $ "component" "<name>"): a host-networked trainer is its
     nodes' addresses (networkPolicy.nodeCIDRs), any other component its pods' labels in this namespace. */}}
{{- define "physarum.npPeer" -}}
{{- if and (eq .component "trainer") .root.Values.trainer.network.hostNetwork -}}
{{- range .root.Values.networkPolicy.nodeCIDRs }}
- ipBlock: {cidr: {{ . }}}
{{- end }}
{{- else -}}
- podSelector:
    matchLabels:
      {{- include "physarum.selectorLabels" . | nindent 6 }}
{{- end -}}
{{- end -}}

{{/* A NetworkPolicy rule's `ports` (a list of TCP ports); nothing for an empty list: every port. */}}
{{- define "physarum.npPorts" -}}
{{- if . -}}
ports:
{{- range . }}
  - {port: {{ . }}, protocol: TCP}
{{- end }}
{{- end -}}
{{- end -}}
