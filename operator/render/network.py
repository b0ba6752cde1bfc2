"""NetworkPolicies of an InferencePool: who may reach its engines and its Redis.

Engines publish every block's token ids on their KV event and replay ports, so a
passive subscriber could read other clients' prompts: only the pool's indexer and
router may reach those ports, only the router the engines' HTTP API (the
``networkPolicy.metricsFrom`` peers may scrape it too) and, with P/D, their bootstrap
port (the router asks a Mooncake prefill pod for its engine ids), and the pool's
engines reach each other on any port (NIXL over UCX and Mooncake open transfer ports
of their own). The managed Redis takes connections from the pool's router and indexer only.
With ``spec.gateway`` the endpoint picker counts as a router (it ingests KV events,
scrapes and reads the index), and the engines' HTTP port admits any peer: the
Gateway's data plane (Envoy) sends them the requests, and kvplane does not know its pods.
Traffic from a pod's own node (kubelet probes) is always allowed by NetworkPolicy.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvplane.operator.api import InferencePoolSpec, KVTransfer
from kvplane.operator.render import k8s, names, stores
from kvplane.operator.render.names import Role

from kvplane.types import Json


def pods(ipool_name: str, roles: Sequence[Role]) -> Json:
    """A podSelector for the pool's pods of these roles."""
    return {
        "matchLabels": {names.LABEL_POOL: names.fit(ipool_name)},
        "matchExpressions": [
            {"key": names.LABEL_ROLE, "operator": "In", "values": [r.value for r in roles]}
        ],
    }


def _ports(*numbers: int) -> list[Json]:
    return [{"protocol": "TCP", "port": n} for n in numbers]


def _policy(
    ipool_name: str, namespace: str, name: str, selector: Json, ingress: list[Json]
) -> Json:
    labels = names.common_labels(ipool_name, "network-policy", "kvplane")
    labels[names.LABEL_POOL] = names.fit(ipool_name)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": k8s.metadata(name, namespace, labels),
        "spec": {"podSelector": selector, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def network_policies(
    ipool_name: str, namespace: str, ipool: InferencePoolSpec, transfer: KVTransfer | None
) -> list[Json]:
    """``transfer``: the pool's P/D transfer (None: aggregated)."""
    policy = ipool.network_policy
    if not policy.enabled:
        return []
    routers = [Role.ROUTER, Role.PICKER] if ipool.gateway is not None else [Role.ROUTER]
    router = {"podSelector": pods(ipool_name, routers)}
    readers = {"podSelector": pods(ipool_name, [*routers, Role.INDEXER])}
    engines = {"podSelector": pods(ipool_name, list(names.ENGINE_ROLES))}
    http = [router, *(dict(p) for p in policy.metrics_from)]
    http_rule: Json = {"from": http, "ports": _ports(names.ENGINE_HTTP_PORT)}
    if ipool.gateway is not None:  # the Gateway's Envoy pods, whichever they are
        http_rule = {"ports": _ports(names.ENGINE_HTTP_PORT)}
    bootstrap = [{"from": [router], "ports": _ports(transfer.bootstrap_port)}] if transfer else []
    out = [
        _policy(
            ipool_name,
            namespace,
            names.engines_policy_name(ipool_name),
            pods(ipool_name, list(names.ENGINE_ROLES)),
            [
                {"from": [readers], "ports": _ports(names.KV_EVENTS_PORT, names.KV_REPLAY_PORT)},
                http_rule,
                *bootstrap,
                {"from": [engines]},
            ],
        )
    ]
    if stores.managed_redis(ipool) is not None:
        out.append(
            _policy(
                ipool_name,
                namespace,
                names.redis_name(ipool_name),
                pods(ipool_name, [Role.REDIS]),
                [{"from": [readers], "ports": _ports(names.REDIS_PORT)}],
            )
        )
    return out
