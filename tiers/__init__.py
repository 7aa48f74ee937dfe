"""Storage tiers below the device: cpu memory slots, disk files, Redis (standalone or
cluster), behind one interface (tiers.base)."""

from tiers.base import RecordTier, Tier
from tiers.cpu import CpuTier
from tiers.disk import DiskTier
from tiers.errors import RedisUrlError, TierConfigError, TierError
from tiers.health import Health, HealthMonitor
from tiers.pins import PinTable
from tiers.redis_tier import RedisTier
from tiers.redis_url import RedisTarget, parse_redis_url
from tiers.stats import LatencySnapshot, TierSnapshot

__all__ = [
    "CpuTier",
    "DiskTier",
    "Health",
    "HealthMonitor",
    "LatencySnapshot",
    "PinTable",
    "RecordTier",
    "RedisTarget",
    "RedisTier",
    "RedisUrlError",
    "Tier",
    "TierConfigError",
    "TierError",
    "TierSnapshot",
    "parse_redis_url",
]
