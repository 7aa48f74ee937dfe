"""The store's options, declared once, and the construction of the tiers they describe.

`StoreConfig` is the one place a store option is defined: its default, its bounds, its
help. Field names are the options' names everywhere: the `LLM(...)` keyword, with
dashes the `kvtier serve` flag (the engine's config tree includes this class as its
store section), a key of a config file. So an error names its option without a
translation, and a front end shows it as its own flag.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from kvstore.errors import StoreConfigError
from kvstore.options import GiB, PathOption, Seconds, Size, describe_error, option
from tiers.disk import FSYNC_POLICIES, DiskTier
from tiers.errors import RedisUrlError, TierConfigError
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
# Host slots of a store without the cpu tier (with it: the slots touched up front), when
# the caller has no better figure (the engine sizes them for one request's records).
STAGING_SIZE = 64 * 1024**2


def parse_tiers(tiers: str | Sequence[str]) -> tuple[str, ...]:
    """'cpu,disk' or ('disk', 'cpu') -> ('cpu', 'disk'): fastest first; '' or 'none': no
    tier (an engine without a store)."""
    names = tiers.split(",") if isinstance(tiers, str) else list(tiers)
    names = [n.strip().lower() for n in names if n.strip() and n.strip().lower() != "none"]
    unknown = sorted(set(names) - set(TIER_ORDER))
    if unknown:
        raise ValueError(f"unknown tier {unknown[0]!r}; choose from {', '.join(TIER_ORDER)}")
    return tuple(t for t in TIER_ORDER if t in names)


def _compression(value: str | None) -> str | None:
    return None if value == "none" else value


def _redis_url(url: str | None) -> str | None:
    """Refused here, before anything starts, rather than when the tier connects."""
    if url is not None:
        try:
            parse_redis_url(url)
        except RedisUrlError as exc:
            raise ValueError(str(exc)) from None
    return url


Tiers = Annotated[tuple[str, ...], BeforeValidator(lambda value: parse_tiers(value or ()))]


class StoreConfig(BaseModel):
    """Every store option. Sizes are bytes (given as a bare number of GiB or with a
    unit); durations are seconds. Construction checks every field and the fields
    together, and raises StoreConfigError naming the option."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), validate_default=False)

    kv_offload: Tiers = option(
        (), "Comma-separated offload tiers below the device: any of cpu, disk, redis.", metavar="TIERS")
    kv_offload_cpu_size: Annotated[Size, Field(gt=0)] = option(
        4 * GiB, "Memory budget of the cpu tier: GiB, or with a unit (512MiB).", metavar="SIZE")
    kv_offload_disk_path: PathOption | None = option(
        None, "Directory of the disk tier (default: $XDG_CACHE_HOME/kvtier/kv, or "
        "~/.cache/kvtier/kv). Several instances may share it.", metavar="DIR")
    kv_offload_disk_size: Annotated[Size, Field(gt=0)] = option(
        32 * GiB, "Budget of the disk tier: GiB, or with a unit.", metavar="SIZE")
    kv_offload_disk_fsync: Literal[FSYNC_POLICIES] = option(
        "none", "When disk records reach stable storage: none (the page cache decides), "
        "file (each record) or full (record and directory).")
    kv_offload_eviction: Literal[EVICTION_POLICIES] = option(
        "lru", "Which records the cpu and disk tiers evict first (vLLM's names): lru, the "
        "least recently used; arc, Adaptive Replacement Cache, which keeps records hit more than "
        "once apart from a stream of records seen once.")
    kv_redis_url: Annotated[str | None, AfterValidator(_redis_url)] = option(
        None, "Redis tier URL: redis://host:port, rediss://:password@host:port, "
        "redis+cluster://host:port,host:port, or unix:///path/to/redis.sock (a Redis on this host).",
        metavar="URL")
    kv_redis_ttl: Seconds | None = option(
        None, "Seconds a Redis record lives (default: no expiry; Redis's eviction policy decides).",
        metavar="SECONDS")
    kv_redis_key_prefix: str = option(
        "kvtier:", "Prefix of every Redis key (separates deployments on one Redis).", metavar="PREFIX")
    kv_redis_op_timeout: Seconds = option(
        2.0, "Seconds one Redis command may take before it counts as failed.", metavar="SECONDS")
    kv_redis_connect_timeout: Seconds = option(
        1.0, "Seconds to wait for a Redis connection.", metavar="SECONDS")
    kv_redis_probe_interval: Seconds = option(
        1.0, "Seconds between probes of an unhealthy Redis tier.", metavar="SECONDS")
    kv_compress: Annotated[Literal["none", "lz4", "lz4-plain", "lz4-planes"] | None,
                           AfterValidator(_compression)] = option(
        None, "Compression of records below the cpu tier: lz4 (byte planes for 2- and 4-byte "
        "dtypes: for bf16 only the sign/exponent plane compresses), lz4-plain, lz4-planes or none.")
    kv_secret: str | None = option(
        None, "Shared secret: records are signed with HMAC-SHA256 and unsigned or foreign ones "
        "rejected. Set it on any tier others can write to (docs/RELIABILITY.md); prefer "
        "--kv-secret-file, command lines are visible to other users.", metavar="SECRET", secret=True)
    kv_load_timeout: Seconds = option(
        10.0, "Seconds to wait for a disk/redis load before recomputing instead.", metavar="SECONDS")
    kv_lookup_timeout: Seconds = option(
        0.1, "Seconds an asynchronous probe of Redis's block index may take; blocks it "
        "has not found by then are recomputed (the scheduler never waits on it).", metavar="SECONDS")
    kv_refresh_interval: Seconds = option(
        1.0, "Seconds between background rescans of the disk directory for records other "
        "processes (or an earlier run) wrote.", metavar="SECONDS")
    kv_write_workers: Annotated[int, Field(gt=0, le=256)] = option(
        2, "Background threads writing records to disk and Redis.")
    kv_max_pending_writes: Size = option(
        256 * 1024**2, "Bytes of records waiting to be written below the cpu tier; past it new saves "
        "are dropped (GiB, or with a unit).", metavar="SIZE")
    kv_promote: bool = option(True, "Copy disk/redis hits into the cpu tier.")

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            option_name, message = describe_error(exc)
            raise StoreConfigError(message, option_name) from None
        self.check_store_options()

    def check_store_options(self) -> None:
        """Checks across fields, after every field has its type. A front end that fills
        in a default (the engine's disk directory) does it in an override, before these."""
        if "disk" in self.kv_offload and not self.kv_offload_disk_path:
            raise StoreConfigError("the disk tier needs a directory", "kv_offload_disk_path")
        if "redis" in self.kv_offload and not self.kv_redis_url:
            raise StoreConfigError("the redis tier needs a URL (redis://host:port)", "kv_redis_url")

    @property
    def secret_bytes(self) -> bytes | None:
        return self.kv_secret.encode() if self.kv_secret else None


def redis_nodes(url: str) -> tuple[tuple[str, int], ...]:
    """(host, port) of every node a Redis URL names (none for a Unix socket)."""
    return parse_redis_url(url).nodes


@contextmanager
def _blaming(option_name: str) -> Iterator[None]:
    """A tier's own configuration error (a directory that cannot be made, a cpu tier too
    small for one record) as a StoreConfigError naming the option to change."""
    try:
        yield
    except TierConfigError as exc:
        raise StoreConfigError(str(exc), option_name) from exc


def build_tiers(
    codec: RecordCodec, config: StoreConfig, pins: PinTable, staging_size: int = STAGING_SIZE
) -> tuple[CpuTier, list[RecordTier]]:
    """The store's host slots and the record tiers below them, in lookup order."""
    if not config.kv_offload:
        raise StoreConfigError("a store needs at least one tier", "kv_offload")
    return build_host_slots(codec, config, pins, staging_size), build_record_tiers(codec, config, pins)


def build_host_slots(codec: RecordCodec, config: StoreConfig, pins: PinTable, staging_size: int) -> CpuTier:
    """The store's host slots, which every load lands in and every save starts from: with
    `cpu` among the tiers they keep records within `kv_offload_cpu_size` (and are the
    `cpu` tier of the stats), else `staging_size` bytes of slots that keep nothing. The
    first `staging_size` bytes are touched now, off the data path."""
    from tiers.cpu import CpuTier

    retain = "cpu" in config.kv_offload
    with _blaming("kv_offload_cpu_size" if retain else "kv_offload"):
        host = CpuTier(config.kv_offload_cpu_size if retain else staging_size, codec.slot_bytes, pins,
                       retain=retain, eviction=config.kv_offload_eviction)
    host.touch_pages(staging_size)
    return host


def build_record_tiers(codec: RecordCodec, config: StoreConfig, pins: PinTable) -> list[RecordTier]:
    """The configured tiers below the host slots, in lookup order."""
    from tiers.redis_tier import RedisTier

    tiers: list[RecordTier] = []
    if "disk" in config.kv_offload:
        with _blaming("kv_offload_disk_path"):
            # Below a cpu tier, the page cache would hold a second copy of what the cpu tier holds.
            tiers.append(DiskTier(
                config.kv_offload_disk_path, config.kv_offload_disk_size, pins,
                fsync=config.kv_offload_disk_fsync, head_bytes=codec.head_size,
                direct_io="cpu" in config.kv_offload, eviction=config.kv_offload_eviction))
    if "redis" in config.kv_offload:
        with _blaming("kv_redis_url"):
            tiers.append(RedisTier(
                config.kv_redis_url, pins, ttl_s=config.kv_redis_ttl, key_prefix=config.kv_redis_key_prefix,
                op_timeout_s=config.kv_redis_op_timeout, connect_timeout_s=config.kv_redis_connect_timeout,
                probe_interval_s=config.kv_redis_probe_interval))
    return tiers
