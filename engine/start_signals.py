"""What SIGINT (Ctrl-C) and SIGTERM do while `kvtier serve` starts (issue 44, item 11).

This module imports nothing of the engine, so that engine.cli can install the handlers
before its own imports load."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from types import FrameType

COMMAND = "kvtier"


class StartSignals:
    """SIGINT (Ctrl-C) or SIGTERM while `kvtier serve` starts: one line, and the process
    ends at once with status 128 + the signal (130 for Ctrl-C). Start-up holds nothing to
    save (disk records are written under a temporary name and renamed), and unwinding it
    from wherever the signal lands prints a KeyboardInterrupt traceback out of an import,
    or aborts the process (`terminate called without an active exception`) when a C++
    thread runs; os._exit does neither. Once the server is ready uvicorn handles both and
    raises them again after its shutdown: SIGINT then ends the process with 130, SIGTERM
    (the orderly stop) with 0."""

    def __init__(self) -> None:
        self.command = COMMAND
        self._ready = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def ready(self) -> None:
        self._ready = True

    def release(self) -> None:
        """Back to Python's handlers (for the commands other than serve)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._ready:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        os.write(2, f"{self.command}: {signal.Signals(signum).name} during start-up, stopped\n".encode())
        os._exit(128 + signum)

    @staticmethod
    def is_command(module_name: str) -> bool:
        """Whether this process is the `kvtier` command: engine.cli run as `python -m
        engine.cli` (`module_name` is "__main__") or through the console script."""
        main = sys.modules.get("__main__")
        return module_name == "__main__" or Path(getattr(main, "__file__", None) or "").name == COMMAND
