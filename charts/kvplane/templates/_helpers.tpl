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

{{/* The ClusterRole every router and indexer is bound to (in its own namespace). */}}
{{- define "kvplane.discoveryRole" -}}
{{- printf "%s-discovery" (include "kvplane.clusterName" . | trunc 53 | trimSuffix "-") -}}
{{- end -}}

{{/* Rules that apply inside every watched namespace (cluster-wide mode: everywhere). */}}
{{- define "kvplane.rbac.namespacedRules" -}}
# The kvplane resources, read through watches. kopf patches InferencePools (a finalizer
# on pools with an external index, and its annotations on them).
- apiGroups: [kvplane.io]
  resources: [inferencepools]
  verbs: [get, list, watch, patch]
- apiGroups: [kvplane.io]
  resources: [kvcachetiers]
  verbs: [list, watch]
# The P:D planner with mode: apply sets spec.replicas of an engine pool (server-side apply).
- apiGroups: [kvplane.io]
  resources: [prefillpools, decodepools]
  verbs: [list, watch, patch]
# Reconcile results: conditions, router endpoint, replica counts, tier use.
- apiGroups: [kvplane.io]
  resources: [inferencepools/status, prefillpools/status, decodepools/status, kvcachetiers/status]
  verbs: [patch]
# What the operator renders: server-side apply (patch; create when new), watched (by the
# managed-by label: drift is repaired from the watch, and rollouts update the status),
# deleted when pruned.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services, configmaps, serviceaccounts]
  verbs: [list, watch, create, patch, delete]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [list, watch, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [list, watch, create, patch, delete]
# GIE's InferencePool, for a pool served through the Gateway API (spec.gateway)
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [list, watch, create, patch, delete]
# Each router and indexer gets a RoleBinding to the discovery ClusterRole, the one role
# the operator may bind: it writes no Role, and cannot grant anything else it holds.
- apiGroups: [rbac.authorization.k8s.io]
  resources: [rolebindings]
  verbs: [list, watch, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [clusterroles]
  verbs: [bind]
  resourceNames: [{{ include "kvplane.discoveryRole" . }}]
# The managed Redis' password: the operator creates its Secret once (create only: it
# reads no Secret for it, and never rewrites one).
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
{{- if or .Values.watchNamespaces .Values.rbac.readSecrets }}
# The password of an external index (spec.index.external.passwordSecretRef): deleting
# such a pool removes its residency keys from that Redis.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
{{- end }}
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
