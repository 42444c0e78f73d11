"""An OpenAI-compatible HTTP server over the serving engine (``tieredkv serve``).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streamed as
server-sent events with ``stream: true``), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text; the names of ``export.py``). docs/openai-server.md has
every supported parameter and what is refused.

One HTTP request is one or more engine requests (a batch of completion prompts) on the
:class:`~tieredkv.runtime.serving.engine.AsyncEngine`; the engine thread calls back into
the event loop with the tokens. A client that goes away cancels its engine requests: a
stream when the connection closes (the response listens for the disconnect while it
streams), a plain request while it waits for the completion; their pages are released as
for any cancelled request.

Errors are OpenAI's: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status
for what the client can fix (bad JSON, a bad field, a sampling value out of range, a prompt
longer than the served length, an unknown model), 503 while the engine is not running, and
500 for anything unexpected (logged here; the client never sees a traceback).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import secrets
import signal
import socket
import sys
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable, Sequence, Union

from tieredkv.errors import (ConfigError, ContextLengthError, KVCacheFullError, TieredKVError, UnsupportedModelError,
                             short)
from tieredkv.runtime.sampling import SamplingParams
from tieredkv.runtime.serving.engine import AsyncEngine
from tieredkv.runtime.serving.export import metric_families, prometheus_text


class ServerUnavailableError(TieredKVError, ImportError):
    """The server's dependencies (fastapi, uvicorn) are not installed."""


try:
    from fastapi import Depends, FastAPI, Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from pydantic import BaseModel, ConfigDict
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as exc:  # the CLI prints this as `error: ...`
    raise ServerUnavailableError(f"the OpenAI-compatible server needs fastapi and uvicorn ({exc}); install them "
                                 "with: pip install 'tieredkv[serve]'") from None

logger = logging.getLogger("tieredkv.serve")

#: the engine's finish reasons that end a choice normally, as OpenAI names them
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
#: the Prometheus text exposition format's content type
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: seconds a stopping server gives the responses in flight before cancelling them
GRACEFUL_TIMEOUT = 5


# ------------------------------------------------------------------------------ errors
class OpenAIError(Exception):
    """An error answered as OpenAI does: ``status`` and ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def _is_union_tag(part) -> bool:
    """pydantic names the member of a union it tried in an error's location: ``str``, ``list[int]``."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or "[" in part)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A short, readable message from pydantic's errors (no input values, at most three). A
    value matching no member of a union is one error naming the members."""
    errors, unions = [], {}
    for err in exc.errors():
        loc = list(err.get("loc", ()))
        tag = next((i for i, p in enumerate(loc) if _is_union_tag(p)), None)
        if tag is None:
            errors.append(err)
            continue
        key = tuple(loc[:tag])
        if key not in unions:
            unions[key] = []
            errors.append({"type": "union", "loc": key, "tags": unions[key]})
        if loc[tag] not in unions[key]:
            unions[key].append(loc[tag])
    parts, param = [], None
    for err in errors[:3]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err["type"] == "union":
            if param is None and loc:
                param = loc[0]
            parts.append(f"{'.'.join(loc) or 'request body'}: expected one of {', '.join(err['tags'])}")
            continue
        where = ".".join(loc)
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            parts.append(f"the request body is not valid JSON ({detail})" if detail else
                         "the request body is not valid JSON")
            continue
        if param is None and loc:
            param = loc[0]
        if err.get("type") == "missing":
            parts.append(f"missing required field '{where}'" if where else "missing request body (a JSON object)")
        else:
            parts.append(f"{where}: {err.get('msg')}" if where else f"request body: {err.get('msg')}")
    if len(errors) > 3:
        parts.append(f"and {len(errors) - 3} more error(s)")
    return "; ".join(parts) or "invalid request", param


#: SamplingParams field names -> the request fields that set them (for ConfigError messages)
_PARAM_NAMES = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                "seed": "seed", "stop": "stop"}


def _sampling_error(exc: ConfigError, max_tokens_name: str) -> OpenAIError:
    msg = str(exc)
    first = msg.split(" ", 1)[0]
    param = _PARAM_NAMES.get(first)
    if first == "max_new_tokens":
        param = max_tokens_name
        msg = max_tokens_name + msg[len(first):]
    return bad_request(msg, param=param)


# ------------------------------------------------------------------------------ request bodies
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields common to both endpoints. Unknown fields are accepted and ignored (logged)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM): 0 or -1 disables it
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False  # extension (vLLM): keep generating past the end-of-sequence token
    cache_salt: str | None = None  # extension (vLLM): requests with different salts never share prefix pages
    return_token_ids: bool = False  # extension (vLLM): the prompt's and each choice's token ids


class CompletionRequest(_SamplingRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True  # extension (vLLM)


# ------------------------------------------------------------------------------ engine requests
class _Run:
    """The engine requests of one HTTP request. The engine thread reports back through the event
    loop: each request's finish resolves a future; when streaming, its tokens and then its finish
    ``(i, None)`` arrive on one queue."""

    def __init__(self, engine: AsyncEngine, *, stream: bool) -> None:
        self.engine = engine
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue | None = asyncio.Queue() if stream else None
        self.ids: list[str] = []
        self.reqs: list[Any] = []  # the engine's Request objects, in submission order
        self.done: list[asyncio.Future] = []

    def _post(self, fn: Callable, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    async def add(self, prompt: Sequence[int], params: SamplingParams, request_id: str, salt: str | None) -> None:
        i = len(self.ids)
        self.ids.append(request_id)
        done = self.loop.create_future()
        self.done.append(done)
        queue = self.queue
        on_token = None if queue is None else (lambda ev: self._post(queue.put_nowait, (i, ev)))

        def on_finish(req) -> None:  # on the engine thread
            self._post(_resolve, done, req)
            if queue is not None:
                self._post(queue.put_nowait, (i, None))

        try:
            fut = self.engine.submit(prompt, params, request_id=request_id, salt=salt, on_token=on_token,
                                     on_finish=on_finish)
        except ConfigError:
            if not self.engine.alive:
                raise _not_running() from None
            raise
        self.reqs.append(await asyncio.wrap_future(fut))

    def abort_unfinished(self) -> None:
        """Cancel every request not known to be finished (an abort of a finished one is a no-op)."""
        for rid, done in zip(self.ids, self.done):
            if not done.done():
                try:
                    self.engine.abort_nowait(rid)
                except TieredKVError:  # the engine is shut down: its requests are cancelled already
                    pass


def _resolve(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _not_running() -> OpenAIError:
    return OpenAIError(503, "the engine is not running (the server is shutting down or the engine failed); "
                            "retry against a running server", code="engine_unavailable")


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events that end when the client goes away: the body is streamed while the
    request's receive channel is watched for the disconnect (whatever ASGI spec version the
    server speaks), and ``cleanup`` runs however the response ends (finished, client gone,
    cancelled by a stopping server)."""

    def __init__(self, content: AsyncIterator[str], cleanup: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        import anyio

        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away while we were sending
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self.cleanup()
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()


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


async def _disconnected(request: HTTPRequest) -> None:
    """Returns when the client has gone away (the request body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# ------------------------------------------------------------------------------ the app
class _Server:
    """What the endpoints share: the engine, the tokenizer, the served name and length."""

    def __init__(self, engine: AsyncEngine, tokenizer, model_name: str) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_len: int = engine.engine.scheduler.max_len
        config = getattr(engine.engine.model, "config", None)
        self.vocab_size: int | None = getattr(config, "vocab_size", None)
        self.created = int(time.time())
        self._warned: set[str] = set()

    # -------------------------------------------------------------- checks
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}` "
                                   "(GET /v1/models)", param="model", code="model_not_found")

    def check_common(self, body: _SamplingRequest) -> None:
        if body.n != 1:
            raise bad_request(f"n must be 1: this server generates one choice per prompt (got {body.n})", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(body, name)
            if value not in (None, 0, 0.0):
                raise bad_request(f"{name} is not supported (only 0); got {value}", name)
        if body.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")
        extra = sorted(set(body.model_extra or ()) - self._warned)
        if extra:
            self._warned.update(extra)
            logger.warning("ignoring request field(s) this server does not know: %s", ", ".join(extra))

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise bad_request("the prompt is empty; expected at least one token", param)
        if self.vocab_size is not None:
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise bad_request(f"token id(s) {short(bad[:5])} out of range; the vocabulary has {self.vocab_size} "
                                  "tokens", param)
        if len(ids) >= self.max_len:
            raise bad_request(f"This model's maximum context length is {self.max_len} tokens; the prompt has "
                              f"{len(ids)} tokens, so a prompt may have at most {self.max_len - 1} (one position must "
                              "remain to generate). Shorten the prompt.", param, code="context_length_exceeded")

    def sampling(self, body: _SamplingRequest, prompt_len: int, max_tokens: int | None,
                 max_tokens_name: str) -> SamplingParams:
        room = self.max_len - prompt_len
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
        if body.top_k is not None and body.top_k < -1:
            raise bad_request(f"top_k must be -1 or 0 (disabled) or a positive integer, got {body.top_k}", "top_k")
        try:
            params = SamplingParams(max_new_tokens=room if max_tokens is None else max_tokens,
                                    temperature=1.0 if body.temperature is None else body.temperature,
                                    top_k=top_k, top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
                                    stop=stop, ignore_eos=body.ignore_eos)
        except ConfigError as exc:
            raise _sampling_error(exc, max_tokens_name) from None
        if params.max_new_tokens > room:
            raise bad_request(f"This model's maximum context length is {self.max_len} tokens. However, you requested "
                              f"{prompt_len + params.max_new_tokens} tokens ({prompt_len} in the prompt, "
                              f"{params.max_new_tokens} for the completion). Reduce the prompt or {max_tokens_name} "
                              f"(at most {room} here).", max_tokens_name, code="context_length_exceeded")
        return params

    # -------------------------------------------------------------- prompts
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def completion_prompts(self, body: CompletionRequest) -> list[tuple[list[int], str | None]]:
        """(token ids, text or None) per prompt."""
        p = body.prompt
        if isinstance(p, str):
            items: list = [p]
        elif not p:
            raise bad_request("prompt is empty; expected a string, a list of strings or a list of token ids",
                              "prompt")
        elif isinstance(p[0], int):
            items = [list(p)]
        else:
            items = list(p)
        out = []
        for k, item in enumerate(items):
            ids = self.encode(item) if isinstance(item, str) else list(item)
            try:
                self.check_prompt(ids, "prompt")
            except OpenAIError as exc:
                if len(items) > 1:
                    exc.message = f"prompt {k} of {len(items)}: {exc.message}"
                raise
            out.append((ids, item if isinstance(item, str) else None))
        return out

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        if not body.messages:
            raise bad_request("messages is empty; expected at least one message", "messages")
        messages = []
        for k, m in enumerate(body.messages):
            if isinstance(m.content, list):
                texts = []
                for part in m.content:
                    if part.type != "text" or part.text is None:
                        raise bad_request(f"messages[{k}].content: only text parts are supported (got a "
                                          f"{short(part.type)} part)", "messages")
                    texts.append(part.text)
                content = "\n".join(texts)
            else:
                content = m.content or ""
            messages.append({"role": m.role, "content": content})
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
        except UnsupportedModelError as exc:
            raise bad_request(f"{exc} (use /v1/completions)", "messages") from None
        except Exception as exc:  # noqa: BLE001 - the template's own errors (jinja2) are about the messages
            from jinja2 import TemplateError

            if isinstance(exc, TemplateError):
                raise bad_request(f"the chat template refused the messages: {exc}", "messages") from None
            raise
        tok = self.tokenizer
        add_bos = None
        bos = getattr(tok, "bos_token_id", None)
        if getattr(tok, "add_bos", False) and bos is not None:
            bos_text = tok.backend.id_to_token(bos) if hasattr(tok, "backend") else None
            if bos_text and text.startswith(bos_text):
                add_bos = False  # the template wrote BOS itself
        ids = tok.encode(text) if add_bos is None else tok.encode(text, add_bos=add_bos)
        self.check_prompt(ids, "messages")
        return ids

    # -------------------------------------------------------------- running
    async def start(self, prompts: list[list[int]], params: list[SamplingParams], base_id: str, salt: str | None,
                    *, stream: bool) -> _Run:
        if not self.engine.alive:
            raise _not_running()
        run = _Run(self.engine, stream=stream)
        try:
            for k, (ids, p) in enumerate(zip(prompts, params)):
                await run.add(ids, p, base_id if len(prompts) == 1 else f"{base_id}-{k}", salt)
        except BaseException as exc:
            run.abort_unfinished()
            if isinstance(exc, (ContextLengthError, KVCacheFullError, ConfigError)):
                raise bad_request(str(exc).replace("max_new_tokens", "max_tokens"),
                                  "messages" if base_id.startswith("chatcmpl") else "prompt",
                                  code="context_length_exceeded" if isinstance(exc, ContextLengthError)
                                  else None) from None
            raise
        return run

    async def wait(self, run: _Run, request: HTTPRequest) -> bool:
        """Wait for every request of ``run``; False when the client went away first (then they
        are cancelled)."""
        watcher = asyncio.ensure_future(_disconnected(request))
        pending = set(run.done)
        try:
            while pending:
                done, _ = await asyncio.wait(pending | {watcher}, return_when=asyncio.FIRST_COMPLETED)
                if watcher in done:
                    return False
                pending -= done
            return True
        finally:
            watcher.cancel()
            run.abort_unfinished()

    @staticmethod
    def failure(req) -> OpenAIError | None:
        """The error a request that did not finish normally reports."""
        reason = req.out.finish_reason
        if reason in FINISH_REASONS:
            return None
        if reason == "error":
            return OpenAIError(500, f"the engine failed on this request: {req.out.error}", code="engine_error")
        return OpenAIError(503, f"the request was cancelled ({reason}): the server is shutting down",
                           code="cancelled")

    @staticmethod
    def usage(run: _Run) -> dict:
        p = sum(len(r.out.prompt_token_ids) for r in run.reqs)
        c = sum(len(r.out.token_ids) for r in run.reqs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def _stream(srv, run, chunk: Callable, choice: Callable, include_usage: bool,
                  first: list[dict]) -> AsyncIterator[str]:
    """A streamed completion's SSE events: ``first`` choices, one chunk per token event (an
    engine error ends the stream with an error event), the usage chunk when asked, [DONE]."""
    for c in first:
        yield _sse(chunk([c]))
    async for k, text, finish, error in _choice_events(run):
        if error is not None:
            yield _sse(error.body())
            break
        yield _sse(chunk([choice(k, text, finish)]))
    else:
        if include_usage:
            yield _sse(chunk([], srv.usage(run)))
    yield "data: [DONE]\n\n"


def create_app(engine: AsyncEngine, tokenizer, model_name: str, *, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (an :class:`AsyncEngine`; the caller starts it and shuts
    it down) under ``model_name``. ``api_key``: the ``/v1`` routes answer 401 without
    ``Authorization: Bearer <api_key>`` (``/health`` and ``/metrics`` stay open)."""
    srv = _Server(engine, tokenizer, model_name)
    app = FastAPI(title="tieredkv OpenAI-compatible server", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tieredkv = srv

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: HTTPRequest, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
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

    # -------------------------------------------------------------- models
    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": srv.created, "owned_by": "tieredkv",
                "root": model_name, "parent": None, "max_model_len": srv.max_len}

    @app.get("/v1/models", dependencies=v1)
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}", dependencies=v1)
    async def get_model(model: str) -> dict:
        srv.check_model(model)
        return model_card()

    # -------------------------------------------------------------- health, metrics
    @app.get("/health")
    async def health() -> Response:
        if engine.alive:
            return JSONResponse({"status": "ok"})
        return _not_running().response()

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

    # -------------------------------------------------------------- completions
    @app.post("/v1/completions", dependencies=v1)
    async def completions(body: CompletionRequest, request: HTTPRequest) -> Response:
        srv.check_model(body.model)
        srv.check_common(body)
        if body.logprobs is not None:
            raise bad_request("logprobs are not supported by this server", "logprobs")
        if body.best_of not in (None, 1):
            raise bad_request(f"best_of must be 1 (got {body.best_of})", "best_of")
        if body.suffix:
            raise bad_request("suffix (insertion) is not supported", "suffix")
        prompts = srv.completion_prompts(body)
        params = [srv.sampling(body, len(ids), body.max_tokens, "max_tokens") for ids, _ in prompts]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        run = await srv.start([ids for ids, _ in prompts], params, rid, body.cache_salt, stream=body.stream)

        def prompt_text(k: int) -> str:
            ids, text = prompts[k]
            return text if text is not None else tokenizer.decode(ids)

        include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)

        def chunk(choices: list[dict], usage: dict | None = None) -> dict:
            out = {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                   "choices": choices}
            if include_usage:
                out["usage"] = usage
            return out

        if body.stream:
            def choice(k: int, text: str, finish: str | None) -> dict:
                c = {"index": k, "text": text, "logprobs": None, "finish_reason": finish}
                if finish is not None and body.return_token_ids:
                    c["token_ids"] = list(run.reqs[k].out.token_ids)
                    c["prompt_token_ids"] = list(run.reqs[k].out.prompt_token_ids)
                return c

            first = [choice(k, prompt_text(k), None) for k in range(len(prompts))] if body.echo else []
            return _EventStream(_guarded(_stream(srv, run, chunk, choice, include_usage, first)),
                                run.abort_unfinished)

        if not await srv.wait(run, request):
            logger.info("%s: the client went away; its request was cancelled", rid)
            return Response(status_code=499)
        choices = []
        for k, req in enumerate(run.reqs):
            err = srv.failure(req)
            if err is not None:
                raise err
            c = {"index": k, "text": (prompt_text(k) if body.echo else "") + req.out.text, "logprobs": None,
                 "finish_reason": FINISH_REASONS[req.out.finish_reason]}
            if body.return_token_ids:
                c["token_ids"] = list(req.out.token_ids)
                c["prompt_token_ids"] = list(req.out.prompt_token_ids)
            choices.append(c)
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model_name,
                             "choices": choices, "usage": srv.usage(run), "system_fingerprint": None})

    # -------------------------------------------------------------- chat
    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(body: ChatCompletionRequest, request: HTTPRequest) -> Response:
        srv.check_model(body.model)
        srv.check_common(body)
        if body.logprobs or body.top_logprobs is not None:
            raise bad_request("logprobs are not supported by this server", "logprobs")
        if body.tools:
            raise bad_request("tools (function calling) are not supported by this server", "tools")
        if body.tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice is not supported (no tools)", "tool_choice")
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise bad_request("response_format: only {\"type\": \"text\"} is supported", "response_format")
        ids = srv.chat_prompt(body)
        name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = srv.sampling(body, len(ids), limit, name)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        run = await srv.start([ids], [params], rid, body.cache_salt, stream=body.stream)
        include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)

        def chunk(choices: list[dict], usage: dict | None = None) -> dict:
            out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                   "system_fingerprint": None, "choices": choices}
            if include_usage:
                out["usage"] = usage
            return out

        if body.stream:
            def choice(k: int, text: str, finish: str | None) -> dict:
                c = {"index": k, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": finish}
                if finish is not None and body.return_token_ids:
                    c["token_ids"] = list(run.reqs[k].out.token_ids)
                return c

            first = [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}]
            return _EventStream(_guarded(_stream(srv, run, chunk, choice, include_usage, first)),
                                run.abort_unfinished)

        if not await srv.wait(run, request):
            logger.info("%s: the client went away; its request was cancelled", rid)
            return Response(status_code=499)
        req = run.reqs[0]
        err = srv.failure(req)
        if err is not None:
            raise err
        choice = {"index": 0, "message": {"role": "assistant", "content": req.out.text}, "logprobs": None,
                  "finish_reason": FINISH_REASONS[req.out.finish_reason]}
        out = {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
               "choices": [choice], "usage": srv.usage(run), "system_fingerprint": None}
        if body.return_token_ids:
            choice["token_ids"] = list(req.out.token_ids)
            out["prompt_token_ids"] = list(req.out.prompt_token_ids)
        return JSONResponse(out)

    return app


async def _choice_events(run: _Run) -> AsyncIterator[tuple[int, str, str | None, OpenAIError | None]]:
    """(choice index, new text, OpenAI finish reason or None, error or None) as the engine
    produces them, until every request of ``run`` has finished (or one failed)."""
    assert run.queue is not None
    finished: set[int] = set()
    reported: set[int] = set()
    while len(finished) < len(run.ids):
        k, ev = await run.queue.get()
        if ev is None:
            finished.add(k)
            if k not in reported:
                err = _Server.failure(run.reqs[k])
                if err is not None:
                    yield k, "", None, err
                    return
                # finished normally without a final event (cannot happen today): close the choice
                yield k, "", FINISH_REASONS[run.reqs[k].out.finish_reason], None
            continue
        if ev.finish_reason is not None:
            reported.add(k)
            yield k, ev.text, FINISH_REASONS.get(ev.finish_reason, "stop"), None
        elif ev.text:
            yield k, ev.text, None, None


async def _guarded(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream whose unexpected failure ends with an OpenAI error event instead of a cut."""
    try:
        async for item in events:
            yield item
    except Exception as exc:  # noqa: BLE001 - logged; the client gets an error event
        logger.error("unexpected error while streaming", exc_info=(type(exc), exc, exc.__traceback__))
        yield _sse(OpenAIError(500, f"the server had an error while streaming ({type(exc).__name__}); the server "
                                    "log has the details").body())
        yield "data: [DONE]\n\n"
    finally:
        await events.aclose()


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
        exits 0 here)."""

        stop_signal: int | None = None

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
            previous = {s: signal.signal(s, self._on_signal) for s in sigs}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

        def _on_signal(self, sig, frame) -> None:
            if self.stop_signal is None:
                self.stop_signal = sig
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    return Server


def serve(engine_args, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          log_level: str = "info", log: Callable[[str], None] | None = None,
          graceful_timeout: float = GRACEFUL_TIMEOUT) -> int:
    """``tieredkv serve``: build the engine from ``engine_args`` (an EngineArgs), start it and
    serve the OpenAI API on ``host:port`` until SIGINT / SIGTERM / SIGHUP; then stop taking
    connections, give the responses in flight ``graceful_timeout`` seconds, cancel the rest,
    stop the engine and return 0. Once listening it writes ``tieredkv serve: listening on
    http://HOST:PORT`` (the bound port, when ``port`` is 0) through ``log`` (default: stderr)."""
    try:
        import uvicorn
    except ImportError as exc:
        raise ServerUnavailableError(f"tieredkv serve needs uvicorn ({exc}); install it with: pip install "
                                     "'tieredkv[serve]'") from None

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
            app = create_app(aeng, served.tokenizer, served.model_name, api_key=api_key)
            config = uvicorn.Config(app, log_config=_log_config(log_level), log_level=log_level, lifespan="off",
                                    access_log=log_level in ("info", "debug"),
                                    timeout_graceful_shutdown=max(1, int(graceful_timeout)))
            server = _server_class()(config)
            task = asyncio.ensure_future(server.serve(sockets=[sock]))
            try:
                while not server.started and not task.done():
                    await asyncio.sleep(0.02)
                if server.started:
                    log(f"tieredkv serve: listening on http://{shown}:{bound[1]}")
                await task
            finally:
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


__all__ = ["ChatCompletionRequest", "CompletionRequest", "METRICS_CONTENT_TYPE", "OpenAIError", "ServerUnavailableError",
           "bind_socket", "create_app", "serve"]
