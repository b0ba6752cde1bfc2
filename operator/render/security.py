"""Pod and container securityContexts of the rendered workloads, by role (pure).

The router, the indexer and the managed Redis meet the restricted Pod Security
Standard: non-root, read-only root filesystem (an emptyDir where they write), no
privilege escalation, every capability dropped, seccomp RuntimeDefault, and Redis
gets no API token. Engines get what their images allow: the vLLM and SGLang images
run as root and write their caches (Hugging Face, Triton, torch.compile) in the root
filesystem, so they keep root and a writable root filesystem, but run without
privilege escalation or capabilities (RDMA adds back IPC_LOCK) under RuntimeDefault
seccomp, and without an API token, which they never use.

Applied to the rendered objects as a last step, so the renderers of each component
stay about what the component runs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Final

from kvplane.operator.render import names
from kvplane.operator.render.names import Role

from kvplane.types import Json

KVPLANE_UID: Final = 65532  # the kvplane image's user (Dockerfile)
REDIS_UID: Final = 999  # the redis user of the official image
REDIS_GID: Final = 1000
SECCOMP: Final[Json] = {"type": "RuntimeDefault"}


@dataclass(frozen=True)
class Hardening:
    pod: Json
    container: Json
    writable: tuple[tuple[str, str], ...] = ()  # (volume name, mount path): emptyDirs
    api_token: bool = True


def _restricted(uid: int, gid: int) -> tuple[Json, Json]:
    pod = {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": gid,
        "fsGroup": gid,
        "seccompProfile": dict(SECCOMP),
    }
    container = {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": dict(SECCOMP),
    }
    return pod, container


_KVPLANE = _restricted(KVPLANE_UID, KVPLANE_UID)
_REDIS = _restricted(REDIS_UID, REDIS_GID)
_ENGINE: Final[Json] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": dict(SECCOMP),
}

BY_ROLE: Final[dict[Role, Hardening]] = {
    # the image's HF_HOME is /tmp/huggingface: the tokenizer fetch writes there
    Role.ROUTER: Hardening(*_KVPLANE, writable=(("tmp", "/tmp"),)),
    Role.INDEXER: Hardening(*_KVPLANE, writable=(("tmp", "/tmp"),)),
    Role.REDIS: Hardening(*_REDIS, writable=(("data", "/data"),), api_token=False),
    Role.PREFILL: Hardening({"seccompProfile": dict(SECCOMP)}, _ENGINE, api_token=False),
    Role.DECODE: Hardening({"seccompProfile": dict(SECCOMP)}, _ENGINE, api_token=False),
}


def _merge(base: Json, extra: Json) -> Json:
    """``extra`` over ``base``, copied (no object shared between manifests);
    capabilities keep the container's own ``add``."""
    out = copy.deepcopy({**base, **extra})
    if "capabilities" in base and "capabilities" in extra:
        out["capabilities"] = copy.deepcopy({**base["capabilities"], **extra["capabilities"]})
    return out


def harden(obj: Json) -> Json:
    """The object with its role's securityContexts (other objects unchanged)."""
    if obj.get("kind") != "Deployment":
        return obj
    template = obj["spec"]["template"]
    role = template["metadata"].get("labels", {}).get(names.LABEL_ROLE)
    if role not in {r.value for r in BY_ROLE}:
        return obj
    rules = BY_ROLE[Role(role)]
    pod = template["spec"]
    pod["securityContext"] = _merge(pod.get("securityContext", {}), rules.pod)
    if not rules.api_token:
        pod["automountServiceAccountToken"] = False
    volumes = pod.setdefault("volumes", [])
    for volume, _ in rules.writable:
        if not any(v["name"] == volume for v in volumes):
            volumes.append({"name": volume, "emptyDir": {"sizeLimit": "1Gi"}})
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        container["securityContext"] = _merge(rules.container, container.get("securityContext", {}))
        mounts = container.setdefault("volumeMounts", [])
        for volume, path in rules.writable:
            if not any(m["mountPath"] == path for m in mounts):
                mounts.append({"name": volume, "mountPath": path})
    return obj
