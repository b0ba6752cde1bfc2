"""Handing a backend the prompt's token ids the router already computed.

The router renders and encodes a prompt to route it; an engine front end that accepts
token ids then skips its own chat template and encode for the requests whose ids the
router has whole when they go (a long prompt no pod holds goes as text:
``RoutingPipeline``). Each form is one entry of ``FORMS``:

* ``dynamo``: Dynamo's frontend takes ``nvext.token_data`` in a chat or completion
  request as the prompt's ids in place of rendering and encoding it (with
  ``--router-mode direct`` it serves the worker the router names by header).

Only a request whose prompt the router encoded from text, one prompt (not a batch,
not given as ids), is rewritten; everything else goes as the client sent it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

import msgspec
from kvplane.router.config import TokenForwarding
from kvplane.router.request import ParsedRequest

# the body again with the ids (msgspec: the ids of a long prompt are a long list)
_encode: Final = msgspec.json.Encoder().encode


def forwardable(req: ParsedRequest) -> bool:
    """A chat, or a completion of one text prompt: what the router encoded from text."""
    if req.kind == "chat":
        return req.messages is not None
    if req.kind != "completions":
        return False
    prompt = req.prompt
    return isinstance(prompt, str) or (
        isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str)
    )


def _dynamo(body: dict[str, Any], tokens: list[int]) -> bytes | None:
    nvext = body.get("nvext", {})
    if not isinstance(nvext, dict):
        return None  # the frontend answers its own 400
    return _encode({**body, "nvext": {**nvext, "token_data": tokens}})


# a form: the body with the ids in it, or None to send the client's own
FORMS: Final[dict[TokenForwarding, Callable[[dict[str, Any], list[int]], bytes | None]]] = {
    TokenForwarding.DYNAMO: _dynamo,
}


def with_token_ids(
    form: TokenForwarding, req: ParsedRequest, raw: bytes, tokens: Sequence[int]
) -> bytes:
    """The body to send: ``raw`` with the prompt's ``tokens`` in ``form``, or ``raw``
    itself where the form is off or the request is not one the router encoded."""
    if form is TokenForwarding.OFF or not forwardable(req):
        return raw
    body = FORMS[form](req.body, tokens if isinstance(tokens, list) else list(tokens))
    return raw if body is None else body
