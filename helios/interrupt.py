"""Ctrl-C as a flag that a long-running command checks between units of work (helios-train's
steps, helios-sample's tokens), never as an exception raised wherever the program happens to be.

The signal arrives between two Python bytecodes, often while a tensor's finaliser hands its
memory back; an exception raised there is swallowed by Python, which prints its traceback
and carries on (a sample once ran on for a minute after SIGINT).  So the first Ctrl-C only sets
``stop`` and says what will happen; a second one gives up at once (KeyboardInterrupt)."""

from __future__ import annotations

import signal
import sys


class StopFlag:
    """Install the handler (``restore()`` puts the previous one back).  ``stop`` turns True at the
    first Ctrl-C, when ``message`` is printed to stderr; the second raises KeyboardInterrupt."""

    def __init__(self, message: str):
        self.stop = False
        self.message = message
        self._prev = signal.signal(signal.SIGINT, self._handler)

    def _handler(self, signum, frame):
        if self.stop:  # a second Ctrl-C: give up at once
            signal.signal(signal.SIGINT, self._prev)
            raise KeyboardInterrupt
        self.stop = True
        print(f"\ninterrupt: {self.message} (Ctrl-C again to abort)", file=sys.stderr)

    def restore(self) -> None:
        """Put back the handler that was there before."""
        signal.signal(signal.SIGINT, self._prev)
