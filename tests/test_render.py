"""Rendered manifests: golden files per scenario plus properties that need no golden.

Each scenario is one InferencePool with its engine pools and KV tiers, rendered by
``inference_pool_objects`` into ``tests/golden/render/<scenario>.yaml`` (all objects,
YAML documents in apply order). After an intended change, regenerate and review the
diff::

    KVPLANE_REGEN_GOLDEN=1 pytest tests/test_render.py

The property tests below hold for every scenario and for any future golden: selectors
are a stable subset of the pod labels, a generation change rolls pods in place, port
names are valid and unique, GPUs match the spec. ``SCENARIOS`` is also what
``test_render_vllm_args.py`` feeds to vLLM's own argument parser.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvplane.operator.api import (
    Compression,
    EnginePoolSpec,
    InferencePoolSpec,
    KVCacheTierSpec,
)
from kvplane.operator.render import (
    EnginePod,
    RenderError,
    Role,
    engine_deployment,
    generation_tag,
    inference_pool_objects,
    lmcache_config,
    pd_transfer,
    router_config,
    sglang_args,
    vllm_args,
)
from kvplane.operator.render import names as N
from kvplane.operator.render.router import FETCH_TOKENIZER, router_config_yaml
from kvplane.router.config import RouterConfig

from kvplane.types import Json

GOLDEN = Path(__file__).resolve().parent / "golden" / "render"
REGEN = os.environ.get("KVPLANE_REGEN_GOLDEN") == "1"
OPERATOR_IMAGE = "ghcr.io/kvplane/kvplane:0.1.0"
NAMESPACE = "serving"
POOL = "llama"

LLAMA: Json = {
    "servedName": "llama-3.1-8b",
    "source": "meta-llama/Llama-3.1-8B-Instruct",
    "revision": "0e9e39f249a16976918f6564b8830bc894c89659",
    "shape": {"layers": 32, "kvHeads": 8, "headDim": 128},
}
GPU_NODES: Json = {
    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
}
DRAM_NATIVE: Json = {"tier": "dram", "backend": "native", "capacityPerPod": "64Gi"}
DRAM_NATIVE.update(bandwidthGbps=40, latencyMs=0.05)
HBM: Json = {"tier": "hbm", "backend": "native", "bandwidthGbps": 2000}
MANAGED_MOONCAKE_URL = f"mooncake://{POOL}-mooncake.{NAMESPACE}.svc:50051"


def _pool(**spec: Any) -> Json:
    return {"poolRef": {"name": POOL}, **spec}


@dataclass(frozen=True)
class Scenario:
    """One InferencePool as the API server would hand it to the operator (camelCase)."""

    name: str
    ipool: Json
    decodes: dict[str, Json]
    prefill: tuple[str, Json] | None = None
    tiers: list[Json] = field(default_factory=list)

    def spec(self) -> InferencePoolSpec:
        return InferencePoolSpec.model_validate(self.ipool)

    def tier_specs(self) -> list[KVCacheTierSpec]:
        return [KVCacheTierSpec.model_validate(t) for t in self.tiers]

    def prefill_spec(self) -> tuple[str, EnginePoolSpec] | None:
        if self.prefill is None:
            return None
        return self.prefill[0], EnginePoolSpec.model_validate(self.prefill[1])

    def decode_specs(self) -> dict[str, EnginePoolSpec]:
        return {n: EnginePoolSpec.model_validate(d) for n, d in self.decodes.items()}

    def render(self, generation: str | None = None) -> list[Json]:
        return inference_pool_objects(
            POOL,
            NAMESPACE,
            self.spec(),
            prefill=self.prefill_spec(),
            decodes=self.decode_specs(),
            tiers=self.tier_specs(),
            default_image=OPERATOR_IMAGE,
            generation=generation,
        )


SCENARIOS: list[Scenario] = [
    Scenario(
        "vllm-aggregated",
        {"model": LLAMA},
        {"main": _pool(replicas=2, resources={"requests": {"cpu": "8", "memory": "64Gi"}})},
    ),
    Scenario(
        "vllm-gateway",
        {"model": LLAMA, "gateway": {"failureMode": "FailOpen"}},
        {"main": _pool(replicas=2)},
    ),
    Scenario(
        "vllm-pd-nixl",
        {
            "model": {**LLAMA, "maxModelLen": 32768},
            "engine": {"extraArgs": ["--gpu-memory-utilization", "0.9"]},
        },
        {
            "a": _pool(
                autoscaling={"minReplicas": 2, "maxReplicas": 8},
                topologySpreadConstraints=[
                    {
                        "maxSkew": 1,
                        "topologyKey": "kubernetes.io/hostname",
                        "whenUnsatisfiable": "ScheduleAnyway",
                    }
                ],
                **GPU_NODES,
            ),
            "b": _pool(replicas=1, extraArgs=["--max-num-seqs", "128"], **GPU_NODES),
        },
        prefill=("llama-prefill", _pool(replicas=1, gpusPerReplica=2, tensorParallelSize=2)),
    ),
    Scenario(
        "vllm-pd-mooncake",
        {"model": LLAMA},
        {"main": _pool(replicas=2)},
        prefill=(
            "llama-prefill",
            _pool(replicas=1, kvTransfer={"connector": "mooncake", "protocol": "tcp"}),
        ),
    ),
    Scenario(
        "vllm-dram-native",
        {"model": LLAMA},
        {"main": _pool(replicas=2)},
        tiers=[HBM, DRAM_NATIVE],
    ),
    Scenario(
        "vllm-pd-nixl-dram-arc",
        {"model": LLAMA},
        {"main": _pool(replicas=2)},
        prefill=("llama-prefill", _pool(replicas=1)),
        tiers=[{**DRAM_NATIVE, "evictionPolicy": "arc"}],
    ),
    Scenario(
        "vllm-lmcache-dram-nvme",
        {"model": LLAMA},
        {"main": _pool(replicas=2)},
        tiers=[
            {
                "tier": "dram",
                "backend": "lmcache",
                "capacityPerPod": "32Gi",
                "bandwidthGbps": 40,
                "latencyMs": 0.05,
            },
            {
                "tier": "nvme",
                "backend": "lmcache",
                "capacityPerPod": "400Gi",
                "bandwidthGbps": 6,
                "latencyMs": 0.2,
                "volume": {"storageClassName": "local-nvme", "size": "500Gi"},
            },
        ],
    ),
    Scenario(
        "vllm-pd-lmcache-mooncake-store",
        {"model": LLAMA},
        {"main": _pool(replicas=2)},
        prefill=("llama-prefill", _pool(replicas=1)),
        tiers=[
            {
                "tier": "dram",
                "backend": "lmcache",
                "capacityPerPod": "32Gi",
                "bandwidthGbps": 40,
            },
            {
                "tier": "nvme",
                "backend": "lmcache",
                "bandwidthGbps": 6,
                "volume": {"hostPath": "/mnt/nvme/kvcache", "size": "200Gi"},
            },
            {
                "tier": "remote",
                "backend": "mooncake",
                "capacityPerPod": "16Gi",
                "bandwidthGbps": 20,
                "latencyMs": 1.0,
                "compression": "cachegen",
                "url": MANAGED_MOONCAKE_URL,
                "masterImage": "registry.example.com/mooncake-master:0.3.13.post1",
            },
        ],
    ),
    Scenario(
        "sglang-aggregated",
        {
            "model": {**LLAMA, "maxModelLen": 16384},
            "engine": {"kind": "sglang", "image": "lmsysorg/sglang:v0.5.23", "blockSize": 64},
            "router": {"policy": "least_loaded"},
        },
        {"main": _pool(replicas=3)},
    ),
    Scenario(
        "sglang-pd-hicache-mooncake",
        {
            "model": LLAMA,
            "engine": {"kind": "sglang", "image": "lmsysorg/sglang:v0.5.23", "blockSize": 64},
        },
        {"main": _pool(replicas=2, gpusPerReplica=2, tensorParallelSize=2)},
        prefill=(
            "llama-prefill",
            _pool(
                replicas=1,
                gpusPerReplica=2,
                tensorParallelSize=2,
                kvTransfer={"connector": "mooncake"},
            ),
        ),
        tiers=[
            {**DRAM_NATIVE, "capacityPerPod": "128Gi"},
            {
                "tier": "remote",
                "backend": "mooncake",
                "capacityPerPod": "32Gi",
                "bandwidthGbps": 20,
                "latencyMs": 1.0,
                "url": MANAGED_MOONCAKE_URL,
            },
        ],
    ),
    Scenario(
        "vllm-external-redis",
        {
            "model": {
                **LLAMA,
                "tokenizer": "/models/llama-3.1-8b",
                "source": "/models/llama-3.1-8b",
            },
            "engine": {
                "hashSeed": "42",
                "env": [
                    {"name": "HF_HUB_OFFLINE", "value": "1"},
                    {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"},
                ],
            },
            "router": {
                "replicas": 3,
                "image": "registry.example.com/kvplane:dev",
                "policy": "round_robin",
                "serviceType": "LoadBalancer",
                "port": 80,
                "apiKeysSecretRef": {"name": "llama-api-keys"},
                "cost": {"prefillTokensPerS": 12000, "loadCap": 3},
            },
            "index": {
                "external": {
                    "url": "rediss://redis.shared.svc:6380/2",
                    "passwordSecretRef": {"name": "redis-auth", "key": "password"},
                }
            },
        },
        {"main": _pool(replicas=1)},
    ),
]
LORA: Json = {
    **LLAMA,
    "loraAdapters": [
        {"name": "sql-lora", "source": "/adapters/sql"},
        {"name": "chat-lora", "source": "org/chat-lora"},
    ],
    "maxLoras": 2,
}
SCENARIOS += [
    Scenario("vllm-lora", {"model": LORA}, {"main": _pool(replicas=2)}),
    Scenario(
        "sglang-lora",
        {
            "model": LORA,
            "engine": {"kind": "sglang", "image": "lmsysorg/sglang:v0.5.23", "blockSize": 64},
        },
        {"main": _pool(replicas=1)},
    ),
]

BY_NAME = {s.name: s for s in SCENARIOS}


class _GoldenDumper(yaml.SafeDumper):
    """Multi-line strings (router.yaml, lmcache.yaml, scripts) as readable blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_GoldenDumper.add_representer(str, _str)


def _dump(objects: list[Json]) -> str:
    return yaml.dump_all(objects, Dumper=_GoldenDumper, sort_keys=False, width=100)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_golden(scenario: Scenario) -> None:
    path = GOLDEN / f"{scenario.name}.yaml"
    text = _dump(scenario.render())
    if REGEN:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"{path} missing: run with KVPLANE_REGEN_GOLDEN=1"
    assert text == path.read_text(), f"{path.name} differs: review, then KVPLANE_REGEN_GOLDEN=1"


def test_every_golden_has_a_scenario() -> None:
    stale = {p.stem for p in GOLDEN.glob("*.yaml")} - set(BY_NAME)
    assert not stale, f"golden files without a scenario: {sorted(stale)}"


# --- properties over every scenario ----------------------------------------------


def _all_objects() -> list[tuple[str, Json]]:
    return [(s.name, o) for s in SCENARIOS for o in s.render()]


def _deployments() -> list[tuple[str, Json]]:
    return [(n, o) for n, o in _all_objects() if o["kind"] == "Deployment"]


def _pod_containers(deployment: Json) -> list[Json]:
    pod = deployment["spec"]["template"]["spec"]
    return [*pod.get("initContainers", []), *pod["containers"]]


def _engine_container(deployment: Json) -> Json:
    container: Json = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["name"] == "engine"
    return container


def _engines(scenario: Scenario) -> list[Json]:
    return [
        o
        for o in scenario.render()
        if o["kind"] == "Deployment" and o["metadata"]["labels"][N.LABEL_ROLE] in N.ENGINE_ROLES
    ]


LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
PORT_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")


def test_selectors_are_stable_subsets_of_pod_labels() -> None:
    for scenario, dep in _deployments():
        selector = dep["spec"]["selector"]["matchLabels"]
        pod_labels = dep["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= pod_labels.items(), (scenario, dep["metadata"]["name"])
        assert N.LABEL_GENERATION not in selector, (scenario, dep["metadata"]["name"])


def test_services_select_their_deployments_pods() -> None:
    for scenario in SCENARIOS:
        objects = scenario.render()
        pods = [
            o["spec"]["template"]["metadata"]["labels"]
            for o in objects
            if o["kind"] == "Deployment"
        ]
        for svc in (o for o in objects if o["kind"] == "Service"):
            selector = svc["spec"]["selector"]
            assert any(selector.items() <= p.items() for p in pods), svc["metadata"]["name"]


def test_a_generation_change_rolls_the_same_deployment() -> None:
    for scenario in SCENARIOS:
        before = {(o["kind"], o["metadata"]["name"]): o for o in scenario.render("aaaaaaaaaaaa")}
        after = {(o["kind"], o["metadata"]["name"]): o for o in scenario.render("bbbbbbbbbbbb")}
        assert before.keys() == after.keys()
        for key, old in before.items():
            if key[0] != "Deployment":
                continue
            new = after[key]
            assert old["spec"]["selector"] == new["spec"]["selector"], key
            labels = new["spec"]["template"]["metadata"]["labels"]
            if labels[N.LABEL_ROLE] == Role.REDIS:
                # the index outlives generations: its keys carry the generation and age
                # out, while a restart would drop every pod's residency at once
                assert old == new, key
                continue
            # a Mooncake master is recreated: not every engine's store keys carry the
            # model's identity (SGLang's page hashes are of tokens alone), so KV of the
            # old model must not be served to the new one
            assert old["spec"]["template"] != new["spec"]["template"], key
            if labels[N.LABEL_ROLE] in N.ENGINE_ROLES:
                assert labels[N.LABEL_GENERATION] == "bbbbbbbbbbbb"
            annotations = new["spec"]["template"]["metadata"]["annotations"]
            assert annotations[N.ANNOTATION_GENERATION] == "bbbbbbbbbbbb"


def test_generation_tag_tracks_pool_and_model_identity() -> None:
    def tag_of(spec: Json, namespace: str = NAMESPACE, pool: str = POOL) -> str:
        return generation_tag(InferencePoolSpec.model_validate(spec), namespace, pool)

    tag = generation_tag(BY_NAME["vllm-aggregated"].spec(), NAMESPACE, POOL)
    assert LABEL_VALUE.match(tag) and len(tag) == 12
    assert tag_of({"model": LLAMA}) == tag
    changes: list[Json] = [
        {"model": {**LLAMA, "servedName": "other"}},
        {"model": {**LLAMA, "revision": "main"}},
        {"model": {**LLAMA, "tokenizer": "org/tok"}},
        {"model": {**LLAMA, "source": "org/other-weights"}},
        {"model": LLAMA, "engine": {"blockSize": 32}},
        {"model": LLAMA, "engine": {"kind": "sglang"}},
        {"model": LLAMA, "engine": {"hashSeed": "7"}},
    ]
    tags = {tag_of(c) for c in changes}
    # the same model in another namespace, or another pool of the same namespace
    tags |= {tag_of({"model": LLAMA}, namespace="other"), tag_of({"model": LLAMA}, pool="other")}
    assert tag not in tags and len(tags) == len(changes) + 2
    # not identity: image, extra args, router settings
    same = {"model": LLAMA, "engine": {"image": "x:1", "extraArgs": ["--a"]}, "router": {"port": 1}}
    assert tag_of(same) == tag


def test_port_names_are_valid_and_unique_per_pod() -> None:
    for scenario, dep in _deployments():
        seen: set[str] = set()
        numbers: set[int] = set()
        for container in _pod_containers(dep):
            for port in container.get("ports", []):
                name = port["name"]
                assert len(name) <= 15 and PORT_NAME.match(name), (scenario, name)
                assert re.search("[a-z]", name), (scenario, name)
                assert name not in seen, (scenario, dep["metadata"]["name"], name)
                assert port["containerPort"] not in numbers, (scenario, name)
                seen.add(name)
                numbers.add(port["containerPort"])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            for container in dep["spec"]["template"]["spec"]["containers"]:
                target = container.get(probe, {})
                for action in ("httpGet", "tcpSocket"):
                    if action in target:
                        assert target[action]["port"] in seen, (scenario, probe)


def test_names_and_label_values_fit_kubernetes_limits() -> None:
    for scenario, obj in _all_objects():
        meta = obj["metadata"]
        assert len(meta["name"]) <= 63 and PORT_NAME.match(meta["name"]), (scenario, meta)
        for value in meta["labels"].values():
            assert len(value) <= 63 and LABEL_VALUE.match(value), (scenario, value)
    long = "a" * 60
    name = N.decode_name(long, "b" * 60)
    assert len(name) == 63 and name != N.decode_name(long, "b" * 59)


def test_gpu_limits_match_the_spec() -> None:
    for scenario in SCENARIOS:
        specs = {N.decode_name(POOL, n): s for n, s in scenario.decode_specs().items()}
        prefill = scenario.prefill_spec()
        if prefill is not None:
            specs[N.prefill_name(POOL)] = prefill[1]
        engines = _engines(scenario)
        assert {e["metadata"]["name"] for e in engines} == specs.keys()
        for dep in engines:
            spec = specs[dep["metadata"]["name"]]
            resources = _engine_container(dep)["resources"]
            assert resources["limits"][N.GPU_RESOURCE] == str(spec.gpus_per_replica)
            if "requests" in resources:
                assert resources["requests"][N.GPU_RESOURCE] == str(spec.gpus_per_replica)
            # an autoscaled pool leaves replicas to its HPA (never sent, so never fought over)
            want = None if spec.autoscaling else spec.desired_replicas()
            assert dep["spec"].get("replicas") == want
            args = _engine_container(dep)["args"]
            tp_flag = "--tensor-parallel-size" if "--model" in args else "--tp-size"
            assert args[args.index(tp_flag) + 1] == str(spec.tensor_parallel_size)


def test_engines_agree_with_the_router_config() -> None:
    for scenario in SCENARIOS:
        objects = scenario.render()
        cm = next(o for o in objects if o["kind"] == "ConfigMap" and "router.yaml" in o["data"])
        config = RouterConfig.model_validate(yaml.safe_load(cm["data"]["router.yaml"]))
        assert config.discovery is not None and config.index.backend == "redis"
        assert config.model.generation == generation_tag(scenario.spec(), NAMESPACE, POOL)
        for dep in _engines(scenario):
            container = _engine_container(dep)
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert ports[N.PORT_HTTP] == config.discovery.http_port
            assert ports[N.PORT_KV_EVENTS] == config.discovery.kv_events_port
            assert ports[N.PORT_KV_REPLAY] == config.discovery.replay_port
            args = container["args"]
            size_flag = "--block-size" if "--model" in args else "--page-size"
            assert args[args.index(size_flag) + 1] == str(config.model.block_size)
            labels = dep["spec"]["template"]["metadata"]["labels"]
            assert labels[N.LABEL_POOL] in config.discovery.selector
            assert labels[N.LABEL_ROLE] in config.discovery.selector
        disaggregated = scenario.prefill is not None
        assert ("prefill" in config.discovery.selector) is disaggregated


def test_vllm_never_combines_offloading_flags_with_a_connector() -> None:
    """--kv-offloading-size silently replaces any --kv-transfer-config connector."""
    for scenario in SCENARIOS:
        for dep in _engines(scenario):
            args = _engine_container(dep)["args"]
            assert not ("--kv-offloading-size" in args and "--kv-transfer-config" in args)


def test_python_hash_seed_is_accepted_by_cpython() -> None:
    assert N.python_hash_seed("42") == "42"
    derived = N.python_hash_seed("kvplane")
    assert derived == N.python_hash_seed("kvplane") != N.python_hash_seed("kvplane2")
    for value in (derived, N.python_hash_seed("random"), N.python_hash_seed("99999999999")):
        env = {**os.environ, "PYTHONHASHSEED": value}
        subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)


def test_a_revision_change_keeps_store_keys_apart() -> None:
    """Every engine of a revision seeds its block hashes alike (P/D pods agree), another
    revision seeds them differently (stores keyed by block hashes never mix revisions),
    and the managed Mooncake master is recreated with the new generation (its in-memory
    objects go)."""

    def seeds_and_master(scenario: Scenario) -> tuple[set[str], str]:
        objs = scenario.render()
        seeds = {
            e["value"]
            for dep in _engines(scenario)
            for e in _engine_container(dep)["env"]
            if e["name"] == "PYTHONHASHSEED"
        }
        master = next(o for o in objs if o["metadata"]["name"] == f"{POOL}-mooncake")
        assert master["kind"] == "Deployment"
        assert master["spec"]["strategy"] == {"type": "Recreate"}
        annotations = master["spec"]["template"]["metadata"]["annotations"]
        return seeds, annotations[N.ANNOTATION_GENERATION]

    scenario = BY_NAME["sglang-pd-hicache-mooncake"]
    ipool = json.loads(json.dumps(scenario.ipool))
    ipool["model"]["revision"] = "a" * 40
    other = Scenario("x", ipool, scenario.decodes, scenario.prefill, scenario.tiers)
    (seed,), generation = seeds_and_master(scenario)
    (other_seed,), other_generation = seeds_and_master(other)
    assert seed != other_seed and generation != other_generation
    spec = scenario.spec()
    assert seed == N.revision_hash_seed(spec.engine.hash_seed, spec.model.revision)
    env = {**os.environ, "PYTHONHASHSEED": other_seed}  # CPython starts with it
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)


def test_tokenizer_fetch_copies_a_local_tokenizer(tmp_path: Path) -> None:
    src = tmp_path / "weights"
    src.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (src / name).write_text("{}")
    dest = tmp_path / "models" / "tokenizer"
    env = {**os.environ, "SOURCE": str(src), "REVISION": "main", "DEST": str(dest)}
    subprocess.run([sys.executable, "-c", FETCH_TOKENIZER], env=env, check=True)
    assert sorted(p.name for p in dest.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    (src / "tokenizer.json").unlink()
    bad = {**env, "DEST": str(tmp_path / "empty")}
    result = subprocess.run([sys.executable, "-c", FETCH_TOKENIZER], env=bad, capture_output=True)
    assert result.returncode != 0 and b"no tokenizer files" in result.stderr


def test_router_cost_calibration_renders_into_the_router_config() -> None:
    scenario = BY_NAME["vllm-aggregated"]
    config = router_config(POOL, NAMESPACE, scenario.spec(), [], "g")
    assert "tail_guard" not in config["cost"]  # off: the router's default
    assert config["cost"]["prefill_attention_ms_per_mpair"] == pytest.approx(1.09)
    ipool = json.loads(json.dumps(scenario.ipool))
    ipool.setdefault("router", {})["cost"] = {
        "tailGuard": 2,
        "prefillAttentionMsPerMpair": 0.5,
    }
    spec = InferencePoolSpec.model_validate(ipool)
    cost = RouterConfig.model_validate(router_config(POOL, NAMESPACE, spec, [], "g")).cost
    assert cost.tail_guard == 2.0 and cost.prefill_attention_ms_per_mpair == 0.5


def test_lmcache_tiers_render_lfu_as_its_cache_policy() -> None:
    dram = _tier(tier="dram", backend="lmcache", capacityPerPod="8Gi", evictionPolicy="lfu")
    nvme = _tier(tier="nvme", backend="lmcache", capacityPerPod="100Gi", evictionPolicy="lfu")
    assert yaml.safe_load(lmcache_config([dram, nvme]))["cache_policy"] == "LFU"
    lru = _tier(tier="dram", backend="lmcache", capacityPerPod="8Gi")
    assert "cache_policy" not in yaml.safe_load(lmcache_config([lru]))  # LMCache's LRU
    with pytest.raises(RenderError, match="one cache_policy"):
        lmcache_config([lru, nvme])
    native = _tier(tier="dram", capacityPerPod="8Gi", evictionPolicy="lfu")
    pod = EnginePod(_ipool(), Role.DECODE, EnginePoolSpec.model_validate(_pool()), [native])
    with pytest.raises(RenderError, match="cannot honour evictionPolicy lfu"):
        vllm_args(pod)


def test_a_remote_tier_is_a_shared_store_for_every_pod_of_the_pool() -> None:
    """The router and the indexer see a remote tier as one store of the whole pool (its
    blocks resident for every pod, kept when the writer dies), at the tier's link, sized
    by every engine pod's capacityPerPod (Mooncake publishes no evictions)."""
    scenario = BY_NAME["vllm-pd-lmcache-mooncake-store"]
    objects = scenario.render()
    configs = [
        yaml.safe_load(o["data"]["router.yaml"])
        for o in objects
        if o["kind"] == "ConfigMap" and "router.yaml" in o.get("data", {})
    ]
    assert configs
    spec = scenario.spec()
    block_bytes = spec.model.kv_bytes() * spec.engine.block_size
    pods = sum(
        int(o["spec"]["replicas"])
        for o in objects
        if o["kind"] == "Deployment" and o["metadata"]["labels"][N.LABEL_ROLE] in N.ENGINE_ROLES
    )
    for config in configs:
        (store,) = RouterConfig.model_validate(config).shared_stores
        assert store.pods is None  # every pod of the pool
        assert (store.link.bandwidth_gbps, store.link.latency_ms) == (20.0, 1.0)
        assert store.capacity_blocks == 16 * 2**30 // block_bytes * pods
    plain = BY_NAME["vllm-dram-native"]
    assert "shared_stores" not in router_config(
        POOL, NAMESPACE, plain.spec(), plain.tier_specs(), "g"
    )


def test_an_lmcache_cpu_tier_is_bounded_in_the_index_by_its_size() -> None:
    """LMCache's in-process connector reports the chunks it stores in its CPU tier and
    never the ones it evicts: the router and the indexer bound what they show there per
    pod by capacityPerPod (RouterConfig.unreported_tier). Tiers that report their
    evictions (vLLM's native offload, SGLang's HiCache) get no such bound."""
    scenario = BY_NAME["vllm-lmcache-dram-nvme"]
    spec = scenario.spec()
    config = router_config(POOL, NAMESPACE, spec, scenario.tier_specs(), "g")
    tier = RouterConfig.model_validate(config).unreported_tier
    block_bytes = spec.model.kv_bytes() * spec.engine.block_size
    assert tier is not None and tier.tier.value == "dram"
    assert tier.blocks == 32 * 2**30 // block_bytes
    for name in ("vllm-dram-native", "sglang-pd-hicache-mooncake", "vllm-aggregated"):
        plain = BY_NAME[name]
        assert "unreported_tier" not in router_config(
            POOL, NAMESPACE, plain.spec(), plain.tier_specs(), "g"
        )


def test_a_generation_tag_of_decimal_digits_reaches_the_router_as_text() -> None:
    """A 12-hex tag is all decimal digits about once in 280 pools: the router's YAML
    carries it quoted, and the router reads the same string (not a number)."""
    scenario = BY_NAME["vllm-aggregated"]
    config = router_config(POOL, NAMESPACE, scenario.spec(), scenario.tier_specs(), "480296055396")
    text = router_config_yaml(config)
    assert "generation: '480296055396'" in text
    loaded = RouterConfig.model_validate(yaml.safe_load(text))
    assert loaded.model.generation == "480296055396"


def test_router_config_reads_tiers_and_index() -> None:
    scenario = BY_NAME["vllm-pd-lmcache-mooncake-store"]
    config = router_config(POOL, NAMESPACE, scenario.spec(), scenario.tier_specs(), "g")
    assert config["cost"]["tiers"] == {
        "dram": {"bandwidth_gbps": 40.0, "latency_ms": 0.0},
        "nvme": {"bandwidth_gbps": 6.0, "latency_ms": 0.0},
        "remote": {"bandwidth_gbps": 20.0, "latency_ms": 1.0},
    }
    assert config["index"]["url"] == f"redis://{POOL}-redis.{NAMESPACE}.svc:6379/0"
    assert config["model"]["kv_bytes_per_token"] == 131072
    external = BY_NAME["vllm-external-redis"]
    ext = router_config(POOL, NAMESPACE, external.spec(), [], "g")
    assert ext["index"]["url"] == "rediss://redis.shared.svc:6380/2"
    assert ext["policy"] == "round_robin" and "tiers" not in ext["cost"]
    kinds = [o["kind"] for o in external.render()]
    assert "Service" in kinds and not any(
        o["metadata"]["name"] == f"{POOL}-redis" for o in external.render()
    )


def test_lmcache_config_from_tiers() -> None:
    scenario = BY_NAME["vllm-pd-lmcache-mooncake-store"]
    config = yaml.safe_load(lmcache_config(scenario.tier_specs()))
    assert config["local_cpu"] is True and config["max_local_cpu_size"] == 32
    assert config["local_disk"] == "file:///kvcache/nvme/"
    assert config["max_local_disk_size"] == 200  # capacity 0: the volume's size
    assert config["remote_url"] == f"mooncakestore://{POOL}-mooncake.{NAMESPACE}.svc:50051/"
    assert config["remote_serde"] == "cachegen" and config["enable_kv_events"] is True


def test_s3_tier_renders_lmcache_s3_region() -> None:
    """LMCache's S3 connector asserts ``extra_config.s3_region`` (LMCache 0.5.6)."""
    s3 = _tier(tier="remote", backend="s3", url="s3://bucket/kv", region="eu-west-1")
    config = yaml.safe_load(lmcache_config([s3]))
    assert config["remote_url"] == "s3://bucket/kv"
    assert config["extra_config"] == {"s3_region": "eu-west-1"}


def test_sglang_mooncake_advertises_the_pod_ip() -> None:
    """SGLang's Mooncake store config defaults local_hostname to localhost."""
    scenario = BY_NAME["sglang-pd-hicache-mooncake"]
    args = [
        a
        for o in scenario.render()
        if o["kind"] == "Deployment"
        for c in o["spec"]["template"]["spec"]["containers"]
        for a in c.get("args", [])
        if "master_server_address" in a
    ]
    assert args and all(json.loads(a)["local_hostname"] == "$(POD_IP)" for a in args)


def test_managed_mooncake_only_when_the_url_names_it() -> None:
    scenario = BY_NAME["sglang-pd-hicache-mooncake"]
    names = {o["metadata"]["name"] for o in scenario.render()}
    assert f"{POOL}-mooncake" in names
    tiers = [dict(t) for t in scenario.tiers]
    tiers[1]["url"] = "mooncake-master.storage.svc:50051"
    external = Scenario("x", scenario.ipool, scenario.decodes, scenario.prefill, tiers)
    assert f"{POOL}-mooncake" not in {o["metadata"]["name"] for o in external.render()}


# --- errors: specs the schema accepts but no engine can run --------------------------


def _ipool(**engine: Any) -> InferencePoolSpec:
    return InferencePoolSpec.model_validate({"model": LLAMA, "engine": engine})


def _tier(**spec: Any) -> KVCacheTierSpec:
    return KVCacheTierSpec.model_validate({"bandwidthGbps": 10, **spec})


def test_render_errors() -> None:
    pool = EnginePoolSpec.model_validate(_pool(gpusPerReplica=2))
    with pytest.raises(RenderError, match="tensorParallelSize"):
        vllm_args(EnginePod(_ipool(), Role.DECODE, pool))
    one = EnginePoolSpec.model_validate(_pool())
    nixl = EnginePoolSpec.model_validate(_pool(kvTransfer={"connector": "nixl"}))
    mooncake = EnginePoolSpec.model_validate(_pool(kvTransfer={"connector": "mooncake"}))
    with pytest.raises(RenderError, match="different kvTransfer"):
        pd_transfer(nixl, [mooncake])
    assert pd_transfer(None, [mooncake]) is None
    assert pd_transfer(one, [nixl, one]) == nixl.kv_transfer
    lmcache = EnginePoolSpec.model_validate(_pool(kvTransfer={"connector": "lmcache"}))
    with pytest.raises(RenderError, match="LMCache P/D"):
        vllm_args(EnginePod(_ipool(), Role.PREFILL, lmcache, (), lmcache.kv_transfer))
    dram = _tier(tier="dram", capacityPerPod="8Gi")
    with pytest.raises(RenderError, match="more than one dram"):
        vllm_args(EnginePod(_ipool(), Role.DECODE, one, [dram, dram]))
    nvme = _tier(tier="nvme", backend="lmcache", volume={"size": "1Ti"})
    remote = _tier(tier="remote", backend="mooncake", url="mooncake://m:50051")
    sglang = _ipool(kind="sglang")
    with pytest.raises(RenderError, match="one storage backend"):
        sglang_args(EnginePod(sglang, Role.DECODE, one, [nvme, remote]))
    s3 = _tier(tier="remote", backend="s3", url="s3://bucket/kv", region="eu-west-1")
    with pytest.raises(RenderError, match="no s3 storage backend"):
        sglang_args(EnginePod(sglang, Role.DECODE, one, [s3]))
    lmcache_dram = _tier(tier="dram", backend="lmcache", capacityPerPod="8Gi")
    with pytest.raises(RenderError, match="backend is native"):
        sglang_args(EnginePod(sglang, Role.DECODE, one, [lmcache_dram]))
    arc = _tier(tier="dram", capacityPerPod="8Gi", evictionPolicy="arc")
    with pytest.raises(RenderError, match="cannot honour evictionPolicy arc"):
        sglang_args(EnginePod(sglang, Role.DECODE, one, [arc]))
    packed = remote.model_copy(update={"compression": Compression.CACHEGEN})
    with pytest.raises(RenderError, match="cannot compress the remote tier"):
        sglang_args(EnginePod(sglang, Role.DECODE, one, [packed]))
    scenario = BY_NAME["vllm-pd-lmcache-mooncake-store"]
    tiers = [{k: v for k, v in t.items() if k != "masterImage"} for t in scenario.tiers]
    no_image = Scenario("x", scenario.ipool, scenario.decodes, scenario.prefill, tiers)
    with pytest.raises(RenderError, match="needs the tier's masterImage"):
        no_image.render()
    tiny = _tier(tier="dram", capacityPerPod="512Mi")
    with pytest.raises(RenderError, match="whole GB"):
        sglang_args(EnginePod(sglang, Role.DECODE, one, [tiny]))
    with pytest.raises(RenderError, match="prefill or decode"):
        engine_deployment(POOL, NAMESPACE, _ipool(), "r", "router", one, [], "g")


def test_autoscaled_pools_get_an_hpa_on_their_signal() -> None:
    from kvplane.operator.render.engine import engine_autoscaler

    ipool = InferencePoolSpec.model_validate(
        {"model": {"servedName": "m", "source": "s", "kvBytesPerToken": 1}}
    )
    fixed = EnginePoolSpec.model_validate({"poolRef": {"name": POOL}, "replicas": 2})
    assert engine_autoscaler(POOL, "ns", ipool, "d", N.Role.DECODE, fixed) is None
    scaled = EnginePoolSpec.model_validate(
        {
            "poolRef": {"name": POOL},
            "autoscaling": {
                "minReplicas": 2,
                "maxReplicas": 6,
                "signal": "queueDepth",
                "target": 4,
            },
        }
    )
    hpa = engine_autoscaler(POOL, "ns", ipool, "d", N.Role.DECODE, scaled)
    assert hpa is not None and hpa["kind"] == "HorizontalPodAutoscaler"
    assert hpa["spec"]["scaleTargetRef"]["name"] == N.decode_name(POOL, "d")
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    pods = hpa["spec"]["metrics"][0]["pods"]
    assert pods["metric"]["name"] == "vllm_num_requests_waiting"  # vllm:, colon-free
    assert pods["target"]["averageValue"] == "4000m"


# --- network policies and pod security ---------------------------------------------------


def _selects(selector: Json, labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels and In/NotIn/Exists)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        value, op = labels.get(expr["key"]), expr["operator"]
        if op == "In" and value not in expr["values"]:
            return False
        if op == "NotIn" and value in expr["values"]:
            return False
        if op == "Exists" and value is None:
            return False
    return True


ALL_PORTS = -1


def _admitted(policies: list[Json], target: dict[str, str], source: dict[str, str]) -> set[int]:
    """Ports ``source`` may reach on ``target`` under the (same-namespace) policies; every
    port when no policy selects the target (ALL_PORTS stands for any port)."""
    selecting = [p for p in policies if _selects(p["spec"]["podSelector"], target)]
    if not selecting:
        return {ALL_PORTS}
    ports: set[int] = set()
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from", [])
            if peers and not any(_selects(p.get("podSelector", {}), source) for p in peers):
                continue
            ports |= {p["port"] for p in rule["ports"]} if rule.get("ports") else {ALL_PORTS}
    return ports


def test_only_kvplane_components_reach_engines_and_redis() -> None:
    """Engines' KV event and replay ports: indexer and router only; their HTTP port (and
    with P/D their bootstrap port): the router only; any port: the pool's other engines
    (P/D transfers); the managed Redis: router and indexer only. A pod of another pool,
    or any other pod, reaches none. With ``gateway`` the picker reaches what the router
    does, and any pod the engines' HTTP port alone (the Gateway's Envoy)."""
    for scenario in SCENARIOS:
        objects = scenario.render()
        policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
        pods = {
            o["spec"]["template"]["metadata"]["labels"][N.LABEL_ROLE]: o["spec"]["template"][
                "metadata"
            ]["labels"]
            for o in objects
            if o["kind"] == "Deployment"
        }
        outsiders = [{}, {**pods["router"], N.LABEL_POOL: "other"}, {"app": "prometheus"}]
        events = {N.KV_EVENTS_PORT, N.KV_REPLAY_PORT}
        prefill = scenario.prefill_spec()
        transfer = pd_transfer(
            prefill[1] if prefill else None, list(scenario.decode_specs().values())
        )
        router_ports = events | {N.ENGINE_HTTP_PORT}
        gateway = scenario.ipool.get("gateway") is not None
        anyone = {N.ENGINE_HTTP_PORT} if gateway else set()
        if transfer is not None:  # the router asks a prefill pod's bootstrap server
            router_ports.add(transfer.bootstrap_port)
        for role in N.ENGINE_ROLES:
            if role.value not in pods:
                continue
            engine = pods[role.value]
            assert _admitted(policies, engine, pods["router"]) == router_ports
            assert _admitted(policies, engine, pods["indexer"]) == events | anyone
            if gateway:
                assert _admitted(policies, engine, pods["picker"]) == router_ports
            for other in N.ENGINE_ROLES:
                if other.value in pods:
                    assert _admitted(policies, engine, pods[other.value]) == {ALL_PORTS} | anyone
            for source in [*outsiders, *([pods["redis"]] if "redis" in pods else [])]:
                assert _admitted(policies, engine, source) == anyone, (scenario.name, source)
        if "redis" in pods:
            redis = pods["redis"]
            for reader in ("router", "indexer"):
                assert _admitted(policies, redis, pods[reader]) == {N.REDIS_PORT}
            for source in [*outsiders, pods["decode"]]:
                assert _admitted(policies, redis, source) == set(), (scenario.name, source)


def test_metrics_peers_reach_only_the_engines_http_port() -> None:
    scenario = BY_NAME["vllm-aggregated"]
    prometheus = {"podSelector": {"matchLabels": {"app": "prometheus"}}}
    spec = InferencePoolSpec.model_validate(
        {**scenario.ipool, "networkPolicy": {"metricsFrom": [prometheus]}}
    )
    objects = inference_pool_objects(
        POOL,
        NAMESPACE,
        spec,
        prefill=None,
        decodes=scenario.decode_specs(),
        tiers=[],
        default_image=OPERATOR_IMAGE,
    )
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    engine = next(o for o in objects if o["metadata"]["name"] == "llama-decode-main")
    labels = engine["spec"]["template"]["metadata"]["labels"]
    assert _admitted(policies, labels, {"app": "prometheus"}) == {N.ENGINE_HTTP_PORT}
    off = InferencePoolSpec.model_validate({**scenario.ipool, "networkPolicy": {"enabled": False}})
    objects = inference_pool_objects(
        POOL,
        NAMESPACE,
        off,
        prefill=None,
        decodes=scenario.decode_specs(),
        tiers=[],
        default_image=OPERATOR_IMAGE,
    )
    assert not [o for o in objects if o["kind"] == "NetworkPolicy"]


RESTRICTED_ROLES = ("router", "indexer", "redis")


def test_router_indexer_and_redis_pods_are_restricted() -> None:
    """The restricted Pod Security Standard, and a writable emptyDir where they write."""
    for scenario, dep in _deployments():
        pod = dep["spec"]["template"]["spec"]
        role = dep["spec"]["template"]["metadata"]["labels"][N.LABEL_ROLE]
        containers = _pod_containers(dep)
        if role in RESTRICTED_ROLES:
            assert pod["securityContext"]["runAsNonRoot"] is True
            assert pod["securityContext"]["runAsUser"] > 0
            assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
            for c in containers:
                sc = c["securityContext"]
                assert sc["readOnlyRootFilesystem"] is True, (scenario, c["name"])
                assert sc["allowPrivilegeEscalation"] is False
                assert sc["capabilities"] == {"drop": ["ALL"]}
                assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
                writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
                assert writable, (scenario, c["name"], "needs somewhere to write")
            if role == "redis":
                assert pod["automountServiceAccountToken"] is False
        elif role in N.ENGINE_ROLES:
            (c,) = containers
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert pod["automountServiceAccountToken"] is False


def test_rdma_engines_keep_only_ipc_lock() -> None:
    found = False
    for scenario in SCENARIOS:
        for dep in _engines(scenario):
            caps = _engine_container(dep)["securityContext"]["capabilities"]
            assert caps["drop"] == ["ALL"]
            assert caps.get("add", ["IPC_LOCK"]) == ["IPC_LOCK"]
            found |= "add" in caps
    assert found, "some scenario uses RDMA"


def test_routers_are_bound_to_the_discovery_cluster_role_only() -> None:
    for scenario in SCENARIOS:
        objects = scenario.render()
        assert not [o for o in objects if o["kind"] == "Role"]
        for binding in (o for o in objects if o["kind"] == "RoleBinding"):
            assert binding["roleRef"] == {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": N.DISCOVERY_ROLE,
            }
