"""The membership store on etcd v3, spoken over etcd's JSON gateway with etcd3gw.

etcd3gw carries the unary calls (range, put, txn, lease). Its watch, however, stops silently
when the server restarts and hides revisions, compaction and errors, so the watch stream here is
read directly from the same gateway endpoint (``POST /v3/watch``) with :mod:`http.client`, where
this module owns the socket: it can resume after the last delivered revision, re-list after a
compaction, and be shut down from another thread. etcd >= 3.4 is required (``/v3/`` gateway).

Over ``https://`` endpoints both paths use TLS with the files of an
:class:`~elastic_allreduce.store.security.EtcdSecurity` (etcd's certificate verified against the
CA given, the client certificate presented). With an etcd user, the transport signs in at
``/v3/auth/authenticate`` and sends the token in the ``Authorization`` header of every request
and watch stream; a token the server no longer knows (a restart, expiry) is renewed once and the
request retried. TLS and auth refusals become one :class:`StoreAuthError` saying what to change.

An outage is weather, not death: with ``outage_timeout`` (the job's ``--outage-timeout``), every
unary call retries an unreachable etcd with backoff and jitter until that deadline, and watches
keep reconnecting as long; lease keep-alives keep trying until the server says the lease is gone.
A compare-and-swap whose earlier attempt may have been applied before its reply was lost checks
whether the key now holds its value, so a retried write is never taken for someone else's.

With several endpoints (a cluster's members), a call asks the member that answered last, then
the others in turn. That a member failed before another answered counts as a lost reply for a
compare-and-swap; and a lease keep-alive gives each member at most a third of the TTL, so that
a stalled member, which accepts connections and answers nothing, cannot hold it past the TTL.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import logging
import math
import queue
import random
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from etcd3gw import exceptions as etcd3gw_exceptions
from etcd3gw.client import Etcd3Client

from elastic_allreduce import codec
from elastic_allreduce.codec import JsonValue
from elastic_allreduce.errors import (
    ConfigError,
    LeaseLostError,
    StoreAuthError,
    StoreError,
    StoreUnavailableError,
    WatchClosedError,
)
from elastic_allreduce.store.api import (
    DEFAULT_ROOT,
    EventType,
    KeyValue,
    Lease,
    LeaseRef,
    Snapshot,
    Store,
    Watch,
    WatchEvent,
)
from elastic_allreduce.store.security import EtcdSecurity, describe_source

log = logging.getLogger(__name__)

API_PATH: Final = "/v3/"
DEFAULT_PORT: Final = 2379
_T = TypeVar("_T")
#: First and longest pause between two attempts of a call while etcd is unreachable.
RETRY_FIRST: Final = 0.05
RETRY_LONGEST: Final = 2.0
#: How long a watch keeps reconnecting when the store has no outage timeout.
DEFAULT_WATCH_GIVE_UP: Final = 60.0
#: Shortest time a lease keep-alive waits for one member of several before asking the next.
KEEPALIVE_MIN_TIMEOUT: Final = 0.5


@dataclass(frozen=True)
class Guard:
    """A condition on a write: ``key`` exists and is attached to lease ``lease`` (the
    launcher's leader key under its own lease: fencing, as etcd's election API does it)."""

    key: str
    lease: int


@dataclass(frozen=True)
class Endpoint:
    """One etcd client URL: plain HTTP (shown as ``HOST:PORT``) or TLS (``https://HOST:PORT``)."""

    host: str
    port: int
    tls: bool = False

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https://' if self.tls else ''}{host}:{self.port}"


def parse_endpoints(text: str) -> tuple[Endpoint, ...]:
    """Parse ``[http://|https://]HOST:PORT[,...]`` (one scheme for all); ConfigError if bad."""
    endpoints: list[Endpoint] = []
    for raw in text.split(","):
        item = raw.strip().rstrip("/")
        tls = item.startswith("https://")
        item = item.removeprefix("https://").removeprefix("http://")
        host, sep, port_text = item.rpartition(":")
        host = host.strip("[]")
        if not item or not sep:
            host, port_text = item, str(DEFAULT_PORT)
        if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ConfigError(
                f"invalid etcd endpoint {raw!r} in {text!r}: use HOST:PORT[,HOST:PORT...], "
                "for example 127.0.0.1:2379"
            )
        endpoints.append(Endpoint(host, int(port_text), tls))
    if len({endpoint.tls for endpoint in endpoints}) > 1:
        raise ConfigError(
            f"etcd endpoints {text!r} mix http:// and https://: one cluster speaks one of them"
        )
    return tuple(endpoints)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def prefix_end(prefix: str) -> str:
    """The range end that selects every key starting with ``prefix`` (prefix is non-empty)."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return raw.decode()


def _int(fields: Mapping[str, Any], name: str) -> int:
    """Read an int64 field of a gateway reply (strings in JSON; absent means 0)."""
    return int(fields.get(name, 0))


class _InvalidToken(Exception):
    """etcd no longer knows the auth token sent (it restarted, or the token expired)."""


#: OpenSSL's names of the alerts a server sends when it refuses the client's certificate.
_CLIENT_CERT_REFUSED: Final = ("ALERT_BAD_CERTIFICATE", "CERTIFICATE_REQUIRED", "ALERT_UNKNOWN_CA")


class _Transport:
    """Unary calls to the first endpoint that answers, remembering which one did; over TLS
    with the security settings' files, signed in as their etcd user if one is given."""

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        request_timeout: float,
        security: EtcdSecurity | None = None,
    ) -> None:
        if not endpoints:
            raise ConfigError("no etcd endpoint given: pass --etcd HOST:PORT[,...]")
        self.endpoints = tuple(endpoints)
        self.request_timeout = request_timeout
        self.security = security = security or EtcdSecurity()
        self.tls = self.endpoints[0].tls
        security.check(tls=self.tls)
        #: The watch stream's TLS context (built first: it checks every file).
        self.ssl_context = security.ssl_context() if self.tls else None
        self._password = security.read_password()
        self._request_options: dict[str, Any] = {}
        if self.tls:
            # Explicit on every request: a session's own setting would lose to $REQUESTS_CA_BUNDLE.
            self._request_options["verify"] = security.cacert or True
            if security.cert is not None:
                self._request_options["cert"] = (security.cert, security.key)
        self._preferred = 0
        self._lock = threading.Lock()
        #: One client per endpoint for each per-request timeout in use (each its own session).
        self._clients_by_timeout: dict[float, list[Etcd3Client]] = {}
        self._clients = self._clients_for(request_timeout)
        #: None: not signed in yet; "": etcd's auth is off (nothing to send).
        self._token: str | None = None
        self._token_lock = threading.Lock()

    def _clients_for(self, timeout: float) -> list[Etcd3Client]:
        """The endpoints' clients whose requests time out after ``timeout`` seconds."""
        with self._lock:
            clients = self._clients_by_timeout.get(timeout)
            if clients is None:
                clients = self._clients_by_timeout[timeout] = [
                    Etcd3Client(
                        host=ep.host,
                        port=ep.port,
                        protocol="https" if ep.tls else "http",
                        timeout=timeout,
                        api_path=API_PATH,
                    )
                    for ep in self.endpoints
                ]
            return clients

    def describe(self) -> str:
        return "etcd at " + ",".join(str(ep) for ep in self.endpoints)

    def unavailable(self, detail: object) -> StoreUnavailableError:
        hint = ""
        closed = ("Remote end closed connection", "Connection reset by peer", "Connection aborted")
        if not self.tls and any(sign in str(detail) for sign in closed):
            hint = " (if it serves TLS, pass --etcd https://HOST:PORT)"
        return StoreUnavailableError(
            f"{self.describe()} is unreachable: {detail}{hint}; start it or pass --etcd HOST:PORT"
        )

    # -- authentication ----------------------------------------------------------------------

    def auth_headers(self) -> dict[str, str]:
        """The ``Authorization`` header of this client's etcd user (empty without one)."""
        token = self._current_token()
        return {"Authorization": token} if token else {}

    def _current_token(self) -> str | None:
        if self.security.user is None:
            return None
        with self._token_lock:
            if self._token is None:
                self._token = self._authenticate()
            return self._token

    def signed_in(self) -> bool:
        """Whether this client holds a token of its etcd user (False without a user, or while
        etcd's auth is off)."""
        return bool(self._current_token())

    def renew_token(self, rejected: str | None) -> None:
        """Forget a token etcd rejected (the next request signs in again)."""
        with self._token_lock:
            if self._token == rejected:
                self._token = None

    def _authenticate(self) -> str:
        user = self.security.user
        try:
            reply, _ = self._call_endpoints(
                "auth/authenticate", {"name": user, "password": self._password}, None
            )
        except StoreError as exc:
            if "authentication is not enabled" in str(exc):
                log.info("%s: etcd's auth is off; user %r is not needed", self.describe(), user)
                return ""
            raise
        token = reply.get("token")
        if not isinstance(token, str) or not token:
            raise StoreError(f"{self.describe()} sent no token for user {user!r}: {reply!r}")
        return token

    # -- requests ----------------------------------------------------------------------------

    def call(
        self, path: str, payload: Mapping[str, Any], *, timeout: float | None = None
    ) -> dict[str, Any]:
        """POST a JSON request to ``/v3/<path>``, trying each endpoint once (and signing in
        again once if etcd no longer knows this client's token). ``timeout``: seconds each
        endpoint gets (default: the request timeout), so that a member that accepts
        connections but answers nothing (stopped, stalled, cut off) holds the call only that
        long before the next member is asked."""
        return self.call_reporting(path, payload, timeout=timeout)[0]

    def call_reporting(
        self, path: str, payload: Mapping[str, Any], *, timeout: float | None = None
    ) -> tuple[dict[str, Any], bool]:
        """:meth:`call`, and whether an endpoint failed before one answered: that earlier
        attempt may have been applied (a member that timed out, or went away after it
        proposed the request), which a conditional write must take into account."""
        clients = self._clients if timeout is None else self._clients_for(timeout)
        token = self._current_token()
        try:
            return self._call_endpoints(path, payload, token, clients)
        except _InvalidToken:
            self.renew_token(token)
            token = self._current_token()
            try:
                return self._call_endpoints(path, payload, token, clients)
            except _InvalidToken as exc:
                raise StoreAuthError(
                    f"{self.describe()} keeps refusing the token of etcd user "
                    f"{self.security.user!r} right after sign-in: {exc}"
                ) from exc

    def _call_endpoints(
        self,
        path: str,
        payload: Mapping[str, Any],
        token: str | None,
        clients: Sequence[Etcd3Client] | None = None,
    ) -> tuple[dict[str, Any], bool]:
        clients = self._clients if clients is None else clients
        with self._lock:
            first = self._preferred
        options = dict(self._request_options)
        if token:
            options["headers"] = {"Authorization": token}
        last_error: Exception | None = None
        for offset in range(len(clients)):
            index = (first + offset) % len(clients)
            try:
                reply = self._post(clients[index], index, path, payload, options)
            except (
                etcd3gw_exceptions.ConnectionFailedError,
                etcd3gw_exceptions.ConnectionTimeoutError,
            ) as exc:
                refusal = self.tls_refusal(exc, self.endpoints[index])
                if refusal is not None:
                    raise refusal from exc
                last_error = exc
                continue
            except etcd3gw_exceptions.Etcd3Exception as exc:
                detail = exc.detail_text or str(exc)
                if self.token_rejected(detail):
                    raise _InvalidToken(detail) from exc
                raise self.server_error(path, payload, detail) from exc
            with self._lock:
                self._preferred = index
            if not isinstance(reply, dict):
                raise StoreError(f"{self.describe()} sent a non-object reply to {path}: {reply!r}")
            return reply, last_error is not None
        raise self.unavailable(_first_line(last_error)) from last_error

    def _post(
        self,
        client: Etcd3Client,
        index: int,
        path: str,
        payload: Mapping[str, Any],
        options: Mapping[str, Any],
    ) -> object:
        """One POST to endpoint ``index`` with its ``client``. etcd refuses a client
        certificate (or its absence) either with an alert or by closing the TLS handshake; a
        handshake closed twice in a row is taken for the refusal, once may be a server that
        was going away."""
        url, data = client.get_url(path), json.dumps(payload)
        try:
            return client.post(url, data=data, **options)
        except etcd3gw_exceptions.ConnectionFailedError as exc:
            if not (self.tls and _handshake_closed(exc)):
                raise
        try:
            return client.post(url, data=data, **options)
        except etcd3gw_exceptions.ConnectionFailedError as exc:
            refusal = self.tls_refusal(exc, self.endpoints[index], closed_is_refusal=True)
            if refusal is not None:
                raise refusal from exc
            raise

    def tls_refusal(
        self, exc: BaseException, endpoint: Endpoint, *, closed_is_refusal: bool = False
    ) -> StoreAuthError | None:
        """The StoreAuthError for a TLS handshake that failed on identity (not on the network):
        etcd's certificate not verified, the client's refused (with an alert or, when
        ``closed_is_refusal``, by closing the handshake), or no TLS on the other side."""
        text = _chain_text(exc)
        security = self.security
        if "CERTIFICATE_VERIFY_FAILED" in text or "certificate verify failed" in text:
            reason = _between(text, "certificate verify failed: ", " (_ssl") or "not verified"
            trusted = (
                f"{describe_source('cacert')} {security.cacert!r}"
                if security.cacert
                else "the system's CAs"
            )
            return StoreAuthError(
                f"etcd at {endpoint} presented a certificate that {trusted} does not verify "
                f"({reason}): pass the CA that signed etcd's server certificate, and an address "
                "that certificate names"
            )
        if any(alert in text for alert in _CLIENT_CERT_REFUSED) or (
            closed_is_refusal and _handshake_closed(exc)
        ):
            if security.cert is None:
                return StoreAuthError(
                    f"etcd at {endpoint} refused the TLS handshake: it requires a client "
                    f"certificate; pass {describe_source('cert')} and {describe_source('key')}"
                )
            return StoreAuthError(
                f"etcd at {endpoint} refused the client certificate {security.cert!r}: it is "
                "not signed by a CA etcd trusts (its --trusted-ca-file); use one that is"
            )
        if "WRONG_VERSION_NUMBER" in text:
            return StoreAuthError(
                f"etcd at {endpoint} does not speak TLS: use http:// for it (or check the port)"
            )
        return None

    def token_rejected(self, detail: str) -> bool:
        """Whether etcd refused the token sent: one from before a restart, an expired one, or
        none because auth was off at sign-in and has been turned on since."""
        return "invalid auth token" in detail or (
            "user name is empty" in detail and self.security.user is not None and not self._token
        )

    def server_error(self, path: str, payload: Mapping[str, Any], detail: str) -> StoreError:
        """The error for etcd's refusal ``detail`` of a request to ``path``."""
        if "etcdserver: leader changed" in detail or "no leader" in detail:
            return self.unavailable(detail)
        if "requested lease not found" in detail:
            return LeaseLostError(
                f"{self.describe()}: the lease is gone (expired or revoked); grant a new one"
            )
        refusal = self._auth_refusal(path, payload, detail)
        if refusal is not None:
            return refusal
        return StoreError(f"{self.describe()} rejected {path}: {detail}")

    def _auth_refusal(
        self, path: str, payload: Mapping[str, Any], detail: str
    ) -> StoreAuthError | None:
        user = self.security.user
        if "permission denied" in detail:
            return StoreAuthError(
                f"{self.describe()}: permission denied {_what(path, payload)} for "
                f"{f'etcd user {user!r}' if user else 'a client without an etcd user'}: its "
                "role does not cover these keys; use the job's own credentials "
                "(--etcd-user, --etcd-password-file), or grant them with `elastic-run etcd-user`"
            )
        if "user name is empty" in detail:
            return StoreAuthError(
                f"{self.describe()} has authentication enabled: pass {describe_source('user')} "
                f"and {describe_source('password_file')}"
            )
        if "authentication failed" in detail:
            return StoreAuthError(
                f"{self.describe()} refused etcd user {user!r}: wrong user name or password "
                f"({describe_source('user')}, {describe_source('password_file')})"
            )
        if "CommonName of client" in detail:
            return StoreAuthError(
                f"{self.describe()} refused the client certificate {self.security.cert!r}: it "
                "has a common name, which etcd's HTTP gateway refuses while auth is on; use one "
                "without (as `elastic-run certs` makes them)"
            )
        return None


def _what(path: str, payload: Mapping[str, Any]) -> str:
    """``on key '/a/b'`` (or ``on keys '/a/'..``) of a request, for permission errors."""
    key = payload.get("key")
    if key is None:
        compares = payload.get("compare") or [{}]
        key = compares[0].get("key")
    if not isinstance(key, str):
        return f"for {path}"
    try:
        name = _unb64(key).decode()
    except ValueError:
        return f"for {path}"
    return f"on {'keys from' if payload.get('range_end') else 'key'} {name!r} ({path})"


def _chain_text(exc: BaseException) -> str:
    """The messages of an exception and of every exception it was raised from or during."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        parts.append(str(getattr(current, "detail_text", None) or current))
        current = current.__cause__ or current.__context__
    return " | ".join(parts)


def _between(text: str, start: str, end: str) -> str:
    _, found, rest = text.partition(start)
    return rest.partition(end)[0] if found else ""


def _first_line(exc: object) -> str:
    text = str(getattr(exc, "detail_text", None) or exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


def _handshake_closed(exc: BaseException) -> bool:
    """Whether a TLS handshake ended because the other side closed the connection."""
    text = _chain_text(exc)
    return "SSLEOFError" in text or "UNEXPECTED_EOF" in text


class EtcdStore(Store):
    """:class:`~elastic_allreduce.store.api.Store` on an etcd v3 cluster (>= 3.4)."""

    def __init__(
        self,
        endpoints: Sequence[Endpoint] | str,
        job_id: str,
        *,
        root: str = DEFAULT_ROOT,
        request_timeout: float = 5.0,
        security: EtcdSecurity | None = None,
        outage_timeout: float = 0.0,
    ) -> None:
        """``security``: TLS files and etcd user; None reads them from the environment
        (:meth:`EtcdSecurity.from_environment`), which is how the processes a command line
        starts get its settings. ``outage_timeout``: seconds a call keeps retrying an
        unreachable etcd (0: each endpoint is tried once, for commands that report at once).
        ConfigError for a bad endpoint, file or combination."""
        super().__init__(job_id, root)
        #: Seconds every call retries an unreachable etcd (settable once the job's is known).
        self.outage_timeout = outage_timeout
        if isinstance(endpoints, str):
            endpoints = parse_endpoints(endpoints)
        if security is None:
            security = EtcdSecurity.from_environment()
        self._transport = _Transport(endpoints, request_timeout, security)
        self._children: list[_EtcdLease | _EtcdWatch] = []
        self._children_lock = threading.Lock()
        self._closed = False
        self._closing = threading.Event()
        #: Whether etcd answered the last call: after an outage, closing does not wait on it.
        self._answering = True

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        """The etcd client endpoints, in the order they are tried."""
        return self._transport.endpoints

    def describe(self) -> str:
        return self._transport.describe()

    def check(self) -> str:
        reply = self._transport.call("maintenance/status", {})
        return str(reply.get("version", "unknown"))

    # -- calls through an outage ---------------------------------------------------------------

    def _call(self, path: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        return self._retrying(
            lambda: self._transport.call(path, payload, timeout=self._attempt_timeout())
        )[0]

    def _attempt_timeout(self) -> float | None:
        """Seconds each endpoint may take in one attempt, so that the attempt ends by the
        caller's deadline (None: the request timeout); in half-second steps, as the transport
        keeps a client per timeout in use."""
        at = self.caller_deadline()
        if at is None:
            return None
        share = (at - time.monotonic()) / len(self._transport.endpoints)
        fits = max(0.5, math.ceil(share * 2) / 2)
        return fits if fits < self._transport.request_timeout else None

    def _retrying(self, attempt: Callable[[], _T]) -> tuple[_T, bool]:
        """``attempt()``, retried while etcd is unreachable for up to ``outage_timeout``
        seconds (or to the caller's deadline, if earlier); its result and whether an attempt
        failed first (it may have been applied)."""
        deadline: float | None = None
        pause = RETRY_FIRST
        while True:
            try:
                result = attempt()
            except StoreUnavailableError as exc:
                self._answering = False
                now = time.monotonic()
                caller = self.caller_deadline()
                if caller is not None and now >= caller:
                    raise StoreUnavailableError(
                        f"{exc} (gave up at the caller's deadline)"
                    ) from exc
                if deadline is None:
                    if self.outage_timeout <= 0:
                        raise
                    deadline = now + self.outage_timeout
                    # A caller with a deadline says what its failure means, once.
                    log.log(
                        logging.WARNING if caller is None else logging.DEBUG,
                        "job %s: %s; retrying for up to %.0f s",
                        self.job_id,
                        exc,
                        self.outage_timeout
                        if caller is None
                        else min(self.outage_timeout, caller - now),
                    )
                if now >= deadline or self._closing.is_set():
                    raise StoreUnavailableError(
                        f"{self.describe()} stayed unreachable for {self.outage_timeout:.0f} s "
                        f"(--outage-timeout): {exc}"
                    ) from exc
                jitter = random.uniform(0.5, 1.0)  # noqa: S311 - spreads retries, no secret
                until = deadline if caller is None else min(deadline, caller)
                self._closing.wait(min(pause * jitter, until - now))
                pause = min(pause * 2, RETRY_LONGEST)
                continue
            self._answering = True
            if deadline is not None:
                waited = time.monotonic() - (deadline - self.outage_timeout)
                log.info(
                    "job %s: %s answers again after %.1f s", self.job_id, self.describe(), waited
                )
            return result, deadline is not None

    # -- reads -------------------------------------------------------------------------------

    def _kv(self, fields: Mapping[str, Any]) -> KeyValue:
        lease = _int(fields, "lease")
        return KeyValue.decode(
            self.relative(_unb64(fields["key"]).decode()),
            _unb64(fields.get("value", "")),
            mod_revision=_int(fields, "mod_revision"),
            create_revision=_int(fields, "create_revision"),
            version=_int(fields, "version"),
            lease=lease or None,
        )

    def _warn_malformed(self, kv: KeyValue) -> None:
        if kv.malformed is not None:
            log.warning(
                "job %s: %s (mod_revision %d) is malformed and ignored: %s",
                self.job_id,
                kv.key,
                kv.mod_revision,
                kv.malformed,
            )

    def get(self, key: str) -> KeyValue | None:
        reply = self._call("kv/range", {"key": _b64(self.absolute(key))})
        kvs = reply.get("kvs", [])
        return self._kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str = "") -> Snapshot:
        start = self.absolute(prefix, allow_empty=True)
        reply = self._call(
            "kv/range",
            {"key": _b64(start), "range_end": _b64(prefix_end(start)), "sort_order": "ASCEND"},
        )
        items = tuple(self._kv(fields) for fields in reply.get("kvs", []))
        for kv in items:
            self._warn_malformed(kv)
        return Snapshot(_int(reply["header"], "revision"), items)

    def current_revision(self) -> int:
        """The store's revision now (cheap: counts nothing, returns the header)."""
        reply = self._call("kv/range", {"key": _b64(self.prefix), "count_only": True, "limit": 1})
        return _int(reply["header"], "revision")

    # -- writes ------------------------------------------------------------------------------

    def _put_request(
        self, key: str, value: JsonValue, lease: Lease | LeaseRef | None
    ) -> dict[str, Any]:
        request: dict[str, Any] = {
            "key": _b64(self.absolute(key)),
            "value": base64.b64encode(codec.encode(value)).decode(),
        }
        if lease is not None:
            request["lease"] = str(lease.id)
        return request

    def put(self, key: str, value: JsonValue, *, lease: Lease | LeaseRef | None = None) -> int:
        reply = self._call("kv/put", self._put_request(key, value, lease))
        return _int(reply["header"], "revision")

    def compare_and_swap(
        self,
        key: str,
        value: JsonValue,
        *,
        expected_mod_revision: int,
        lease: Lease | LeaseRef | None = None,
        guard: Guard | None = None,
    ) -> int | None:
        """See Store.compare_and_swap; with ``guard``, also only while that key is held under
        that lease (see :meth:`put_guarded`)."""
        request = self._put_request(key, value, lease)
        (reply, failed_over), retried = self._retrying(
            lambda: self._txn(
                request["key"], expected_mod_revision, {"request_put": request}, guard
            )
        )
        if reply.get("succeeded"):
            return _int(reply["header"], "revision")
        if retried or failed_over:
            # An attempt whose reply was lost (at this member or at one asked before) may have
            # been applied: then the key holds exactly this value (and lease), written after
            # the expected revision.
            current = self.get(key)
            if (
                current is not None
                and current.raw == codec.encode(value)
                and current.lease == (lease.id if lease is not None else None)
                and current.mod_revision > expected_mod_revision
            ):
                return current.mod_revision
        return None

    def delete(self, key: str, *, expected_mod_revision: int | None = None) -> bool:
        b64_key = _b64(self.absolute(key))
        if expected_mod_revision is None:
            reply = self._call("kv/deleterange", {"key": b64_key})
            return _int(reply, "deleted") > 0
        (reply, failed_over), retried = self._retrying(
            lambda: self._txn(
                b64_key, expected_mod_revision, {"request_delete_range": {"key": b64_key}}
            )
        )
        if not reply.get("succeeded"):
            # A lost reply of an applied attempt: the key is gone.
            return (retried or failed_over) and self.get(key) is None
        responses = reply.get("responses", [{}])
        return _int(responses[0].get("response_delete_range", {}), "deleted") > 0

    def _txn(
        self,
        b64_key: str,
        expected_mod_revision: int | None,
        operation: Mapping[str, Any],
        guard: Guard | None = None,
    ) -> tuple[dict[str, Any], bool]:
        """One transaction: the reply, and whether a member failed before one answered (an
        attempt that may have been applied; see :meth:`_Transport.call_reporting`)."""
        compare: list[dict[str, str]] = []
        if expected_mod_revision is not None:
            compare.append(
                {
                    "key": b64_key,
                    "result": "EQUAL",
                    "target": "MOD",
                    "mod_revision": str(expected_mod_revision),
                }
            )
        if guard is not None:
            compare.append(
                {
                    "key": _b64(self.absolute(guard.key)),
                    "result": "EQUAL",
                    "target": "LEASE",
                    "lease": str(guard.lease),
                }
            )
        return self._transport.call_reporting(
            "kv/txn",
            {"compare": compare, "success": [operation], "failure": []},
            timeout=self._attempt_timeout(),
        )

    def put_guarded(
        self, key: str, value: JsonValue, *, guard: Guard, lease: Lease | None = None
    ) -> int | None:
        """Write only while ``guard.key`` is held under ``guard.lease`` (a leader's writes:
        a launcher that lost its leadership can never overwrite its successor's); the new
        revision, or None when the guard failed and nothing was written."""
        request = self._put_request(key, value, lease)
        reply = self._call_txn(request["key"], None, {"request_put": request}, guard)
        return _int(reply["header"], "revision") if reply.get("succeeded") else None

    def _call_txn(
        self,
        b64_key: str,
        expected_mod_revision: int | None,
        operation: Mapping[str, Any],
        guard: Guard | None,
    ) -> dict[str, Any]:
        attempt = self._retrying(
            lambda: self._txn(b64_key, expected_mod_revision, operation, guard)
        )
        return attempt[0][0]

    # -- leases and watches ------------------------------------------------------------------

    def grant_lease(self, ttl: int, *, on_lost: Callable[[Lease], None] | None = None) -> Lease:
        if ttl < 1:
            raise ConfigError(f"lease TTL must be at least 1 second, got {ttl}")
        asked_at = time.monotonic()
        reply = self._call("lease/grant", {"TTL": str(ttl), "ID": "0"})
        if reply.get("error"):
            raise StoreError(f"{self.describe()} refused a lease of {ttl} s: {reply['error']}")
        lease = _EtcdLease(self, int(reply["ID"]), _int(reply, "TTL"), on_lost)
        lease.renewed_at = asked_at
        self._adopt(lease)
        lease.start()
        return lease

    def lease_remaining(self, lease_id: int) -> int | None:
        # etcd answers -1 for a lease it does not know and the (negative) time since expiry,
        # truncated toward zero, for one it has not revoked yet.
        reply = self._call("lease/timetolive", {"ID": str(lease_id)})
        remaining = _int(reply, "TTL")
        return None if remaining < 0 else remaining

    def revoke_lease(self, lease_id: int) -> bool:
        try:
            self._call("kv/lease/revoke", {"ID": str(lease_id)})
        except LeaseLostError:
            return False
        return True

    def watch_prefix(
        self,
        prefix: str = "",
        *,
        start_revision: int | None = None,
        give_up_after: float | None = None,
    ) -> Watch:
        if start_revision is None:
            start_revision = self.current_revision() + 1
        if give_up_after is None:
            # A watch waits out the same outage as the calls: a job fails at its deadline.
            timeout = self.outage_timeout
            give_up_after = timeout if timeout > 0 else DEFAULT_WATCH_GIVE_UP
        watch = _EtcdWatch(self, prefix, start_revision, give_up_after)
        self._adopt(watch)
        watch.start()
        return watch

    def _adopt(self, child: _EtcdLease | _EtcdWatch) -> None:
        with self._children_lock:
            if self._closed:
                child.close_quietly()
                raise StoreError(f"the store for job {self.job_id} is closed")
            self._children = [c for c in self._children if c.active] + [child]

    def close(self) -> None:
        """Stop every watch and keep-alive and revoke the leases. Once etcd does not answer
        (the outage that ended the job, or a revoke), the other leases are left to expire by
        their TTL: closing waits for no request timeout per lease."""
        self._closing.set()
        with self._children_lock:
            self._closed = True
            children, self._children = self._children, []
        for child in children:
            if self._answering:
                child.close_quietly()
            else:
                child.abandon()

    # -- used by leases and watches ----------------------------------------------------------

    @property
    def transport(self) -> _Transport:
        """The endpoint-failover transport (shared with this store's leases and watches)."""
        return self._transport

    def decode_event(self, fields: Mapping[str, Any]) -> WatchEvent:
        """Turn one gateway watch event into a WatchEvent (logging a malformed value)."""
        kv_fields = fields["kv"]
        revision = _int(kv_fields, "mod_revision")
        if fields.get("type") == "DELETE":
            key = self.relative(_unb64(kv_fields["key"]).decode())
            return WatchEvent(EventType.DELETE, key, revision)
        kv = self._kv(kv_fields)
        self._warn_malformed(kv)
        return WatchEvent(EventType.PUT, kv.key, revision, kv=kv)


class _EtcdLease(Lease):
    """A granted lease and the one thread that refreshes it every TTL/3 seconds."""

    def __init__(
        self,
        store: EtcdStore,
        lease_id: int,
        ttl: int,
        on_lost: Callable[[Lease], None] | None,
    ) -> None:
        super().__init__()
        self.id = lease_id
        self.ttl = ttl
        self._store = store
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._keepalive, name=f"lease-{lease_id:x}", daemon=True
        )

    @property
    def active(self) -> bool:
        return not self._stop.is_set()

    def start(self) -> None:
        self._thread.start()

    def _keepalive(self) -> None:
        interval = max(self.ttl / 3.0, 0.1)
        retry = min(interval, 0.25)
        wait = interval
        transport = self._store.transport
        # A member that accepts the connection but answers nothing (stopped, stalled, cut off)
        # would hold a keep-alive for the whole request timeout, longer than the TTL: each
        # member gets one interval, so the next one renews the lease in time. The only member
        # gets the full timeout: nobody else could answer sooner.
        per_member = (
            min(transport.request_timeout, max(interval, KEEPALIVE_MIN_TIMEOUT))
            if len(transport.endpoints) > 1
            else None
        )
        failing_since: float | None = None
        while not self._stop.wait(wait):
            asked_at = time.monotonic()
            try:
                reply = transport.call("lease/keepalive", {"ID": str(self.id)}, timeout=per_member)
            except StoreError as exc:
                # Only the server decides that a lease expired; keep trying until it says so.
                if failing_since is None:
                    failing_since = asked_at
                    log.warning(
                        "job %s: keep-alive of lease %x failed (trying again until etcd "
                        "answers): %s",
                        self._store.job_id,
                        self.id,
                        exc,
                    )
                wait = retry
                continue
            if _int(reply.get("result", {}), "TTL") <= 0:
                self._mark_lost("the server reports it expired")
                return
            if failing_since is not None:
                log.info(
                    "job %s: lease %x renewed again after %.1f s",
                    self._store.job_id,
                    self.id,
                    asked_at - failing_since,
                )
                failing_since = None
            self.renewed_at = asked_at
            wait = interval

    def _mark_lost(self, why: str) -> None:
        if self._lost.is_set():
            return
        log.warning("job %s: lease %x lost: %s", self._store.job_id, self.id, why)
        self._lost.set()
        self._stop.set()
        if self._on_lost is not None:
            try:
                self._on_lost(self)
            except Exception:
                log.exception(
                    "job %s: on_lost callback of lease %x failed", self._store.job_id, self.id
                )

    def _join(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._store.transport.request_timeout + 1.0)

    def stop_keepalive(self) -> None:
        self._join()

    def revoke(self) -> None:
        if self._lost.is_set():
            return
        self._join()
        self._store.revoke_lease(self.id)
        self._lost.set()

    def close_quietly(self) -> None:
        try:
            self.revoke()
        except StoreError as exc:
            log.warning("job %s: could not revoke lease %x: %s", self._store.job_id, self.id, exc)

    def abandon(self) -> None:
        """Stop refreshing without a call to etcd (which is away): the lease expires by its TTL."""
        self._stop.set()


class _Idle(Exception):
    """The watch stream sent nothing for IDLE_REOPEN_S (no event, no progress notification)."""


class _Compacted(Exception):
    def __init__(self, compact_revision: int) -> None:
        super().__init__(compact_revision)
        self.compact_revision = compact_revision


class _EtcdWatch(Watch):
    """A watch stream that reconnects, resumes, re-lists after compaction and reports failure."""

    #: Reopen the stream after this long without a byte (a half-open connection sends nothing).
    IDLE_REOPEN_S: Final = 10.0

    def __init__(
        self, store: EtcdStore, prefix: str, start_revision: int, give_up_after: float
    ) -> None:
        self._store = store
        self._prefix = prefix
        self._start = store.absolute(prefix, allow_empty=True)
        self._next_revision = start_revision
        self._delivered_revision = start_revision - 1
        self._give_up_after = give_up_after
        self._events: queue.Queue[WatchEvent | BaseException] = queue.Queue()
        self._stop = threading.Event()
        self._closed = False
        self._conn: http.client.HTTPConnection | None = None
        self._conn_lock = threading.Lock()
        self._endpoint_index = 0
        #: Whether the current stream got an answer: give_up_after counts from the last one.
        self._reconnected = False
        self._thread = threading.Thread(
            target=self._run, name=f"watch-{store.job_id}-{prefix or '*'}", daemon=True
        )

    @property
    def active(self) -> bool:
        return not self._stop.is_set()

    @property
    def revision(self) -> int:
        return self._delivered_revision

    def start(self) -> None:
        self._thread.start()

    def get(self, timeout: float) -> WatchEvent | None:
        if self._closed:
            raise WatchClosedError(f"watch on {self._start!r} is closed")
        try:
            item = self._events.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            self._events.put(item)  # every later get() raises the same error
            raise item
        self._delivered_revision = max(self._delivered_revision, item.revision)
        return item

    def close(self) -> None:
        self._closed = True
        self._stop.set()
        self._shutdown_connection()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def close_quietly(self) -> None:
        self.close()

    def abandon(self) -> None:
        self.close()

    # -- the watch thread --------------------------------------------------------------------

    def _run(self) -> None:
        transport = self._store.transport
        down_since: float | None = None
        backoff = 0.05
        while not self._stop.is_set():
            endpoint = transport.endpoints[self._endpoint_index % len(transport.endpoints)]
            # The last stream got an answer (it went idle, or failed below): no outage so far.
            down_since, backoff = self._since_answer(down_since, backoff)
            self._reconnected = False
            try:
                self._stream(endpoint)
                down_since, backoff = None, 0.05
            except _Compacted as exc:
                try:
                    self._resync(exc.compact_revision)
                    down_since, backoff = None, 0.05
                    continue
                except StoreUnavailableError:
                    pass  # treated like a dropped stream below
            except _Idle:
                # An idle stream (no event, no progress notification): reopen it quietly.
                log.debug("job %s: watch on %r idle; reopening", self._store.job_id, self._prefix)
                continue
            except StoreAuthError as exc:  # a refusal is final: retrying cannot change it
                self._events.put(exc)
                return
            except (OSError, http.client.HTTPException, ValueError, StoreUnavailableError) as exc:
                if self._stop.is_set():
                    return
                refusal = transport.tls_refusal(exc, endpoint) if endpoint.tls else None
                if refusal is not None:
                    self._events.put(refusal)
                    return
                log.info(
                    "job %s: watch on %r lost its stream to %s (%s); resuming from revision %d",
                    self._store.job_id,
                    self._prefix,
                    endpoint,
                    _first_line(exc),
                    self._next_revision,
                )
            except Exception as exc:  # never die silently: hand the error to the reader
                log.exception("job %s: watch on %r failed", self._store.job_id, self._prefix)
                self._events.put(StoreError(f"watch on {self._prefix!r} failed: {exc!r}"))
                return
            if self._stop.is_set():
                return
            # That stream got an answer before it failed: an outage starts now.
            down_since, backoff = self._since_answer(down_since, backoff)
            now = time.monotonic()
            down_since = now if down_since is None else down_since
            if now - down_since > self._give_up_after:
                self._events.put(
                    transport.unavailable(
                        f"the watch on {self._prefix!r} could not reconnect for "
                        f"{self._give_up_after:.0f} s"
                        + (
                            " (--outage-timeout)"
                            if self._give_up_after == self._store.outage_timeout
                            else ""
                        )
                    )
                )
                return
            self._endpoint_index += 1
            self._stop.wait(backoff)
            backoff = min(backoff * 2, 1.0)

    def _since_answer(self, down_since: float | None, backoff: float) -> tuple[float | None, float]:
        """The outage's start and the backoff, both reset when the last stream got an answer:
        ``give_up_after`` counts one outage, not the sum of those the watch lived through."""
        return (None, 0.05) if self._reconnected else (down_since, backoff)

    def _stream(self, endpoint: Endpoint) -> None:
        """Open one watch stream and pump its events until it ends (raises on any failure)."""
        transport = self._store.transport
        headers = {"Content-Type": "application/json", **transport.auth_headers()}
        token = headers.get("Authorization")
        conn: http.client.HTTPConnection
        if endpoint.tls:
            conn = http.client.HTTPSConnection(
                endpoint.host,
                endpoint.port,
                timeout=transport.request_timeout,
                context=transport.ssl_context,
            )
        else:
            conn = http.client.HTTPConnection(
                endpoint.host, endpoint.port, timeout=transport.request_timeout
            )
        with self._conn_lock:
            if self._stop.is_set():
                return
            self._conn = conn
        try:
            body = json.dumps(
                {
                    "create_request": {
                        "key": _b64(self._start),
                        "range_end": _b64(prefix_end(self._start)),
                        "start_revision": str(self._next_revision),
                        "progress_notify": True,
                    }
                }
            )
            conn.request("POST", API_PATH + "watch", body=body, headers=headers)
            response = conn.getresponse()
            if response.status != 200:
                detail = response.read(1000).decode(errors="replace")
                refusal = transport.server_error("watch", {"key": _b64(self._start)}, detail)
                if isinstance(refusal, StoreAuthError):
                    raise refusal
                raise http.client.HTTPException(
                    f"watch request answered {response.status} {response.reason}: {detail}"
                )
            if conn.sock is not None:
                conn.sock.settimeout(self.IDLE_REOPEN_S)
            while not self._stop.is_set():
                try:
                    line = response.readline()
                except TimeoutError as exc:
                    raise _Idle from exc
                if not line:
                    raise ConnectionResetError("the server closed the watch stream")
                if line.strip():
                    self._handle(json.loads(line), token)
                    self._reconnected = True  # the server answered: the watch is (re)created
        finally:
            with self._conn_lock:
                self._conn = None
            conn.close()

    def _handle(self, message: Mapping[str, Any], token: str | None) -> None:
        if "error" in message:
            raise ConnectionResetError(f"watch stream error: {message['error']}")
        result = message.get("result", {})
        compact_revision = _int(result, "compact_revision")
        if compact_revision:
            raise _Compacted(compact_revision)
        if result.get("canceled"):
            reason = str(result.get("cancel_reason", ""))
            transport = self._store.transport
            if transport.token_rejected(reason):
                transport.renew_token(token)  # sign in again, then reconnect
            elif "permission denied" in reason:
                key = {"key": _b64(self._start), "range_end": _b64(prefix_end(self._start))}
                raise transport.server_error("watch", key, reason)
            raise ConnectionResetError(f"watch canceled: {reason}")
        events = result.get("events", [])
        for fields in events:
            event = self._store.decode_event(fields)
            self._events.put(event)
            self._next_revision = event.revision + 1
        if not events and not result.get("created"):
            # A progress notification: every change up to this revision has been sent.
            header_revision = _int(result.get("header", {}), "revision")
            self._next_revision = max(self._next_revision, header_revision + 1)

    def _resync(self, compact_revision: int) -> None:
        snapshot = self._store.get_prefix(self._prefix)
        log.warning(
            "job %s: watch on %r needed revision %d but history was compacted at %d; "
            "re-listed %d keys at revision %d",
            self._store.job_id,
            self._prefix,
            self._next_revision,
            compact_revision,
            len(snapshot),
            snapshot.revision,
        )
        self._events.put(
            WatchEvent(EventType.RESYNC, self._prefix, snapshot.revision, snapshot=snapshot)
        )
        self._next_revision = snapshot.revision + 1

    def _shutdown_connection(self) -> None:
        with self._conn_lock:
            conn = self._conn
            if conn is not None and conn.sock is not None:
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_RDWR)
