{{/* Names ------------------------------------------------------------------------- */}}

{{- define "kvplane.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvplane.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 53 | trimSuffix "-" -}}
{{- else if contains (include "kvplane.name" .) .Release.Name -}}
{{- .Release.Name | trunc 53 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "kvplane.name" .) | trunc 53 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Cluster-scoped objects: two releases of the same name in two namespaces must not
     collide, so the release namespace is part of the name. */}}
{{- define "kvplane.clusterName" -}}
{{- printf "%s-%s" .Release.Namespace (include "kvplane.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvplane.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvplane.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvplane.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* kopf peering: on with more than one replica. */}}
{{- define "kvplane.peering" -}}
{{- if gt (int .Values.operator.replicas) 1 -}}true{{- end -}}
{{- end -}}

{{/* Unique per release: a ClusterKopfPeering is cluster-scoped. */}}
{{- define "kvplane.peeringName" -}}
{{- default (include "kvplane.clusterName" .) .Values.peering.name -}}
{{- end -}}

{{/* Labels ------------------------------------------------------------------------ */}}

{{- define "kvplane.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvplane.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvplane.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "kvplane.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvplane
{{- end -}}

{{/* RBAC ----------------------------------------------------------------------------
     The single list of what the operator may do. docs/deploy.md explains each rule;
     tests/test_chart.py runs the operator with nothing else, and checks that
     config/rbac (kustomize) grants exactly the same. No wildcards. */}}

{{/* Rules that apply inside every watched namespace (cluster-wide mode: everywhere). */}}
{{- define "kvplane.rbac.namespacedRules" -}}
# The kvplane resources. The operator reads all four; kopf patches InferencePools (its
# progress annotations, and a finalizer on pools with an external index).
- apiGroups: [kvplane.io]
  resources: [inferencepools]
  verbs: [get, list, watch, patch]
- apiGroups: [kvplane.io]
  resources: [kvcachetiers]
  verbs: [get, list, watch]
# The P:D planner in apply mode sets spec.replicas of an engine pool (server-side apply).
- apiGroups: [kvplane.io]
  resources: [prefillpools, decodepools]
  verbs: [get, list, watch, patch]
# Reconcile results: conditions, router endpoint, replica counts.
- apiGroups: [kvplane.io]
  resources: [inferencepools/status, prefillpools/status, decodepools/status]
  verbs: [patch]
# Owned Deployments: server-side apply (patch; create when new), read for status, watched
# (rollouts trigger a reconcile), listed and deleted when pruned.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
# The other owned objects: server-side apply, listed and deleted when pruned.
- apiGroups: [""]
  resources: [services, configmaps, serviceaccounts]
  verbs: [list, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [list, create, patch, delete]
# Autoscaled engine pools (spec.autoscaling) get an HPA.
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [list, create, patch, delete]
# Never read by the operator: it grants each router a Role to discover engine pods, and
# RBAC only lets it grant what it holds itself.
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
# The password of an external index (spec.index.external.passwordSecretRef): deleting
# such a pool removes its residency keys from that Redis.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
# kopf reports handler failures as Events.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- if and (include "kvplane.peering" .) .Values.watchNamespaces }}
# kopf peering (replicas > 1): a KopfPeering in each watched namespace.
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [list, watch, patch]
{{- end }}
{{- end -}}

{{/* Rules that are always cluster-wide. */}}
{{- define "kvplane.rbac.clusterRules" -}}
# kopf discovers the resources it serves by watching CRDs, even when namespaced.
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- if .Values.watchNamespaces }}
# Namespaced kopf follows the watched namespaces' creation and deletion.
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
{{- else if include "kvplane.peering" . }}
# kopf peering (replicas > 1), cluster-wide: one ClusterKopfPeering.
- apiGroups: [kopf.dev]
  resources: [clusterkopfpeerings]
  verbs: [list, watch, patch]
{{- end }}
{{- end -}}
