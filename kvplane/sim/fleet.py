"""Many simulated engines in one process and event loop, each with its own HTTP port,
ZMQ PUB and replay ports, as a fleet of separate vLLM pods would have.

One process keeps a benchmark's machine budget for routers and clients: engines cost
only their bookkeeping, and the tokenizer (by far the largest object) is loaded once
and shared. ``time_scale`` stretches modeled time (4.0: four wall seconds per
simulated second) so that Python overhead in routers and clients stays small next to
the modeled latencies; divide latencies measured by clients by it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvplane.router.tokens import PromptTokenizer
from kvplane.sim.engine import Fabric
from kvplane.sim.kvcache import Link, PeerFabric, SharedStore
from kvplane.sim.lora import LoraConfig, adapters_of
from kvplane.sim.profiles import PROFILES, EngineProfile
from kvplane.sim.server import EngineRegistry, OutputToken, SimEngine, SimEngineConfig

ROLES = ("both", "prefill", "decode")
CONNECTORS = ("nixl", "mooncake", "sglang")


@dataclass(slots=True)
class FleetConfig:
    tokenizer: str  # directory with tokenizer.json / tokenizer_config.json
    engines: int = 2
    profile: str = "cpu-tiny"
    model: str = "sim"  # served model name
    chat_template: str | None = None  # template text or a file; default: the tokenizer's
    host: str = "127.0.0.1"
    base_port: int = 0  # engine i listens on base_port + i (0: free ports)
    kv_events_base_port: int = 0
    replay_base_port: int = 0
    replay: bool = True
    kv_events: bool = True
    topic: str = "kv@{name}@{model}"  # format fields: name, model, index
    time_scale: float = 1.0
    stream_interval: int = 1
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    enable_prefix_caching: bool = True
    block_size: int | None = None  # overrides keep the profile's KV capacity in tokens
    num_gpu_blocks: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    cpu_offload_blocks: int | None = None
    roles: Sequence[str] = ()  # per engine (P/D); default: all "both"
    kv_connector: str = "nixl"
    pd_link_gbps: float = 50.0
    bootstrap_base_port: int = 0  # Mooncake/SGLang bootstrap port of prefill engine i
    names: Sequence[str] = field(default_factory=tuple)
    lora_modules: Sequence[str] = ()  # LoRA adapters, name=path (vLLM --lora-modules)
    max_loras: int = 1  # adapters in one batch (vLLM --max-loras)
    lora_load_ms: float = 5.0  # simulated: an adapter entering a GPU slot
    pooling: bool = False  # serve embeddings, score, rerank (vLLM: --runner pooling)
    # a store every engine writes to and loads from (0 blocks: none), and peer pulls
    # (0 GB/s: none): kvcache.SharedStore, kvcache.PeerFabric
    store_blocks: int = 0
    store_link: Link = field(default_factory=lambda: Link(25.0, 1.0))
    store_policy: str = "lru"
    store_write_through: bool = False
    peer_link: Link | None = None


def resolve_profile(cfg: FleetConfig) -> EngineProfile:
    """The named profile with the fleet's overrides applied."""
    try:
        p = PROFILES[cfg.profile]
    except KeyError:
        raise ValueError(f"unknown profile {cfg.profile!r}; known: {sorted(PROFILES)}") from None
    if cfg.block_size is not None and cfg.block_size != p.block_size:
        tokens = p.capacity_tokens
        p = replace(p, block_size=cfg.block_size, num_gpu_blocks=tokens // cfg.block_size + 1)
    if cfg.num_gpu_blocks is not None:
        p = replace(p, num_gpu_blocks=cfg.num_gpu_blocks)
    if cfg.max_model_len is not None:
        p = replace(p, max_model_len=cfg.max_model_len)
    if cfg.max_num_seqs is not None:
        p = replace(p, max_num_seqs=cfg.max_num_seqs)
    if cfg.max_num_batched_tokens is not None:
        p = replace(p, max_num_batched_tokens=cfg.max_num_batched_tokens)
    if cfg.cpu_offload_blocks is not None:
        p = replace(p, cpu_offload_blocks=cfg.cpu_offload_blocks)
    return p


def read_chat_template(value: str | None) -> str | None:
    """vLLM's ``--chat-template``: a file path or the template itself."""
    if value is None:
        return None
    path = Path(value)
    with contextlib.suppress(OSError):
        if path.is_file():
            return path.read_text()
    return value


class SimFleet:
    """Start with :meth:`start` inside an event loop, or use :func:`running_fleet`."""

    def __init__(self, cfg: FleetConfig, tokenizer: PromptTokenizer | None = None) -> None:
        if cfg.engines < 1:
            raise ValueError("a fleet needs at least one engine")
        roles = list(cfg.roles) or ["both"] * cfg.engines
        if len(roles) != cfg.engines or any(r not in ROLES for r in roles):
            raise ValueError(f"roles must name {cfg.engines} of {ROLES}, got {roles}")
        if cfg.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_connector must be one of {CONNECTORS}")
        self.cfg = cfg
        self.profile = resolve_profile(cfg)
        self.chat_template = read_chat_template(cfg.chat_template)
        self.tokenizer = tokenizer or PromptTokenizer(
            cfg.tokenizer, chat_template=self.chat_template
        )
        self.output = OutputToken.for_tokenizer(self.tokenizer)
        self.registry = EngineRegistry()
        names = list(cfg.names) or [f"e{i}" for i in range(cfg.engines)]
        bs = self.profile.block_size
        self.store = (
            SharedStore(cfg.store_blocks, bs, cfg.store_link, cfg.store_policy)
            if cfg.store_blocks
            else None
        )
        self.peers = PeerFabric(cfg.peer_link) if cfg.peer_link is not None else None
        shares = self.store is not None or self.peers is not None
        self.engines: list[SimEngine] = []
        for i, (name, role) in enumerate(zip(names, roles, strict=True)):

            def port(base: int, i: int = i) -> int:
                return base + i if base else 0

            lora = None
            if cfg.lora_modules:
                adapters = adapters_of(cfg.lora_modules)
                lora = LoraConfig(adapters, cfg.max_loras, cfg.lora_load_ms)
            ecfg = SimEngineConfig(
                profile=self.profile,
                name=name,
                model=cfg.model,
                tokenizer_path=str(cfg.tokenizer),
                host=cfg.host,
                port=port(cfg.base_port),
                kv_events=cfg.kv_events,
                kv_events_port=port(cfg.kv_events_base_port),
                replay_port=port(cfg.replay_base_port) if cfg.replay else None,
                topic=cfg.topic.format(name=name, model=cfg.model, index=i),
                time_scale=cfg.time_scale,
                stream_interval=cfg.stream_interval,
                hash_algo=cfg.hash_algo,
                hash_seed=cfg.hash_seed,
                enable_prefix_caching=cfg.enable_prefix_caching,
                kv_role=role,
                kv_connector=cfg.kv_connector,
                pd_link_gbps=cfg.pd_link_gbps,
                bootstrap_port=port(cfg.bootstrap_base_port) if role == "prefill" else None,
                lora=lora,
                pooling=cfg.pooling,
                fabric=(
                    Fabric(name, self.store, self.peers, cfg.store_write_through)
                    if shares
                    else None
                ),
            )
            self.engines.append(SimEngine(ecfg, self.tokenizer, self.output, self.registry))

    async def start(self) -> None:
        started: list[SimEngine] = []
        try:
            for e in self.engines:
                await e.start()
                started.append(e)
        except BaseException:
            for e in started:
                await e.stop()
            raise

    async def stop(self) -> None:
        for e in self.engines:
            await e.stop()

    def describe(self) -> list[dict[str, Any]]:
        """Every engine's endpoints (for router configs and benchmark scripts)."""
        return [
            {
                **e.backend(),
                "engine_id": e.cfg.engine_id,
                "role": e.cfg.kv_role,
                "port": e.port,
                "bootstrap_port": e.bootstrap_port,
            }
            for e in self.engines
        ]

    def backends(self) -> list[dict[str, Any]]:
        """kvplane router backend entries (with P/D roles and bootstrap ports)."""
        return [e.router_backend() for e in self.engines]


@contextlib.contextmanager
def running_fleet(
    cfg: FleetConfig, tokenizer: PromptTokenizer | None = None, start_timeout_s: float = 60.0
) -> Iterator[SimFleet]:
    """A started fleet served by its own event loop in a background thread."""
    fleet = SimFleet(cfg, tokenizer)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="sim-fleet")
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(fleet.start(), loop).result(start_timeout_s)
        yield fleet
    finally:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(fleet.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        if not thread.is_alive():
            loop.close()
