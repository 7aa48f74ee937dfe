"""Health of a tier, with exponential backoff that keeps failing I/O off the hot path.

After a failure the tier is UNHEALTHY and `available()` says no until a backoff delay
has passed; then one operation is let through as a probe. Success makes the tier
HEALTHY again; another failure doubles the delay (up to a cap). A dead Redis therefore
costs no network round trip on the hot path. Recovery does not wait for the backoff: a
tier with a background probe (Redis) asks at a short period while unhealthy and records
the success as soon as it gets an answer.

`recoveries` counts the outages the tier came back from: returns to HEALTHY, and restarts
a probe noticed while the tier looked healthy throughout (`record_restart`), so that
whoever keeps beliefs about the tier (the store's index of a remote tier) can tell that
what it knew may be gone.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable


class Health(enum.StrEnum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


class HealthMonitor:
    def __init__(
        self,
        min_backoff_s: float = 0.25,
        max_backoff_s: float = 8.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._min = min_backoff_s
        self._max = max_backoff_s
        self._backoff = min_backoff_s
        self._retry_at = 0.0
        self.state = Health.HEALTHY
        self.last_error: str | None = None
        self.recoveries = 0

    @property
    def backoff_s(self) -> float:
        """The delay before the hot path tries the tier again after its last failure."""
        with self._lock:
            return self._backoff

    def available(self) -> bool:
        """True when healthy, or when the backoff has passed and a probe may go out."""
        with self._lock:
            return self.state is Health.HEALTHY or self._clock() >= self._retry_at

    def record_success(self) -> None:
        with self._lock:
            if self.state is Health.UNHEALTHY:
                self.recoveries += 1
            self.state = Health.HEALTHY
            self._backoff = self._min

    def record_restart(self) -> None:
        """The service behind the tier restarted between two answers: an outage too short
        for any operation to fail, after which it may hold nothing of before."""
        with self._lock:
            self.recoveries += 1

    def record_failure(self, error: BaseException | str) -> None:
        with self._lock:
            if self.state is Health.HEALTHY:
                self._backoff = self._min
            else:
                self._backoff = min(self._backoff * 2, self._max)
            self.state = Health.UNHEALTHY
            self.last_error = (
                error if isinstance(error, str) else f"{type(error).__name__}: {error}"
            )
            self._retry_at = self._clock() + self._backoff
