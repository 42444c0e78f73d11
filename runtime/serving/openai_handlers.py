"""What the completion and chat endpoints share: checking a request, turning its prompt into
token ids, running its engine requests and streaming or collecting their tokens.

One HTTP request is one or more engine requests (a batch of completion prompts) on the
:class:`~tieredkv.runtime.serving.engine.AsyncEngine`; the engine thread calls back into
the event loop with the tokens. Prompts are checked before they cost anything (valid
Unicode, a length in characters that can fit the served length — ``prompts.py``) and
tokenized on a worker thread, so the event loop keeps answering other requests (``/health``
among them) while a long prompt is encoded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tieredkv.errors import (ConfigError, ContextLengthError, KVCacheFullError, PromptError, TieredKVError,
                             UnsupportedModelError, short)
from tieredkv.runtime.sampling import SamplingParams
from tieredkv.runtime.serving.engine import AsyncEngine
from tieredkv.runtime.serving.openai_protocol import (FINISH_REASONS, SSE_DONE, ChatCompletionRequest,
                                                      CompletionRequest, OpenAIError, _SamplingRequest, bad_request,
                                                      not_running, sampling_error, shutting_down, sse)
from tieredkv.runtime.serving.prompts import check_text, max_chars_per_token, min_tokens

logger = logging.getLogger("tieredkv.serve")


class Run:
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
                raise not_running() from None
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


class Frontend:
    """What the endpoints share: the engine, the tokenizer, the served name and length, and the
    requests in flight (a stopping server waits for them, :meth:`drain`)."""

    def __init__(self, engine: AsyncEngine, tokenizer, model_name: str) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_len: int = engine.engine.scheduler.max_len
        config = getattr(engine.engine.model, "config", None)
        self.vocab_size: int | None = getattr(config, "vocab_size", None)
        self.chars_per_token = max_chars_per_token(tokenizer)
        self.created = int(time.time())
        self.draining = False  # a stopping server takes no new requests
        self.in_flight: set[asyncio.Future] = set()  # finish futures of the engine requests running
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

    def check_text(self, text: str, what: str, param: str) -> None:
        """Valid Unicode, and a length in characters that can fit the served length (before any
        tokenizing: a prompt of N characters has at least ceil(N / chars_per_token) tokens)."""
        try:
            check_text(text, what)
        except PromptError as exc:
            raise bad_request(str(exc), param) from None
        least = min_tokens(len(text), self.chars_per_token)
        if least >= self.max_len:
            raise bad_request(f"This model's maximum context length is {self.max_len} tokens; {what} has "
                              f"{len(text)} characters, which are at least {least} tokens (a token of this model "
                              f"covers at most {self.chars_per_token} characters), so it cannot fit. Shorten the "
                              "prompt.", param, code="context_length_exceeded")

    def sampling(self, body: _SamplingRequest, prompt_len: int, max_tokens: int | None,
                 max_tokens_name: str) -> SamplingParams:
        """The request's sampling; no ``max_tokens``: up to the served length (vLLM's default)."""
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
            raise sampling_error(exc, max_tokens_name) from None
        if params.max_new_tokens > room:
            raise bad_request(f"This model's maximum context length is {self.max_len} tokens. However, you requested "
                              f"{prompt_len + params.max_new_tokens} tokens ({prompt_len} in the prompt, "
                              f"{params.max_new_tokens} for the completion). Reduce the prompt or {max_tokens_name} "
                              f"(at most {room} here).", max_tokens_name, code="context_length_exceeded")
        return params

    # -------------------------------------------------------------- prompts
    async def completion_prompts(self, body: CompletionRequest) -> list[tuple[list[int], str | None]]:
        """(token ids, text or None) per prompt; texts are checked first, then tokenized on a
        worker thread."""
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
        where = (lambda k: f"prompt {k} of {len(items)}") if len(items) > 1 else (lambda k: "the prompt")
        for k, item in enumerate(items):
            if isinstance(item, str):
                self.check_text(item, where(k), "prompt")

        def encode_all() -> list[tuple[list[int], str | None]]:  # on a worker thread; stops at the first refusal
            out = []
            for k, item in enumerate(items):
                ids = self.tokenizer.encode(item) if isinstance(item, str) else list(item)
                try:
                    self.check_prompt(ids, "prompt")
                except OpenAIError as exc:
                    if len(items) > 1:
                        exc.message = f"{where(k)}: {exc.message}"
                    raise
                out.append((ids, item if isinstance(item, str) else None))
            return out

        if any(isinstance(item, str) for item in items):
            return await asyncio.to_thread(encode_all)
        return encode_all()

    def _chat_messages(self, body: ChatCompletionRequest) -> list[dict[str, str]]:
        if not body.messages:
            raise bad_request("messages is empty; expected at least one message", "messages")
        messages, chars = [], 0
        for k, m in enumerate(body.messages):
            if isinstance(m.content, list):
                texts = []
                for j, part in enumerate(m.content):
                    if part.type != "text":
                        raise bad_request(f"messages[{k}].content[{j}]: only text parts are supported (got a "
                                          f"{short(part.type)} part)", "messages")
                    if part.text is None:
                        raise bad_request(f"messages[{k}].content[{j}]: a text part needs its text (a string in "
                                          "'text')", "messages")
                    texts.append(part.text)
                content = "\n".join(texts)
            else:
                content = m.content or ""
            self.check_text(content, f"messages[{k}].content", "messages")
            if m.name is not None:
                self.check_text(m.name, f"messages[{k}].name", "messages")
            chars += len(content)
            messages.append({"role": m.role, "content": content})
        least = min_tokens(chars, self.chars_per_token)
        if least >= self.max_len:
            raise bad_request(f"This model's maximum context length is {self.max_len} tokens; the messages have "
                              f"{chars} characters, which are at least {least} tokens (a token of this model covers at "
                              f"most {self.chars_per_token} characters), so they cannot fit. Shorten the messages.",
                              "messages", code="context_length_exceeded")
        return messages

    def _render_and_encode(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        """The chat template's text as token ids (on a worker thread)."""
        tok = self.tokenizer
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        except UnsupportedModelError as exc:
            raise bad_request(f"{exc} (use /v1/completions)", "messages") from None
        except Exception as exc:  # noqa: BLE001 - the template's own errors (jinja2) are about the messages
            from jinja2 import TemplateError

            if isinstance(exc, TemplateError):
                raise bad_request(f"the chat template refused the messages: {exc}", "messages") from None
            raise
        self.check_text(text, "the rendered conversation", "messages")
        add_bos = None
        bos = getattr(tok, "bos_token_id", None)
        if getattr(tok, "add_bos", False) and bos is not None:
            bos_text = tok.backend.id_to_token(bos) if hasattr(tok, "backend") else None
            if bos_text and text.startswith(bos_text):
                add_bos = False  # the template wrote BOS itself
        return tok.encode(text) if add_bos is None else tok.encode(text, add_bos=add_bos)

    async def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        messages = self._chat_messages(body)
        ids = await asyncio.to_thread(self._render_and_encode, messages, body.add_generation_prompt)
        self.check_prompt(ids, "messages")
        return ids

    # -------------------------------------------------------------- running
    async def start(self, prompts: list[list[int]], params: list[SamplingParams], base_id: str, salt: str | None,
                    *, stream: bool) -> Run:
        if self.draining:
            raise shutting_down()
        if not self.engine.alive:
            raise not_running()
        run = Run(self.engine, stream=stream)
        try:
            for k, (ids, p) in enumerate(zip(prompts, params)):
                await run.add(ids, p, base_id if len(prompts) == 1 else f"{base_id}-{k}", salt)
                done = run.done[-1]
                self.in_flight.add(done)
                done.add_done_callback(self.in_flight.discard)
        except BaseException as exc:
            run.abort_unfinished()
            if isinstance(exc, (ContextLengthError, KVCacheFullError, ConfigError)):
                raise bad_request(str(exc).replace("max_new_tokens", "max_tokens"),
                                  "messages" if base_id.startswith("chatcmpl") else "prompt",
                                  code="context_length_exceeded" if isinstance(exc, ContextLengthError)
                                  else None) from None
            raise
        return run

    async def drain(self, timeout: float, stop: asyncio.Event | None = None) -> int:
        """Take no new requests; wait up to ``timeout`` seconds (or until ``stop`` is set) for
        the engine requests in flight. Returns how many are still running."""
        self.draining = True
        pending = set(self.in_flight)
        if pending:
            waiters = [asyncio.ensure_future(asyncio.wait(pending, timeout=timeout))]
            if stop is not None:
                waiters.append(asyncio.ensure_future(stop.wait()))
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            for w in waiters:
                w.cancel()
        return sum(not f.done() for f in pending)

    async def wait(self, run: Run, request: HTTPRequest) -> bool:
        """Wait for every request of ``run``; False when the client went away first (then they
        are cancelled)."""
        watcher = asyncio.ensure_future(disconnected(request))
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
        return OpenAIError(503, f"the server is shutting down: this request was cancelled before it finished (after "
                                f"{len(req.out.token_ids)} generated token(s)); retry it against a running server",
                           code="server_shutting_down")

    @staticmethod
    def usage(run: Run) -> dict:
        p = sum(len(r.out.prompt_token_ids) for r in run.reqs)
        c = sum(len(r.out.token_ids) for r in run.reqs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


# ------------------------------------------------------------------------------ streaming
async def disconnected(request: HTTPRequest) -> None:
    """Returns when the client has gone away (the request body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class EventStream(StreamingResponse):
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


async def choice_events(run: Run) -> AsyncIterator[tuple[int, str, str | None, OpenAIError | None]]:
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
                err = Frontend.failure(run.reqs[k])
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


async def stream_events(front: Frontend, run: Run, chunk: Callable, choice: Callable, include_usage: bool,
                        first: list[dict]) -> AsyncIterator[str]:
    """A streamed completion's SSE events: ``first`` choices, one chunk per token event (an
    engine error or a cancellation ends the stream with an error event), the usage chunk when
    asked, then ``[DONE]`` — always, so a client tells a cut answer from a complete one. An
    unexpected failure is logged and ends the stream with an error event too."""
    try:
        for c in first:
            yield sse(chunk([c]))
        async for k, text, finish, error in choice_events(run):
            if error is not None:
                yield sse(error.body())
                break
            yield sse(chunk([choice(k, text, finish)]))
        else:
            if include_usage:
                yield sse(chunk([], front.usage(run)))
    except Exception as exc:  # noqa: BLE001 - logged; the client gets an error event
        logger.error("unexpected error while streaming", exc_info=(type(exc), exc, exc.__traceback__))
        yield sse(OpenAIError(500, f"the server had an error while streaming ({type(exc).__name__}); the server "
                                   "log has the details").body())
    yield SSE_DONE


# ------------------------------------------------------------------------------ the two endpoints
async def completion_response(front: Frontend, body: CompletionRequest, request: HTTPRequest) -> Response:
    """``POST /v1/completions``."""
    front.check_model(body.model)
    front.check_common(body)
    if body.logprobs is not None:
        raise bad_request("logprobs are not supported by this server", "logprobs")
    if body.best_of not in (None, 1):
        raise bad_request(f"best_of must be 1 (got {body.best_of})", "best_of")
    if body.suffix:
        raise bad_request("suffix (insertion) is not supported", "suffix")
    prompts = await front.completion_prompts(body)
    params = [front.sampling(body, len(ids), body.max_tokens, "max_tokens") for ids, _ in prompts]
    rid, created, model_name = f"cmpl-{uuid.uuid4().hex}", int(time.time()), front.model_name
    run = await front.start([ids for ids, _ in prompts], params, rid, body.cache_salt, stream=body.stream)

    def prompt_text(k: int) -> str:
        ids, text = prompts[k]
        return text if text is not None else front.tokenizer.decode(ids)

    include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)

    def chunk(choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": rid, "object": "text_completion", "created": created, "model": model_name, "choices": choices}
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
        return EventStream(stream_events(front, run, chunk, choice, include_usage, first), run.abort_unfinished)

    if not await front.wait(run, request):
        logger.info("%s: the client went away; its request was cancelled", rid)
        return Response(status_code=499)
    choices = []
    for k, req in enumerate(run.reqs):
        err = front.failure(req)
        if err is not None:
            raise err
        c = {"index": k, "text": (prompt_text(k) if body.echo else "") + req.out.text, "logprobs": None,
             "finish_reason": FINISH_REASONS[req.out.finish_reason]}
        if body.return_token_ids:
            c["token_ids"] = list(req.out.token_ids)
            c["prompt_token_ids"] = list(req.out.prompt_token_ids)
        choices.append(c)
    return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model_name,
                         "choices": choices, "usage": front.usage(run), "system_fingerprint": None})


async def chat_response(front: Frontend, body: ChatCompletionRequest, request: HTTPRequest) -> Response:
    """``POST /v1/chat/completions``."""
    front.check_model(body.model)
    front.check_common(body)
    if body.logprobs or body.top_logprobs is not None:
        raise bad_request("logprobs are not supported by this server", "logprobs")
    if body.tools:
        raise bad_request("tools (function calling) are not supported by this server", "tools")
    if body.tool_choice not in (None, "none", "auto"):
        raise bad_request("tool_choice is not supported (no tools)", "tool_choice")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise bad_request("response_format: only {\"type\": \"text\"} is supported", "response_format")
    ids = await front.chat_prompt(body)
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = front.sampling(body, len(ids), limit, name)
    rid, created, model_name = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), front.model_name
    run = await front.start([ids], [params], rid, body.cache_salt, stream=body.stream)
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

        first = [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
        return EventStream(stream_events(front, run, chunk, choice, include_usage, first), run.abort_unfinished)

    if not await front.wait(run, request):
        logger.info("%s: the client went away; its request was cancelled", rid)
        return Response(status_code=499)
    req = run.reqs[0]
    err = front.failure(req)
    if err is not None:
        raise err
    choice = {"index": 0, "message": {"role": "assistant", "content": req.out.text}, "logprobs": None,
              "finish_reason": FINISH_REASONS[req.out.finish_reason]}
    out = {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
           "choices": [choice], "usage": front.usage(run), "system_fingerprint": None}
    if body.return_token_ids:
        choice["token_ids"] = list(req.out.token_ids)
        out["prompt_token_ids"] = list(req.out.prompt_token_ids)
    return JSONResponse(out)


__all__ = ["EventStream", "Frontend", "Run", "chat_response", "choice_events", "completion_response", "disconnected",
           "stream_events"]
