"""The routers under test and their exact command lines.

Every router gets the same simulated fleet, cold, and its documented policy
flags: kvplane (the cost policy and every other registered policy as a baseline:
``kvplane-<policy>``),
the PyPI ``vllm-router`` (``kv_aware`` fed by the engines' KV events, which it
discovers from each worker's ``/kv_event_sources``; ``cache_aware``,
``consistent_hash``, ``round_robin``), ``sglang-router`` (``cache_aware``) and NVIDIA
Dynamo's KV router (``dynamo``, ``dynamo-<settings>``: kvplane.bench.peers.dynamo).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvplane.bench.peers import dynamo
from kvplane.bench.peers.dynamo import RunningPeer, WorkerSpec
from kvplane.bench.procs import HOST, spawn, venv_bin
from kvplane.local.ports import free_port
from kvplane.router.config import TierCost
from kvplane.router.policies import labelled

KVPLANE_POLICIES = labelled()  # every registered policy: kvplane, kvplane-<policy>
VLLM_ROUTER_POLICIES = ("kv_aware", "cache_aware", "consistent_hash", "round_robin")
PEERS = (*(f"vllm-router-{p}" for p in VLLM_ROUTER_POLICIES), "sglang-router-cache_aware")
# kvplane's cost policy as a Gateway API endpoint picker behind real Envoy
GATEWAY = "kvplane-envoy"
ALL_ROUTERS = (*KVPLANE_POLICIES, GATEWAY, *PEERS, "dynamo", "dynamo-<presets>")
# a run without --routers: kvplane, its strongest baselines and every peer
DEFAULT_ROUTERS = (
    "kvplane",
    "kvplane-round_robin",
    "kvplane-sticky",
    "kvplane-prefix_affinity",
    *PEERS,
)


@dataclass(frozen=True, slots=True)
class EngineEndpoint:
    name: str
    url: str
    kv_events: str
    replay: str
    headers: Mapping[str, str] = field(default_factory=dict)  # engines sharing one url
    token_ids: str = "off"  # how the url takes a prompt's ids (RouterConfig.forward_tokens)
    unreported_host_blocks: int = 0  # a host tier the engine publishes no KV events for


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What a router must be told about the fleet's model (an operator would render it)."""

    name: str
    tokenizer: Path
    block_size: int
    max_model_len: int
    kv_bytes_per_token: int
    prefill_tokens_per_s: float
    decode_step_ms: float
    prefill_attention_ms_per_mpair: float = 0.0
    dram: TierCost | None = None  # the engines' CPU tier, where they have one
    cost_set: dict[str, Any] = field(default_factory=dict)  # cost overrides (experiments)
    max_num_batched_tokens: int = 8192  # the engines' scheduler budget (peers register it)
    kv_blocks: int = 0  # the engines' KV capacity in blocks (peers register it)
    # the fleet's shared store and peer pulls, as router config keys (``--fleet-shape``)
    fleet_kv: dict[str, Any] = field(default_factory=dict)


@dataclass
class RouterLaunch:
    name: str
    port: int
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def kvplane_config(
    model: ModelFacts, engines: Sequence[EngineEndpoint], policy: str
) -> dict[str, object]:
    """The router config an operator would render for this fleet, calibrated to its profile."""
    return {
        "model": {
            "name": model.name,
            "tokenizer": str(model.tokenizer),
            "block_size": model.block_size,
            "max_model_len": model.max_model_len,
            "kv_bytes_per_token": model.kv_bytes_per_token,
        },
        "backends": [
            {
                "name": e.name,
                "url": e.url,
                "kv_events": e.kv_events,
                "replay": e.replay,
                **({"headers": dict(e.headers)} if e.headers else {}),
            }
            for e in engines
        ],
        "policy": policy,
        "cost": {
            "prefill_tokens_per_s": model.prefill_tokens_per_s,
            "prefill_attention_ms_per_mpair": model.prefill_attention_ms_per_mpair,
            "decode_step_ms": model.decode_step_ms,
            **({"tiers": {"dram": model.dram.model_dump()}} if model.dram else {}),
            **model.cost_set,
        },
        "index": {"backend": "memory"},
        "auth": {"route_headers": True},  # the replay counts requests per pod
        "scrape_interval_s": 0.5,
        "forward_tokens": _token_ids(engines),
        **_unreported_tier(engines),
        **model.fleet_kv,
    }


def _unreported_tier(engines: Sequence[EngineEndpoint]) -> dict[str, object]:
    """Engines with a host tier they publish nothing for (Dynamo's mockers): the router
    is told its size, as an operator rendering that tier would."""
    sizes = {e.unreported_host_blocks for e in engines}
    if len(sizes) != 1 or not (blocks := sizes.pop()):
        return {}
    return {"unreported_tier": {"tier": "dram", "blocks": blocks}}


def _token_ids(engines: Sequence[EngineEndpoint]) -> str:
    """Engines that all take the router's ids one way (Dynamo's frontend) are handed them."""
    forms = {e.token_ids for e in engines}
    return forms.pop() if len(forms) == 1 else "off"


def launch_for(
    name: str,
    model: ModelFacts,
    engines: Sequence[EngineEndpoint],
    rundir: Path,
) -> RouterLaunch:
    port = free_port()
    urls = [e.url for e in engines]
    if any(e.headers for e in engines) and name not in KVPLANE_POLICIES:
        raise SystemExit(
            f"bench routing: {name} cannot route to engines that share a url and differ by "
            "a header (the mocker fleet); only kvplane and Dynamo's frontend run there"
        )
    if name in KVPLANE_POLICIES:
        cfg = rundir / f"{name}.yaml"
        cfg.write_text(yaml.safe_dump(kvplane_config(model, engines, KVPLANE_POLICIES[name])))
        argv = [venv_bin("kvplane"), "--log-level", "warning", "router", "--config", str(cfg)]
        argv += ["--host", HOST, "--port", str(port)]
        return RouterLaunch(name, port, argv)
    if name == GATEWAY:
        cfg = rundir / f"{name}.yaml"
        cfg.write_text(yaml.safe_dump(kvplane_config(model, engines, "cost")))
        argv = [sys.executable, "-m", "kvplane.local.gateway", "--config", str(cfg)]
        argv += ["--port", str(port), "--log-dir", str(rundir)]
        return RouterLaunch(name, port, argv)
    if name.startswith("vllm-router-"):
        policy = name.removeprefix("vllm-router-")
        argv = [venv_bin("vllm-router"), "--host", HOST, "--port", str(port), "--worker-urls"]
        argv += [*urls, "--policy", policy, "--prometheus-port", str(free_port())]
        argv += ["--log-level", "warning"]
        if policy == "kv_aware":
            argv += ["--kv-event-block-size", str(model.block_size)]
            argv += ["--kv-event-model", model.name]
        return RouterLaunch(name, port, argv, {"NO_COLOR": "1"})
    if name == "sglang-router-cache_aware":
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", HOST]
        argv += ["--port", str(port), "--worker-urls", *urls, "--policy", "cache_aware"]
        argv += ["--prometheus-port", str(free_port()), "--log-level", "warn"]
        return RouterLaunch(name, port, argv, {"NO_COLOR": "1"})
    raise SystemExit(f"bench routing: unknown router {name!r} (choose from {ALL_ROUTERS})")


def worker_specs(model: ModelFacts, engines: Sequence[EngineEndpoint]) -> list[WorkerSpec]:
    """The fleet as Dynamo registers it: worker ids from 1, the engines' real scheduler
    budget and KV capacity."""
    return [
        WorkerSpec(
            worker_id=i + 1,
            name=e.name,
            url=e.url,
            kv_events=e.kv_events,
            replay=e.replay,
            block_size=model.block_size,
            max_num_batched_tokens=model.max_num_batched_tokens,
            total_kv_blocks=model.kv_blocks,
        )
        for i, e in enumerate(engines)
    ]


def start_router(
    name: str,
    model: ModelFacts,
    engines: Sequence[EngineEndpoint],
    rundir: Path,
    time_scale: float,
    token_table: Path | None = None,
) -> RunningPeer:
    """Start router ``name`` in front of ``engines``: its processes and its port
    (``token_table``: the run's prompts' token ids, for a peer that would otherwise
    tokenize in Python what it tokenizes natively)."""
    if dynamo.is_selector_peer(name):
        return dynamo.start_selector_peer(
            name,
            worker_specs(model, engines),
            model.tokenizer,
            rundir,
            time_scale,
            sys.executable,
            token_table,
        )
    launch = launch_for(name, model, engines, rundir)
    return RunningPeer(name, launch.port, [spawn(name, launch.argv, rundir, launch.env)])
