"""``kvplane sim``: serve a fleet of simulated vLLM engines until interrupted.

Prints one JSON line per engine (name, url, kv_events, replay, topic, engine_id, role,
port, bootstrap_port) once every engine listens; ``--describe FILE`` writes the same as
a JSON list, and ``--router-config FILE`` a kvplane router config for the fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from kvplane.sim.fleet import CONNECTORS, ROLES, FleetConfig, SimFleet
from kvplane.sim.kvcache import STORE_POLICIES, Link, router_kv_settings
from kvplane.sim.profiles import PROFILES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", required=True, help="tokenizer directory (HF files)")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--profile", default="h100-llama-3.1-8b", choices=sorted(PROFILES))
    p.add_argument("--model", default="sim", help="served model name")
    p.add_argument("--chat-template", default=None, help="template file or text")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="engine i serves HTTP on PORT+i")
    p.add_argument("--kv-events-port", type=int, default=0, help="engine i: PUB on PORT+i")
    p.add_argument("--replay-port", type=int, default=0, help="engine i: replay on PORT+i")
    p.add_argument("--no-kv-events", action="store_true")
    p.add_argument("--topic", default="kv@{name}@{model}", help="fields: name, model, index")
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="wall seconds per simulated second (4.0 runs 4x slower than the modeled GPU)",
    )
    p.add_argument("--stream-interval", type=int, default=1, help="tokens per SSE chunk")
    p.add_argument(
        "--prefix-caching-hash-algo",
        default="sha256",
        choices=["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"],
    )
    p.add_argument("--hash-seed", default=None, help="NONE_HASH seed (vLLM: PYTHONHASHSEED)")
    p.add_argument("--no-enable-prefix-caching", action="store_true")
    p.add_argument(
        "--runner",
        default="generate",
        choices=["generate", "pooling"],
        help="pooling: also serve /v1/embeddings, /v1/score, /v1/rerank (as vLLM's flag)",
    )
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--cpu-offload-blocks", type=int, default=None)
    p.add_argument(
        "--kv-role",
        action="append",
        default=[],
        choices=ROLES,
        help="per engine, in order (repeat; one value applies to all); default both",
    )
    p.add_argument("--prefill", type=int, default=0, help="the first N engines are prefill")
    p.add_argument("--kv-connector", default="nixl", choices=CONNECTORS)
    p.add_argument("--pd-link-gbps", type=float, default=50.0, help="P/D KV transfer GB/s")
    p.add_argument(
        "--bootstrap-port", type=int, default=0, help="prefill engine i's bootstrap: PORT+i"
    )
    p.add_argument(
        "--lora-modules", nargs="+", default=[], help="LoRA adapters, name=path (as vLLM)"
    )
    p.add_argument("--max-loras", type=int, default=1, help="adapters in one batch (as vLLM)")
    p.add_argument("--lora-load-ms", type=float, default=5.0, help="an adapter's load")
    p.add_argument(
        "--store-blocks",
        type=int,
        default=0,
        help="a shared store every engine writes to and loads from, in blocks (0: none)",
    )
    p.add_argument("--store-gbps", type=float, default=25.0, help="the store's link, GB/s")
    p.add_argument("--store-latency-ms", type=float, default=1.0)
    p.add_argument("--store-policy", choices=STORE_POLICIES, default="lru")
    p.add_argument(
        "--store-write-through",
        action="store_true",
        help="store blocks as computed (as LMCache, Mooncake Store), not as HBM evicts them",
    )
    p.add_argument(
        "--peer-gbps", type=float, default=0.0, help="peer pulls between engines, GB/s (0: none)"
    )
    p.add_argument("--peer-latency-ms", type=float, default=0.2)
    p.add_argument("--describe", type=Path, default=None, help="write the engines as JSON")
    p.add_argument("--router-config", type=Path, default=None, help="write a router config")


def fleet_config(a: argparse.Namespace) -> FleetConfig:
    roles: list[str] = list(a.kv_role)
    if len(roles) == 1:
        roles = roles * a.engines
    if a.prefill:
        if roles:
            raise SystemExit("kvplane sim: use --prefill or --kv-role, not both")
        roles = ["prefill"] * a.prefill + ["decode"] * (a.engines - a.prefill)
    return FleetConfig(
        tokenizer=a.tokenizer,
        engines=a.engines,
        profile=a.profile,
        model=a.model,
        chat_template=a.chat_template,
        host=a.host,
        base_port=a.port,
        kv_events_base_port=a.kv_events_port,
        replay_base_port=a.replay_port,
        kv_events=not a.no_kv_events,
        topic=a.topic,
        time_scale=a.time_scale,
        stream_interval=a.stream_interval,
        hash_algo=a.prefix_caching_hash_algo,
        hash_seed=a.hash_seed,
        enable_prefix_caching=not a.no_enable_prefix_caching,
        block_size=a.block_size,
        num_gpu_blocks=a.num_gpu_blocks,
        max_model_len=a.max_model_len,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        cpu_offload_blocks=a.cpu_offload_blocks,
        roles=roles,
        kv_connector=a.kv_connector,
        pd_link_gbps=a.pd_link_gbps,
        bootstrap_base_port=a.bootstrap_port,
        lora_modules=a.lora_modules,
        max_loras=a.max_loras,
        lora_load_ms=a.lora_load_ms,
        pooling=a.runner == "pooling",
        store_blocks=a.store_blocks,
        store_link=Link(a.store_gbps, a.store_latency_ms),
        store_policy=a.store_policy,
        store_write_through=a.store_write_through,
        peer_link=Link(a.peer_gbps, a.peer_latency_ms) if a.peer_gbps > 0 else None,
    )


def router_config_yaml(fleet: SimFleet) -> str:
    """A kvplane router config (in-memory index, cost policy) for this fleet."""
    import yaml

    p = fleet.profile
    lora = fleet.cfg.lora_modules
    doc = {
        "model": {
            "name": fleet.cfg.model,
            "tokenizer": str(fleet.cfg.tokenizer),
            "block_size": p.block_size,
            "max_model_len": min(p.max_model_len, p.capacity_tokens),
            "kv_bytes_per_token": p.kv_bytes_per_token,
            **({"chat_template": fleet.chat_template} if fleet.chat_template else {}),
            **({"lora_adapters": [m.split("=", 1)[0] for m in lora]} if lora else {}),
        },
        "backends": fleet.backends(),
        "policy": "cost",
        "index": {"backend": "memory"},
    }
    if any(e.cfg.kv_role != "both" for e in fleet.engines):
        doc["pd"] = {"connector": fleet.cfg.kv_connector}
    store = fleet.cfg.store_link if fleet.store is not None else None
    doc.update(router_kv_settings(store, fleet.cfg.peer_link))
    return str(yaml.safe_dump(doc, sort_keys=False))


async def serve(fleet: SimFleet, describe: Path | None, router_config: Path | None) -> None:
    cfg = fleet.cfg
    await fleet.start()
    gc.freeze()  # the tokenizer and the pools live for the whole run: keep them out of GC passes
    try:
        rows = fleet.describe()
        for row in rows:
            print(json.dumps(row), flush=True)
        if describe is not None:
            await asyncio.to_thread(describe.write_text, json.dumps(rows, indent=1) + "\n")
        if router_config is not None:
            await asyncio.to_thread(router_config.write_text, router_config_yaml(fleet))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        print(
            f"kvplane sim: {len(rows)} engines ({fleet.profile.name}, time scale "
            f"{cfg.time_scale}) serving {cfg.model}; Ctrl-C stops",
            file=sys.stderr,
            flush=True,
        )
        await stop.wait()
    finally:
        await fleet.stop()


def run(a: argparse.Namespace) -> int:
    try:
        fleet = SimFleet(fleet_config(a))
    except ValueError as exc:
        print(f"kvplane sim: {exc}", file=sys.stderr)
        return 2
    coro = serve(fleet, a.describe, a.router_config)
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvplane sim", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
