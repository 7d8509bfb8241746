"""Membership store: the abstract interface (:mod:`.api`), etcd (:mod:`.etcd`), private etcd,
TLS and credentials of an etcd client (:mod:`.security`)."""

from elastic_allreduce.codec import JsonValue
from elastic_allreduce.store.api import (
    EventType,
    KeyValue,
    Lease,
    LeaseRef,
    Snapshot,
    Store,
    Watch,
    WatchEvent,
)
from elastic_allreduce.store.embedded import EmbeddedEtcd, ServerTls
from elastic_allreduce.store.etcd import Endpoint, EtcdStore, Guard, parse_endpoints
from elastic_allreduce.store.security import EtcdSecurity

__all__ = [
    "EmbeddedEtcd",
    "Endpoint",
    "EtcdSecurity",
    "EtcdStore",
    "EventType",
    "Guard",
    "JsonValue",
    "KeyValue",
    "Lease",
    "LeaseRef",
    "ServerTls",
    "Snapshot",
    "Store",
    "Watch",
    "WatchEvent",
    "parse_endpoints",
]
