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
