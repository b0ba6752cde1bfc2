"""The endpoint picker's gRPC server: Envoy's ``ExternalProcessor`` service and the
gRPC health services the protocol names (``liveness``, ``readiness`` and the
processor's own), over the pools' router state, which runs its discovery, scrapes
and KV event ingestion as the HTTP router's does (``runtime``). The pools' Prometheus
metrics are served over HTTP on their own port."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from kvplane.router import runtime
from kvplane.router.app import Router, build_router, make_discovery
from kvplane.router.config import RouterConfig
from kvplane.router.epp.exchange import Exchange
from kvplane.router.epp.messages import ProcessingRequest, ProcessingResponse
from kvplane.router.epp.picker import Picker, PickerSettings
from kvplane.router.models import ModelRegistry
from prometheus_client import start_http_server

log = logging.getLogger("kvplane.router.epp")

PROCESSOR = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "liveness", "readiness", PROCESSOR)


class Processor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, picker: Picker) -> None:
        self.picker = picker

    async def Process(
        self,
        request_iterator: AsyncIterator[ProcessingRequest],
        context: grpc.aio.ServicerContext[ProcessingRequest, ProcessingResponse],
    ) -> AsyncIterator[ProcessingResponse]:
        exchange = Exchange(self.picker)
        try:
            async for req in request_iterator:
                for resp in await exchange.on(req):
                    yield resp
        finally:
            exchange.close()


@dataclass
class RunningPicker:
    server: grpc.aio.Server
    port: int
    registry: ModelRegistry
    picker: Picker
    health: health.HealthServicer

    async def stop(self, grace_s: float = 5.0) -> None:
        for name in HEALTH_SERVICES:
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace_s)
        for router in self.registry:
            await runtime.stop(router)


async def start_picker(
    configs: Sequence[RouterConfig],
    port: int,
    settings: PickerSettings | None = None,
    host: str = "0.0.0.0",
    embedded_indexer: bool | None = None,
    routers: Sequence[Router] | None = None,
) -> RunningPicker:
    """Build the pools, start their background work, then serve (port 0: a free one)."""
    if routers is None:
        first = build_router(configs[0])  # the others export through its metrics registry
        routers = [first, *(build_router(c, metrics=first.metrics) for c in configs[1:])]
    registry = ModelRegistry(routers)
    picker = Picker(registry, settings or PickerSettings())
    for router in routers:
        embed = (
            router.config.index.backend == "memory"
            if embedded_indexer is None
            else embedded_indexer
        )
        await runtime.start(router, make_discovery(router.config), embed)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_ExternalProcessorServicer_to_server(Processor(picker), server)
    checker = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    for name in HEALTH_SERVICES:
        checker.set(name, health_pb2.HealthCheckResponse.SERVING)
    runtime.settle()
    return RunningPicker(server, bound, registry, picker, checker)


async def serve(
    configs: Sequence[RouterConfig],
    port: int,
    settings: PickerSettings,
    host: str,
    metrics_port: int,
) -> None:
    """Run until SIGTERM or SIGINT (``kvplane epp``)."""
    running = await start_picker(configs, port, settings, host)
    if metrics_port:  # every pool's series share the first pool's registry
        first = next(iter(running.registry))
        start_http_server(metrics_port, registry=first.metrics.registry)
    log.info("endpoint picker serving %s on %s:%d", running.registry.names(), host, running.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await running.stop()
