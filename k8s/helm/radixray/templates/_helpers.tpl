{{/* The objects' base name: nameOverride, else the release name. */}}
{{- define "radixray.name" -}}
{{- default .Release.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of the top-level objects (selectors and pod labels keep app.kubernetes.io/name only,
as the Kustomize manifests do). */}}
{{- define "radixray.labels" -}}
app.kubernetes.io/name: radixray
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "radixray.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{/* The `radixray serve` knobs as serveConfigV2 `args` (snake_case). */}}
{{- define "radixray.serveArgs" -}}
{{- $v := .Values -}}
{{- $args := dict -}}
{{- if ne $v.engine "radixray" -}}
{{- $_ := set $args "engine" $v.engine -}}
{{- $_ := set $args "vllm_python" $v.vllm.python -}}
{{- $_ := set $args "vllm_args" $v.vllm.args -}}
{{- end -}}
{{- $_ := set $args "model" $v.model -}}
{{- $_ := set $args "workers" $v.workers -}}
{{- $_ := set $args "gpus_per_worker" $v.gpusPerWorker -}}
{{- $_ := set $args "device" $v.device -}}
{{- $_ := set $args "policy" $v.policy -}}
{{- $_ := set $args "kv_tokens" $v.kvTokens -}}
{{- $_ := set $args "page_size" $v.pageSize -}}
{{- $_ := set $args "router_replicas" $v.routerReplicas -}}
{{- $_ := set $args "metrics_public" $v.metricsPublic -}}
{{- range $key, $value := $v.extraArgs -}}
{{- if has $key (list "api_key" "admin_key") -}}
{{- fail (printf "extraArgs.%s: keys come from Secrets (apiKey, adminKey), never from values" $key) -}}
{{- end -}}
{{- $_ := set $args $key $value -}}
{{- end -}}
{{- toYaml $args -}}
{{- end -}}

{{/* The `radixray serve` flags of a RayCluster head. */}}
{{- define "radixray.serveFlags" -}}
{{- $v := .Values -}}
--model {{ $v.model }}
{{- if ne $v.engine "radixray" }} --engine {{ $v.engine }} --vllm-python {{ $v.vllm.python }}
{{- with $v.vllm.args }} --vllm-args {{ . | squote }}{{ end }}{{ end }}
{{- printf " --workers %v" $v.workers }}
{{- if ne $v.device "cpu" }}{{ printf " --gpus-per-worker %v" $v.gpusPerWorker }}{{ end }}
{{- printf " --device %s --policy %s" $v.device $v.policy }}
{{- if not (kindIs "invalid" $v.kvTokens) }}{{ printf " --kv-tokens %v" $v.kvTokens }}{{ end }}
{{- printf " --page-size %v --routers %v" $v.pageSize $v.routerReplicas }}
{{- if $v.metricsPublic }} --metrics-public{{ end }}
{{- end -}}

{{/* env of the head container: the router's keys, from Secrets. */}}
{{- define "radixray.keyEnv" -}}
- name: RADIXRAY_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKey.secretName }}
      key: {{ .Values.apiKey.key }}
      optional: {{ .Values.apiKey.optional }}
- name: RADIXRAY_ADMIN_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.adminKey.secretName }}
      key: {{ .Values.adminKey.key }}
      optional: {{ .Values.adminKey.optional }}
{{- end -}}

{{/* spec.gcsFaultToleranceOptions, when enabled. */}}
{{- define "radixray.gcsFaultTolerance" -}}
{{- $ft := .Values.gcsFaultTolerance -}}
{{- if $ft.enabled -}}
{{- if not $ft.redisAddress -}}
{{- fail "gcsFaultTolerance.enabled needs gcsFaultTolerance.redisAddress" -}}
{{- end -}}
gcsFaultToleranceOptions:
  redisAddress: {{ $ft.redisAddress | quote }}
  {{- with $ft.redisPassword.secretName }}
  redisPassword:
    valueFrom:
      secretKeyRef:
        name: {{ . }}
        key: {{ $ft.redisPassword.key }}
  {{- end }}
  {{- with $ft.externalStorageNamespace }}
  externalStorageNamespace: {{ . | quote }}
  {{- end }}
{{- end -}}
{{- end -}}

{{/* The head's ports (the PodMonitor scrapes `serve` and `metrics`). */}}
{{- define "radixray.headPorts" -}}
- containerPort: 6379
  name: gcs
- containerPort: 8265
  name: dashboard
- containerPort: 10001
  name: client
- containerPort: 8000
  name: serve
- containerPort: 8080
  name: metrics
{{- end -}}

{{/* The worker group (shared by both kinds; `command` only on a RayCluster). */}}
{{- define "radixray.workerGroup" -}}
{{- $w := .Values.workerGroup -}}
- groupName: {{ $w.name }}
  replicas: {{ $w.replicas }}
  minReplicas: {{ $w.minReplicas }}
  maxReplicas: {{ $w.maxReplicas }}
  rayStartParams: {}
  template:
    metadata:
      labels:
        app.kubernetes.io/name: radixray
        app.kubernetes.io/component: worker
    spec:
      containers:
        - name: ray-worker
          image: {{ include "radixray.image" . }}
          imagePullPolicy: {{ .Values.image.pullPolicy }}
          {{- if eq .Values.kind "RayCluster" }}
          command: ["/bin/bash", "-lc", "--"]
          args: ["ulimit -n 65536; eval \"$KUBERAY_GEN_RAY_START_CMD\""]
          {{- end }}
          ports:
            - containerPort: 8080
              name: metrics
          lifecycle:
            preStop:
              exec:
                command: ["/bin/sh", "-c", "ray stop"]
          resources:
            {{- toYaml $w.resources | nindent 12 }}
      {{- with $w.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end -}}
