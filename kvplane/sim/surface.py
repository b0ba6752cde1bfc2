"""The simulated engine's OpenAI surface beyond completions and chat: ``/v1/embeddings``,
``/v1/score`` (and ``/score``), ``/v1/rerank`` (``/rerank``, ``/v2/rerank``) and
``/v1/responses``.

Pooling answers (embeddings, scores) are computed at once from the token ids, not
scheduled (the simulator's engine core models generation alone), and served only by an
engine configured as pooling (``SimEngineConfig.pooling``): vLLM serves them only with a
pooling model (``--runner pooling``) and answers 404 for a generative one. A simulated
pooling engine still generates (a real one would not). A response is generated like a
chat completion of its messages; with ``store`` (the default) it is kept in this
process, as vLLM keeps it (``VLLM_ENABLE_RESPONSES_API_STORE=1``), so only this engine
can continue it (``previous_response_id``; an id it does not hold is vLLM's 404).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Final

from kvplane.sim import openai_api as api
from kvplane.sim import surface_api as sa
from kvplane.sim.httpd import Request, Response, StreamingResponse

if TYPE_CHECKING:
    from kvplane.sim.server import SimEngine, _Gen

MAX_STORED: Final = 10_000  # responses kept per engine (the oldest go first)
RESPONSE_PREFIX: Final = "/v1/responses/"  # GET /v1/responses/{id}: a stored response

Routes = dict[tuple[str, str], Callable[[Request], Any]]


def register(engine: SimEngine, routes: Routes) -> None:
    s = Surface(engine)
    routes["POST", "/v1/responses"] = s.responses
    routes["GET", RESPONSE_PREFIX + "{id}"] = s.retrieve
    if not engine.cfg.pooling:
        return
    routes["POST", "/v1/embeddings"] = s.embeddings
    for path in ("/v1/score", "/score"):
        routes["POST", path] = s.score
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        routes["POST", path] = s.rerank


def _hex() -> str:
    return uuid.uuid4().hex


class Surface:
    def __init__(self, engine: SimEngine) -> None:
        self.e = engine
        # response id -> its conversation (input messages and the answer), its body
        self.stored: OrderedDict[str, tuple[list[dict[str, str]], dict[str, Any]]] = OrderedDict()

    async def _request(self, req: Request) -> dict[str, Any]:
        obj = api.parse_json_object(req.body)
        api.check_model(obj, self.e.cfg.model)
        return obj

    async def _ids(self, value: Any, param: str) -> list[list[int]]:
        """Text, token ids, or a batch of either, as token ids (else vLLM's 400)."""
        try:
            prompts = api.parse_prompts(value)
        except api.ApiError:
            raise api.ApiError(400, f"'{param}' must be text or token ids", param=param) from None
        out: list[list[int]] = []
        for p in prompts:
            if isinstance(p, str):
                out.append(await self.e.encode_text(p, True))
            else:
                self.e.check_ids(p)
                out.append(p)
        return out

    async def embeddings(self, req: Request) -> Response:
        obj = await self._request(req)
        if "input" not in obj:
            raise api.ApiError(400, "Field required: input", param="input")
        batch = await self._ids(obj["input"], "input")
        dims = obj.get("dimensions")
        if dims is not None and (type(dims) is not int or not 0 < dims <= sa.EMBED_DIM):
            raise api.ApiError(400, f"dimensions must be in 1..{sa.EMBED_DIM}", param="dimensions")
        vectors = [sa.embedding(ids, dims) for ids in batch]
        tokens = sum(len(ids) for ids in batch)
        body = sa.embedding_response(
            f"embd-{_hex()}", int(time.time()), self.e.cfg.model, vectors, tokens
        )
        return api.json_response(body)

    async def score(self, req: Request) -> Response:
        obj = await self._request(req)
        for a, b in (
            ("queries", "documents"),
            ("queries", "items"),
            ("data_1", "data_2"),
            ("text_1", "text_2"),
        ):
            if a in obj and b in obj:
                break
        else:
            raise api.ApiError(400, "Field required: queries, documents", param="queries")
        left = await self._ids(obj[a], a)
        right = await self._ids(obj[b], b)
        if len(left) == 1:
            left = left * len(right)
        if len(left) != len(right):
            raise api.ApiError(400, f"'{a}' must have one item or as many as '{b}'", param=a)
        scores = [sa.similarity(x, y) for x, y in zip(left, right, strict=True)]
        tokens = sum(len(x) + len(y) for x, y in zip(left, right, strict=True))
        body = sa.score_response(
            f"score-{_hex()}", int(time.time()), self.e.cfg.model, scores, tokens
        )
        return api.json_response(body)

    async def rerank(self, req: Request) -> Response:
        obj = await self._request(req)
        query = obj.get("query")
        if not isinstance(query, str):
            raise api.ApiError(400, "Field required: query (a string)", param="query")
        docs = sa.texts(obj.get("documents"), "documents")
        top_n = obj.get("top_n") or 0
        if type(top_n) is not int or top_n < 0:
            raise api.ApiError(400, "top_n must be a non-negative integer", param="top_n")
        q = await self.e.encode_text(query, True)
        scored: list[tuple[int, str, float]] = []
        tokens = 0
        for i, doc in enumerate(docs):
            d = await self.e.encode_text(doc, True)
            tokens += len(q) + len(d)
            scored.append((i, doc, sa.similarity(q, d)))
        scored.sort(key=lambda r: -r[2])
        ranked = scored[:top_n] if top_n else scored
        body = sa.rerank_response(f"rerank-{_hex()}", self.e.cfg.model, ranked, tokens)
        return api.json_response(body)

    # ---- /v1/responses ---------------------------------------------------------------

    async def responses(self, req: Request) -> Response | StreamingResponse:
        e = self.e
        if e.dead:
            raise api.ApiError(500, f"engine is dead: {e.dead}", "InternalServerError")
        p = sa.parse_responses(await self._request(req))
        history: list[dict[str, str]] = []
        if p.previous_response_id is not None:
            found = self.stored.get(p.previous_response_id)
            if found is None:
                raise sa.response_not_found(p.previous_response_id)
            # as vLLM: instructions do not carry over to the next response
            history = [m for m in found[0] if m.get("role") != "system"]
        # vLLM's order: the new instructions, the stored conversation, the new input
        system = p.messages[:1] if p.instructions else []
        turn = history + p.messages[len(system) :]
        ids = await e.encode_chat(system + turn, {})
        max_tokens = api.effective_max_tokens(
            p.max_output_tokens, len(ids), e.max_model_len, chat=True
        )
        rid = f"resp_{_hex()}"
        gen = e.start_generation(ids, max_tokens, rid)
        head = sa.ResponseHead(rid, f"msg_{_hex()}", int(time.time()), e.cfg.model, max_tokens, p)
        if p.stream:
            return StreamingResponse(self._stream(gen, head, turn))
        try:
            while gen.open_subs > 0:
                await gen.wait()
        except asyncio.CancelledError:
            e.abort(gen)
            raise
        text, status, usage = self._outcome(gen)
        body = sa.responses_response(head, status, [sa.output_message(head.msg_id, text)], usage)
        self._store(head, turn, text, body)
        return api.json_response(body)

    async def retrieve(self, req: Request) -> Response:
        rid = req.path[len(RESPONSE_PREFIX) :]
        found = self.stored.get(rid)
        if found is None:
            raise sa.response_not_found(rid)
        return api.json_response(found[1])

    def _outcome(self, gen: _Gen) -> tuple[str, str, dict[str, Any]]:
        sub = gen.subs[0]
        status = "incomplete" if sub.finish == "length" else "completed"
        usage = sa.responses_usage(sub.prompt_len, sub.cached, sub.n_out)
        return self.e.out.text * sub.n_out, status, usage

    def _store(
        self, head: sa.ResponseHead, turn: list[dict[str, str]], text: str, body: dict[str, Any]
    ) -> None:
        if not head.params.store:
            return
        self.stored[head.rid] = ([*turn, {"role": "assistant", "content": text}], body)
        while len(self.stored) > MAX_STORED:
            self.stored.popitem(last=False)

    async def _stream(
        self, gen: _Gen, head: sa.ResponseHead, turn: list[dict[str, str]]
    ) -> AsyncIterator[bytes]:
        events = sa.ResponseEvents(head)
        token = self.e.out.text
        sub = gen.subs[0]
        try:
            yield events.opening()
            while True:
                if gen.open_subs > 0 and sub.n_out == sub.n_sent:
                    await gen.wait()
                pending = sub.n_out - sub.n_sent
                sub.n_sent = sub.n_out
                if pending > 0:
                    yield events.delta(token * pending)
                if gen.open_subs <= 0 and sub.n_out == sub.n_sent:
                    break
            text, status, usage = self._outcome(gen)
            message = sa.output_message(head.msg_id, text)
            self._store(head, turn, text, sa.responses_response(head, status, [message], usage))
            yield events.closing(text, status, usage)
        finally:
            self.e.abort(gen)
