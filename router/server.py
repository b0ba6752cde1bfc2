"""uvicorn entry point (``factory=True``) so ``--workers N`` can fork processes."""

from __future__ import annotations

import os

from fastapi import FastAPI
from kvplane.router.app import create_app
from kvplane.router.models import load_pools


def app_from_env() -> FastAPI:
    configs = load_pools(os.environ["KVPLANE_ROUTER_CONFIG"])  # one pool, or pools: [...]
    embedded = True if os.environ.get("KVPLANE_EMBEDDED_INDEXER") == "1" else None
    return create_app(configs, embedded_indexer=embedded)
