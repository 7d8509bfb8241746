"""One key written in the background, the latest value winning.

A training step must not wait for etcd: rank 0 reports each commit (``status/progress``), and a
slow or absent store (an outage that the store's calls wait out) would stall every rank at its
next collective. :class:`LatestValueWriter` takes the value and returns at once; one thread
writes it, and a value superseded before it was written is skipped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from elastic_allreduce.codec import JsonValue
from elastic_allreduce.errors import ElasticAllreduceError
from elastic_allreduce.store.api import Store

log = logging.getLogger(__name__)


class LatestValueWriter:
    """Writes ``key`` from one daemon thread; :meth:`submit` never blocks on the store."""

    def __init__(self, open_store: Callable[[], Store], key: str) -> None:
        self._open_store = open_store
        self._key = key
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: JsonValue | None = None
        self._has_pending = False
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"write-{key}", daemon=True)
        self._thread.start()

    def submit(self, value: JsonValue) -> None:
        """Write ``value`` soon (replacing a value not written yet)."""
        with self._lock:
            self._pending, self._has_pending = value, True
            self._wake.notify()

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until the last submitted value was written (or
        failed); whether it was."""
        with self._lock:
            return self._wake.wait_for(lambda: not self._has_pending and not self._busy, timeout)

    def close(self, timeout: float = 2.0) -> None:
        """Write what is pending (for up to ``timeout`` seconds), then stop the thread."""
        self.flush(timeout)
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        self._thread.join(timeout=timeout)

    def _run(self) -> None:
        store: Store | None = None
        try:
            while True:
                with self._lock:
                    self._wake.wait_for(lambda: self._has_pending or self._closed)
                    if self._closed and not self._has_pending:
                        return
                    value, self._has_pending, self._busy = self._pending, False, True
                try:
                    if store is None:
                        store = self._open_store()
                    store.put(self._key, value)
                except ElasticAllreduceError as exc:
                    log.warning("could not write %s to the store: %s", self._key, exc)
                finally:
                    with self._lock:
                        self._busy = False
                        self._wake.notify_all()
        finally:
            if store is not None:
                store.close()
