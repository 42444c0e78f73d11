"""Process lifetime for what tieredkv writes to disk (the T4 file, a half-built engine
directory): SIGTERM as an ordinary exit for the command-line tools, so that what they clean
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

#: the exit status of a process stopped by SIGTERM (128 + 15), as a shell reports it
SIGTERM_STATUS = 128 + signal.SIGTERM


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (on this machine)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _raise_exit(signum, frame) -> None:
    raise SystemExit(SIGTERM_STATUS)


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """Within the block, SIGTERM raises SystemExit(143) in the main thread (elsewhere: no change)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
