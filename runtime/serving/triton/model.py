"""tieredkv in Triton's Python backend: ``TritonPythonModel`` (decoupled).

``tieredkv triton-repo`` copies this file into ``<repository>/<model>/1/model.py`` beside the
``engine_args.json`` it loads. One model instance runs one serving engine (continuous batching
over the tiered KV cache) on a thread of its own (``AsyncEngine``); ``execute`` hands each
request to it and returns at once, and responses go out through each request's response sender
from one sender thread (sends never stall the engine's steps):

- without ``stream``: one response, the whole completion (prefixed by the prompt unless
  ``exclude_input_in_output``), flagged final — the HTTP ``generate`` endpoint's case;
- with ``stream``: one response per generated token carrying the text new since the last one,
  the last flagged final.

Bad input (no ``text_input``, bad sampling parameters, a prompt the engine refuses) gets an
error response, flagged final; the model goes on. A request the client cancels (gRPC stream
cancelled, stopped stream) is aborted in the engine before its next step — its pages freed, or
with ``on_cancel: keep`` (config.pbtxt parameter) its full pages kept in the prefix index — and
gets a final ``CANCELLED`` error response. Cancellation is seen after each streamed response and
by a watcher thread polling the requests that are queued or not streaming.

Metrics: the engine's metric families (``tieredkv.runtime.serving.export``) are Triton custom
metrics on the server's ``/metrics`` (labels ``model``, ``version``), refreshed between engine
steps at most every ``METRICS_INTERVAL`` seconds while busy and whenever the engine falls idle;
counters are increased by the difference since the last refresh (Triton counters only
increase). Whenever the engine falls idle the model also checks the cache's and the prefix
index's invariants and that no page is left held for a request
(``tieredkv_triton_idle_checks_total``, ``tieredkv_triton_idle_check_failures_total``,
``tieredkv_kv_pages_held_by_requests``; a failure is logged with what is wrong).
"""

from __future__ import annotations

import itertools
import json
import queue
import re
import threading
import time
import traceback
from functools import partial
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from tieredkv.errors import TieredKVError
from tieredkv.runtime.serving.deploy import ENGINE_ARGS_FILE, EngineArgs
from tieredkv.runtime.serving.engine import AsyncEngine
from tieredkv.runtime.serving.export import PREFIX, Family, metric_families
from tieredkv.runtime.serving.triton import health
from tieredkv.runtime.serving.triton.protocol import ON_CANCEL, OPTION_INPUTS, decode_prompt, parse_request

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
METRICS_INTERVAL = 0.5  # seconds between two metric refreshes while the engine is busy
CANCEL_POLL = 0.1  # seconds between two looks at the requests not streaming (queued, or whole-completion)


class _Stream:
    """One Triton request's state. Written by the engine thread (tokens), the sender thread
    (cancellation seen after a send) and the watcher (cancellation polled)."""

    __slots__ = ("sender", "rid", "opts", "prompt_text", "n_prompt", "sent_tokens", "final_queued",
                 "cancel_requested", "checked_at", "request")

    def __init__(self, request, sender, rid, opts, prompt_text, n_prompt):
        self.request, self.sender, self.rid, self.opts = request, sender, rid, opts
        self.prompt_text, self.n_prompt = prompt_text, n_prompt
        self.sent_tokens = 0
        self.final_queued = False
        self.cancel_requested = False
        self.checked_at = time.monotonic()


class _Metrics:
    """tieredkv metric families as Triton custom metrics (created on first sight)."""

    def __init__(self, labels: dict[str, str], logger):
        self.labels, self.logger = labels, logger
        self.families: dict[str, object] = {}
        self.metrics: dict[tuple, object] = {}
        self.last: dict[tuple, float] = {}
        self.broken: set[str] = set()

    def publish(self, fams: list[Family]) -> None:
        for f in fams:
            if f.name in self.broken:
                continue
            fam = self.families.get(f.name)
            if fam is None:
                kind = pb_utils.MetricFamily.COUNTER if f.kind == "counter" else pb_utils.MetricFamily.GAUGE
                # a stable description: models sharing a server register the same family
                help = re.sub(r"over the last \d+ requests", "over the engine's metrics window", f.help)
                try:
                    fam = self.families[f.name] = pb_utils.MetricFamily(name=f.name, description=help, kind=kind)
                except Exception as exc:  # noqa: BLE001 - one metric must not take the model down
                    if "not supported" in str(exc):  # the server runs with --allow-metrics=false
                        self.broken.update(x.name for x in fams)
                        self.logger.log_info(f"tieredkv: custom metrics off ({exc})")
                        return
                    self.broken.add(f.name)
                    self.logger.log_warn(f"tieredkv: metric {f.name} not exported: {exc}")
                    continue
            for labels, value in f.samples:
                key = (f.name, tuple(sorted(labels.items())))
                metric = self.metrics.get(key)
                if metric is None:
                    metric = self.metrics[key] = fam.Metric(labels={**self.labels, **labels})
                if f.kind == "counter":
                    delta = value - self.last.get(key, 0.0)
                    if delta > 0:
                        metric.increment(delta)
                        self.last[key] = value
                else:
                    metric.set(value)


class TritonPythonModel:
    def initialize(self, args):
        self.logger = pb_utils.Logger
        self.model_name, self.version = args["model_name"], args["model_version"]
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise RuntimeError(f"tieredkv model {self.model_name}: config.pbtxt must set model_transaction_policy "
                               "{ decoupled: true } (responses stream from the engine's thread)")
        on_cancel = config.get("parameters", {}).get("on_cancel", {}).get("string_value", "free") or "free"
        if on_cancel not in ON_CANCEL:
            raise RuntimeError(f"tieredkv model {self.model_name}: parameter on_cancel must be one of "
                               f"{list(ON_CANCEL)}, got {on_cancel!r}")
        self.keep_prefix = on_cancel == "keep"
        path = Path(args["model_repository"]) / str(args["model_version"]) / ENGINE_ARGS_FILE
        t0 = time.perf_counter()
        try:
            served = EngineArgs.load(path).build(log=self.logger.log_info)
        except Exception as exc:  # noqa: BLE001 - the reason must reach the server log and the load status
            detail = "" if isinstance(exc, TieredKVError) else "\n" + traceback.format_exc()
            msg = f"tieredkv model {self.model_name}: cannot build the serving engine from {path}: " \
                  f"{type(exc).__name__}: {exc}"
            self.logger.log_error(msg + detail)
            raise RuntimeError(msg) from None
        self.tokenizer = served.tokenizer
        self.engine = AsyncEngine(served.engine)
        self._ids = itertools.count()
        self._active: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._refresh_pending = False
        self._last_refresh = 0.0
        self._dirty = True
        self.idle_checks = self.idle_failures = 0
        self.metrics = _Metrics({"model": self.model_name, "version": str(self.version)}, self.logger)
        self.engine.start()
        self._sender = threading.Thread(target=self._send_loop, name="tieredkv-triton-sender", daemon=True)
        self._sender.start()
        self._watcher = threading.Thread(target=self._watch_loop, name="tieredkv-triton-watcher", daemon=True)
        self._watcher.start()
        self._schedule_refresh()
        kv = type(served.engine.cache).__name__
        self.logger.log_info(f"tieredkv model {self.model_name} ready: {served.model_name} on {kv}, on_cancel="
                             f"{on_cancel}, built in {time.perf_counter() - t0:.1f}s")

    # ------------------------------------------------------------------ requests
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                st, ids, params, salt = self._prepare(request, sender)
            except (TieredKVError, ValueError) as exc:
                self._queue.put(("error", sender, str(exc), pb_utils.TritonError.INVALID_ARG))
                continue
            except Exception as exc:  # noqa: BLE001 - one request's surprise is that request's error
                self.logger.log_error(f"tieredkv: reading a request failed: {traceback.format_exc()}")
                self._queue.put(("error", sender, f"{type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL))
                continue
            with self._lock:
                self._active[st.rid] = st
            try:
                fut = self.engine.submit(ids, params, request_id=st.rid, salt=salt, on_token=partial(self._on_token, st),
                                         on_finish=partial(self._on_finish, st))
            except TieredKVError as exc:  # the engine is shut down (it failed, or the model is unloading)
                with self._lock:
                    self._active.pop(st.rid, None)
                why = f": {self.engine.error}" if self.engine.error is not None else ""
                self._queue.put(("error", sender, f"{exc}{why}", pb_utils.TritonError.UNAVAILABLE))
                continue
            fut.add_done_callback(partial(self._submitted, st))
        return None

    def _prepare(self, request, sender):
        text = pb_utils.get_input_tensor_by_name(request, "text_input")
        if text is None:
            raise ValueError("text_input is required (the prompt, a string)")
        values = text.as_numpy().reshape(-1)
        if values.size != 1:
            raise ValueError(f"text_input must hold one string, got {values.size}")
        prompt = decode_prompt(values[0])
        tensors = {}
        for name in OPTION_INPUTS:
            t = pb_utils.get_input_tensor_by_name(request, name)
            if t is not None:
                tensors[name] = bool(t.as_numpy().reshape(-1)[0])
        sp = pb_utils.get_input_tensor_by_name(request, "sampling_parameters")
        sampling = sp.as_numpy().reshape(-1)[0] if sp is not None else None
        params, salt, opts = parse_request(sampling, request.parameters(), tensors)
        ids = self.tokenizer.encode(prompt)
        st = _Stream(request, sender, f"triton-{next(self._ids)}", opts, prompt, len(ids))
        return st, ids, params, salt

    # callbacks on the engine thread: short, never block
    def _submitted(self, st: _Stream, fut) -> None:
        exc = fut.exception()
        if exc is None:
            return
        with self._lock:
            self._active.pop(st.rid, None)
        st.final_queued = True
        code = pb_utils.TritonError.INVALID_ARG if isinstance(exc, TieredKVError) else pb_utils.TritonError.INTERNAL
        self._queue.put(("error", st.sender, str(exc), code))

    def _on_token(self, st: _Stream, event) -> None:
        if not st.opts.stream or st.cancel_requested or st.final_queued:
            return
        n = 0 if event.finish_reason == "eos" else 1  # the end-of-sequence token is not part of the output
        fields = {"text": event.text, "finish_reason": event.finish_reason or "", "n_out": n}
        st.sent_tokens += n
        final = event.finish_reason is not None
        st.final_queued = final
        self._queue.put(("response", st, fields, FINAL if final else 0))

    def _on_finish(self, st: _Stream, req) -> None:
        with self._lock:
            self._active.pop(st.rid, None)
        self._dirty = True
        if not st.final_queued:
            st.final_queued = True
            out = req.out
            if out.finish_reason == "cancelled":
                self._queue.put(("error", st.sender, "request cancelled", pb_utils.TritonError.CANCELLED))
            elif out.finish_reason == "error":
                self._queue.put(("error", st.sender, out.error or "the engine failed", pb_utils.TritonError.INTERNAL))
            elif st.opts.stream:
                fields = {"text": "", "finish_reason": out.finish_reason or "",
                          "n_out": len(out.token_ids) - st.sent_tokens}
                self._queue.put(("response", st, fields, FINAL))
            else:
                text = (st.prompt_text if st.opts.prepend_input else "") + out.text
                fields = {"text": text, "finish_reason": out.finish_reason or "", "n_out": len(out.token_ids)}
                self._queue.put(("response", st, fields, FINAL))
        if not self.engine.engine.has_unfinished() or time.monotonic() - self._last_refresh >= METRICS_INTERVAL:
            self._schedule_refresh()

    def _cancel(self, st: _Stream) -> None:
        if st.cancel_requested:
            return
        st.cancel_requested = True
        try:
            self.engine.abort_nowait(st.rid, keep_prefix=self.keep_prefix)
        except TieredKVError:
            pass  # shut down: every request is ended anyway

    # ------------------------------------------------------------------ the sender thread
    def _response(self, st: _Stream, fields: dict):
        o = st.opts
        out = [pb_utils.Tensor("text_output", np.array([fields["text"].encode("utf-8")], dtype=np.object_))]
        if o.return_finish_reason:
            out.append(pb_utils.Tensor("finish_reason", np.array([fields["finish_reason"].encode()], dtype=np.object_)))
        if o.return_num_input_tokens:
            out.append(pb_utils.Tensor("num_input_tokens", np.array([st.n_prompt], dtype=np.uint32)))
        if o.return_num_output_tokens:
            out.append(pb_utils.Tensor("num_output_tokens", np.array([fields["n_out"]], dtype=np.uint32)))
        return pb_utils.InferenceResponse(output_tensors=out)

    def _send_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            kind = item[0]
            try:
                if kind == "response":
                    _, st, fields, flags = item
                    st.sender.send(self._response(st, fields), flags=flags)
                    if not flags and not st.cancel_requested:
                        st.checked_at = time.monotonic()
                        if st.sender.is_cancelled():
                            self._cancel(st)
                elif kind == "error":
                    _, sender, message, code = item
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)), flags=FINAL)
                elif kind == "metrics":
                    self.metrics.publish(item[1])
            except Exception:  # noqa: BLE001 - a client gone away must not stop the others' responses
                self.logger.log_verbose(f"tieredkv: {kind} not sent: {traceback.format_exc()}")

    # ------------------------------------------------------------------ the watcher thread
    def _watch_loop(self) -> None:
        while not self._stopping.wait(CANCEL_POLL):
            now = time.monotonic()
            with self._lock:
                streams = list(self._active.values())
            for st in streams:
                if st.cancel_requested or st.final_queued or now - st.checked_at < 2.5 * CANCEL_POLL:
                    continue
                st.checked_at = now
                try:
                    cancelled = st.sender.is_cancelled()
                except Exception:  # noqa: BLE001 - finished in the meantime
                    cancelled = False
                if cancelled:
                    self._cancel(st)
            if (streams or self._dirty) and now - self._last_refresh >= 2 * METRICS_INTERVAL:
                self._schedule_refresh()

    # ------------------------------------------------------------------ metrics
    def _schedule_refresh(self) -> None:
        if self._refresh_pending:
            return
        self._refresh_pending = True
        self._last_refresh = time.monotonic()
        try:
            self.engine.call_nowait(self._refresh)
        except TieredKVError:
            self._refresh_pending = False

    def _refresh(self) -> None:
        """On the engine thread, between steps."""
        self._refresh_pending = False
        self._last_refresh = time.monotonic()
        engine = self.engine.engine
        idle = not engine.has_unfinished()
        self._dirty = not idle
        if idle:
            problem = health.idle_check(engine)
            self.idle_checks += 1
            if problem:
                self.idle_failures += 1
                self.logger.log_error(f"tieredkv model {self.model_name}: idle check failed: {problem}")
        fams = metric_families(engine)
        with self._lock:
            in_flight = len(self._active)

        def one(name, kind, help, value):
            return Family(PREFIX + name, kind, help, [({}, float(value))])

        fams += [one("triton_requests_in_flight", "gauge", "Triton requests the engine has not finished", in_flight),
                 one("kv_sequences_open", "gauge", "sequences open in the KV cache (running and paused requests)",
                     health.open_sequences(engine)),
                 one("kv_pages_held_by_requests", "gauge",
                     "page references held for requests (0 when idle; the prefix index's not counted)",
                     health.pages_held_by_requests(engine)),
                 one("triton_idle_checks_total", "counter",
                     "invariant checks run when the engine fell idle (cache, prefix index, no page held)",
                     self.idle_checks),
                 one("triton_idle_check_failures_total", "counter", "idle checks that failed (the log says why)",
                     self.idle_failures)]
        self._queue.put(("metrics", fams))

    # ------------------------------------------------------------------ unload
    def finalize(self):
        self.logger.log_info(f"tieredkv model {self.model_name}: stopping the engine")
        self._stopping.set()
        self.engine.stop_nowait()  # cancels what is left: each request gets its final response
        self.engine.join(60)
        self._queue.put(None)
        self._sender.join(60)
        self._watcher.join(5)
