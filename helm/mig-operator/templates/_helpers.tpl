{{/* Names and labels shared by every template. */}}

{{- define "mig-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "mig-operator.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels on every object; pass (dict "ctx" $ "component" "controller"). */}}
{{- define "mig-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
{{ include "mig-operator.selectorLabels" . }}
{{- end -}}

{{/* The labels Deployments, DaemonSets and Services select on. */}}
{{- define "mig-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mig-operator.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end -}}

{{- define "mig-operator.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "mig-operator.controllerServiceAccount" -}}
{{- default (printf "%s-controller" (include "mig-operator.fullname" .)) .Values.serviceAccount.controller.name -}}
{{- end -}}

{{- define "mig-operator.agentServiceAccount" -}}
{{- default (printf "%s-agent" (include "mig-operator.fullname" .)) .Values.serviceAccount.agent.name -}}
{{- end -}}

{{/* The Service in front of the webhook; the certificate names it. */}}
{{- define "mig-operator.webhookService" -}}
{{- printf "%s-webhook" (include "mig-operator.fullname" .) -}}
{{- end -}}

{{- define "mig-operator.webhookCertSecret" -}}
{{- if .Values.webhook.certManager.enabled -}}
{{- printf "%s-webhook-tls" (include "mig-operator.fullname" .) -}}
{{- else -}}
{{- default (printf "%s-webhook-cert" (include "mig-operator.fullname" .)) .Values.webhook.selfSigned.secretName -}}
{{- end -}}
{{- end -}}

{{- define "mig-operator.certificate" -}}
{{- printf "%s-webhook" (include "mig-operator.fullname" .) -}}
{{- end -}}

{{/* The GPUs' MPS directories on the node, as the agent derives them: beside the shim's directory, or
beside the simulator's state file. The agent and the MPS host pod must name the same one. */}}
{{- define "mig-operator.mpsDir" -}}
{{- if hasPrefix "sim:" .Values.agent.backend -}}
{{- printf "%s/simulated-gpus.json.mps" .Values.agent.stateDir -}}
{{- else -}}
{{- printf "%s/mps" (dir (trimSuffix "/" .Values.shim.hostDir)) -}}
{{- end -}}
{{- end -}}

{{/* The PriorityClass of placeholder pods (autoscaling): the admin's, else the chart's own. */}}
{{- define "mig-operator.placeholderPriorityClass" -}}
{{- .Values.autoscaling.placeholder.priorityClassName | default (printf "%s-placeholder" (include "mig-operator.fullname" .)) -}}
{{- end -}}
