"""What the Triton model checks about its engine when it falls idle, and exports as metrics, so
a test (or an operator) can see from outside that no request left a page behind.

Call these on the engine thread between steps (``AsyncEngine.call_nowait``)."""

from __future__ import annotations


def open_sequences(engine) -> int:
    """Sequences the cache holds (each running or paused request has one)."""
    return engine.cache.usage().sequences


def pages_held_by_requests(engine) -> int:
    """Page references held by requests' sequences (a page per record, every layer together) — 0
    when no request is running or paused; the prefix index's own references are not counted."""
    return engine.cache.usage().sequence_refs


def idle_check(engine) -> str | None:
    """On an idle engine (no request waiting, running or paused): None when the cache's and the
    prefix index's invariants hold and no page is held for a request, else what is wrong."""
    if engine.has_unfinished():
        return None
    problems = []
    try:
        engine.cache.check()
        if engine.prefix is not None:
            engine.prefix.check()
    except AssertionError as exc:
        problems.append(f"invariant: {exc}")
    n = open_sequences(engine)
    if n:
        problems.append(f"{n} sequence(s) still open in the cache")
    held = pages_held_by_requests(engine)
    if held:
        problems.append(f"{held} page reference(s) still held for requests")
    live = [r.request_id for r in engine.requests.values() if not r.finished]
    if live:
        problems.append(f"unfinished requests {live[:5]}")
    return "; ".join(problems) or None
