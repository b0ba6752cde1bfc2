"""Serve an ASGI app with uvicorn from a background thread (demo and tests)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from kvplane.local.ports import free_port


@contextlib.contextmanager
def serve_in_thread(
    app: Any,
    port: int | None = None,
    host: str = "127.0.0.1",
    start_timeout_s: float = 60.0,
    config: Callable[..., uvicorn.Config] = uvicorn.Config,
) -> Iterator[int]:
    """Yield the port once the server accepts connections; stop it on exit. ``config``
    makes the server's config from ``app, host=, port=, log_level=``."""
    port = port or free_port()
    server = uvicorn.Server(config(app, host=host, port=port, log_level="warning"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(
        target=loop.run_until_complete, args=(server.serve(),), daemon=True, name=f"srv-{port}"
    )
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError(f"server on port {port} did not start")
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(15)
