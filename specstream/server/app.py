"""The FastAPI app: OpenAI routes, /health, /metrics, API-key and body-size guards.

``build_app(llm, ServerConfig(...))`` returns an ASGI app whose lifespan starts and stops the
engine-loop thread; ``specstream serve`` runs it with uvicorn.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from specstream.llm import LLM
from specstream.server import serving
from specstream.server.async_engine import AsyncEngine
from specstream.server.metrics import CONTENT_TYPE, MetricsExporter
from specstream.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    decode_json,
    parse_request,
)


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP side behaves; the engine has its own EngineConfig."""

    # The id clients pass as ``model`` (and /v1/models lists).
    model_name: str
    # With a key, /v1/* needs ``Authorization: Bearer <key>`` (else 401).
    api_key: str | None = None
    # Larger request bodies get 413.
    max_body_bytes: int = 1 << 20
    # Requests that may wait for admission at once; more get 429.
    max_queue: int = 256
    # Seconds a request may wait for admission before a 503.
    queue_timeout_s: float = 60.0
    # Upper bound on ``n`` (choices per prompt).
    max_n: int = 16

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1 or self.max_queue < 1 or self.queue_timeout_s <= 0:
            raise ValueError("max_body_bytes, max_queue and queue_timeout_s must be positive")


def _json_error(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


class GuardMiddleware:
    """Bearer-token check on /v1/* and a Content-Length limit, before any body is read."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.max_body_bytes = app, max_body_bytes
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            err = None
            if self.expected is not None and scope["path"].startswith("/v1"):
                if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                    err = APIError(401, "Invalid or missing API key: send 'Authorization: "
                                        "Bearer <key>'.", code="invalid_api_key")
            length = headers.get(b"content-length", b"0")
            if err is None and length.isdigit() and int(length) > self.max_body_bytes:
                err = _too_large(self.max_body_bytes)
            if err is not None:
                return await _json_error(err)(scope, receive, send)
        await self.app(scope, receive, send)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than the server's limit of {limit} bytes.",
                    code="request_too_large")


async def _read_json(request: Request, limit: int) -> Any:
    """The body as JSON; bodies without Content-Length are counted as they arrive.

    A Content-Type other than JSON is a 415; none at all is read as JSON, as vLLM and OpenAI
    do (``curl --data-binary`` and hand-written clients often send none).
    """
    ctype = request.headers.get("content-type", "").strip()
    media = ctype.split(";", 1)[0].strip().lower()
    if media and media != "application/json" and not (
            media.startswith("application/") and media.endswith("+json")):
        raise APIError(415, f"Unsupported Content-Type {ctype[:100]!r}: send the body as JSON "
                            "with 'Content-Type: application/json'.",
                       code="unsupported_media_type")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    return decode_json(bytes(body))


SubmitHook = Callable[[Any, Any], dict[str, str]]  # (job, parsed request) -> response headers


def openai_app(
    config: ServerConfig,
    tok: Any,
    max_len: int,
    backend: Any,
    health: Callable[[], Awaitable[JSONResponse]],
    metrics: Callable[[], Awaitable[bytes]],
    on_submit: SubmitHook | None = None,
    **fastapi_kwargs: Any,
) -> FastAPI:
    """The OpenAI routes over ``backend`` (anything ``serving.submit/stream/collect`` accept:
    the local :class:`AsyncEngine`, or the Ray ingress's replica pool).

    Endpoints are plain Starlette routes, so callers that import FastAPI lazily can use it.
    """
    app = FastAPI(docs_url=None, redoc_url=None, **fastapi_kwargs)
    app.add_middleware(GuardMiddleware, api_key=config.api_key,
                       max_body_bytes=config.max_body_bytes)
    created = int(time.time())

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return _json_error(exc)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return _json_error(APIError(exc.status_code, str(exc.detail)))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)

    def check_common(req: Any) -> None:
        if req.model != config.model_name:
            raise APIError(404, f"The model `{req.model}` does not exist; this server serves "
                                f"`{config.model_name}`.", param="model", code="model_not_found")
        if not 1 <= req.n <= config.max_n:
            raise APIError(400, f"n must be in [1, {config.max_n}], got {req.n}", param="n")

    async def respond(request: Request, req: Any, kind: str, prompts: list[list[int]],
                      param: str) -> Any:
        total = len(prompts) * req.n
        if total > config.max_queue:  # not "busy" (429): retrying could never help
            raise APIError(400, f"This request asks for {total} completions ({len(prompts)} "
                                f"prompt(s) x n={req.n}), more than the server ever queues at "
                                f"once (--max-queue {config.max_queue}); send fewer prompts "
                                "or a smaller n.", param="n" if req.n > 1 else param)
        params = [serving.sampling_params(req, len(p), max_len, param) for p in prompts]
        usage = bool(req.stream_options and req.stream_options.include_usage)
        stops = tuple(params[0].stop or ())  # normalised to a tuple by SamplingParams
        job = serving.new_job(kind, req.model, [len(p) for p in prompts], stops, usage,
                              request.headers.get("x-request-id"))
        await serving.submit(backend, job, prompts, params)
        try:
            headers = on_submit(job, req) if on_submit is not None else {}
            if req.stream:
                return serving.JobStream(backend, job, headers)
            return JSONResponse(await serving.collect(backend, job, request), headers=headers)
        except BaseException:
            serving.close(backend, job)
            raise

    async def completions(request: Request) -> Any:
        req = parse_request(CompletionRequest, await _read_json(request, config.max_body_bytes))
        assert isinstance(req, CompletionRequest)
        check_common(req)
        return await respond(request, req, "completion", _encode_prompts(req.prompt, tok),
                             "prompt")

    async def chat(request: Request) -> Any:
        req = parse_request(ChatCompletionRequest,
                            await _read_json(request, config.max_body_bytes))
        check_common(req)
        if tok is None or not tok.chat_template:
            raise APIError(400, "This model has no chat template; use /v1/completions.")
        assert isinstance(req, ChatCompletionRequest)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            # the template writes any BOS itself, so no special tokens are added here
            ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
        except Exception as exc:  # a template's raise_exception(), e.g. a bad role order
            raise APIError(400, f"The chat template rejected the messages: {exc}",
                           param="messages") from None
        return await respond(request, req, "chat", [ids], "messages")

    async def models(request: Request) -> JSONResponse:
        card = _model_card(config.model_name, created, max_len)
        return JSONResponse({"object": "list", "data": [card]})

    async def model(request: Request) -> JSONResponse:
        model_id = request.path_params["model_id"]
        if model_id != config.model_name:
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model",
                           code="model_not_found")
        return JSONResponse(_model_card(model_id, created, max_len))

    async def health_route(request: Request) -> JSONResponse:
        return await health()

    async def metrics_route(request: Request) -> Response:
        return Response(await metrics(), media_type=CONTENT_TYPE)

    for path, endpoint, method in [
        ("/v1/completions", completions, "POST"), ("/v1/chat/completions", chat, "POST"),
        ("/v1/models", models, "GET"), ("/v1/models/{model_id}", model, "GET"),
        ("/health", health_route, "GET"), ("/metrics", metrics_route, "GET"),
    ]:
        app.add_route(path, endpoint, methods=[method])
    return app


def build_app(llm: LLM, config: ServerConfig) -> FastAPI:
    """An OpenAI-compatible app over ``llm``; the engine thread lives as long as the app runs."""
    engine = AsyncEngine(llm, config.max_queue, config.queue_timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.shutdown()

    async def health() -> JSONResponse:
        if not engine.alive:
            return JSONResponse({"status": "error", "error": engine.error}, status_code=503)
        return JSONResponse({"status": "ok"})

    exporter = MetricsExporter(config.model_name)

    async def metrics() -> bytes:
        return exporter.render([engine.metrics.snapshot(engine.num_pending)])

    app = openai_app(config, llm.engine.tokenizer, llm.engine.max_model_len, engine, health,
                     metrics, title="SpecStream", lifespan=lifespan)
    app.state.engine = engine
    app.state.config = config
    return app


def _model_card(name: str, created: int, max_len: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "specstream",
            "max_model_len": max_len}


def _encode_prompts(prompt: Any, tok: Any) -> list[list[int]]:
    """``prompt`` as token-id lists: text, token ids, or a list of either."""
    items = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) \
        else list(prompt)
    if not items:
        raise APIError(400, "prompt is empty.", param="prompt")
    out = []
    for p in items:
        if isinstance(p, str):
            if tok is None:
                raise APIError(400, "This model has no tokenizer: send token ids.",
                               param="prompt")
            p = tok.encode(p)
        if not p:
            raise APIError(400, "prompt is empty: give at least one token.", param="prompt")
        out.append(list(p))
    return out
