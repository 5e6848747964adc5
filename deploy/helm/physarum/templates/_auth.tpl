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
rollout: [rollout, buffer, reward, engine]
trainer: [buffer, rollout, engine]
engine: [engine]
{{- end -}}

{{- /* env of a component: the token directory (when auth is on) and the plugin allow-list */ -}}
{{- define "physarum.authEnv" -}}
{{- if .root.Values.auth.enabled }}
- {name: PHYSARUM_TOKEN_DIR, value: /var/run/physarum/tokens}
{{- end }}
- {name: PHYSARUM_PLUGIN_ALLOWLIST, value: {{ join "," .root.Values.plugins.allowlist | quote }}}
{{- end -}}

{{- define "physarum.authMount" -}}
{{- if .root.Values.auth.enabled }}
- {name: service-tokens, mountPath: /var/run/physarum/tokens, readOnly: true}
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
