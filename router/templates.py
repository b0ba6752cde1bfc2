"""Chat templates: rendering, and a bounded place for templates a request brings.

The configured template (or the tokenizer's) is the operator's and renders in-process.
A request's own ``chat_template`` is refused unless ``model.trust_request_chat_template``
(as vLLM's ``--trust-request-chat-template``); when trusted, it renders in a worker
process that is killed past ``model.request_template_timeout_s`` and limited in memory.
Not a thread: a running jinja render cannot be stopped from outside (no await points;
it holds the GIL in 5 ms slices), and jinja's sandbox bounds ``range`` but neither loop
nesting nor ``'a' * 10**9``. The pool is pebble's, which replaces a killed worker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import resource
from collections.abc import Sequence
from typing import Any, Final

from kvplane.router.tokens import ChatFormatError, ChatOptions, render_chat
from transformers import AutoTokenizer, PreTrainedTokenizerBase

log = logging.getLogger("kvplane.router.templates")

# vLLM's words (vllm/renderers/online_renderer.py, validate_chat_template)
UNTRUSTED_TEMPLATE: Final = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)
WORKER_MEMORY_BYTES: Final = 1 << 30  # address space a render may add to a worker
WORKERS: Final = 2


def request_template(opts: ChatOptions) -> str | None:
    """The template a request brings: ``chat_template``, or the same key inside
    ``chat_template_kwargs`` (vLLM checks both)."""
    if opts.chat_template is not None:
        return opts.chat_template
    inner = opts.chat_template_kwargs.get("chat_template")
    return inner if inner is not None else None


# -- the worker side ---------------------------------------------------------------
_worker_hf: PreTrainedTokenizerBase | None = None


def _init_worker(path: str) -> None:
    global _worker_hf
    _worker_hf = AutoTokenizer.from_pretrained(path)
    import psutil  # after the imports: the limit is on what a render adds

    limit = psutil.Process().memory_info().vms + WORKER_MEMORY_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _render_in_worker(messages: Sequence[Any], opts: ChatOptions) -> str:
    assert _worker_hf is not None, "worker not initialised"
    try:
        return render_chat(_worker_hf, messages, opts, None)
    except MemoryError:
        raise ChatFormatError("chat template failed: out of memory") from None


def _ready() -> None:
    """A first task, to start a worker."""


class RequestTemplates:
    """Renders request-supplied templates in worker processes, each cut at ``timeout_s``."""

    def __init__(self, tokenizer_path: str, timeout_s: float) -> None:
        from pebble import ProcessPool

        self.timeout_s = timeout_s
        self._pool = ProcessPool(
            max_workers=WORKERS,
            initializer=_init_worker,
            initargs=(str(tokenizer_path),),
            context=multiprocessing.get_context("spawn"),
        )
        # start the workers now (imports, the tokenizer), not on the first request
        # that brings a template
        for _ in range(WORKERS):
            self._pool.schedule(_ready)

    async def render(self, messages: Sequence[Any], opts: ChatOptions) -> str:
        future = self._pool.schedule(_render_in_worker, (messages, opts), timeout=self.timeout_s)
        try:
            result: str = await asyncio.wrap_future(future)
        except concurrent.futures.TimeoutError:
            raise ChatFormatError(
                f"chat template did not render within {self.timeout_s:g} s"
            ) from None
        except ChatFormatError:
            raise
        except Exception as exc:  # a worker that died (memory limit): the pool replaces it
            raise ChatFormatError(f"chat template failed: {type(exc).__name__}") from exc
        return result

    def close(self) -> None:
        self._pool.stop()  # type: ignore[no-untyped-call]
        self._pool.join(timeout=5)
