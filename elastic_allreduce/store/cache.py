"""A local, always-current copy of every key under a prefix (list, then watch)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping

from elastic_allreduce.errors import StoreError
from elastic_allreduce.store.api import EventType, KeyValue, Store, Watch, WatchEvent

#: An owner's inbox: store changes, its own threads' events and signal handlers' notes.
Inbox = queue.SimpleQueue[object]


def new_inbox() -> Inbox:
    """An empty inbox. A SimpleQueue because its ``put`` is reentrant: a signal handler runs
    in the owner's thread, possibly while that thread is inside ``get``, where queue.Queue
    holds a lock the handler's ``put`` would wait for forever (a SIGTERM that hangs an agent).
    """
    return queue.SimpleQueue()


class PrefixCache:
    """Keeps ``{relative key: KeyValue}`` for a prefix current from the store's watch.

    Changes arrive in the owner's ``inbox``: a forwarding thread puts each WatchEvent there (or
    the StoreError that ended the watch), so the owner waits on one queue for the store's
    changes and its own events alike, with no polling. The owner hands every item it takes from
    the inbox to :meth:`apply`; only the owner's thread reads or changes the view.
    """

    def __init__(
        self,
        store: Store,
        inbox: Inbox,
        prefix: str = "",
        *,
        give_up_after: float | None = None,
    ) -> None:
        snapshot = store.get_prefix(prefix)
        self._items: dict[str, KeyValue] = dict(snapshot.as_dict())
        self.revision = snapshot.revision
        self._watch: Watch = store.watch_prefix(
            prefix, start_revision=snapshot.revision + 1, give_up_after=give_up_after
        )
        self._inbox = inbox
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._forward, name=f"cache-{store.job_id}-{prefix or '*'}", daemon=True
        )
        self._thread.start()

    def _forward(self) -> None:
        while not self._stop.is_set():
            try:
                event = self._watch.get(0.5)
            except StoreError as exc:
                if not self._stop.is_set():
                    self._inbox.put(exc)
                return
            if event is not None:
                self._inbox.put(event)

    def apply(self, item: object) -> bool:
        """Apply an inbox item if it is the store's; True if it changed the view.

        Raises the StoreError that ended the watch (etcd unreachable for too long).
        """
        if isinstance(item, StoreError):
            raise item
        if not isinstance(item, WatchEvent):
            return False
        if item.type is EventType.RESYNC and item.snapshot is not None:
            self._items = dict(item.snapshot.as_dict())
        elif item.type is EventType.PUT and item.kv is not None:
            self._items[item.key] = item.kv
        else:
            self._items.pop(item.key, None)
        self.revision = max(self.revision, item.revision)
        return True

    def items(self) -> Mapping[str, KeyValue]:
        """The current view (a copy)."""
        return dict(self._items)

    def get(self, key: str) -> KeyValue | None:
        """One key of the current view."""
        return self._items.get(key)

    def close(self) -> None:
        """Stop watching and join the forwarding thread."""
        self._stop.set()
        self._watch.close()
        self._thread.join(timeout=5.0)


def drain(inbox: Inbox, timeout: float) -> list[object]:
    """Everything in ``inbox``: wait up to ``timeout`` for the first item, then take the rest."""
    try:
        items = [inbox.get(timeout=timeout)]
    except queue.Empty:
        return []
    while True:
        try:
            items.append(inbox.get_nowait())
        except queue.Empty:
            return items
