"""Ctrl-C (SIGINT) and SIGTERM during training: stop, save the current step, say how to resume.

The handler raises ``KeyboardInterrupt`` where the training loop is, so a long step stops at
once; the loop then rolls back the unfinished step (the weights are untouched until the
optimizer update) and saves a checkpoint of the last finished one. The update itself is a
critical section: a signal that arrives during it is held until it is done, so a checkpoint
never holds half-updated weights.
"""

from __future__ import annotations

import contextlib
import signal
import threading

# The shell's convention: 128 + the signal's number.
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Interrupted(KeyboardInterrupt):
    """Training stopped on a signal; ``str(e)`` says what was saved and how to resume."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class StopOnSignal:
    """While active, SIGINT and SIGTERM raise KeyboardInterrupt (held inside ``critical``);
    ``signal`` is the one received. Inactive off the main thread or when ``enabled`` is
    False (DDP ranks would have to agree on a step to stop at)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.signal: int | None = None
        self.held = False
        self.in_critical = False
        self.previous = {}

    def __enter__(self) -> StopOnSignal:
        if self.enabled:
            for sig in EXIT_CODES:
                self.previous[sig] = signal.signal(sig, self.handle)
        return self

    def __exit__(self, *exc) -> None:
        # Back to the previous handlers: a second Ctrl-C while the checkpoint is saved stops
        # the process (the save is atomic: the previous checkpoint stays intact).
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def handle(self, signum, frame) -> None:
        self.signal = signum
        if self.in_critical:
            self.held = True
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def critical(self):
        """A signal during the body is raised once the body is done."""
        self.in_critical = True
        try:
            yield
        finally:
            self.in_critical = False
        if self.held:
            self.held = False
            raise KeyboardInterrupt

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signal, 130)
