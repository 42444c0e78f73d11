"""The scheduler: which requests hold KV, and what each step feeds.

Each step (``Scheduler.schedule``):
  1. **Admission**, oldest first: paused requests resume, then waiting ones join, while the
     sequence cap (``max_num_seqs``) and the KV budget allow (below). A request whose
     prompt and output could never fit is refused at submission (:meth:`Scheduler.check`).
  2. **The step's work** under one token budget (``max_num_batched_tokens``): every running
     request that is decoding feeds its one token; the rest of the budget goes to prefill
     chunks (at most ``prefill_chunk`` tokens each), oldest request first. With prefix reuse,
     a request that has computed nothing of its own first takes the prefix pages published
     since its admission, then waits while an older request is still prefilling the page it
     would compute next (two questions on one document, admitted together, prefill it once).
  3. **Room for the step**: when the KV the step needs exceeds the budget (optimistic
     admission lets requests grow into it), or no running request has room for its next
     prefill page, running requests are preempted — the most recently admitted first (the
     work lost is the least; the oldest requests finish first) — by *demotion* (tiered cache:
     the victim's pages leave the device for the host / disk tier; it resumes later with
     nothing recomputed) or by *recompute* (its pages are freed; it re-prefills its prompt
     and output so far, from the prefix index where reuse is on).

The KV budget is counted in pages per layer of the device (every layer holds the same
pages), with the cache's own arithmetic (``KVCache.device_pages`` and its kin — the scheduler
sees the cache through the serving interface only). What a running request needs on the device:
  * paged cache: every page of its tokens;
  * tiered cache: its hot window only (T0: sink pages, recent window, the page being
    written) — the rest of its pages may live on the host and disk. Admission counts what each
    request is committed to (a prefilling request its hot window to come); a step's plan what
    each holds while the step runs (nothing yet for one not prefilled; a prefill chunk one page
    beyond its hot window, the engine feeding it in forward calls that fit:
    ``KVCache.max_step_tokens``), so the room of requests not started serves the one prefilling.
Admission policies (``admission``):
  * ``contiguous``: reserve the model's full context per request, as a contiguous
    max-length preallocation does (the baseline of the design note; paged cache only);
  * ``reserve``: reserve what the request can reach (prompt + max_new_tokens; for the
    tiered cache a full hot window) — no request is ever preempted;
  * ``optimistic``: admit when what the request needs now fits; preempt when growth does
    not. On the tiered cache, the host tier is always reserved to completion (when it is
    bounded and there is no disk tier), the index's unlisted prefix pages giving way first.

The tiered cache's working sets: under ``reserve`` and ``optimistic`` a request also waits
while the device could not hold, next to the running requests', every page it attends in a
step at its final length (``KVCache.holds_working_sets``: hot windows at full precision, the
other attended pages at full precision or warm) — unless nothing is running, so a request
too long for the device alone still runs, tiered. Past that point every step would read the
missing pages from the host (exact mode) for every request at once: measured under load, that
multiplied the inter-token latency by ten while the queue it replaced was short.
``oversubscribe=True`` admits on hot windows alone (more requests at once, each slower).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from tieredkv.errors import ConfigError, ContextLengthError, KVCacheFullError, short
from tieredkv.runtime.serving.request import Request, RequestStatus

ADMISSION = ("contiguous", "reserve", "optimistic")
PREEMPTION = ("auto", "demote", "recompute")


@dataclass(frozen=True)
class SchedulerConfig:
    """``max_num_seqs``: requests holding KV at once; ``max_num_batched_tokens``: tokens fed per
    step, decode and prefill together (None: no limit — every admitted prompt is prefilled in
    the step it is admitted, a batch job's throughput setting, unless it waits for an older
    request's prefill of the same prefix); ``prefill_chunk``: the most
    tokens of one prompt per forward call; ``admission`` / ``preemption``: see the module
    docstring (``auto``: demote on the tiered cache, recompute on the others); ``max_model_len``: the longest sequence served (default: the model's context); ``oversubscribe``: admit
    past the tiered cache's device working sets (module docstring)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = 2048
    prefill_chunk: int = 512
    admission: str = "optimistic"
    preemption: str = "auto"
    max_model_len: int | None = None
    oversubscribe: bool = False

    def __post_init__(self) -> None:
        for name, low in (("max_num_seqs", 1), ("prefill_chunk", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= 1 << 20:
                raise ConfigError(f"{name} must be an integer in [{low}, {1 << 20}], got {short(value)}")
        for name in ("max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 1 <= value <= 1 << 24):
                raise ConfigError(f"{name} must be None or an integer in [1, {1 << 24}], got {short(value)}")
        if self.admission not in ADMISSION:
            raise ConfigError(f"admission must be one of {list(ADMISSION)}, got {short(self.admission)}")
        if self.preemption not in PREEMPTION:
            raise ConfigError(f"preemption must be one of {list(PREEMPTION)}, got {short(self.preemption)}")
        if not isinstance(self.oversubscribe, bool):
            raise ConfigError(f"oversubscribe must be true or false, got {short(self.oversubscribe)}")


@dataclass
class ScheduledStep:
    """One step's work: prefill chunks (request, tokens) and the decoding requests; the
    requests preempted to make room for it, by kind."""

    prefills: list[tuple[Request, int]] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)
    preempted: list[tuple[Request, str]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.prefills) + len(self.decodes)


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class Scheduler:
    """Request queues and the KV budget of one cache (see the module docstring). The engine
    owns the cache; the scheduler only counts, except for preemption and resumption, which
    it asks of the cache."""

    def __init__(self, cache, config: SchedulerConfig, *, context: int, prefix=None,
                 open_sequence: Callable[[Request], None], close_sequence: Callable[[Request], None],
                 rematch: Callable[[Request], None] | None = None) -> None:
        """``open_sequence(req)`` gives an admitted request its sequence in the cache (with its
        prefix-index hits); ``close_sequence(req)`` frees it (a recompute preemption);
        ``rematch(req)`` gives a request that has computed nothing yet the prefix pages
        published since (prefix reuse)."""
        self.cache, self.config, self.prefix = cache, config, prefix
        self._open, self._close, self._rematch = open_sequence, close_sequence, rematch
        self.max_len = min(context, config.max_model_len or context)
        self.demotes = cache.demotes
        self.page_size = cache.page_size  # 1: a cache without pages (the contiguous oracle) is counted in tokens
        self.preemption = config.preemption
        if self.preemption == "auto":
            self.preemption = "demote" if self.demotes else "recompute"
        if self.preemption == "demote" and not self.demotes:
            raise ConfigError("preemption 'demote' needs the tiered cache (pages have somewhere to go); use "
                              "preemption = 'recompute' with the paged cache")
        if config.admission == "contiguous" and self.demotes:
            raise ConfigError("admission 'contiguous' models max-length preallocation on the paged cache; "
                              "use 'reserve' or 'optimistic' with the tiered cache")
        self.capacity = cache.device_capacity
        self.host_capacity = cache.host_capacity
        self.waiting: deque[Request] = deque()  # new and recompute-preempted requests, oldest first
        self.paused: deque[Request] = deque()  # demotion-preempted, in preemption order
        self.running: list[Request] = []  # in admission order
        self._admissions = 0

    # ------------------------------------------------------------------ what a request needs
    def final_tokens(self, req: Request) -> int:
        """The tokens a request can reach."""
        return min(self.max_len, len(req.prompt) + req.params.max_new_tokens)

    def _reserved(self, req: Request) -> int:
        """Device pages reserved for ``req`` whatever its length (0: none, it is counted as it grows)."""
        a, P = self.config.admission, self.page_size
        if a == "contiguous":
            return _pages(self.max_len, P)
        if a == "reserve":
            return self.cache.reserve_pages(self.final_tokens(req))
        return 0

    def _need(self, req: Request, new: int, *, committed: bool = True) -> int:
        """Device pages ``req`` holds after feeding ``new`` more tokens (while it writes them);
        ``committed``: at least what it was admitted with while it prefills its prompt."""
        now, after = req.computed, req.computed + new
        prompt = len(req.tokens) if committed and req.to_feed > 1 else None
        return max(self.cache.device_pages(now, after, prompt=prompt), self._reserved(req))

    def device_need(self, plan: dict[Request, int] | None = None, extra: Request | None = None,
                    extra_new: int = 0, *, committed: bool = True) -> int:
        """Device pages the running requests (and ``extra``) need after feeding ``plan``'s tokens:
        ``committed`` (admission), with what each prefilling request was admitted with; else
        (a step's plan) what each holds while the step runs — a request admitted but not
        prefilled yet holds nothing, and the one prefilling may use that room for its chunk
        (its pages past the hot window leave the device when the chunk is in)."""
        plan = plan or {}
        total = sum(self._need(r, plan.get(r, 0), committed=committed) for r in self.running)
        if extra is not None:
            total += self._need(extra, extra_new, committed=committed)
        return total

    def _host_need(self, extra: Request | None = None) -> int:
        """Host pages reserved to completion: every request holding pages, and the prefix
        index's pages a request lists (those only the index holds can be dropped)."""
        reqs = self.running + list(self.paused) + ([extra] if extra is not None else [])
        return sum(_pages(self.final_tokens(r), self.page_size) for r in reqs)

    def _host_fits(self, extra: Request) -> bool:
        if self.host_capacity is None:
            return True
        need = self._host_need(extra)
        cached = len(self.prefix.unlisted()) if self.prefix is not None else 0
        short_by = need + cached - self.host_capacity
        if short_by > 0 and self.prefix is not None:
            self.prefix.evict(short_by)
            cached = len(self.prefix.unlisted())
        return need + cached <= self.host_capacity

    # ------------------------------------------------------------------ submission
    def check(self, req: Request) -> None:
        """Refuse a request that could never run: longer than the served length, or needing
        more KV than the whole budget holds."""
        n = len(req.prompt)
        if n == 0:
            raise ContextLengthError(f"request {req.request_id}: the prompt is empty; expected at least one token")
        if n >= self.max_len:
            raise ContextLengthError(
                f"request {req.request_id}: the prompt has {n} tokens; the served length is {self.max_len} tokens, "
                f"so a prompt may have at most {self.max_len - 1} (one position must remain to generate)")
        P = self.page_size
        if self.capacity is not None:
            final = self.final_tokens(req)
            alone = max(self._reserved(req), self.cache.device_pages(final, final))
            if alone > self.capacity:
                what = "its hot window" if self.demotes else f"its {final} tokens"
                raise KVCacheFullError(
                    f"request {req.request_id}: needs {alone} device pages per layer ({what}); the KV budget holds "
                    f"{self.capacity}. Raise the budget, or lower max_new_tokens or the prompt")
        if self.host_capacity is not None and _pages(self.final_tokens(req), P) > self.host_capacity:
            raise KVCacheFullError(
                f"request {req.request_id}: its {self.final_tokens(req)} tokens need {_pages(self.final_tokens(req), P)} host "
                f"pages per layer; the host budget holds {self.host_capacity} and there is no disk tier")

    def add(self, req: Request) -> None:
        self.check(req)
        self.waiting.append(req)

    def abort(self, req: Request) -> None:
        """Take a request out of every queue (the engine frees its pages)."""
        for queue in (self.waiting, self.paused):
            if req in queue:
                queue.remove(req)
        if req in self.running:
            self.running.remove(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.paused or self.running)

    # ------------------------------------------------------------------ one step
    def _fits(self, plan: dict[Request, int], extra: Request | None = None, extra_new: int = 0, *,
              committed: bool = True) -> bool:
        return self.capacity is None or self.device_need(plan, extra, extra_new, committed=committed) <= self.capacity

    def _admissible(self, req: Request) -> bool:
        """Whether a waiting request fits next to the running ones: its reservation, or (optimistic)
        what it needs soon — the pages of its first prefill chunk (paged), its hot window once
        its prompt is in (tiered)."""
        if self.capacity is None:
            return True
        return (self.device_need({}) + max(self._soon(req), self._reserved(req)) <= self.capacity
                and self._working_sets_fit(req))

    def _working_sets_fit(self, req: Request) -> bool:
        """Whether the device holds the working sets of the running requests and ``req`` at their
        final lengths (module docstring); always when nothing runs or ``oversubscribe`` is set."""
        if self.config.oversubscribe or self.config.admission == "contiguous" or not self.running:
            return True
        return self.cache.holds_working_sets([self.final_tokens(r) for r in self.running + [req]])

    def _soon(self, req: Request) -> int:
        """Device pages a request needs to make progress once admitted: its hot window once its
        prompt is in and a page to write into (tiered); its first prefill chunk (paged)."""
        return self.cache.admission_pages(len(req.tokens), min(len(req.tokens), self.config.prefill_chunk))

    def _admit(self) -> None:
        while self.paused and len(self.running) < self.config.max_num_seqs:
            req = self.paused[0]
            if not self._fits({}, req, 0) or not self._working_sets_fit(req):
                break
            self.paused.popleft()
            self.cache.resume(req.seq_id)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        if self.paused:
            return  # paused requests go first
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if not self._admissible(req) or not self._host_fits(req):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.admitted_at = self._admissions
            self._admissions += 1
            self.running.append(req)
            self._open(req)

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        self._admit()
        while True:
            plan = self._plan(step)
            if plan or not self.running:
                break
            # every running request is prefilling and none has room for a page: the newest gives way
            if len(self.running) == 1:
                raise KVCacheFullError(f"request {self.running[0].request_id} alone needs more KV than the budget "
                                       f"holds ({self.capacity} device pages per layer)")
            self._preempt(max(self.running, key=lambda r: r.admitted_at), step)
        for req in self.running:
            if req in plan:
                if self._decoding(req):
                    step.decodes.append(req)
                else:
                    step.prefills.append((req, plan[req]))
        return step

    def _plan(self, step: ScheduledStep) -> dict[Request, int]:
        """Tokens per running request this step (preempting where decodes outgrow the budget)."""
        budget = self.config.max_num_batched_tokens
        left = float("inf") if budget is None else budget
        plan: dict[Request, int] = {}
        for req in self.running:
            if self._decoding(req) and left >= 1:
                plan[req] = 1
                left -= 1
        while not self._fits(plan, committed=False):  # growth beyond the budget: preempt the newest
            victim = max((r for r in self.running), key=lambda r: r.admitted_at)
            if len(self.running) == 1:
                raise KVCacheFullError(f"request {victim.request_id} alone needs more KV than the budget holds")
            self._preempt(victim, step)
            plan.pop(victim, None)
        for req in sorted(self.running, key=lambda r: r.admitted_at):
            if left <= 0:
                break
            if req in plan or self._decoding(req) or self._waits_for_prefix(req):
                continue
            n = int(min(req.to_feed, self.config.prefill_chunk, left))
            while n > 0 and not self._fits({**plan, req: n}, committed=False):  # shrink the chunk to what fits
                n = n - self.page_size if n > self.page_size else 0
            if n <= 0:
                continue
            plan[req] = n
            left -= n
        return plan

    def _waits_for_prefix(self, req: Request) -> bool:
        """A request that has computed nothing of its own takes the prefix pages published since
        its admission, then waits while an older running request is still prefilling the page it
        would compute next (hash-chain keys name a page and everything before it)."""
        if self._rematch is None or req.chain is None or req.computed != req.hit_tokens:
            return False
        self._rematch(req)
        P = self.page_size
        page = req.computed // P
        keys = req.chain.extend(req.tokens)
        if page >= min(len(keys), (len(req.tokens) - 1) // P):
            return False
        for other in self.running:
            if (other is req or other.admitted_at > req.admitted_at or other.chain is None
                    or self._decoding(other) or other.computed >= (page + 1) * P):
                continue
            theirs = other.chain.extend(other.tokens)
            if page < len(theirs) and theirs[page] == keys[page]:
                return True
        return False

    @staticmethod
    def _decoding(req: Request) -> bool:
        """Past its prompt: feeds the one token it sampled last."""
        return req.seq_id is not None and req.to_feed == 1 and bool(req.out.token_ids)

    def _preempt(self, victim: Request, step: ScheduledStep) -> None:
        self.running.remove(victim)
        kind = self.preemption
        if kind == "demote":
            self.cache.pause(victim.seq_id)
            victim.status = RequestStatus.PAUSED
            self.paused.append(victim)
        else:
            self._close(victim)
            victim.status = RequestStatus.WAITING
            self.waiting.appendleft(victim)
        victim.metrics.preemptions[kind] = victim.metrics.preemptions.get(kind, 0) + 1
        step.preempted.append((victim, kind))
