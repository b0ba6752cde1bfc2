"""Peer routers that ``kvplane bench routing`` runs beside kvplane, where a peer needs
more than a command line: NVIDIA Dynamo's KV router, through its runtime-free selection
service on kvplane's simulated engines (``dynamo``) and end to end through its own
frontend over its own simulated engines (``dynamo_mocker``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

# What a peer's benchmark proxy tells the benchmark's client (kvplane.bench.replay): the
# engine it chose, and the milliseconds it spent on work the peer's real frontend does
# natively (taken out of the request's time to first token).
BACKEND_HEADER: Final = "x-bench-backend"
OVERHEAD_HEADER: Final = "x-bench-overhead-ms"


def worker_of(chunk: Mapping[str, Any]) -> int | None:
    """The decode worker a Dynamo frontend names in a response chunk's ``nvext``
    (asked for with ``nvext.extra_fields: ["worker_id"]``)."""
    nvext = chunk.get("nvext")
    if not isinstance(nvext, dict):
        return None
    wid = nvext.get("worker_id")
    if isinstance(wid, dict):
        wid = wid.get("decode_worker_id")
    return wid if isinstance(wid, int) else None
