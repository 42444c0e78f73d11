"""An OpenAI-compatible HTTP server over the serving engine (``tieredkv serve``).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streamed as
server-sent events with ``stream: true``), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text; the names of ``export.py``). docs/openai-server.md has
every supported parameter, what is refused and the server's limits.

This module is the app and the process: the routes, two ASGI guards (a request body that is
JSON and at most ``max_request_bytes``; an unexpected exception answered as a 500 OpenAI
error), and :func:`serve` with its shutdown contract. The wire format is
``openai_protocol.py``; what the endpoints do, ``openai_handlers.py``.

Errors are OpenAI's: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status
for what the client can fix (bad JSON or not JSON, a body over the limit, a bad field, a
sampling value out of range, a prompt longer than the served length, an unknown model), 503
while the engine is not running or the server is stopping, and 500 for anything unexpected
(logged here; the client never sees a traceback).

**Stopping** (SIGINT, SIGTERM, SIGHUP): the server stops taking connections and new requests
(503 ``server_shutting_down``, ``/health`` too), gives the engine requests in flight
``shutdown_timeout`` seconds to finish, then cancels the rest: a plain request still waiting
gets the 503 error body, a stream an error event and ``data: [DONE]``; the engine stops and
the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import math
import secrets
import signal
import socket
import sys
import threading
from typing import Callable

from tieredkv.errors import ConfigError
from tieredkv.runtime.serving.engine import AsyncEngine
from tieredkv.runtime.serving.export import metric_families, prometheus_text
from tieredkv.runtime.serving.openai_protocol import (ChatCompletionRequest, CompletionRequest, OpenAIError,
                                                      ServerUnavailableError, bad_request, is_json_content_type,
                                                      not_running, shutting_down, validation_message)
from tieredkv.runtime.serving.openai_handlers import Frontend, chat_response, completion_response

# after openai_protocol, which turns a missing fastapi into a ServerUnavailableError
from fastapi import Depends, FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("tieredkv.serve")

#: the Prometheus text exposition format's content type
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: seconds a stopping server gives the engine requests in flight before cancelling them
SHUTDOWN_TIMEOUT = 5.0
#: the largest request body accepted, in bytes (``--max-request-bytes``)
MAX_REQUEST_BYTES = 16 * 2**20
#: seconds beyond the grace period uvicorn waits for the cancelled responses to be written
_WRITE_MARGIN = 5.0


# ------------------------------------------------------------------------------ ASGI guards
class RequestTooLarge(StarletteHTTPException):
    """A request body over the limit, found while it is read (no Content-Length)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, too_large(limit).message)
        self.limit = limit


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"the request body is larger than this server accepts ({limit} bytes, set by "
                            "--max-request-bytes); send a shorter prompt or a smaller batch",
                       code="request_too_large")


class _BodyGuard:
    """ASGI middleware for requests with a body: it must be JSON (``Content-Type:
    application/json``, else 415) and at most ``limit`` bytes (else 413, refused from the
    Content-Length before anything is read, or as soon as the bytes read pass it)."""

    def __init__(self, app, limit: int | None) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", ())}
        length = headers.get(b"content-length")
        has_body = b"transfer-encoding" in headers or (length is not None and length.strip() not in (b"", b"0"))
        if has_body:
            kind = headers.get(b"content-type", b"").decode("latin-1")
            if not is_json_content_type(kind):
                got = f"Content-Type {kind!r}" if kind else "no Content-Type"
                await OpenAIError(415, f"the request body must be JSON sent with 'Content-Type: application/json' "
                                       f"(this request has {got})", param=None,
                                  code="unsupported_media_type").response()(scope, receive, send)
                return
        if self.limit is None:
            await self.app(scope, receive, send)
            return
        if length is not None and length.strip().isdigit() and int(length) > self.limit:
            await too_large(self.limit).response()(scope, receive, send)
            return
        limit, seen = self.limit, 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise RequestTooLarge(limit)
            return message

        await self.app(scope, limited, send)


class _Unexpected:
    """ASGI middleware: an unexpected exception is logged here (with its traceback) and answered
    as a 500 with an OpenAI error body that names only its type."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:  # noqa: BLE001 - logged; the client gets an error body
            logger.error("unexpected error serving %s %s", scope.get("method"), scope.get("path"),
                         exc_info=(type(exc), exc, exc.__traceback__))
            if started:  # too late for a status: let the server close the connection
                raise
            body = OpenAIError(500, f"the server had an error processing the request ({type(exc).__name__}); "
                                    "the server log has the details").response()
            await body(scope, receive, send)


# ------------------------------------------------------------------------------ the app
def create_app(engine: AsyncEngine, tokenizer, model_name: str, *, api_key: str | None = None,
               max_request_bytes: int | None = MAX_REQUEST_BYTES) -> FastAPI:
    """The FastAPI app serving ``engine`` (an :class:`AsyncEngine`; the caller starts it and shuts
    it down) under ``model_name``. ``api_key``: the ``/v1`` routes answer 401 without
    ``Authorization: Bearer <api_key>`` (``/health`` and ``/metrics`` stay open);
    ``max_request_bytes``: the largest request body (None: no limit). ``app.state.tieredkv``
    is the :class:`Frontend` (its ``drain`` is the first half of a graceful stop)."""
    if max_request_bytes is not None and (not isinstance(max_request_bytes, int) or max_request_bytes < 1):
        raise ConfigError(f"max_request_bytes must be a positive integer or None, got {max_request_bytes!r}")
    front = Frontend(engine, tokenizer, model_name)
    app = FastAPI(title="tieredkv OpenAI-compatible server", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tieredkv = front

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: HTTPRequest, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestTooLarge)
    async def _too_large(request: HTTPRequest, exc: RequestTooLarge) -> JSONResponse:
        return too_large(exc.limit).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return bad_request(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 404:
            message = f"{request.method} {request.url.path}: not found"
        elif exc.status_code == 405:
            message = f"{request.method} {request.url.path}: method not allowed"
        return JSONResponse(OpenAIError(exc.status_code, message).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    app.add_middleware(_BodyGuard, limit=max_request_bytes)
    app.add_middleware(_Unexpected)

    async def check_key(request: HTTPRequest) -> None:
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise OpenAIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                              type="invalid_request_error", code="invalid_api_key")

    v1 = [Depends(check_key)]

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": front.created, "owned_by": "tieredkv",
                "root": model_name, "parent": None, "max_model_len": front.max_len}

    @app.get("/v1/models", dependencies=v1)
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}", dependencies=v1)
    async def get_model(model: str) -> dict:
        front.check_model(model)
        return model_card()

    @app.get("/health")
    async def health() -> Response:
        if front.draining:
            return shutting_down().response()
        if engine.alive:
            return JSONResponse({"status": "ok"})
        return not_running().response()

    @app.get("/metrics")
    async def metrics() -> Response:
        render = lambda: prometheus_text(metric_families(engine.engine))  # noqa: E731
        if engine.alive:
            try:
                text = await engine.call(render)  # on the engine thread, between two steps
            except ConfigError:  # it stopped meanwhile: nothing moves any more
                text = render()
        else:
            text = render()
        return Response(text, media_type=METRICS_CONTENT_TYPE)

    @app.post("/v1/completions", dependencies=v1)
    async def completions(body: CompletionRequest, request: HTTPRequest) -> Response:
        return await completion_response(front, body, request)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(body: ChatCompletionRequest, request: HTTPRequest) -> Response:
        return await chat_response(front, body, request)

    return app


# ------------------------------------------------------------------------------ serving
def bind_socket(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) TCP socket; port 0 picks a free one. ConfigError when the
    address cannot be bound."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host!r}: cannot resolve the address ({exc})") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot bind {host}:{port} ({exc.strerror or exc}); choose another --port "
                          "(0 picks a free one)") from None
    sock.set_inheritable(True)
    return sock


def _log_config(level: str) -> dict:
    """uvicorn's logging, all of it on stderr (the CLI's contract), plus this module's logger."""
    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    cfg["handlers"]["access"]["stream"] = "ext://sys.stderr"
    cfg["loggers"]["tieredkv"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return cfg


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, with SIGINT / SIGTERM / SIGHUP as a graceful stop that returns
        (uvicorn re-raises the signal after its shutdown; a server that stopped as asked
        exits 0 here). ``on_stop(again)`` is called on the event loop at each signal."""

        stop_signal: int | None = None
        on_stop: Callable[[bool], None] | None = None
        loop: asyncio.AbstractEventLoop | None = None

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            self.loop = asyncio.get_running_loop()
            sigs = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
            previous = {s: signal.signal(s, self._on_signal) for s in sigs}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

        def _on_signal(self, sig, frame) -> None:
            again = self.stop_signal is not None
            if not again:
                self.stop_signal = sig
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            if self.on_stop is not None and self.loop is not None:
                self.loop.call_soon_threadsafe(self.on_stop, again)

    return Server


def serve(engine_args, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          log_level: str = "info", log: Callable[[str], None] | None = None,
          shutdown_timeout: float = SHUTDOWN_TIMEOUT, max_request_bytes: int | None = MAX_REQUEST_BYTES) -> int:
    """``tieredkv serve``: build the engine from ``engine_args`` (an EngineArgs), start it and
    serve the OpenAI API on ``host:port`` until SIGINT / SIGTERM / SIGHUP; then stop as the
    module docstring says (``shutdown_timeout`` seconds of grace; a second signal ends the
    grace at once) and return 0. Once listening it writes ``tieredkv serve: listening on
    http://HOST:PORT`` (the bound port, when ``port`` is 0) through ``log`` (default: stderr)."""
    try:
        import uvicorn
    except ImportError as exc:
        raise ServerUnavailableError(f"tieredkv serve needs uvicorn ({exc}); install it with: pip install "
                                     "'tieredkv[serve]'") from None
    if not isinstance(shutdown_timeout, (int, float)) or isinstance(shutdown_timeout, bool) or \
            not 0 <= shutdown_timeout <= 3600:
        raise ConfigError(f"--shutdown-timeout must be a number of seconds in [0, 3600], got {shutdown_timeout!r}")

    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    sock = bind_socket(host, port)
    try:
        served = engine_args.build(log=log)
        bound = sock.getsockname()
        shown = f"[{bound[0]}]" if sock.family == socket.AF_INET6 else bound[0]
        mode = type(served.engine.cache).__name__
        log(f"tieredkv serve: model {served.model_name} ({mode}, max_model_len {served.engine.scheduler.max_len})")

        async def main() -> int:
            aeng = AsyncEngine(served.engine)
            aeng.start()
            app = create_app(aeng, served.tokenizer, served.model_name, api_key=api_key,
                             max_request_bytes=max_request_bytes)
            front: Frontend = app.state.tieredkv
            config = uvicorn.Config(app, log_config=_log_config(log_level), log_level=log_level, lifespan="off",
                                    access_log=log_level in ("info", "debug"),
                                    timeout_graceful_shutdown=math.ceil(shutdown_timeout + _WRITE_MARGIN))
            server = _server_class()(config)
            hurry = asyncio.Event()  # a second signal: no more grace
            stopping: list[asyncio.Task] = []

            async def stop() -> None:
                running = len(front.in_flight)
                log(f"tieredkv serve: stopping ({signal.Signals(server.stop_signal).name}): no new requests; "
                    f"{running} request(s) in flight get up to {shutdown_timeout:g} s to finish")
                left = await front.drain(shutdown_timeout, hurry)
                if left:
                    log(f"tieredkv serve: cancelling {left} request(s) still running (503 / an error event and "
                        "[DONE] to their clients)")
                await aeng.shutdown()

            def on_stop(again: bool) -> None:
                if not stopping:
                    stopping.append(asyncio.ensure_future(stop()))
                if again:
                    hurry.set()

            server.on_stop = on_stop
            task = asyncio.ensure_future(server.serve(sockets=[sock]))
            try:
                while not server.started and not task.done():
                    await asyncio.sleep(0.02)
                if server.started:
                    log(f"tieredkv serve: listening on http://{shown}:{bound[1]}")
                await task
            finally:
                hurry.set()
                for t in stopping:
                    await t
                await aeng.shutdown()
            if server.stop_signal is not None:
                log(f"tieredkv serve: stopped ({signal.Signals(server.stop_signal).name})")
            if not server.started:
                log("tieredkv serve: the server did not start")
                return 1
            if aeng.error is not None:
                log(f"tieredkv serve: the engine failed: {type(aeng.error).__name__}: {aeng.error}")
                return 1
            return 0

        return asyncio.run(main())
    finally:
        sock.close()


__all__ = ["ChatCompletionRequest", "CompletionRequest", "MAX_REQUEST_BYTES", "METRICS_CONTENT_TYPE", "OpenAIError",
           "SHUTDOWN_TIMEOUT", "ServerUnavailableError", "bind_socket", "create_app", "serve"]
