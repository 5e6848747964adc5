{{/* Guards the schema cannot express (or that must hold even with --skip-schema-validation). */}}
{{- define "physarum.guards" -}}
{{- $e := .Values.engines -}}
{{- if and $e.hpa.enabled $e.managerScaling.enabled -}}
{{- fail "engines: hpa.enabled and managerScaling.enabled are both true; an HPA and the rollout manager would fight over the engine Deployment's replicas: enable one of them" -}}
{{- end -}}
{{- range $name, $scaler := dict "engines.hpa" $e.hpa "reward.hpa" .Values.reward.hpa -}}
{{- if and $scaler.enabled (gt (int $scaler.minReplicas) (int $scaler.maxReplicas)) -}}
{{- fail (printf "%s: minReplicas (%d) must be <= maxReplicas (%d)" $name (int $scaler.minReplicas) (int $scaler.maxReplicas)) -}}
{{- end -}}
{{- end -}}
{{- if and (not .Values.redis.enabled) (not .Values.redis.externalUrl) -}}
{{- fail "redis: enabled is false but externalUrl is empty; set redis.externalUrl (redis://host:6379/0) or redis.enabled=true" -}}
{{- end -}}
{{- range $what, $spec := dict "model" .Values.model "datasets" .Values.datasets -}}
{{- if has $spec.source (list "hf" "s3") -}}
{{- if not $.Values.models.persistence.enabled -}}
{{- fail (printf "%s.source %s downloads into the models volume: enable models.persistence (or use a pre-filled volume with source %s)" $what $spec.source (ternary "pvc" "none" (eq $what "model"))) -}}
{{- end -}}
{{- if not (hasPrefix (printf "%s/" (trimSuffix "/" $.Values.models.mountPath)) $spec.path) -}}
{{- fail (printf "%s.path %s must be a directory under models.mountPath %s (the fetch Job writes it there)" $what $spec.path $.Values.models.mountPath) -}}
{{- end -}}
{{- if and (eq $spec.source "hf") (not $spec.hf.repo) -}}
{{- fail (printf "%s.source hf needs %s.hf.repo (owner/name on the hub)" $what $what) -}}
{{- end -}}
{{- if and (eq $spec.source "s3") (not $spec.s3.uri) -}}
{{- fail (printf "%s.source s3 needs %s.s3.uri (s3://bucket/prefix)" $what $what) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and .Values.trainer.network.hostNetwork .Values.networkPolicy.enabled (not .Values.networkPolicy.nodeCIDRs) -}}
{{- fail "trainer.network.hostNetwork with networkPolicy.enabled: the trainer sends from node addresses, which pod-selector rules do not admit; list the GPU nodes' CIDRs in networkPolicy.nodeCIDRs (or disable networkPolicy)" -}}
{{- end -}}
{{- $egress := .Values.networkPolicy.extraEgress -}}
{{- if and .Values.networkPolicy.enabled (not .Values.redis.enabled) (not $egress.buffer) -}}
{{- fail "redis.externalUrl with networkPolicy.enabled: the buffer reaches only this release's Redis; add a rule for the external Redis to networkPolicy.extraEgress.buffer" -}}
{{- end -}}
{{- if and .Values.networkPolicy.enabled (not .Values.redis.enabled) (not .Values.trainer.network.hostNetwork) (not $egress.trainer) -}}
{{- fail "redis.externalUrl with networkPolicy.enabled: the trainer keeps its job records in Redis and reaches only this release's; add a rule for the external Redis to networkPolicy.extraEgress.trainer" -}}
{{- end -}}
{{- if and .Values.networkPolicy.enabled .Values.checkpoints.objectStore.endpoint (not .Values.trainer.network.hostNetwork) (not $egress.trainer) -}}
{{- fail "checkpoints.objectStore.endpoint with networkPolicy.enabled: the trainer reaches only its peers; add a rule for the object store to networkPolicy.extraEgress.trainer" -}}
{{- end -}}
{{- $ckpt := .Values.checkpoints.persistence -}}
{{- if and (eq $e.joinMode "disk") (not $ckpt.enabled) -}}
{{- fail "engines.joinMode disk needs a volume the trainer and the engines share: enable checkpoints.persistence, or set engines.joinMode=sync" -}}
{{- end -}}
{{- if and $e.lora.enabled (not $ckpt.enabled) -}}
{{- fail "engines.lora needs a volume the trainer and the engines share (SGLang loads each version of an adapter from a directory the trainer writes): enable checkpoints.persistence" -}}
{{- end -}}
{{- $ranks := int .Values.trainer.replicas -}}
{{- $disk := eq $e.joinMode "disk" -}}
{{- if and (or (gt $ranks 1) $disk $e.lora.enabled) $ckpt.enabled (not $ckpt.existingClaim) (ne $ckpt.accessMode "ReadWriteMany") -}}
{{- $sharers := ternary (printf "the %d trainer ranks" $ranks) "the trainer" (gt $ranks 1) -}}
{{- if $disk }}{{ $sharers = printf "%s and the engines (engines.joinMode disk)" $sharers }}{{ else if $e.lora.enabled }}{{ $sharers = printf "%s and the engines (engines.lora)" $sharers }}{{ end -}}
{{- fail (printf "checkpoints.persistence.accessMode %s: %s share the volume from different nodes; use ReadWriteMany" $ckpt.accessMode $sharers) -}}
{{- end -}}
{{- end -}}
