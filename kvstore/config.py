"""Store options and the construction of the tiers they describe."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.errors import StoreConfigError
from tiers.disk import FSYNC_POLICIES, DiskTier
from tiers.errors import TierConfigError
from tiers.eviction import EVICTION_POLICIES
from tiers.redis_url import parse_redis_url

if TYPE_CHECKING:  # StoreConfig is checked before torch is imported (the CLI's bad flags)
    from kvstore.record import RecordCodec
    from tiers.base import RecordTier
    from tiers.cpu import CpuTier
    from tiers.pins import PinTable

TIER_ORDER = ("cpu", "disk", "redis")
# Tiers shared by every instance configured with them: their outage hits all instances at once.
REMOTE_TIERS = ("redis",)
COMPRESS_OPTIONS = (None, "", "none", "lz4", "lz4-plain", "lz4-planes")
# The option a tier's own configuration error is about (sizes are checked before).
TIER_OPTIONS = {"cpu": "cpu_size", "disk": "disk_path", "redis": "redis_url"}
GiB = 1024**3


def parse_tiers(tiers: str | Sequence[str]) -> tuple[str, ...]:
    """'cpu,disk' or ('disk', 'cpu') -> ('cpu', 'disk'): fastest first."""
    names = tiers.split(",") if isinstance(tiers, str) else list(tiers)
    names = [n.strip().lower() for n in names if n.strip()]
    unknown = sorted(set(names) - set(TIER_ORDER))
    if unknown:
        raise StoreConfigError(f"unknown tier {unknown[0]!r}; choose from {', '.join(TIER_ORDER)}", "tiers")
    if not names:
        raise StoreConfigError("a store needs at least one tier", "tiers")
    return tuple(t for t in TIER_ORDER if t in names)


@dataclass(frozen=True)
class StoreConfig:
    """Every store option. Sizes are bytes; times are seconds."""

    tiers: tuple[str, ...] = ("cpu",)
    cpu_size: int = 4 * GiB
    # host slots of a store without the cpu tier; with it, the slots touched up front
    staging_size: int = 64 * 1024**2
    pin_memory: bool | None = None  # None: pinned iff CUDA is available
    disk_path: str | None = None
    disk_size: int = 32 * GiB
    disk_fsync: str = "none"
    eviction: str = "lru"  # of the cpu and disk tiers (tiers.eviction)
    redis_url: str | None = None
    redis_ttl_s: float | None = None
    redis_key_prefix: str = "kvtier:"
    redis_op_timeout_s: float = 2.0
    redis_connect_timeout_s: float = 1.0
    redis_probe_interval_s: float = 1.0
    compress: str | None = None  # applies to disk and redis records
    secret: str | bytes | None = field(default=None, repr=False)
    lookup_timeout_s: float = 0.1  # bound on a probe of Redis's block index
    refresh_interval_s: float = 1.0  # how often listable tiers (disk) are rescanned
    load_timeout_s: float = 10.0
    max_pending_write_bytes: int = 256 * 1024**2
    write_workers: int = 2
    promote: bool = True  # copy disk/redis hits into the cpu tier

    def __post_init__(self) -> None:
        object.__setattr__(self, "tiers", parse_tiers(self.tiers))
        if "disk" in self.tiers and not self.disk_path:
            raise StoreConfigError("the disk tier needs a directory", "disk_path")
        if "redis" in self.tiers and not self.redis_url:
            raise StoreConfigError("the redis tier needs a URL (redis://host:port)", "redis_url")
        if self.compress not in COMPRESS_OPTIONS:
            raise StoreConfigError(f"unknown compression {self.compress!r}; use none or lz4", "compress")
        if self.disk_fsync not in FSYNC_POLICIES:
            raise StoreConfigError(f"must be one of {', '.join(FSYNC_POLICIES)}", "disk_fsync")
        if self.eviction not in EVICTION_POLICIES:
            raise StoreConfigError(f"must be one of {', '.join(EVICTION_POLICIES)}", "eviction")
        positive = ("cpu_size", "staging_size", "disk_size", "lookup_timeout_s", "load_timeout_s", "redis_op_timeout_s",
                    "redis_connect_timeout_s", "redis_probe_interval_s", "refresh_interval_s", "write_workers")
        for name in positive:
            if getattr(self, name) <= 0:
                raise StoreConfigError(f"must be positive, got {getattr(self, name)}", name)
        if self.redis_ttl_s is not None and self.redis_ttl_s <= 0:
            raise StoreConfigError(f"must be positive (or unset: no expiry), got {self.redis_ttl_s}", "redis_ttl_s")
        if self.max_pending_write_bytes < 0:
            raise StoreConfigError(f"must be >= 0, got {self.max_pending_write_bytes}", "max_pending_write_bytes")

    @property
    def secret_bytes(self) -> bytes | None:
        if not self.secret:
            return None
        return self.secret.encode() if isinstance(self.secret, str) else bytes(self.secret)


def redis_nodes(url: str) -> tuple[tuple[str, int], ...]:
    """(host, port) of every node a Redis URL names (none for a Unix socket)."""
    return parse_redis_url(url).nodes


def build_memory(codec: RecordCodec, config: StoreConfig, pins: PinTable) -> CpuTier:
    """The host slots: the cpu tier when configured, else staging slots that keep nothing."""
    from tiers.cpu import CpuTier

    retain = "cpu" in config.tiers
    size = config.cpu_size if retain else config.staging_size
    try:
        return CpuTier(size, codec.slot_bytes, pins, config.pin_memory, retain=retain, eviction=config.eviction)
    except TierConfigError as exc:
        raise StoreConfigError(str(exc), "cpu_size" if retain else "staging_size") from exc


def build_record_tiers(codec: RecordCodec, config: StoreConfig, pins: PinTable) -> list[RecordTier]:
    """The configured record tiers, in lookup order; TierConfigError becomes StoreConfigError
    naming the tier's option."""
    from tiers.redis_tier import RedisTier

    builders = {
        # Below a cpu tier, the page cache would hold a second copy of what the cpu tier holds.
        "disk": lambda: DiskTier(config.disk_path, config.disk_size, pins, fsync=config.disk_fsync,
                                 head_bytes=codec.head_size, direct_io="cpu" in config.tiers,
                                 eviction=config.eviction),
        "redis": lambda: RedisTier(
            config.redis_url,
            pins,
            ttl_s=config.redis_ttl_s,
            key_prefix=config.redis_key_prefix,
            op_timeout_s=config.redis_op_timeout_s,
            connect_timeout_s=config.redis_connect_timeout_s,
            probe_interval_s=config.redis_probe_interval_s,
        ),
    }
    tiers = []
    for name in config.tiers:
        if name == "cpu":
            continue
        try:
            tiers.append(builders[name]())
        except TierConfigError as exc:
            raise StoreConfigError(str(exc), TIER_OPTIONS[name]) from exc
    return tiers
