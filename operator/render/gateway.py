"""The Gateway API path of an InferencePool that asks for it (``spec.gateway``), pure.

- kvplane's endpoint picker: ``kvplane epp`` reading the router's own ConfigMap (the
  same pool, discovery, index and policy) as the router's ServiceAccount, and its
  Service (gRPC, ``appProtocol: kubernetes.io/h2c``);
- a GIE ``InferencePool`` (``inference.networking.k8s.io/v1``, its v1.6 schema) of the
  same name selecting the pool's serving engine pods on the engine port, with
  ``endpointPickerRef`` naming that Service, so that an ``HTTPRoute`` of any conformant
  gateway sends traffic where kvplane picks.

With P/D the GIE pool selects the decode pods: the picker runs prefill legs itself
(NIXL) and names the decode pod.
"""

from __future__ import annotations

from typing import Final

from kvplane.operator.api import GatewaySpec, InferencePoolSpec
from kvplane.operator.render import k8s, names, stores
from kvplane.operator.render.names import Role
from kvplane.operator.render.router import (
    CONFIG_DIR,
    CONFIG_PATH,
    MODELS_DIR,
    _tokenizer_init,
)

from kvplane.types import Json

GIE_GROUP: Final = "inference.networking.k8s.io"
GIE_API_VERSION: Final = f"{GIE_GROUP}/v1"
PORT_GRPC: Final = "grpc"
PICKER_METRICS_PORT: Final = 9090
PORT_METRICS: Final = "metrics"


def gie_inference_pool(ipool_name: str, namespace: str, gateway: GatewaySpec) -> Json:
    """GIE's InferencePool for the pool: the serving engine pods, kvplane's picker."""
    labels = names.object_labels(ipool_name, Role.PICKER, "kvplane-epp")
    return {
        "apiVersion": GIE_API_VERSION,
        "kind": "InferencePool",
        "metadata": k8s.metadata(ipool_name, namespace, labels),
        "spec": {
            # matchLabels only, as GIE requires (Service-compatible selection)
            "selector": {
                "matchLabels": {names.LABEL_POOL: names.fit(ipool_name), names.LABEL_ROLE: "decode"}
            },
            "targetPorts": [{"number": names.ENGINE_HTTP_PORT}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": names.picker_name(ipool_name),
                "port": {"number": gateway.port},
                "failureMode": gateway.failure_mode.value,
            },
        },
    }


def picker_objects(
    ipool_name: str, namespace: str, ipool: InferencePoolSpec, generation: str, default_image: str
) -> list[Json]:
    """The picker's Deployment and Service (it runs as the router's ServiceAccount
    and reads the router's ConfigMap, both rendered by ``router_objects``)."""
    gateway = ipool.gateway
    assert gateway is not None
    name = names.picker_name(ipool_name)
    router = names.router_name(ipool_name)
    labels = names.object_labels(ipool_name, Role.PICKER, "kvplane-epp")
    selector = names.selector_labels(ipool_name, Role.PICKER)
    image = ipool.router.image or default_image
    container: Json = {
        "name": "epp",
        "image": image,
        "command": [
            "kvplane",
            "epp",
            "--config",
            CONFIG_PATH,
            "--port",
            str(gateway.port),
            "--metrics-port",
            str(PICKER_METRICS_PORT),
        ],
        "env": stores.index_env(ipool_name, ipool),
        "ports": [
            k8s.port(PORT_GRPC, gateway.port),
            k8s.port(PORT_METRICS, PICKER_METRICS_PORT),
        ],
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "models", "mountPath": MODELS_DIR, "readOnly": True},
        ],
        # the protocol's gRPC health services (GIE: readiness, liveness)
        "readinessProbe": {
            "grpc": {"port": gateway.port, "service": "readiness"},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "grpc": {"port": gateway.port, "service": "liveness"},
            "periodSeconds": 15,
            "failureThreshold": 4,
        },
    }
    if not container["env"]:
        del container["env"]
    pod: Json = {
        "serviceAccountName": router,
        "initContainers": [_tokenizer_init(ipool, image)],
        "containers": [container],
        "volumes": [
            {"name": "config", "configMap": {"name": router}},
            {"name": "models", "emptyDir": {"sizeLimit": "1Gi"}},
        ],
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
    }
    deployment = k8s.deployment(
        name,
        namespace,
        labels,
        selector,
        labels,
        pod,
        replicas=gateway.replicas,
        strategy={"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        annotations={names.ANNOTATION_GENERATION: generation},
        pod_annotations={names.ANNOTATION_GENERATION: generation},
    )
    svc = k8s.service(name, namespace, labels, selector, [(PORT_GRPC, gateway.port, PORT_GRPC)])
    svc["spec"]["ports"][0]["appProtocol"] = "kubernetes.io/h2c"
    return [deployment, svc]


def gateway_objects(
    ipool_name: str, namespace: str, ipool: InferencePoolSpec, generation: str, default_image: str
) -> list[Json]:
    """Nothing unless the pool asks for the Gateway API path."""
    if ipool.gateway is None:
        return []
    return [
        *picker_objects(ipool_name, namespace, ipool, generation, default_image),
        gie_inference_pool(ipool_name, namespace, ipool.gateway),
    ]
