"""Peer routers that ``kvplane bench routing`` runs beside kvplane, where a peer needs
more than a command line: NVIDIA Dynamo's KV router, through its runtime-free selection
service on kvplane's simulated engines (``dynamo``) and end to end through its own
frontend over its own simulated engines (``dynamo_mocker``)."""

from __future__ import annotations

from typing import Final

# What a peer's benchmark proxy tells the benchmark's client (kvplane.bench.replay): the
# engine it chose, and the milliseconds it spent on work the peer's real frontend does
# natively (taken out of the request's time to first token).
BACKEND_HEADER: Final = "x-bench-backend"
OVERHEAD_HEADER: Final = "x-bench-overhead-ms"
