"""The console of a benchmark run: one progress bar and the result, everything else in a log.

`captured(log_path)` points file descriptors 1 and 2 at the log for the length of a run,
so that whatever the libraries print (torch's profiler, transformers' warnings, engine
logs, progress prints of the workloads) lands there, C++ code included; the terminal
is kept aside for `progress` (the one bar, replaced phase by phase) and `echo` (the
result table and where the files are). Outside `captured` both go to stdout/stderr.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")
_terminal: IO[str] | None = None


def plain_number(value: float) -> str:
    """Three significant digits and never an exponent: a table of milliseconds reads
    12346, 123, 12.3, 1.23, 0.0123 (`.3g` wrote 1.23e+04 and 1.23e-05)."""
    if value == 0 or not math.isfinite(value):
        return "0" if value == 0 else str(value)
    decimals = max(0, 2 - math.floor(math.log10(abs(value))))
    return f"{value:.{decimals}f}"


def echo(text: str) -> None:
    """Print to the terminal, also while a run is captured."""
    print(text, file=_terminal or sys.stdout, flush=True)


def progress(iterable: Iterable[T] | None = None, *, total: int | None = None, desc: str = "") -> tqdm:
    """The run's progress bar (a tqdm on the terminal): one at a time, each erased when
    done, so the console shows a single bar whatever the phase."""
    return tqdm(iterable, total=total, desc=desc, leave=False, file=_terminal or sys.stderr,
                dynamic_ncols=True, disable=None)


@contextlib.contextmanager
def captured(log_path: Path) -> Iterator[Path]:
    """Send fds 1 and 2 (and Python's logging and warnings) to `log_path` meanwhile."""
    global _terminal
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    terminal = os.fdopen(os.dup(saved[1]), "w", buffering=1)
    previous = (sys.stdout, sys.stderr, _terminal)
    with open(log_path, "a", buffering=1) as log:
        for fd in (1, 2):
            os.dup2(log.fileno(), fd)
        sys.stdout = sys.stderr = log
        _terminal = terminal
        handler = logging.StreamHandler(log)
        root = logging.getLogger()
        root.addHandler(handler)
        logging.captureWarnings(True)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("default")
                yield log_path
        finally:
            logging.captureWarnings(False)
            root.removeHandler(handler)
            log.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
            sys.stdout, sys.stderr, _terminal = previous
            terminal.close()

