"""The connector between the engine and the tiered KV store.

`connectors.base` holds the interface the engine talks to and the null connector;
`connectors.kvstore_connector` implements it on kvstore (imported only when a store is
configured, so an engine without --kv-offload never loads the store and its clients).
"""

from connectors.base import (
    ConnectorConfigError,
    KVConnector,
    KVStoreNotConfiguredError,
    NullConnector,
    SchedulerConnector,
    WorkerConnector,
)

__all__ = [
    "ConnectorConfigError",
    "KVConnector",
    "KVStoreNotConfiguredError",
    "NullConnector",
    "SchedulerConnector",
    "WorkerConnector",
]
