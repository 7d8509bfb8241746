"""This machine's network, as far as a node of a job needs it: its addresses, the interface
that holds one, and the address it reaches another host from (also a training process's, for
its IPv6 relay: :mod:`elastic_allreduce.bootstrap.ipv6`).

``elastic-run join`` uses :func:`source_address` and :func:`interface_of` so that a bare
``join --etcd E --job-id J`` advertises the address (and gives Gloo the interface) that routes
to etcd, and :func:`check_local_address` / :func:`check_interface` so that a wrong ``--host`` or
``--gloo-iface`` fails at start with one clear error instead of in ``hvd.init()``.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping

import psutil

from elastic_allreduce.errors import ConfigError

_FAMILIES = (socket.AF_INET, socket.AF_INET6)


def addresses() -> dict[str, list[str]]:
    """Each interface's IPv4 and IPv6 addresses (IPv6 link-local ones without their zone)."""
    found: dict[str, list[str]] = {}
    for name, entries in psutil.net_if_addrs().items():
        for entry in entries:
            if entry.family in _FAMILIES:
                found.setdefault(name, []).append(entry.address.split("%", 1)[0])
    return found


def _same(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return False


def interface_of(address: str, table: Mapping[str, list[str]] | None = None) -> str | None:
    """The interface holding ``address`` (None when no interface of this machine has it)."""
    for name, held in (addresses() if table is None else table).items():
        if any(_same(address, mine) for mine in held):
            return name
    return None


_NO_ROUTE_ADVICE = "check the address and this host's network, or pass --host"


def source_address(host: str, port: int, advice: str = _NO_ROUTE_ADVICE) -> str:
    """The address this machine sends from to reach ``host:port`` (its route's source; an IPv6
    link-local one with its ``%zone``).

    Nothing is sent: connecting a UDP socket only picks the route. ConfigError when no route
    leads there (``advice`` says what to do) or the name does not resolve.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError as exc:
        raise ConfigError(f"cannot resolve {host!r}: {exc}") from exc
    reasons = []
    for family, kind, proto, _, target in infos:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.connect(target)
            except OSError as exc:
                reasons.append(str(exc))
                continue
            return str(probe.getsockname()[0])
    raise ConfigError(
        f"no route from this machine to {host} ({'; '.join(reasons) or 'no address'}): {advice}"
    )


def check_local_address(address: str) -> str:
    """``address`` if an interface of this machine holds it; else ConfigError listing them."""
    table = addresses()
    try:
        ipaddress.ip_address(address)
    except ValueError as exc:
        raise ConfigError(
            f"--host {address!r} is not an IP address: give one of this machine's addresses "
            f"({_listing(table)})"
        ) from exc
    if interface_of(address, table) is None:
        raise ConfigError(
            f"--host {address} is not an address of this machine: give one of its addresses "
            f"({_listing(table)}), the one other hosts reach it at"
        )
    return address


def check_interface(name: str) -> str:
    """``name`` if this machine has that network interface; else ConfigError listing them."""
    table = addresses()
    if name not in psutil.net_if_addrs():
        raise ConfigError(
            f"--gloo-iface {name!r}: this machine has no such network interface (it has: "
            f"{', '.join(sorted(table)) or 'none'})"
        )
    return name


def check_host_name(address: str) -> None:
    """ConfigError when this machine's host name resolves only to loopback while the node is
    reached at ``address`` from other hosts.

    Horovod 0.28.1 creates the Gloo device of its process-set contexts (the global process set
    included: every job has one) without the interface of ``HOROVOD_GLOO_IFACE``, so Gloo binds
    it to the address of the host name; a name that resolves to 127.0.x.x (Debian's
    ``127.0.1.1 HOST`` line in /etc/hosts) makes every peer on another host fail to connect.
    """
    if is_loopback(address):
        return
    name = socket.gethostname()
    try:
        resolved = {str(info[4][0]) for info in socket.getaddrinfo(name, None)}
    except OSError as exc:
        raise ConfigError(
            f"this host's name {name!r} does not resolve ({exc}): Horovod's Gloo binds its "
            f"process-set connections to it; make it resolve to {address} (for example the "
            f"line '{address} {name}' in /etc/hosts)"
        ) from exc
    if all(is_loopback(found.split("%", 1)[0]) for found in resolved):
        raise ConfigError(
            f"this host's name {name!r} resolves to {', '.join(sorted(resolved))}, a loopback "
            "address: Horovod's Gloo binds its process-set connections to the address of the "
            "host name (not to --gloo-iface), so peers on other hosts could not connect. Make "
            f"{name!r} resolve to {address} (for example the line '{address} {name}' in "
            "/etc/hosts, instead of a 127.0.1.1 line)"
        )


def is_loopback(address: str) -> bool:
    """Whether ``address`` is a loopback address (or ``localhost``)."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _listing(table: Mapping[str, list[str]]) -> str:
    return ", ".join(f"{a} on {name}" for name, held in sorted(table.items()) for a in held)
