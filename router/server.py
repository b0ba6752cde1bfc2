"""uvicorn entry point (``factory=True``) so ``--workers N`` can fork processes."""

from __future__ import annotations

import os

from fastapi import FastAPI
from kvplane.router.app import create_app
from kvplane.router.config import load_config


def app_from_env() -> FastAPI:
    config = load_config(os.environ["KVPLANE_ROUTER_CONFIG"])
    embedded = True if os.environ.get("KVPLANE_EMBEDDED_INDEXER") == "1" else None
    return create_app(config, embedded_indexer=embedded)
