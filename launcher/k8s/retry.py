"""Transient Kubernetes API failures are weather: retries with backoff and jitter to a deadline.

An API server restarts, fails over, sheds load (429, 503), answers through a proxy that times out
(502, 504), or a request's connection breaks: none of that is a reason to fail a job whose
workers train without the API. :func:`retrying` repeats one call through such failures, waiting
a growing, jittered delay between attempts (:class:`Backoff`), until it succeeds, fails for a
reason a retry cannot change (a 4xx: forbidden, not found, conflict, invalid), or its deadline
passes; then it raises :class:`~launcher.k8s.errors.KubernetesUnavailableError` saying for how
long and how often it tried, with the last error. Waits are on a ``threading.Event`` (the
caller's stop event), so a closing component never sleeps out a delay.

:class:`Reports` says a recurring problem once (a 403 for an exceeded quota, an API that keeps
failing) and says when it is over, instead of one line per attempt.

Which failures are transient: no answer at all (:class:`KubernetesUnavailableError`: refused
connection, DNS, TLS, a timeout, a broken connection), 429 Too Many Requests and every 5xx.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final, TypeVar

from launcher.k8s.errors import KubernetesApiError, KubernetesUnavailableError

log = logging.getLogger(__name__)

T = TypeVar("T")

#: HTTP statuses worth another attempt besides every 5xx: the server sheds load.
TOO_MANY_REQUESTS: Final = 429


def is_transient(error: KubernetesApiError) -> bool:
    """Whether another attempt may succeed: no answer, 429, or a 5xx."""
    if isinstance(error, KubernetesUnavailableError):
        return True
    status = error.status
    return status is not None and (status == TOO_MANY_REQUESTS or 500 <= status <= 599)


@dataclass(frozen=True)
class Backoff:
    """Delays between attempts: ``first`` doubling up to ``cap`` seconds, each one drawn from
    its upper half (jitter, so that many clients that failed together do not retry together)."""

    first: float = 0.1
    cap: float = 5.0

    def delays(self) -> Iterator[float]:
        delay = self.first
        while True:
            yield random.uniform(delay / 2, delay)  # noqa: S311 - jitter, not a secret
            delay = min(self.cap, delay * 2)


#: Between attempts after a transient failure: 0.2 s doubling to 5 s.
TRANSIENT_BACKOFF: Final = Backoff(first=0.2, cap=5.0)
#: Between attempts the API refused (403: a quota that may free up): 2 s doubling to 60 s.
REFUSED_BACKOFF: Final = Backoff(first=2.0, cap=60.0)


def retrying(
    call: Callable[[], T],
    *,
    what: str,
    deadline: float,
    stop: threading.Event | None = None,
    backoff: Backoff = TRANSIENT_BACKOFF,
    on_transient: Callable[[KubernetesApiError], None] | None = None,
) -> T:
    """``call()``, again after each transient failure until it succeeds, for at most
    ``deadline`` seconds; a non-transient error is raised at once. ``what`` names the call in
    the error ("create pod x in namespace 'ml'"). ``on_transient`` sees every transient failure
    (to report it); a set ``stop`` ends the waiting early with the last error."""
    started = time.monotonic()
    attempts = 0
    delays = backoff.delays()
    stop = stop or threading.Event()
    while True:
        attempts += 1
        try:
            return call()
        except KubernetesApiError as exc:
            if not is_transient(exc):
                raise
            if on_transient is not None:
                on_transient(exc)
            elapsed = time.monotonic() - started
            delay = next(delays)
            if elapsed + delay > deadline or stop.wait(delay):
                raise KubernetesUnavailableError(
                    f"the Kubernetes API kept failing to {what} for {elapsed:.0f} s "
                    f"({attempts} attempts; deadline {deadline:.0f} s, --outage-timeout for a "
                    f"launcher): {exc}",
                    exc.status,
                ) from exc


class Reports:
    """Says each kind of recurring problem once (WARNING) and that it is over (INFO)."""

    def __init__(self, logger: logging.Logger, prefix: str) -> None:
        self._log = logger
        self._prefix = prefix
        self._lock = threading.Lock()
        #: Kind of problem -> how often it happened since it was first said.
        self._open: dict[str, int] = {}

    def problem(self, kind: str, message: str) -> bool:
        """Say ``message`` if ``kind`` is not already said; whether it was said now."""
        with self._lock:
            count = self._open.get(kind)
            self._open[kind] = (count or 0) + 1
        if count is None:
            self._log.warning("%s %s", self._prefix, message)
            return True
        self._log.debug("%s (again, %d times) %s", self._prefix, count + 1, message)
        return False

    def over(self, kind: str, message: str) -> None:
        """``kind`` stopped happening: say so (with how often it happened), if it was said."""
        with self._lock:
            count = self._open.pop(kind, None)
        if count is not None:
            self._log.info("%s %s (after %d failed attempts)", self._prefix, message, count)

    def is_open(self, kind: str) -> bool:
        with self._lock:
            return kind in self._open
