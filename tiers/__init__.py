"""Storage tiers below the device: cpu memory slots, disk files, Redis (standalone or
cluster), behind one interface (tiers.base).

The names below are imported on first use, so that `tiers.disk`'s constants (which the
CLI's option checks need) come without the cpu tier's torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CpuTier": "tiers.cpu",
    "DiskTier": "tiers.disk",
    "Health": "tiers.health",
    "HealthMonitor": "tiers.health",
    "LatencySnapshot": "tiers.stats",
    "PinTable": "tiers.pins",
    "RecordTier": "tiers.base",
    "RedisTarget": "tiers.redis_url",
    "RedisTier": "tiers.redis_tier",
    "RedisUrlError": "tiers.errors",
    "Tier": "tiers.base",
    "TierConfigError": "tiers.errors",
    "TierError": "tiers.errors",
    "TierSnapshot": "tiers.stats",
    "parse_redis_url": "tiers.redis_url",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
