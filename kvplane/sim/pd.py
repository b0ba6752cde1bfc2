"""Prefill/decode disaggregation between simulated engines of one process.

The engines speak the connectors' request protocols (what a router sends and reads)
exactly, and model the KV movement itself: a prefill engine computes the prompt and
keeps its blocks pinned for a lease; a decode engine finds the prefill engine in the
process's registry, waits for the prompt KV it lacks to cross the link (``tokens x
kv_bytes_per_token / link GB/s``, transfers into one engine queued on its link),
inserts those blocks into its own prefix cache (``BlockStored`` events, as vLLM's
decode side announces blocks it received) and then decodes, recomputing only the
prompt's last partial block.

Protocols (engine-interfaces.md §4.2, §4.3, §5.1):

- NIXL: a request with ``kv_transfer_params.do_remote_decode`` runs as usual on the
  prefill engine; its answer carries ``kv_transfer_params`` naming the engine, the
  request and its blocks; the decode leg carries them verbatim
  (``do_remote_prefill``). No full block: no params (the router then aggregates).
- Mooncake: both legs at once, matched by ``transfer_id``; the decode leg names the
  prefill engine (``remote_engine_id``, ``remote_bootstrap_addr``, whose ``GET /query``
  lists the engine id per DP rank).
- SGLang: the same body to both, with ``bootstrap_host`` / ``bootstrap_port`` /
  ``bootstrap_room``; disaggregated SGLang servers require them.

The block pool has no public API for received KV yet, so :func:`pin_prefix` and
:func:`insert_prefix` work on the core's pool directly (a thin adapter).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from kvplane.sim.engine import EngineCore
from kvplane.sim.events import BlockStored
from kvplane.sim.hashing import external_hash
from kvplane.sim.kvcache import BlockMeta, BlockPool
from kvplane.sim.openai_api import ApiError

LEASE_S: Final = 30.0  # NIXL kv_lease_duration: a prefill keeps its blocks this long
HANDOFF_TIMEOUT_S: Final = 120.0  # a decode leg waits this long for its prefill
NIXL_REQUIRED: Final = (
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
)
BOOTSTRAP_KEYS: Final = ("bootstrap_host", "bootstrap_port", "bootstrap_room")

PRODUCE: Final = "produce"
CONSUME: Final = "consume"


class HandoffFailed(Exception):
    """The prefill side is gone (aborted, lease over, unknown engine)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What a request asks of this engine's P/D side."""

    role: str  # PRODUCE | CONSUME
    connector: str
    key: str | None = None  # rendezvous key of concurrent protocols
    params: Mapping[str, Any] = field(default_factory=dict)


def _bad(message: str) -> ApiError:
    return ApiError(400, message, "BadRequestError", "kv_transfer_params")


def _scalar_bootstrap(body: Mapping[str, Any]) -> tuple[str, int, int] | None:
    values = [body.get(k) for k in BOOTSTRAP_KEYS]
    if all(v is None for v in values):
        return None
    values = [v[0] if isinstance(v, list) and len(v) == 1 else v for v in values]
    host, port, room = values
    if any(isinstance(v, list) for v in values):
        raise _bad("the simulator hands off one sequence per request (no bootstrap lists)")
    if not isinstance(host, str) or type(room) is not int:
        raise _bad("bootstrap_host must be a string and bootstrap_room an integer")
    return host, int(port) if isinstance(port, int) else 0, room


def plan(
    kv_role: str, connector: str, body: Mapping[str, Any], ktp: Mapping[str, Any] | None
) -> Plan | None:
    """The P/D part of a request for an engine with ``kv_role`` and ``connector``; None
    for a plain request. Raises the 400 a real engine would give for a request it
    cannot take."""
    if connector == "sglang":
        boot = _scalar_bootstrap(body)
        if boot is None:
            if kv_role != "both":
                raise _bad(
                    f"a disaggregated ({kv_role}) server needs bootstrap_host, "
                    "bootstrap_port and bootstrap_room"
                )
            return None
        if kv_role == "both":
            return None  # a regular server ignores them
        host, port, room = boot
        role = PRODUCE if kv_role == "prefill" else CONSUME
        return Plan(role, connector, f"sglang:{host}:{port}:{room}", {"host": host, "port": port})
    if not ktp:
        return None
    remote_decode = bool(ktp.get("do_remote_decode"))
    remote_prefill = bool(ktp.get("do_remote_prefill"))
    if remote_decode and remote_prefill:
        raise _bad("do_remote_decode and do_remote_prefill are exclusive")
    if not (remote_decode or remote_prefill):
        return None
    if remote_decode and kv_role == "decode":
        raise _bad("this engine is a KV consumer (decode); it does not prefill for others")
    if remote_prefill and kv_role == "prefill":
        raise _bad("this engine is a KV producer (prefill); it does not receive KV")
    if connector == "mooncake":
        xfer = ktp.get("transfer_id")
        if not isinstance(xfer, str) or not xfer:
            raise _bad("MooncakeConnector needs a transfer_id on both legs")
        if remote_prefill and not isinstance(ktp.get("remote_engine_id"), str):
            raise _bad("MooncakeConnector decode leg needs remote_engine_id")
        return Plan(PRODUCE if remote_decode else CONSUME, connector, f"mooncake:{xfer}", ktp)
    if remote_prefill:
        missing = [k for k in NIXL_REQUIRED if ktp.get(k) is None]
        if missing:
            raise _bad(f"NixlConnector decode leg lacks {', '.join(missing)}")
    return Plan(PRODUCE if remote_decode else CONSUME, connector, None, ktp)


def transfer_seconds(tokens: int, kv_bytes_per_token: int, link_gbps: float) -> float:
    """Simulated seconds to move ``tokens`` of KV over a link of ``link_gbps`` GB/s."""
    return tokens * kv_bytes_per_token / (link_gbps * 1e9)


# ---- the block pool adapter -----------------------------------------------------------


def _pool(core: EngineCore) -> BlockPool:
    pool: BlockPool = core._pool  # no public API for received KV yet
    return pool


def pin_prefix(core: EngineCore, hashes: list[bytes]) -> list[int]:
    """Take a reference on the cached blocks of a prompt's leading ``hashes`` (a
    prefill engine holds them for the decode side until it pulls or the lease ends)."""
    pool = _pool(core)
    blocks: list[int] = []
    for h in hashes:
        b = pool.lookup(h)
        if b is None:
            break
        blocks.append(b)
    pool.touch(blocks)
    return blocks


def unpin(core: EngineCore, blocks: list[int]) -> None:
    _pool(core).release(blocks)


def local_prefix_blocks(core: EngineCore, hashes: list[bytes]) -> int:
    """Leading blocks already cached here (vLLM counts the local hit before pulling)."""
    pool = _pool(core)
    n = 0
    for h in hashes:
        if pool.lookup(h) is None:
            break
        n += 1
    return n


def insert_prefix(
    core: EngineCore, hashes: list[bytes], token_ids: list[int], start: int, count: int
) -> int:
    """Cache ``hashes[start:start + count]`` as received blocks: allocated, findable
    by hash, announced (``BlockStored``), then released to the free queue's tail
    (the request that needs them is admitted next). Returns the tokens inserted; fewer
    when free blocks run short (the decode engine recomputes the rest)."""
    pool = _pool(core)
    bs = core.profile.block_size
    count = min(count, pool.num_free)
    if count <= 0:
        return 0
    blocks = pool.allocate(count)
    ext = [external_hash(h) for h in hashes[max(0, start - 1) : start + count]]
    offset = 1 if start > 0 else 0
    parent = ext[0] if start > 0 else None
    for i, b in enumerate(blocks):
        idx = start + i
        e = ext[offset + i]
        meta = None
        if pool.cpu is not None:
            prev = ext[offset + i - 1] if offset + i > 0 else None
            meta = BlockMeta(e, prev, tuple(token_ids[idx * bs : (idx + 1) * bs]))
        pool.insert(b, hashes[idx], e, meta)
    pool.events.append(
        BlockStored(ext[offset:], parent, token_ids[start * bs : (start + count) * bs], bs)
    )
    pool.release(blocks)
    return count * bs


# ---- pins and rendezvous ----------------------------------------------------------------


@dataclass(slots=True)
class Pin:
    """A finished prefill's blocks, held for the decode side."""

    engine_id: str
    request_id: str
    prompt_len: int
    hashes: list[bytes]
    blocks: list[int]
    release_fn: Callable[[Pin], None]
    key: str | None = None  # rendezvous key (Mooncake, SGLang)
    timer: asyncio.TimerHandle | None = None
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            if self.timer is not None:
                self.timer.cancel()
            self.release_fn(self)


class HandoffBoard:
    """Where concurrent legs meet: the decode leg waits on a key the prefill fills."""

    def __init__(self) -> None:
        self._slots: dict[str, asyncio.Future[Pin]] = {}

    def _slot(self, key: str) -> asyncio.Future[Pin]:
        fut = self._slots.get(key)
        if fut is None:
            fut = self._slots[key] = asyncio.get_running_loop().create_future()
        return fut

    def offer(self, key: str, pin: Pin) -> None:
        fut = self._slot(key)
        if not fut.done():
            fut.set_result(pin)

    def fail(self, key: str, reason: str) -> None:
        fut = self._slot(key)
        if not fut.done():
            fut.set_exception(HandoffFailed(reason))
            fut.exception()  # retrieved: no "never retrieved" warning if nobody waits

    def drop(self, key: str) -> None:
        fut = self._slots.pop(key, None)
        if fut is not None and not fut.done():
            fut.cancel()

    async def take(self, key: str, timeout_s: float) -> Pin:
        fut = self._slot(key)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except TimeoutError as exc:
            raise HandoffFailed(f"no prefill for {key} within {timeout_s:.0f} s") from exc
        finally:
            if fut.done():
                self._slots.pop(key, None)


class Link:
    """An engine's inbound KV link: transfers into it queue (FIFO) for the bandwidth."""

    def __init__(self) -> None:
        self.free_at = 0.0

    def reserve(self, now: float, duration: float) -> float:
        """Start a transfer of ``duration`` (wall seconds) no earlier than ``now``;
        returns when it ends."""
        start = max(now, self.free_at)
        self.free_at = start + duration
        return self.free_at


def nixl_params(
    pin: Pin, host: str, port: int, expiry_unix: float, num_tokens: int
) -> dict[str, Any]:
    """What vLLM 0.33's NIXL prefill side returns (``pull_scheduler.request_finished``)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(pin.blocks)],
        "remote_engine_id": pin.engine_id,
        "remote_request_id": pin.request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": num_tokens,
        "remote_blocks_expiry_time": expiry_unix,
        "remote_registration_generation": 0,
        "transfer_mode": "pull",
    }


def transfer_failed(message: str) -> ApiError:
    """vLLM with ``kv_load_failure_policy: fail``: the request errors."""
    return ApiError(500, f"KV transfer failed: {message}", "InternalServerError", None)
