"""The FastAPI app: OpenAI routes, vLLM's extra routes, /health, /metrics, API-key and
body-size guards.

``build_app(llm, ServerConfig(...))`` returns an ASGI app whose lifespan starts and stops the
engine-loop thread; ``specstream serve`` runs it with uvicorn. Besides /v1/completions,
/v1/chat/completions and /v1/models it serves vLLM's /tokenize, /detokenize, /tokenizer_info
(lm-evaluation-harness's remote tokenizer reads it), /version and /ping.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from specstream import __version__
from specstream.llm import LLM
from specstream.server import serving
from specstream.server.async_engine import AsyncEngine
from specstream.server.errors import APIError
from specstream.server.metrics import CONTENT_TYPE, MetricsExporter
from specstream.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from specstream.server.request_body import decode_json, parse_request
from specstream.server.request_params import render, sampling_params
from specstream.server.stream import JobStream

# generation_config.json's sampling fields that become request defaults (vLLM's list;
# max_new_tokens arrives as max_tokens)
DEFAULT_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                         "max_tokens")


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
    # Replaces the tokenizer's chat template (--chat-template).
    chat_template: str | None = None
    # Defaults of the sampling fields a request leaves unset (--generation-config): keys of
    # DEFAULT_SAMPLING_KEYS.
    default_sampling: Mapping[str, float | int] = field(default_factory=dict)
    # usage.prompt_tokens_details.cached_tokens (vLLM's --enable-prompt-tokens-details).
    enable_prompt_tokens_details: bool = False

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1 or self.max_queue < 1 or self.queue_timeout_s <= 0:
            raise ValueError("max_body_bytes, max_queue and queue_timeout_s must be positive")
        unknown = sorted(set(self.default_sampling) - set(DEFAULT_SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"default_sampling takes {', '.join(DEFAULT_SAMPLING_KEYS)}; got "
                             f"{', '.join(unknown)}")


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
    *,
    vocab_size: int | None = None,
    **fastapi_kwargs: Any,
) -> FastAPI:
    """The OpenAI routes over ``backend`` (anything ``serving.submit/collect`` and
    ``JobStream`` accept: the local :class:`AsyncEngine`, or the Ray ingress's replica pool).
    ``vocab_size`` (the model's) bounds the token ids of ``logit_bias``; None leaves that to
    the engine.

    Endpoints are plain Starlette routes, so callers that import FastAPI lazily can use it.
    """
    app = FastAPI(docs_url=None, redoc_url=None, **fastapi_kwargs)
    app.add_middleware(GuardMiddleware, api_key=config.api_key,
                       max_body_bytes=config.max_body_bytes)
    created = int(time.time())
    template = config.chat_template or (tok.chat_template if tok is not None else None)

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return _json_error(exc)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return _json_error(APIError(exc.status_code, str(exc.detail)))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)

    def check_model(name: str | None) -> None:
        if name is not None and name != config.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                                f"`{config.model_name}`.", param="model", code="model_not_found")

    def check_common(req: Any) -> None:
        check_model(req.model)
        if not 1 <= req.n <= config.max_n:
            raise APIError(400, f"n must be in [1, {config.max_n}], got {req.n}", param="n")

    def render_chat(req: Any) -> list[int]:
        """The request's messages through the chat template, as token ids."""
        if tok is None or not template:
            raise APIError(400, "This model has no chat template; use /v1/completions (or "
                                "start the server with --chat-template).")
        messages, kwargs = req.render_args()
        try:
            text = tok.apply_chat_template(messages, chat_template=template, **kwargs)
        except Exception as exc:  # a template's raise_exception(), e.g. a bad role order
            raise APIError(400, f"The chat template rejected the messages: {exc}",
                           param="messages") from None
        # the template writes any BOS itself: special tokens only where the request asks
        return tok.encode(text, add_special_tokens=req.add_special_tokens)

    async def respond(request: Request, req: Any, kind: str, prompts: list[list[int]],
                      texts: list[str | None], param: str) -> Any:
        total = len(prompts) * req.n
        if total > config.max_queue:  # not "busy" (429): retrying could never help
            raise APIError(400, f"This request asks for {total} completions ({len(prompts)} "
                                f"prompt(s) x n={req.n}), more than the server ever queues at "
                                f"once (--max-queue {config.max_queue}); send fewer prompts "
                                "or a smaller n.", param="n" if req.n > 1 else param)
        params = [sampling_params(req, len(p), max_len, param, config.default_sampling,
                                  vocab_size) for p in prompts]
        stops = tuple(params[0].stop or ())  # normalised to a tuple by SamplingParams
        job = serving.new_job(kind, req.model, prompts, texts, req.n, stops,
                              render(req, tok, config.enable_prompt_tokens_details),
                              req.stream and req.include_usage,
                              request.headers.get("x-request-id") or req.request_id)
        await serving.submit(backend, job, prompts, params)
        try:
            headers = on_submit(job, req) if on_submit is not None else {}
            if req.stream:
                return JobStream(backend, job, headers)
            return JSONResponse(await serving.collect(backend, job, request), headers=headers)
        except BaseException:
            serving.close(backend, job)
            raise

    async def completions(request: Request) -> Any:
        req = parse_request(CompletionRequest, await _read_json(request, config.max_body_bytes))
        check_common(req)
        prompts, texts = _encode_prompts(req.prompt, tok, req.add_special_tokens)
        return await respond(request, req, "completion", prompts, texts, "prompt")

    async def chat(request: Request) -> Any:
        req = parse_request(ChatCompletionRequest,
                            await _read_json(request, config.max_body_bytes))
        check_common(req)
        return await respond(request, req, "chat", [render_chat(req)], [None], "messages")

    async def tokenize(request: Request) -> JSONResponse:
        data = await _read_json(request, config.max_body_bytes)
        chat_form = isinstance(data, dict) and "messages" in data
        req = parse_request(TokenizeChatRequest if chat_form else TokenizeCompletionRequest,
                            data)
        check_model(req.model)
        if tok is None:
            raise APIError(400, "This model has no tokenizer.")
        ids = render_chat(req) if chat_form else tok.encode(
            req.prompt, add_special_tokens=req.add_special_tokens)
        strs = [tok.token_str(t) for t in ids] if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": max_len, "tokens": ids,
                             "token_strs": strs})

    async def detokenize(request: Request) -> JSONResponse:
        req = parse_request(DetokenizeRequest, await _read_json(request, config.max_body_bytes))
        check_model(req.model)
        if tok is None:
            raise APIError(400, "This model has no tokenizer.")
        bad = [t for t in req.tokens if not 0 <= t < tok.vocab_size]
        if bad:
            raise APIError(400, f"token ids outside the vocabulary [0, {tok.vocab_size}): "
                                f"{bad[:5]}", param="tokens")
        return JSONResponse({"prompt": tok.decode(req.tokens, skip_special_tokens=False)})

    async def tokenizer_info(request: Request) -> JSONResponse:
        if tok is None:
            raise APIError(404, "This model has no tokenizer.")
        return JSONResponse(_tokenizer_info(tok, template))

    async def version(request: Request) -> JSONResponse:
        return JSONResponse({"version": __version__})

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

    for path, endpoint, methods in [
        ("/v1/completions", completions, ["POST"]), ("/v1/chat/completions", chat, ["POST"]),
        ("/v1/models", models, ["GET"]), ("/v1/models/{model_id}", model, ["GET"]),
        ("/tokenize", tokenize, ["POST"]), ("/detokenize", detokenize, ["POST"]),
        ("/tokenizer_info", tokenizer_info, ["GET"]), ("/version", version, ["GET"]),
        ("/health", health_route, ["GET"]), ("/ping", health_route, ["GET", "POST"]),
        ("/metrics", metrics_route, ["GET"]),
    ]:
        app.add_route(path, endpoint, methods=methods)
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
                     metrics, vocab_size=llm.engine.model_config.vocab_size,
                     title="SpecStream", lifespan=lifespan)
    app.state.engine = engine
    app.state.config = config
    return app


def _model_card(name: str, created: int, max_len: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "specstream",
            "max_model_len": max_len}


def _encode_prompts(prompt: Any, tok: Any, add_special_tokens: bool = True
                    ) -> tuple[list[list[int]], list[str | None]]:
    """``prompt`` as token-id lists (text, token ids, or a list of either), and each prompt's
    text (None where it came as token ids)."""
    items = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) \
        else list(prompt)
    if not items:
        raise APIError(400, "prompt is empty.", param="prompt")
    out, texts = [], []
    for p in items:
        texts.append(p if isinstance(p, str) else None)
        if isinstance(p, str):
            if tok is None:
                raise APIError(400, "This model has no tokenizer: send token ids.",
                               param="prompt")
            p = tok.encode(p, add_special_tokens=add_special_tokens)
        if not p:
            raise APIError(400, "prompt is empty: give at least one token.", param="prompt")
        out.append(list(p))
    return out, texts


def _tokenizer_info(tok: Any, template: str | None) -> dict[str, Any]:
    """vLLM's /tokenizer_info: the tokenizer's configuration (tokenizer_config.json, special
    tokens as their text), with the chat template in use. lm-evaluation-harness's remote
    tokenizer reads ``eos_token``, ``bos_token``, ``pad_token`` and ``chat_template``."""
    info = {k: _plain(v) for k, v in tok.config.items()
            if k not in ("vocab_file", "merges_file", "tokenizer_file")}
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info.setdefault(key, None)
    info["chat_template"] = template
    return info


def _plain(value: Any) -> Any:
    """Serialised AddedTokens (``{"content": ..., "special": ...}``) as their text."""
    if isinstance(value, dict):
        return value["content"] if "content" in value else {k: _plain(v)
                                                             for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
