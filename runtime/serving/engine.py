"""The serving engine: many requests through one model and one KV cache, continuously.

``Engine`` is synchronous: ``add_request`` / ``abort`` between steps, ``step`` runs one
scheduler step (chunked prefill and decode under the step's token budget, see
``scheduler.py``) and returns the tokens it produced. ``AsyncEngine`` runs an Engine on a
thread of its own for asyncio servers: ``generate`` streams one request's tokens, and
leaving the stream early (a client disconnect) cancels it. The engine is the only owner of
the cache; cancellation, abort and errors are ordinary events that release the request's
pages (keeping its full pages in the prefix index when reuse is on).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import deque
from concurrent.futures import Future
import time
from typing import AsyncIterator, Callable, Sequence

import torch

from tieredkv.errors import ConfigError, TieredKVError
from tieredkv.models.cache import KVCache
from tieredkv.models.llama import decode_one_token
from tieredkv.models.tokenizer import Tokenizer
from tieredkv.runtime.sampling import SamplingParams, sample_token
from tieredkv.runtime.serving.metrics import ServingMetrics, StepSample
from tieredkv.runtime.serving.prefix import PrefixConfig, PrefixIndex
from tieredkv.runtime.serving.request import Completion, OnToken, Request, RequestStatus, TokenEvent
from tieredkv.runtime.serving.scheduler import ScheduledStep, Scheduler, SchedulerConfig

ON_ERROR = ("fail", "raise")


class Engine:
    """``cache``: the engine's KV cache (a paged cache with ``max_pages`` set, or a tiered
    cache with byte budgets, bounds the KV memory); ``prefix``: a PrefixConfig turns on
    prefix reuse (the paged or the tiered cache); ``model_id``: the prefix keys' model key;
    ``on_error``: ``fail`` ends a request whose step raised with finish reason ``error``
    (the others go on), ``raise`` lets the exception out (a batch job's choice)."""

    def __init__(self, model, cache: KVCache, *, tokenizer: Tokenizer | None = None,
                 scheduler: SchedulerConfig | None = None, prefix: PrefixConfig | None = None,
                 model_id: str | None = None, on_error: str = "fail", remote=None, keep_finished: bool = True,
                 metrics_window: int | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        if on_error not in ON_ERROR:
            raise ConfigError(f"on_error must be one of {list(ON_ERROR)}, got {on_error!r}")
        self.model, self.cache, self.tokenizer = model, cache, tokenizer
        self.config = scheduler or SchedulerConfig()
        self.on_error, self.clock = on_error, clock
        mc = model.config
        self.context = mc.max_position_embeddings
        self.eos_ids = frozenset(mc.eos_token_ids) | frozenset(tokenizer.eos_token_ids if tokenizer else ())
        self.prefix = None
        if prefix is not None:
            if not cache.shares_pages:
                raise ConfigError(f"prefix reuse needs a cache whose sequences share pages (the paged or the tiered "
                                  f"cache); {type(cache).__name__} has none")
            self.prefix = PrefixIndex(cache, prefix, model_id=model_id or mc.name)
        self.remote = None
        if remote is not None:
            from tieredkv.runtime.serving.remote import RemoteTier

            if self.prefix is None:
                raise ConfigError("the remote KV tier shares prefix pages; it needs prefix reuse (give prefix=)")
            self.remote = RemoteTier(remote, cache, model)
            self.prefix.on_publish = self.remote.publish
        self.scheduler = Scheduler(cache, self.config, context=self.context, prefix=self.prefix,
                                   open_sequence=self._open, close_sequence=self._close,
                                   rematch=self._rematch if self.prefix is not None else None)
        self.page_size = self.scheduler.page_size
        self.requests: dict[str, Request] = {}
        self.metrics = ServingMetrics(window=metrics_window)
        self.keep_finished = keep_finished
        self._ids = itertools.count()
        self._kv_token_bytes = cache.spec.token_bytes_per_layer * cache.spec.num_layers

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, salt: str | None = None, on_token: OnToken | None = None,
                    on_finish: Callable[[Request], None] | None = None, index: int | None = None) -> Request:
        """Queue a request (token ids). Raises a typed error — and queues nothing — when it could
        never run (empty, longer than the served length, more KV than the budget holds) or its
        id is in use. ``index``: its output's index (``Completion.index``, ``TokenEvent.index``;
        default: the engine's count of requests, which also names it when ``request_id`` is None)."""
        count = next(self._ids)
        index = count if index is None else index
        request_id = str(count) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ConfigError(f"request id {request_id!r} is already in use")
        req = Request(index, request_id, list(prompt), params or SamplingParams(), tokenizer=self.tokenizer,
                      arrival=self.clock(), salt=salt, on_token=on_token)
        req.on_finish = on_finish
        if self.prefix is not None:
            req.chain = self.prefix.chain(salt)
        self.scheduler.add(req)
        self.requests[request_id] = req
        if self.metrics.start is None:
            self.metrics.start = req.metrics.arrival
        return req

    def abort(self, request_id: str, *, keep_prefix: bool = True) -> bool:
        """Cancel a request wherever it is (between steps); False when it is unknown or done.
        ``keep_prefix``: its full pages go to the prefix index like a finished request's
        (reuse on); False frees every page it computed beyond those already indexed."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        if not keep_prefix:
            req.no_publish = True
        self._finish(req, "cancelled")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ sequences
    def _open(self, req: Request) -> None:
        """An admitted request's sequence in the cache, starting with its prefix-index hits."""
        hits: list[int] = []
        if self.prefix is not None:
            hits = self.prefix.match(req.chain, req.tokens)
            if req.metrics.first_scheduled is None:
                req.metrics.cached_tokens = len(hits) * self.page_size
                for tier in self.cache.page_tiers(hits) if hits else ():
                    req.metrics.prefix_hit_pages[tier] = req.metrics.prefix_hit_pages.get(tier, 0) + 1
        req.seq_id = self.cache.add_sequence(shared=hits) if hits else self.cache.add_sequence()
        req.computed = len(hits) * self.page_size
        self.cache.expect(req.seq_id, self.scheduler.final_tokens(req))  # storage grown now, not mid-decode
        if self.remote is not None:
            self._load_remote(req, len(hits))
        req.hit_tokens = req.computed
        if req.metrics.first_scheduled is None:
            req.metrics.first_scheduled = self.clock()

    def _rematch(self, req: Request) -> None:
        """A request that has computed nothing of its own takes the longer run of prefix pages
        the index may hold since it was admitted (another request's prefill published them): its
        sequence starts over from those."""
        have = req.hit_tokens // self.page_size
        hits = self.prefix.match_more(req.chain, req.tokens, have)
        if len(hits) <= have:
            return
        tiers = self.cache.page_tiers(hits[have:])  # where they were found (the new sequence pins some)
        old, req.seq_id = req.seq_id, self.cache.add_sequence(shared=hits)  # the old one lives until this works
        self.cache.free_sequence(old)
        req.computed = req.hit_tokens = len(hits) * self.page_size
        self.cache.expect(req.seq_id, self.scheduler.final_tokens(req))
        if not req.out.token_ids and not req.metrics.preemptions.get("recompute"):  # its first admission
            req.metrics.cached_tokens = req.computed
            for tier in tiers:
                req.metrics.prefix_hit_pages[tier] = req.metrics.prefix_hit_pages.get(tier, 0) + 1

    def _load_remote(self, req: Request, local: int) -> None:
        """The pages after the local prefix hits that the remote tier holds, written into the
        request's sequence (then indexed locally); a failure leaves them to be computed."""
        usable = (len(req.tokens) - 1) // self.page_size
        keys = req.chain.extend(req.tokens)[local:usable]
        pages = self.remote.fetch(keys)
        if not pages:
            return
        try:
            written = self.remote.load_into(req.seq_id, pages)
        except (TieredKVError, RuntimeError, ValueError):  # start over from the local hits: compute the rest
            self.remote.count_error()
            shared = self.cache.pages_of(req.seq_id)[:local]
            self.cache.free_sequence(req.seq_id)
            req.seq_id = self.cache.add_sequence(shared=shared) if shared else self.cache.add_sequence()
            return
        req.computed += written
        if req.metrics.first_scheduled is None:
            req.metrics.cached_tokens += written
            req.metrics.prefix_hit_pages["remote"] = req.metrics.prefix_hit_pages.get("remote", 0) + len(pages)
        self._publish(req)

    def _publish(self, req: Request) -> None:
        if self.prefix is not None and req.seq_id is not None:
            self.prefix.publish(req.chain, req.seq_id, req.tokens[: req.computed])

    def _close(self, req: Request) -> None:
        """Free a request's sequence (its full pages stay in the prefix index)."""
        if req.seq_id is None:
            return
        if not req.no_publish:
            self._publish(req)
        self.cache.free_sequence(req.seq_id)
        req.seq_id, req.computed = None, 0

    def _finish(self, req: Request, reason: str | None = None, error: str | None = None) -> None:
        if reason is not None:
            req.out.finish_reason = reason
        req.out.error = error
        self.scheduler.abort(req)
        self._close(req)
        req.status = RequestStatus.FINISHED
        m = req.metrics
        m.finished = self.clock()
        m.output_tokens = len(req.out.token_ids)
        self.metrics.finished(m, req.out.finish_reason or "unknown")
        if not self.keep_finished:
            del self.requests[req.request_id]
        if req.on_finish is not None:
            req.on_finish(req)

    def _emit(self, req: Request, logits: torch.Tensor, events: list[TokenEvent]) -> None:
        token = sample_token(logits, req.params, req.generator)
        event = req.accept(token, self.eos_ids, self.scheduler.max_len)
        now = self.clock()
        if req.metrics.first_token is None:
            req.metrics.first_token = now
        req.metrics.token_times.append(now)
        events.append(event)
        if req.on_token is not None and req.on_token(event) is False and req.out.finish_reason is None:
            req.out.finish_reason = "cancelled"
        if req.out.finish_reason is not None:
            self._finish(req)

    def _failed(self, reqs: list[Request], exc: Exception) -> None:
        if self.on_error == "raise" or not isinstance(exc, (TieredKVError, RuntimeError, ValueError)):
            raise exc
        for req in reqs:
            if not req.finished:
                self._finish(req, "error", f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ one step
    def step(self) -> list[TokenEvent]:
        """One scheduler step; returns the tokens produced (also streamed to the callbacks)."""
        return self._run(self.scheduler.schedule())

    @torch.no_grad()
    def _run(self, step: ScheduledStep) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        # the scheduler sizes chunks to the KV budget; each forward call also keeps the cache's own
        # limit (new pages must fit next to the hot windows held when it starts)
        t_start = self.clock()
        for req, n in step.prefills:
            try:
                while n > 0:  # the cache may take fewer tokens per forward call than the chunk
                    limit = self.cache.max_step_tokens()
                    k = n if limit is None else min(n, limit)
                    self._slots([req.seq_id], k)
                    lo = req.computed
                    tokens = torch.tensor(req.tokens[lo: lo + k]).unsqueeze(0)
                    logits = self.model(tokens, torch.arange(lo, lo + k).unsqueeze(0), self.cache, [req.seq_id],
                                        last_only=True)
                    req.computed += k
                    n -= k
            except Exception as exc:  # noqa: BLE001 - one request's failure ends that request only
                self._failed([req], exc)
                continue
            self.metrics.kv_bytes_peak = max(self.metrics.kv_bytes_peak, self.cache.kv_bytes())
            if req.to_feed == 0:
                self._emit(req, logits[0, -1], events)
            self._publish(req)
        t_prefilled = self.clock()
        self.metrics.prefill_seconds += t_prefilled - t_start
        if step.decodes:
            batch = step.decodes
            try:
                self._slots([r.seq_id for r in batch], 1)
                logits = decode_one_token(self.model, self.cache, [r.seq_id for r in batch],
                                          torch.tensor([r.tokens[-1] for r in batch]),
                                          torch.tensor([r.computed for r in batch]))
            except Exception as exc:  # noqa: BLE001
                self._failed(batch, exc)
            else:
                self.metrics.decode_steps += 1
                self.metrics.decode_tokens += len(batch)
                self.metrics.kv_bytes_peak = max(self.metrics.kv_bytes_peak, self.cache.kv_bytes())
                for row, req in enumerate(batch):
                    req.computed += 1
                    self._emit(req, logits[row], events)
                    if not req.finished and req.computed % self.page_size == 0:
                        self._publish(req)
            self.metrics.decode_seconds += self.clock() - t_prefilled
        if self.prefix is not None:
            self.prefix.sweep()
        self._sample(step.num_tokens)
        return events

    def _slots(self, seq_ids: list[int], num_new: int) -> None:
        """Slots for the next forward call: where the cache has no room, the prefix index's pages
        that no sequence lists give way, least recently used first (the forward call raises the
        cache's typed error when even that is not enough)."""
        while not self.cache.allocate_slots(seq_ids, num_new):
            if self.prefix is None or not self.prefix.evict(max(1, len(seq_ids))):
                return

    def _sample(self, tokens: int) -> None:
        s, now, usage = self.scheduler, self.clock(), self.cache.usage()
        # allocated: what the device holds, or what the scheduler counts for the running requests where it
        # reserves more (max-length preallocation); used: the bytes holding tokens
        counted = (s.device_need() if s.capacity is not None else 0) * self.page_size * self._kv_token_bytes
        self.metrics.step(StepSample(now, len(s.running), len(s.waiting), len(s.paused), tokens,
                                     max(usage.device_bytes, counted), usage.token_bytes,
                                     usage.tier_bytes if self.cache.demotes else {}))

    def run(self, *, progress=None) -> None:
        """Step until every request is finished; ``progress``: a tqdm-like bar advanced per
        finished request."""
        done = self.metrics.requests_total
        while self.has_unfinished():
            self.step()
            if progress is not None:
                progress.update(self.metrics.requests_total - done)
                done = self.metrics.requests_total
        if self.prefix is not None:
            self.metrics.prefix = self.prefix.stats.to_dict()

    def close(self) -> None:
        """Release what outlives the requests: the remote tier's writer (after writing what is
        queued) and the cache's files. Statistics stay readable."""
        if self.remote is not None:
            self.remote.close()
        self.cache.close()

    def summary(self) -> dict:
        if self.prefix is not None:
            self.metrics.prefix = self.prefix.stats.to_dict()
        out = self.metrics.summary()
        if self.remote is not None:
            out["remote"] = self.remote.stats.to_dict()
        return out


_DONE = object()


class AsyncEngine:
    """An Engine stepped on a background thread; asyncio front doors submit, stream and
    cancel. ``start()`` before use, ``shutdown()`` at the end (or ``async with``).

    Only the engine thread touches the engine: submissions and aborts are commands it runs
    between two steps, in the order they came, before the next step (a busy engine never
    starves them)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._wake = threading.Condition()
        self._commands: deque[tuple[Callable[[], object], Future]] = deque()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.error: BaseException | None = None

    async def __aenter__(self) -> "AsyncEngine":
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="tieredkv-engine", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    def _run_commands(self) -> None:
        while True:
            with self._wake:
                if not self._commands:
                    return
                fn, fut = self._commands.popleft()
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - the caller gets it
                fut.set_exception(exc)

    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._wake:
                while not self._stop and not self._commands and not engine.has_unfinished():
                    self._wake.wait()
                stop = self._stop
            self._run_commands()
            if stop:
                for req in list(engine.requests.values()):
                    if not req.finished:
                        engine.abort(req.request_id)
                engine.close()
                return
            if not engine.has_unfinished():
                continue
            try:
                engine.step()
            except BaseException as exc:  # noqa: BLE001 - the engine is broken: end every stream
                self.error = exc
                for req in list(engine.requests.values()):
                    if not req.finished:
                        engine._finish(req, "error", f"engine failure: {type(exc).__name__}: {exc}")
                with self._wake:
                    self._stop = True
                self._run_commands()
                return

    def _submit(self, fn: Callable[[], object]) -> Future:
        """Queue ``fn`` for the engine thread (before its next step); a Future of its result."""
        fut: Future = Future()
        with self._wake:
            if self._stop or self._thread is None:
                raise ConfigError("the engine is shut down (or not started)")
            self._commands.append((fn, fut))
            self._wake.notify_all()
        return fut

    def submit(self, prompt: Sequence[int], params: SamplingParams | None = None, *, request_id: str | None = None,
               salt: str | None = None, on_token: OnToken | None = None,
               on_finish: Callable[[Request], None] | None = None) -> Future:
        """``Engine.add_request`` from any thread without an event loop; the callbacks run on the
        engine thread (keep them short). A Future of the request (or of its typed error)."""
        prompt = list(prompt)
        return self._submit(lambda: self.engine.add_request(prompt, params, request_id=request_id, salt=salt,
                                                            on_token=on_token, on_finish=on_finish))

    def call_nowait(self, fn: Callable[[], object]) -> Future:
        """Run ``fn`` on the engine thread before its next step, from any thread (a Future of its
        result): reading the engine's state between steps (the Triton model's metrics)."""
        return self._submit(fn)

    @property
    def alive(self) -> bool:
        """The engine thread runs and takes work (not stopped, not failed)."""
        return self._thread is not None and self._thread.is_alive() and not self._stop and self.error is None

    async def call(self, fn: Callable[[], object]):
        """Run ``fn`` on the engine thread between two steps (reading the engine's state)."""
        return await self._call(fn)

    def stop_nowait(self) -> None:
        """Ask the engine thread to cancel everything and end (``shutdown`` without waiting)."""
        with self._wake:
            self._stop = True
            self._wake.notify_all()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    async def _call(self, fn: Callable[[], object]):
        """Run ``fn`` on the engine thread before its next step; its result (or exception)."""
        return await asyncio.wrap_future(self._submit(fn))

    async def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None, *,
                          request_id: str | None = None, salt: str | None = None) -> tuple[Request, asyncio.Queue]:
        """Queue a request; returns it and the queue its events arrive on (ending with a
        finished request's sentinel). Typed errors as Engine.add_request."""
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        put = lambda item: loop.call_soon_threadsafe(queue.put_nowait, item)  # noqa: E731
        prompt = list(prompt)
        req = await self._call(lambda: self.engine.add_request(prompt, params, request_id=request_id, salt=salt,
                                                               on_token=put, on_finish=lambda r: put(_DONE)))
        return req, queue

    async def generate(self, prompt: Sequence[int], params: SamplingParams | None = None, *,
                       request_id: str | None = None, salt: str | None = None) -> AsyncIterator[TokenEvent]:
        """Stream one request's token events. Leaving the iteration early cancels the request."""
        req, queue = await self.add_request(prompt, params, request_id=request_id, salt=salt)
        try:
            while True:
                item = await queue.get()
                if item is _DONE:
                    return
                yield item
        finally:
            if not req.finished:
                await self.abort(req.request_id)

    async def complete(self, prompt: Sequence[int], params: SamplingParams | None = None, **kw) -> Completion:
        """The whole completion of one request."""
        req, queue = await self.add_request(prompt, params, **kw)
        while await queue.get() is not _DONE:
            pass
        return req.out

    async def abort(self, request_id: str, *, keep_prefix: bool = True) -> bool:
        """Cancel a request (before the engine's next step); False when unknown or done."""
        return await self._call(lambda: self.engine.abort(request_id, keep_prefix=keep_prefix))

    def abort_nowait(self, request_id: str, *, keep_prefix: bool = True) -> Future:
        """``abort`` from any thread without an event loop (Triton's ``execute``, a callback):
        the Future completes once the engine thread ran it."""
        return self._submit(lambda: self.engine.abort(request_id, keep_prefix=keep_prefix))
