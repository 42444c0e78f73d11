"""kvpress presses as :class:`~tieredkv.runtime.eval.harness.EvalMethod` s, so NVIDIA kvpress
and tieredkv are scored side by side by the same perplexity and passkey code.

A press runs on *our* weights through ``transformers`` (:func:`tieredkv.models.hf_compat.to_transformers`
shares the tensors, nothing is copied). kvpress is used as a library: its press is a
context manager that hooks every attention layer and compresses the KV cache in the
first forward call of a fresh cache (the prefill; see ``is_prefilling`` in
``kvpress/presses/base_press.py``).

Question-agnostic protocol (the one :mod:`tieredkv.runtime.eval.harness` defines):

* ``open(context)`` prefills the whole context in ONE forward call inside
  ``with press(hf_model):`` on a fresh ``transformers.DynamicCache``; the cache is
  compressed before anything that follows the context is seen.
* ``logprobs(continuation)`` and ``greedy(prompt, n)`` run *outside* the press (a press
  never compresses after the prefill), with explicit ``position_ids`` that continue at
  ``context_len`` although the cache is shorter (as ``kvpress/pipeline.py`` does), and
  crop the cache back to its post-compression length afterwards, so every call leaves
  the session as it found it.

Because nothing is compressed after the prefill, feeding the continuation in chunks is
exactly teacher forcing token by token (``teacher_forcing_chunk``; the unit tests prove
chunk 1 == chunk N).

Budget ``b`` (fraction of the context's KV kept) = ``1 - compression_ratio``.

Notes on the presses in the question-agnostic setting:

* SnapKV scores with the attention of the *last window of the context* (64 tokens by
  default) rather than of the question, because the question is not seen before
  compression. That is the protocol, not a defect; it is the usual "query-agnostic"
  SnapKV variant.
* TOVA likewise scores with the last context token's attention.
* ObservedAttention (H2O-like) needs the full attention matrix of the prefill, so it
  runs with ``attn_implementation="eager"``; every other press here runs with ``"sdpa"``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch

from tieredkv.models.hf_compat import to_transformers
from tieredkv.models.llama import Llama
from tieredkv.runtime.eval.harness import EvalMethod, EvalSession, greedy_loop, token_logprobs

__all__ = [
    "KVPressMethod",
    "PRESS_CLASSES",
    "attn_implementation_for",
    "budget_to_compression_ratio",
    "make_press",
    "press_names",
    "press_registry",
]

#: registry name -> (kvpress class name, keyword arguments besides compression_ratio)
PRESS_CLASSES: dict[str, tuple[str, dict[str, Any]]] = {
    "streaming_llm": ("StreamingLLMPress", {"n_sink": 4}),
    "snapkv": ("SnapKVPress", {"window_size": 64, "kernel_size": 5}),
    "tova": ("TOVAPress", {}),
    "observed_attention": ("ObservedAttentionPress", {}),
    "knorm": ("KnormPress", {}),
    "expected_attention": ("ExpectedAttentionPress", {"n_future_positions": 512, "n_sink": 4}),
}

#: presses whose ``score`` needs the attention weights of the prefill (eager attention)
_NEEDS_ATTENTION_WEIGHTS = ("ObservedAttentionPress",)


def budget_to_compression_ratio(budget: float) -> float:
    """KV budget ``b`` in (0, 1] (fraction kept) -> kvpress ``compression_ratio = 1 - b``."""
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"KV budget must be in (0, 1], got {budget}")
    return 1.0 - budget


def press_names() -> list[str]:
    return list(PRESS_CLASSES)


def make_press(name: str, compression_ratio: float):
    """One kvpress press by registry name (see :data:`PRESS_CLASSES`)."""
    import kvpress

    if name not in PRESS_CLASSES:
        raise KeyError(f"unknown press {name!r}; expected one of {press_names()}")
    cls_name, kwargs = PRESS_CLASSES[name]
    return getattr(kvpress, cls_name)(compression_ratio=compression_ratio, **kwargs)


def press_registry(compression_ratio: float) -> dict[str, Any]:
    """Every registered press at ``compression_ratio``: name -> kvpress press instance."""
    return {name: make_press(name, compression_ratio) for name in PRESS_CLASSES}


def attn_implementation_for(press: Any) -> str:
    """``"eager"`` for presses that need the prefill's attention weights, else ``"sdpa"``."""
    if press is not None and type(press).__name__ in _NEEDS_ATTENTION_WEIGHTS:
        return "eager"
    return "sdpa"


class _PressSession(EvalSession):
    """A context prefilled (and compressed) into a fresh cache (``method.new_cache()``: a
    ``DynamicCache``, or a quantized one)."""

    def __init__(self, method: "KVPressMethod", context: Sequence[int], total_tokens: int | None = None) -> None:
        self.m = method
        self.context_len = len(context)
        if self.context_len == 0:
            raise ValueError("the context must hold at least one token")
        self.cache = method.new_cache()
        ids = torch.as_tensor(list(context), dtype=torch.long).unsqueeze(0)
        press = method.session_press(self.context_len, total_tokens)
        press_ctx = press(method.hf_model) if press is not None else contextlib.nullcontext()
        with torch.inference_mode(), press_ctx:
            out = method.hf_model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.last_logits = out.logits[0, -1].float()
        # lengths after compression, restored after each call
        self.layer_lens = [self.cache.layers[i].get_seq_length() for i in range(len(self.cache.layers))]
        if len(set(self.layer_lens)) > 1:
            # transformers builds one attention mask from layer 0's length for every layer
            raise NotImplementedError(f"{type(press).__name__} kept different token counts per layer "
                                      f"({sorted(set(self.layer_lens))}); only uniform presses are supported")
        method._record(self.context_len, self.layer_lens)
        # a cache that cannot be cropped (a quantized one) is restored from a snapshot instead
        self.saved = method.snapshot(self.cache)

    @property
    def kept_tokens(self) -> float:
        """Mean over layers of the tokens kept in the cache after compression."""
        return sum(self.layer_lens) / len(self.layer_lens)

    def _restore(self) -> None:
        if self.saved is not None:
            self.m.restore(self.cache, self.saved)
            return
        for layer, n in zip(self.cache.layers, self.layer_lens):
            layer.crop(n)

    @torch.inference_mode()
    def _feed(self, ids: Sequence[int], *, start_pos: int, chunk: int) -> torch.Tensor:
        """Feed ``ids`` after what is cached, positions from ``start_pos``; logits [n, V] float32."""
        outs = []
        ids = list(ids)
        for lo in range(0, len(ids), chunk):
            piece = torch.as_tensor(ids[lo : lo + chunk], dtype=torch.long).unsqueeze(0)
            pos = torch.arange(start_pos + lo, start_pos + lo + piece.shape[1]).unsqueeze(0)
            out = self.m.hf_model(input_ids=piece, position_ids=pos, past_key_values=self.cache, use_cache=True)
            outs.append(out.logits[0].float())
            self.m.after_forward(self.cache)
        return torch.cat(outs, dim=0)

    def logprobs(self, continuation: Sequence[int]) -> torch.Tensor:
        if len(continuation) == 0:
            return torch.zeros(0, dtype=torch.float64)
        try:
            logits = self._feed(continuation, start_pos=self.context_len, chunk=self.m.teacher_forcing_chunk)
        finally:
            self._restore()
        return token_logprobs(self.last_logits, logits, continuation)

    @torch.inference_mode()
    def greedy(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        try:
            logits = (self._feed(prompt, start_pos=self.context_len, chunk=self.m.teacher_forcing_chunk)[-1]
                      if len(prompt) else self.last_logits)
            pos = [self.context_len + len(prompt)]

            def step(tok: int) -> torch.Tensor:
                pos[0] += 1
                return self._feed([tok], start_pos=pos[0] - 1, chunk=1)[-1]

            out = greedy_loop(logits, step, max_new_tokens=max_new_tokens,
                              eos=set(self.m.model.config.eos_token_ids))
        finally:
            self._restore()
        return out

    def close(self) -> None:
        self.cache = None


class KVPressMethod(EvalMethod):
    """A kvpress press (or ``None``: no compression) on ``model``'s weights through transformers.

    ``budget`` is recorded for the results row (the press's own ``compression_ratio`` is
    what compresses; :func:`budget_to_compression_ratio` maps one to the other).
    ``attn_implementation``: ``None`` picks :func:`attn_implementation_for` the press.
    ``teacher_forcing_chunk``: continuation tokens per forward call while scoring (any
    value gives the same log-probs, see the module docstring).
    ``hf_model``: an already built ``to_transformers(model, ...)`` to share between methods.
    """

    def __init__(self, model: Llama, press: Any, *, name: str, budget: float | None = None,
                 attn_implementation: str | None = None, teacher_forcing_chunk: int = 256,
                 hf_model: Any = None, info: dict | None = None) -> None:
        if teacher_forcing_chunk < 1:
            raise ValueError(f"teacher_forcing_chunk must be >= 1, got {teacher_forcing_chunk}")
        self.model, self.press, self.name = model, press, name
        ratio = float(getattr(press, "compression_ratio", 0.0)) if press is not None else 0.0
        self.budget = 1.0 - ratio if budget is None else budget
        self.attn_implementation = attn_implementation or attn_implementation_for(press)
        self.hf_model = hf_model if hf_model is not None else to_transformers(
            model, attn_implementation=self.attn_implementation)
        self.teacher_forcing_chunk = teacher_forcing_chunk
        self.info = info or {}
        self._sessions = 0
        self._context_tokens = 0
        self._kept_tokens = 0.0

    @classmethod
    def from_registry(cls, model: Llama, press_name: str, budget: float, **kwargs: Any) -> "KVPressMethod":
        """The registered press ``press_name`` at KV budget ``budget`` (fraction kept)."""
        ratio = budget_to_compression_ratio(budget)
        return cls(model, make_press(press_name, ratio), name=press_name, budget=budget, **kwargs)

    # ------------------------------------------------------------------ hooks of a cache kind
    # (tools/eval/quantized_cache.py overrides them for transformers' QuantizedCache)
    def new_cache(self) -> Any:
        """A fresh cache for one session."""
        from transformers import DynamicCache

        return DynamicCache()

    def session_press(self, context_len: int, total_tokens: int | None) -> Any:
        """The press that compresses this session's prefill (None: none)."""
        return self.press

    def snapshot(self, cache: Any) -> Any:
        """What restores ``cache`` after a call; None: crop it back to its length after the prefill."""
        return None

    def restore(self, cache: Any, saved: Any) -> None:
        """Put ``cache`` back as ``snapshot`` saw it."""
        raise NotImplementedError

    def after_forward(self, cache: Any) -> None:
        """Called after every forward call that fed tokens after the context."""

    def _record(self, context_len: int, layer_lens: list[int]) -> None:
        self._sessions += 1
        self._context_tokens += context_len
        self._kept_tokens += sum(layer_lens) / len(layer_lens)

    def open(self, context: Sequence[int], *, total_tokens: int | None = None) -> _PressSession:
        """Prefill and compress ``context``. ``total_tokens`` is accepted for the harness
        interface and not used: a press's budget is a fraction of the *context* (kvpress's
        ``compression_ratio``), whatever follows it."""
        return _PressSession(self, context, total_tokens)

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "method": self.name,
            "budget": self.budget,
            "backend": "kvpress",
            "press": type(self.press).__name__ if self.press is not None else None,
            "attn_implementation": self.attn_implementation,
            "teacher_forcing_chunk": self.teacher_forcing_chunk,
        }
        if self.press is not None:
            d["press_args"] = {k: v for k, v in vars(self.press).items() if isinstance(v, (int, float, str, bool))}
        return {**d, **self.info}

    def stats(self) -> dict[str, Any]:
        if not self._sessions:
            return {"sessions": 0}
        return {
            "sessions": self._sessions,
            "context_tokens": self._context_tokens,
            "kept_tokens": self._kept_tokens,
            "kept_fraction": self._kept_tokens / self._context_tokens,
        }
