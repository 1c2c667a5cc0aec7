"""SIGINT and SIGTERM during a run: stop within seconds, with the checkpoint holding the last whole step
(train.py; docs/training.md, Reliability)."""
import os
import signal
import sys
from contextlib import contextmanager


class Stopped(BaseException):
    """Raised by SIGINT/SIGTERM inside StopSignal.interruptible(). A BaseException, as KeyboardInterrupt is, so that
    no `except Exception` on its way swallows it."""


class StopSignal:
    """SIGINT/SIGTERM stop the run within seconds, wherever it is, and the checkpoint holds the last whole step.
    Inside interruptible() (evaluation, sampling, a step's forward and backward passes: nothing there changes the
    weights) the signal raises Stopped at once. Elsewhere it only sets a flag that the loop reads after the step:
    stopping inside the optimizer update would save half-updated weights. immediate=False (DDP) always takes the
    flag, so that every rank stops after the same step. A second signal exits at once without saving; the last
    checkpoint stays as it was, since a save writes a temporary file and renames it."""

    def __init__(self, immediate: bool):
        self.immediate = immediate

    def __enter__(self):
        self.signum, self.raising = None, self.immediate  # a run's set-up writes nothing that a stop could cut short
        self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, frame):
        if self.signum is not None:
            sys.stdout.flush()
            print(f"train.py: second {signal.Signals(signum).name}: exiting at once, without saving", file=sys.stderr,
                  flush=True)
            os._exit(128 + signum)
        self.signum = signum
        if self.raising:
            raise Stopped(self.name)

    @contextmanager
    def interruptible(self):
        if not self.immediate:
            yield
            return
        if self.signum is not None:  # it came during the last update or save
            raise Stopped(self.name)
        self.raising = True
        try:
            yield
        finally:
            self.raising = False

    def hold(self) -> None:
        """End the set-up: from here on only interruptible() raises."""
        self.raising = False

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)
