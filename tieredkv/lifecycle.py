"""Process lifetime for what tieredkv writes to disk (the T4 file, a half-built engine
directory): SIGTERM and SIGHUP as ordinary exits for the command-line tools, so that what they clean
up on the way out (``finally`` blocks, context managers, ``atexit`` and ``weakref.finalize``
hooks) is cleaned up when a job scheduler or ``kill`` stops them too; and whether a process
is alive, so that what a SIGKILL (which cannot be caught) left is recognised as stale and
removed the next time."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Iterator

#: the signals that end a command as an ordinary exit: SIGTERM (kill, a job scheduler) and SIGHUP
#: (a closed terminal, a dropped ssh session); the status is 128 + the signal, as a shell reports it
TERMINATING = (signal.SIGTERM, signal.SIGHUP)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (on this machine)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


#: the exit status of the terminating signal received within :func:`signals_exit`, if any
_received: list[int] = []


def _raise_exit(signum, frame) -> None:
    _received.append(128 + signum)
    raise SystemExit(128 + signum)


def received_exit() -> int | None:
    """The exit status (128 + signal) of a terminating signal received within the current (or
    last) :func:`signals_exit` block, else None. A signal that lands inside a C extension's
    initialisation reaches the caller as another exception (``ImportError: initialization
    failed``), not as the SystemExit the handler raised: this tells the caller it was one."""
    return _received[0] if _received else None


def terminated(exc: SystemExit) -> bool:
    """Whether ``exc`` is the exit a terminating signal raised (:func:`signals_exit`)."""
    return exc.code in {128 + s for s in TERMINATING}


@contextlib.contextmanager
def signals_exit() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise SystemExit(128 + signal) in the main thread
    (elsewhere: no change), so cleanup code runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received.clear()
    previous = {s: signal.signal(s, _raise_exit) for s in TERMINATING}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Within the block, SIGINT, SIGTERM and SIGHUP wait (blocked) until it ends: for a few steps
    that must not be split (two renames that replace a directory)."""
    blocked = {signal.SIGINT, *TERMINATING}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
