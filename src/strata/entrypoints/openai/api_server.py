"""The FastAPI app of `strata serve` and the uvicorn server that runs it.

Every error leaves as OpenAI's error schema: validation errors become 400s naming the parameter (never
pydantic's internals), unknown routes 404, wrong methods 405 with `Allow`, and anything unexpected a 500
that does not touch the engine. A small ASGI guard in front of the app answers 503 while shutting down,
401 without the API key, and 413 for oversized bodies (declared, or found so while reading a chunked
one), and counts responses by status for the metrics.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import secrets
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from strata import __version__
from strata.engine.engine_client import EngineClient
from strata.entrypoints.openai.metrics import ServerMetrics
from strata.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    OpenAIError,
    TokenizeRequest,
    TokenizeResponse,
    error_body,
)
from strata.entrypoints.openai.server_config import ServerConfig
from strata.entrypoints.openai.serving import OpenAIServing
from strata.entrypoints.openai.serving_chat import OpenAIServingChat
from strata.entrypoints.openai.serving_completion import OpenAIServingCompletion

__all__ = ["ServerConfig", "build_app", "freeze_startup_heap", "run_server"]

logger = logging.getLogger("strata.server")

OPEN_PATHS = frozenset({"/health"})


class BodyTooLarge(Exception):
    """The body being read grew past the limit."""


class GuardMiddleware:
    """Shutdown, auth and body-size checks before any routing or parsing; status counting after.

    The body is read here, counting bytes as they arrive, and handed to the app in one piece: a chunked
    body (no Content-Length) is refused as soon as it passes the limit, not after all of it was read.
    """

    def __init__(self, app: FastAPI, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.app = app
        self.config = config
        self.metrics = metrics
        # Metric labels use known routes only, so random paths cannot blow up the label set.
        self.routes = frozenset(route.path for route in app.routes if isinstance(route, APIRoute))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        endpoint = path if path in self.routes else "other"
        status_seen: list[int] = []

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_seen.append(message["status"])
            await send(message)

        rejection = self._rejection(scope)
        try:
            if rejection is None:
                try:
                    replay = await self._read_body(receive)
                except BodyTooLarge:
                    rejection = self._too_large()
                else:
                    if replay is None:  # the client left while sending: nobody to answer
                        return
                    receive = replay
            if rejection is not None:
                status, message, code = rejection
                # The rest of an oversized body is never read, so the connection cannot be reused.
                headers = {"Connection": "close"} if status == 413 else None
                response = JSONResponse(
                    error_body(status, message, code=code), status_code=status, headers=headers
                )
                await response(scope, receive, counting_send)
            else:
                await self.app(scope, receive, counting_send)
        finally:
            status_label = str(status_seen[0]) if status_seen else "disconnected"
            self.metrics.http_requests.labels(endpoint=endpoint, status=status_label).inc()

    def _rejection(self, scope: Scope) -> tuple[int, str, str] | None:
        """(status, message, code) of a request refused before the app sees it, else None."""
        if self.config.shutting_down:
            return 503, "the server is shutting down", "service_unavailable"
        headers = dict(scope["headers"])
        if self.config.api_key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            expected = f"Bearer {self.config.api_key}".encode()
            if not secrets.compare_digest(given, expected):
                return (
                    401,
                    "Incorrect or missing API key: send 'Authorization: Bearer KEY'",
                    "invalid_api_key",
                )
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.config.max_body_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> tuple[int, str, str]:
        return (
            413,
            f"the request body must be at most {self.config.max_body_bytes} bytes",
            "request_too_large",
        )

    async def _read_body(self, receive: Receive) -> Receive | None:
        """Read the whole body (at most the limit, else BodyTooLarge); return a `receive` that replays it
        and then passes on what the client does next (a disconnect), or None if the client left."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.config.max_body_bytes:
                raise BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        first: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return first

        return replay


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A short message and the top-level parameter it is about, from pydantic's first error."""
    errors = exc.errors()
    # In a union (`prompt`: text or token ids) a value error is from the member whose type matched.
    error = next((e for e in errors if e.get("type") == "value_error"), errors[0] if errors else {})
    if error.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    loc = [part for part in error.get("loc", ()) if part != "body"]
    if not loc or not isinstance(loc[0], str):
        return "the request body must be a JSON object with the endpoint's fields", None
    if error.get("type") == "extra_forbidden":
        path = ".".join(str(part) for part in loc)
        return f"{path}: this server does not support this field", loc[0]
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{loc[0]}: {message}", loc[0]


def build_app(engine: EngineClient, config: ServerConfig) -> ASGIApp:
    metrics = ServerMetrics(config.model_names[0])
    completions = OpenAIServingCompletion(engine, config, metrics)
    chat = OpenAIServingChat(engine, config, metrics)
    base = OpenAIServing(engine, config, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            config.shutting_down = True
            await engine.shutdown()

    app = FastAPI(title="Strata", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.response().model_dump(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(400, message, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # The exception's headers carry `Allow` on a 405.
        return JSONResponse(
            error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving a request")
        return JSONResponse(error_body(500, f"internal server error: {type(exc).__name__}"), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return JSONResponse(error_body(503, "the engine is not running"), status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(engine.stats), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        """The engine's counters (forward passes, batch sizes, KV blocks): for tests and debugging. A
        data-parallel engine adds them up and lists each replica's under "replicas"."""
        return engine.stats

    def model_card(name: str) -> ModelCard:
        return ModelCard(id=name, root=config.model_path, max_model_len=engine.max_model_len)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[model_card(name) for name in config.model_names])

    # `:path`, as served names may hold slashes ("org/model").
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        base.check_model(model_id)
        return model_card(model_id)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        base.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError(400, "give exactly one of 'prompt' or 'messages'", "prompt")
        if engine.tokenizer is None:
            raise OpenAIError(400, "this server has no tokenizer", "prompt")
        if request.messages is not None:
            _, ids = await base.render_chat(request, request.messages)
        else:
            assert request.prompt is not None
            ids = await base.encode_text(request.prompt, request.add_special_tokens is not False)
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        base.check_model(request.model)
        if engine.tokenizer is None:
            raise OpenAIError(400, "this server has no tokenizer", "tokens")
        return DetokenizeResponse(prompt=await base.decode_tokens(request.tokens))

    @app.post("/v1/completions", response_model=None)
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Any:
        return await completions.create(request, raw_request)

    @app.post("/v1/chat/completions", response_model=None)
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Any:
        return await chat.create(request, raw_request)

    return GuardMiddleware(app, config, metrics)


# After the shutdown timeout has ended the engine's requests, the seconds their responses get to finish
# (an error event and `[DONE]` for streams) before uvicorn cuts the connections.
SHUTDOWN_GRACE_S = 5.0


class _Server(uvicorn.Server):
    """uvicorn, plus: flag the app as shutting down on the first signal, end the engine's requests at the
    shutdown timeout (so their clients get an error, not a cut connection), and say when it is ready."""

    def __init__(
        self,
        uvicorn_config: uvicorn.Config,
        server_config: ServerConfig,
        engine: EngineClient,
        shutdown_timeout: float,
    ) -> None:
        super().__init__(uvicorn_config)
        self.server_config = server_config
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self._engine_stop: asyncio.Task[None] | None = None
        # An engine that failed for good (a dead tensor-parallel rank, every data-parallel replica dead)
        # stops the server; it exits non-zero.
        engine.on_failure = self.stop_after_failure

    def stop_after_failure(self) -> None:
        self.server_config.shutting_down = True
        self.should_exit = True

    async def shutdown(self, sockets: Any = None) -> None:
        def stop_engine() -> None:
            self._engine_stop = asyncio.ensure_future(self.engine.shutdown())

        timer = asyncio.get_running_loop().call_later(self.shutdown_timeout, stop_engine)
        try:
            await super().shutdown(sockets=sockets)
        finally:
            timer.cancel()

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.server_config.shutting_down = True
        super().handle_exit(sig, frame)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            print(f"strata: serving {self.server_config.model_names[0]} at http://{host}:{port}", flush=True)


def freeze_startup_heap() -> int:
    """Collect the garbage of startup, then take every object alive (the engine's modules, compiled graphs,
    tokenizer) out of the cyclic garbage collector's generations (`gc.freeze`), and return how many. Each
    full pass of the collector walks every object it tracks while the engine waits, hundreds of thousands
    for a compiled engine, and none once they are frozen. Only for a process
    that serves one engine for its whole life: a frozen object that later becomes cyclic garbage stays."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info(
        "froze %d startup objects out of the garbage collector's passes (a full pass over them took %.0f ms)",
        frozen,
        (time.perf_counter() - start) * 1e3,
    )
    return frozen


def run_server(
    engine: EngineClient, config: ServerConfig, host: str, port: int, shutdown_timeout: float
) -> None:
    """Serve until SIGINT/SIGTERM; in-flight requests get `shutdown_timeout` seconds, then are aborted
    (a stream ends with an error event and `[DONE]`, a waiting client gets a 503). An engine that fails
    for good stops it too (`engine.failure` then says why)."""
    app = build_app(engine, config)
    freeze_startup_heap()
    uvicorn_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=logging.getLogger().getEffectiveLevel(),
        access_log=False,
        timeout_graceful_shutdown=shutdown_timeout + SHUTDOWN_GRACE_S,
    )
    # uvicorn re-raises the signal it caught into the previous handler after shutting down; a no-op
    # handler there makes a graceful shutdown exit 0 instead of dying of the signal.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    _Server(uvicorn_config, config, engine, shutdown_timeout).run()
