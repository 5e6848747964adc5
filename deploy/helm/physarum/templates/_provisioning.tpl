{{/* Model and dataset provisioning: what the fetch Jobs fetch, and the init containers that wait for it. */}}

{{/* Where the fetch Jobs put the model and the datasets, and whether any is fetched: (root). */}}
{{- define "physarum.fetches" -}}
{{- $out := dict -}}
{{- range $what, $spec := dict "model" .Values.model "datasets" .Values.datasets -}}
{{- if has $spec.source (list "hf" "s3") -}}
{{- $kind := ternary (ternary "hf-dataset" "hf" (eq $what "datasets")) "s3" (eq $spec.source "hf") -}}
{{- $src := ternary $spec.hf.repo $spec.s3.uri (eq $spec.source "hf") -}}
{{- $rev := ternary $spec.hf.revision "" (eq $spec.source "hf") -}}
{{- $_ := set $out $what (dict "kind" $kind "source" $src "revision" $rev "path" $spec.path) -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* Init containers of a pod: the plugin copy (plugins.image; pods that load plugins), one that waits for each
     fetched directory's ready marker (pods that read the models volume), then the component's own initContainers. (dict "root" $ "values" ... "image" "<image>" "waitForData" bool) */}}
{{- define "physarum.initContainers" -}}
{{- $fetches := include "physarum.fetches" .root | fromJson -}}
{{- $waits := list -}}
{{- if and .waitForData .root.Values.models.persistence.enabled -}}
{{- range $what := keys $fetches | sortAlpha -}}{{ $waits = append $waits (get $fetches $what).path }}{{- end -}}
{{- end -}}
{{- $plugins := and .root.Values.plugins.image.repository (has .component (list "trainer" "rollout" "reward")) -}}
{{- if or $waits .values.initContainers $plugins }}
initContainers:
  {{- if $plugins }}{{ include "physarum.pluginInit" . | nindent 2 }}{{ end }}
  {{- if $waits }}
  - name: wait-for-data
    image: {{ .image }}
    command: [/bin/sh, -c]
    args:
      - |
        for dir in {{ join " " $waits }}; do
          until [ -f "$dir/.physarum-ready" ]; do echo "waiting for $dir/.physarum-ready (the fetch Job)"; sleep 10; done
        done
    securityContext:
      {{- include "physarum.securityContext" . | nindent 6 }}
    resources:
      requests: {cpu: 10m, memory: 16Mi}
      limits: {memory: 64Mi}
    volumeMounts:
      {{- include "physarum.modelsMount" .root | nindent 6 }}
  {{- end }}
  {{- with .values.initContainers }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}
{{- end -}}
