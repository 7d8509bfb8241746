"""A local, always-current copy of every key under a prefix (list, then watch)."""

from __future__ import annotations

from collections.abc import Mapping

from elastic_allreduce.store.api import EventType, KeyValue, Store, Watch


class PrefixCache:
    """Keeps ``{relative key: KeyValue}`` for a prefix current from the store's watch.

    ``poll(timeout)`` applies the changes that arrived (waiting up to ``timeout`` for the first)
    and returns whether anything changed; ``items()`` is the current view. A compaction RESYNC
    replaces the whole view. Not thread-safe: one owner polls it.
    """

    def __init__(self, store: Store, prefix: str = "", *, give_up_after: float = 60.0) -> None:
        snapshot = store.get_prefix(prefix)
        self._items: dict[str, KeyValue] = dict(snapshot.as_dict())
        self.revision = snapshot.revision
        self._watch: Watch = store.watch_prefix(
            prefix, start_revision=snapshot.revision + 1, give_up_after=give_up_after
        )

    def poll(self, timeout: float) -> bool:
        """Apply pending changes; block up to ``timeout`` for the first one. True if any."""
        changed = False
        event = self._watch.get(timeout)
        while event is not None:
            changed = True
            if event.type is EventType.RESYNC and event.snapshot is not None:
                self._items = dict(event.snapshot.as_dict())
            elif event.type is EventType.PUT and event.kv is not None:
                self._items[event.key] = event.kv
            else:
                self._items.pop(event.key, None)
            self.revision = max(self.revision, event.revision)
            event = self._watch.get(0)
        return changed

    def items(self) -> Mapping[str, KeyValue]:
        """The current view (a copy)."""
        return dict(self._items)

    def get(self, key: str) -> KeyValue | None:
        """One key of the current view."""
        return self._items.get(key)

    def close(self) -> None:
        """Stop watching."""
        self._watch.close()
