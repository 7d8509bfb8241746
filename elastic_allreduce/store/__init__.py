"""Membership store: the abstract interface (:mod:`.api`), etcd (:mod:`.etcd`), private etcd."""

from elastic_allreduce.codec import JsonValue
from elastic_allreduce.store.api import (
    EventType,
    KeyValue,
    Lease,
    Snapshot,
    Store,
    Watch,
    WatchEvent,
)
from elastic_allreduce.store.embedded import EmbeddedEtcd
from elastic_allreduce.store.etcd import Endpoint, EtcdStore, parse_endpoints

__all__ = [
    "EmbeddedEtcd",
    "Endpoint",
    "EtcdStore",
    "EventType",
    "JsonValue",
    "KeyValue",
    "Lease",
    "Snapshot",
    "Store",
    "Watch",
    "WatchEvent",
    "parse_endpoints",
]
