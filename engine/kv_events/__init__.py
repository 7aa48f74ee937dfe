"""KV events in vLLM's format (`--kv-events-config`): what this instance holds on its
device and in each store tier, published over ZMQ for routers and indexers.

Modules: config (vLLM's KVEventsConfig), schema (the event structs and wire format),
publisher (the ZMQ PUB and replay thread), recorders (device pool and block index
changes -> events).
"""

from __future__ import annotations

from engine.kv_events.config import KVEventsConfig, parse_kv_events_config
from engine.kv_events.publisher import KVEventsEndpointError, ZmqEventPublisher
from engine.kv_events.recorders import DevicePoolEvents, TierEvents
from engine.kv_events.schema import AllBlocksCleared

__all__ = ["KVEvents", "KVEventsConfig", "KVEventsEndpointError", "parse_kv_events_config", "start_kv_events"]


class KVEvents:
    """An instance's event stream: its publisher and the listeners the device pool and
    the store's index report to. It opens with AllBlocksCleared, so that a subscriber
    forgets what an earlier run of the instance announced; the disk tier's index, rebuilt
    from the directory at start, then comes as stored blocks."""

    def __init__(self, config: KVEventsConfig, block_size: int) -> None:
        self.config = config
        self.publisher = ZmqEventPublisher(config)
        self.device = DevicePoolEvents(self.publisher.put, block_size)
        self.tiers = TierEvents(self.publisher.put, block_size)
        self.publisher.put(AllBlocksCleared())

    def close(self) -> None:
        self.publisher.close()


def start_kv_events(config: KVEventsConfig | None, block_size: int) -> KVEvents | None:
    """The instance's events, or None when `config` publishes none."""
    if config is None or not config.publishes:
        return None
    return KVEvents(config, block_size)
