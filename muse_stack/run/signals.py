"""SIGINT/SIGTERM during a run: a flag the training loop reads at known points, never an
exception thrown into the middle of a save.

The handler is installed on the first line of a run and stays until its results are
written, so a signal during setup, a step or a checkpoint save only asks the run to stop at
the next safe point; a second signal during a save changes nothing (the save finishes).
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

from muse_stack.util.errors import MuseStackError

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequested(MuseStackError):
    """Raised between setup phases when a stop signal has arrived (exit status 130, as for SIGINT)."""

    exit_code = 130

    def __init__(self, name: str) -> None:
        super().__init__(f"stopped by {name} during setup")
        self.signal = name


class StopFlag:
    """Records the first stop request (a signal name, or a reason such as ``stop_after``)."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self.count = 0  #: signals received, the first one included

    def __call__(self, signum, _frame) -> None:
        self.count += 1
        if self.signal is None:
            self.signal = signal.Signals(signum).name

    def request(self, reason: str) -> None:
        if self.signal is None:
            self.signal = reason

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def check(self) -> None:
        """Between setup phases: stop now when asked to."""
        if self.signal is not None:
            raise StopRequested(self.signal)

    @contextmanager
    def installed(self) -> Iterator["StopFlag"]:
        """Catch SIGINT/SIGTERM in this block (main thread only; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        old = {s: signal.getsignal(s) for s in SIGNALS}
        for s in SIGNALS:
            signal.signal(s, self)
        try:
            yield self
        finally:
            for s, h in old.items():
                signal.signal(s, h)
