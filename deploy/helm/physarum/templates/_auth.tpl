{{- /*
Per-service tokens (services/common/auth.py): one Secret holds a token per callee service; each pod mounts only the
keys it needs, as <service>.token files under PHYSARUM_TOKEN_DIR. The trainer's job API keeps jobApi's api-token.
GRANTS below is the chart's copy of physarum/stack.py's GRANTS.
*/ -}}
{{- define "physarum.serviceTokensName" -}}
{{- printf "%s-service-tokens" (include "physarum.fullname" .) -}}
{{- end -}}

{{- define "physarum.tokenGrants" -}}
buffer: [buffer]
reward: [reward]
rollout: [rollout, buffer, reward, engine, router]
trainer: [buffer, rollout, engine]
engine: [engine]
router: [router]
{{- end -}}

{{- define "physarum.tokenDir" -}}/var/run/physarum/tokens{{- end -}}

{{- /* The command of a server that takes its token only as a flag (sglang-router's control-plane key, SGLang's
--admin-api-key) and ships no Physarum code: a shell reads the mounted token file and execs the server with the
pod's args ("$@") and the flag. Without auth, the server's own command. */ -}}
{{- define "physarum.keyedCommand" -}}
{{- if .root.Values.auth.enabled -}}
[sh, -c, {{ printf "exec %s \"$@\" %s" (join " " .command) (printf .flag (printf "$(cat %s/%s.token)" (include "physarum.tokenDir" .root) .service)) | toJson }}, {{ .service }}]
{{- else -}}
{{ .command | toJson }}
{{- end -}}
{{- end -}}

{{- /* env of a component: the token directory (when auth is on) and the plugin allow-list */ -}}
{{- define "physarum.authEnv" -}}
{{- if .root.Values.auth.enabled }}
- {name: PHYSARUM_TOKEN_DIR, value: {{ include "physarum.tokenDir" .root }}}
{{- end }}
- {name: PHYSARUM_PLUGIN_ALLOWLIST, value: {{ join "," .root.Values.plugins.allowlist | quote }}}
{{- end -}}

{{- define "physarum.authMount" -}}
{{- if .root.Values.auth.enabled }}
- {name: service-tokens, mountPath: {{ include "physarum.tokenDir" .root }}, readOnly: true}
{{- end }}
{{- end -}}

{{- define "physarum.authVolume" -}}
{{- if .root.Values.auth.enabled }}
- name: service-tokens
  secret:
    secretName: {{ include "physarum.serviceTokensName" .root }}
    defaultMode: 0400
    items:
      {{- range (get (fromYaml (include "physarum.tokenGrants" .root)) .component) }}
      - {key: {{ . }}, path: {{ . }}.token}
      {{- end }}
{{- end }}
{{- end -}}

{{- /* A user's plugin code (plugins.image): the init container that copies it into the `plugins` volume, the mount and
     PYTHONPATH of the pods that load plugins (trainer, rollout manager, reward), and the volume. (a component's ctx) */ -}}
{{- define "physarum.pluginInit" -}}
{{- $p := .root.Values.plugins }}
{{- if $p.image.repository }}
- name: plugins
  image: {{ include "physarum.pinnedImage" $p.image }}
  imagePullPolicy: {{ $p.image.pullPolicy }}
  command: [cp, -R, {{ printf "%s/." $p.sourcePath | quote }}, /plugins-volume/]
  securityContext:
    {{- include "physarum.securityContext" . | nindent 4 }}
  resources:
    requests: {cpu: 10m, memory: 16Mi}
    limits: {memory: 128Mi}
  volumeMounts:
    - {name: plugins, mountPath: /plugins-volume}
{{- end }}
{{- end -}}

{{- define "physarum.pluginEnv" -}}
{{- if .root.Values.plugins.image.repository }}
- {name: PYTHONPATH, value: {{ .root.Values.plugins.mountPath | quote }}}
{{- end }}
{{- end -}}

{{- define "physarum.pluginMount" -}}
{{- if .root.Values.plugins.image.repository }}
- {name: plugins, mountPath: {{ .root.Values.plugins.mountPath }}, readOnly: true}
{{- end }}
{{- end -}}

{{- define "physarum.pluginVolume" -}}
{{- if .root.Values.plugins.image.repository }}
- name: plugins
  emptyDir: {sizeLimit: 1Gi}
{{- end }}
{{- end -}}
