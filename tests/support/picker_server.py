"""Run kvplane's endpoint picker (gRPC) on its own event loop in a background thread."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any, TypeVar

from kvplane.router.app import Router
from kvplane.router.config import RouterConfig
from kvplane.router.epp.picker import PickerSettings
from kvplane.router.epp.server import RunningPicker, start_picker

T = TypeVar("T")


class PickerThread:
    def __init__(self, running: RunningPicker, loop: asyncio.AbstractEventLoop) -> None:
        self.running = running
        self.loop = loop

    @property
    def port(self) -> int:
        return self.running.port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.running.port}"

    def router(self, model: str | None = None) -> Router:
        registry = self.running.registry
        return registry.resolve(model) if model else next(iter(registry))

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run ``coro`` on the picker's loop (its state is only touched there)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@contextlib.contextmanager
def serve_picker(
    configs: Sequence[RouterConfig],
    settings: PickerSettings | None = None,
    port: int = 0,
) -> Iterator[PickerThread]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="epp")
    thread.start()
    try:
        start = start_picker(configs, port, settings, host="127.0.0.1")
        running = asyncio.run_coroutine_threadsafe(start, loop).result(60)
        picker = PickerThread(running, loop)
        try:
            yield picker
        finally:
            with contextlib.suppress(Exception):
                picker.call(running.stop(grace_s=0.5))
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
