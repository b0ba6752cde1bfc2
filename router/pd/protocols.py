"""The two legs of a P/D handoff, as the engines expect them. Pure builders.

- vLLM NixlConnector (sequential): the prefill leg asks for one token with
  ``kv_transfer_params.do_remote_decode``; its response's ``kv_transfer_params``
  (the prefill pod's engine id, block ids and NIXL side channel) go verbatim into
  the decode leg, which carries the client's original request. One X-Request-Id
  for both legs.
- vLLM MooncakeConnector (concurrent): both legs carry the same ``transfer_id``;
  the decode leg names the prefill pod's bootstrap server and the engine id that
  server reports on ``GET /query``.
- SGLang (concurrent): the same body goes to both, with ``bootstrap_host``,
  ``bootstrap_port`` (the prefill pod's bootstrap server) and a random
  ``bootstrap_room`` that pairs the two sides.

Sources: vLLM 0.33 ``toy_proxy_server.py`` and ``mooncake_connector_proxy.py``,
``nixl/pull_scheduler.py``, ``mooncake_connector.py``; SGLang's router
(``inject_bootstrap_into_value``). See docs/pd.md.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from kvplane.types import Json

# Options that make no sense for a one-token prefill or that vLLM rejects with stream=false.
_PREFILL_DROP = ("stream_options", "min_tokens", "min_completion_tokens")
# What vLLM's own proxy sends: the decode side is remote, nothing is known yet.
NIXL_PREFILL_PARAMS: Json = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# What the decode side of vLLM's NIXL connector needs to pull the blocks.
NIXL_REQUIRED = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size")
DP_RANK_HEADER = "X-data-parallel-rank"


def one_token(body: Mapping[str, Any]) -> Json:
    """The client's request cut to a one-token, non-streaming prefill."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROP}
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    if "n" in body:
        out["n"] = 1
    return out


def nixl_prefill_body(body: Mapping[str, Any]) -> Json:
    return {**one_token(body), "kv_transfer_params": dict(NIXL_PREFILL_PARAMS)}


def nixl_decode_body(body: Mapping[str, Any], params: Mapping[str, Any]) -> Json:
    """The original request with the prefill pod's ``kv_transfer_params`` verbatim."""
    return {**body, "kv_transfer_params": dict(params)}


def kv_transfer_params(response: Any) -> Json | None:
    """The prefill response's ``kv_transfer_params`` when it is something to hand off.

    vLLM returns none (or null) when the prompt was shorter than a block or the
    request failed; a dict without the fields the decode side needs is no handoff
    either, and the decode pod then prefills itself.
    """
    if not isinstance(response, dict):
        return None
    params = response.get("kv_transfer_params")
    if not isinstance(params, dict) or not all(params.get(k) is not None for k in NIXL_REQUIRED):
        return None
    return params


def transfer_id(request_id: str, attempt: int = 1) -> str:
    """``xfer-<request id>``, suffixed on retries so a stale prefill never matches."""
    return f"xfer-{request_id}" if attempt <= 1 else f"xfer-{request_id}-{attempt}"


def mooncake_prefill_body(body: Mapping[str, Any], xfer: str) -> Json:
    params = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": xfer}
    return {**one_token(body), "kv_transfer_params": params}


def mooncake_decode_body(
    body: Mapping[str, Any], xfer: str, bootstrap_addr: str, engine_id: str
) -> Json:
    params = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_bootstrap_addr": bootstrap_addr,
        "remote_engine_id": engine_id,
        "transfer_id": xfer,
    }
    return {**body, "kv_transfer_params": params}


def mooncake_engine_ids(query: Any) -> dict[int, str]:
    """``GET /query`` of a Mooncake bootstrap server -> engine id per DP rank."""
    if not isinstance(query, dict):
        raise ValueError("bootstrap /query did not return an object")
    out: dict[int, str] = {}
    for rank, entry in query.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("engine_id"), str):
            raise ValueError(f"bootstrap /query entry {rank!r} has no engine_id")
        out[int(rank)] = entry["engine_id"]
    if not out:
        raise ValueError("bootstrap /query lists no engine (workers not registered yet)")
    return out


def pick_dp_rank(engine_ids: Mapping[int, str], request_id: str) -> int:
    """A DP rank of the prefill engine, spread by request id."""
    ranks = sorted(engine_ids)
    return ranks[sum(request_id.encode()) % len(ranks)]


def host_of(url: str) -> str:
    """A backend URL's host, as an engine dials it (IPv6 without brackets)."""
    host = urlsplit(url).hostname
    if not host:
        raise ValueError(f"backend URL {url!r} has no host")
    return host


def bootstrap_addr(url: str, port: int) -> str:
    """``http://host:port`` of a prefill pod's bootstrap server (IPv6 bracketed)."""
    host = host_of(url)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bootstrap_room() -> int:
    """SGLang pairs the two sides by this random id (non-negative int64)."""
    return secrets.randbits(63)


def batch_size(body: Mapping[str, Any]) -> int | None:
    """Sequences an SGLang request expands into when it is a batch (a list of
    prompts), else None (one sequence: the bootstrap fields are scalars)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return None


def sglang_body(body: Mapping[str, Any], host: str, port: int, rooms: int | list[int]) -> Json:
    """The body sent to both sides; list-valued for a batch, one entry per prompt."""
    if isinstance(rooms, list):
        return {
            **body,
            "bootstrap_host": [host] * len(rooms),
            "bootstrap_port": [port] * len(rooms),
            "bootstrap_room": rooms,
        }
    return {**body, "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": rooms}


def multi_sequence(body: Mapping[str, Any]) -> bool:
    """n > 1 or a batch of prompts: vLLM's handoff has one consumer per request."""
    n = body.get("n")
    return (isinstance(n, int) and n > 1) or batch_size(body) is not None
