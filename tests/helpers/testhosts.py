"""Test hosts: Linux network namespaces joined by a bridge, so that one machine holds several
"hosts" with their own addresses, links and routes (DESIGN.md, "Test hosts on one machine").

Layout of one :class:`TestHosts` group of N hosts::

    <prefix>-br   a namespace holding only the bridge ``br0`` and the bridge-side veth ends
                  ``port1`` .. ``portN`` (the root namespace is never touched)
    <prefix>-h1   a host: ``lo`` up and ``enp1s0`` (veth, the other end is ``port1``) with
    ...           10.231.<k>.1/24 and fdea:a11e:d0ce:<k>::1/64 (added ``nodad``: usable at once);
                  ``TestHosts(n, ipv4=False)``: IPv6-only hosts, whose interface has no IPv4
                  address at all (``lo`` keeps 127.0.0.1, as on a real IPv6-only machine)

``<prefix>`` is ``eatns-<pid>-<n>``: the creating process and a counter, so that a group only
ever touches namespaces it made, and :func:`remove_stale` can tell the leftovers of dead runs
(their pid no longer exists) from those of live ones. Every group's namespaces are isolated
from every other group's, so the per-group subnet ``<k>`` only has to help a reader of logs.

Faults:

- :meth:`Host.link_down` sets the *bridge-side* veth end down: a pulled cable. The host keeps its
  addresses and routes (the kernel marks them ``linkdown`` but still uses them), nothing it sends
  arrives anywhere and nothing reaches it: on the host and on its peers, packets vanish.
  Setting the host-side interface down instead would not be a partition but a local failure:
  the kernel deletes the IPv6 addresses and the IPv4 connected route, so the host's own processes
  get ``ENETUNREACH`` at once. :meth:`Host.link_up` restores the link, puts back any address the
  kernel dropped, flushes stale neighbour entries and waits until the bridge forwards again.
- :meth:`Host.blackhole` silently drops all IPv4 and IPv6 traffic between two hosts, in both
  directions, while both keep talking to every other host. It is made on the receiving side:
  each of the two hosts gets a policy rule ``from <peer address> iif <iface> blackhole`` (placed
  before the ``local`` table lookup, which setup moves from priority 0 to 200). A blackhole
  *route* to the peer (``ip route add blackhole``) is not silent: the host's own ``connect()``
  fails at once with ``EINVAL`` (``prohibit`` gives ``EACCES``, ``unreachable``
  ``EHOSTUNREACH``), which no real partition does. Only the peer's test addresses are cut (IPv6
  link-local traffic still passes; IPv4 ARP between the two does not, since the kernel checks
  the route back to an ARP request's sender).

What a process sees, in both cases, is what it sees on a LAN where a peer vanished: packets of
open connections disappear (TCP retransmits until its own timeout); a new connection's SYN
disappears too, and once neighbour resolution of the peer gives up (about 3 s without a cached
entry) ``connect()`` fails with ``EHOSTUNREACH``. No tool for latency or loss exists here (no
``tc netem``, no iptables/nft).

Cleanup (:meth:`TestHosts.close`, also on an exception in a ``with`` body and at interpreter exit)
SIGKILLs every process in the group's namespaces (found with ``ip netns pids``, so processes that
were not started through :meth:`Host.popen` die too), waits for them to go, and deletes the
namespaces, which destroys the veths and the bridge with them.

The processes in all hosts share the machine's hostname and file system: a test that needs
distinct host names passes them explicitly (for example ``HOROVOD_HOSTNAME``).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import ipaddress
import itertools
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

log = logging.getLogger(__name__)

#: Every namespace this module makes is named ``<PREFIX>-<pid>-<n>-<role>``.
PREFIX = "eatns"
_NAME = re.compile(rf"^{PREFIX}-(\d+)-(\d+)-(br|h\d+|probe)$")
BRIDGE = "br0"
#: Priority of the blackhole rules; setup moves the ``local`` table lookup after them.
CUT_RULE_PRIORITY = 100
LOCAL_RULE_PRIORITY = 200
MAX_HOSTS = 250
IP_TIMEOUT = 10.0

_counter = itertools.count(1)
_open_groups: weakref.WeakSet[TestHosts] = weakref.WeakSet()


class TestHostsError(RuntimeError):
    """A namespace, link or address could not be made, changed or removed."""

    __test__ = False  # not a pytest test class


# -- running ip --------------------------------------------------------------------------------


def _ip(*args: str, timeout: float = IP_TIMEOUT, check: bool = True) -> str:
    """Run ``ip ARGS`` and return its stdout; raise :class:`TestHostsError` when it fails."""
    try:
        done = subprocess.run(
            ["ip", *args], capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TestHostsError(f"`ip {' '.join(args)}` could not run: {exc}") from exc
    if check and done.returncode != 0:
        raise TestHostsError(
            f"`ip {' '.join(args)}` exited with {done.returncode}: {done.stderr.strip()}"
        )
    return done.stdout


def _ip_json(*args: str) -> list[dict[str, Any]]:
    text = _ip("-j", *args).strip()
    if not text:
        return []
    parsed = json.loads(text)
    assert isinstance(parsed, list), f"`ip -j {' '.join(args)}` printed {text[:200]!r}"
    return parsed


def _wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass (then raise)."""
    deadline = time.monotonic() + timeout
    delay = 0.005
    while not predicate():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TestHostsError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.05)


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


def process_running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in {"Z", "X"}


# -- namespaces --------------------------------------------------------------------------------


def all_namespaces() -> list[str]:
    """Names of all network namespaces known to ``ip netns`` (any owner)."""
    return [str(entry["name"]) for entry in _ip_json("netns", "list")]


def namespace_pids(ns: str) -> list[int]:
    """The processes whose network namespace is ``ns`` (zombies excluded)."""
    return sorted(int(word) for word in _ip("netns", "pids", ns).split())


def kill_namespace(ns: str, timeout: float = 5.0) -> None:
    """SIGKILL every process in ``ns`` (again and again, for any that forked meanwhile) until
    none is left, then delete the namespace."""

    def empty() -> bool:
        pids = namespace_pids(ns)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return not pids

    if ns in all_namespaces():
        _wait_until(empty, timeout, f"the processes in namespace {ns} to die")
        _ip("netns", "delete", ns)


#: ``ip netns exec NS`` bind-mounts the files of ``NETNS_ETC/NS/`` over ``/etc/``.
NETNS_ETC = Path("/etc/netns")


def _write_hosts_file(host: Host) -> None:
    """Give the host an ``/etc/hosts`` of its own (``ip netns exec`` mounts it) in which the
    machine's host name resolves to the host's own addresses, as on a real machine of a
    cluster: Horovod's Gloo binds its process-set contexts to the host name's address, and
    ``elastic-run join`` refuses a name that resolves to loopback."""
    name = socket.gethostname()
    folder = NETNS_ETC / host.ns
    folder.mkdir(parents=True, exist_ok=True)
    own = "".join(f"{address} {name}\n" for address in host.addresses)
    (folder / "hosts").write_text(f"127.0.0.1 localhost\n::1 localhost\n{own}")


def remove_stale() -> list[str]:
    """Delete the namespaces that dead runs of this module left behind (their creating pid no
    longer exists), with any process still in them. Returns the names removed."""
    removed: list[str] = []
    if NETNS_ETC.is_dir():
        for leftover in NETNS_ETC.iterdir():
            match = _NAME.match(leftover.name)
            if match is not None and not _pid_exists(int(match.group(1))):
                shutil.rmtree(leftover, ignore_errors=True)
    for ns in all_namespaces():
        match = _NAME.match(ns)
        if match is None or _pid_exists(int(match.group(1))):
            continue
        try:
            kill_namespace(ns)
        except TestHostsError:
            log.exception("could not remove the stale test namespace %s", ns)
        else:
            log.info("removed the stale test namespace %s", ns)
            removed.append(ns)
    return removed


@functools.cache
def available() -> str | None:
    """None when test hosts can be made here, else the reason (for ``pytest.skip``)."""
    if os.geteuid() != 0:
        return f"network namespaces need root (this process runs as uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"{PREFIX}-{os.getpid()}-{next(_counter)}-probe"
    try:
        _ip("netns", "add", probe)
        try:
            _ip("-n", probe, "link", "add", BRIDGE, "type", "bridge")
            _ip("-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "b0")
            _ip("-n", probe, "link", "set", "b0", "master", BRIDGE)
            _ip("-n", probe, "-6", "addr", "add", "fd00::1/64", "dev", "a0", "nodad")
        finally:
            kill_namespace(probe)
    except TestHostsError as exc:
        return f"cannot make network namespaces, veths and bridges here: {exc}"
    return None


# -- hosts -------------------------------------------------------------------------------------


@dataclass(eq=False)
class Host:
    """One test host: a network namespace with one interface into its group's bridge."""

    name: str  #: "h1", "h2", ...
    ns: str  #: the namespace, for ``ip netns exec``
    iface: str  #: the host's interface (never eth0)
    ipv4: str | None  #: None on an IPv6-only host
    ipv6: str
    ipv4_prefix: int
    ipv6_prefix: int
    bridge_ns: str
    port: str  #: the bridge-side end of the host's veth, in ``bridge_ns``
    group: TestHosts = field(repr=False)
    _procs: list[subprocess.Popen[Any]] = field(default_factory=list, repr=False)
    _dropping_from: set[str] = field(default_factory=set, repr=False)

    def address(self, family: socket.AddressFamily = socket.AF_INET) -> str:
        """The host's address of ``family`` (AF_INET or AF_INET6), without brackets."""
        if family == socket.AF_INET:
            if self.ipv4 is None:
                raise ValueError(f"{self.name} is an IPv6-only host: it has no IPv4 address")
            return self.ipv4
        if family == socket.AF_INET6:
            return self.ipv6
        raise ValueError(f"test hosts have IPv4 and IPv6 addresses, not {family!r}")

    @property
    def addresses(self) -> list[str]:
        """The host's addresses on its interface: IPv4 (unless IPv6-only), then IPv6."""
        return [address for address in (self.ipv4, self.ipv6) if address is not None]

    def endpoint(self, port: int, family: socket.AddressFamily = socket.AF_INET) -> str:
        """``ADDRESS:PORT``, with the IPv6 address in brackets."""
        address = self.address(family)
        return f"[{address}]:{port}" if family == socket.AF_INET6 else f"{address}:{port}"

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside the host (``ip netns exec`` execs it: the pid is the command's).
        It is killed at cleanup if still running."""
        proc: subprocess.Popen[Any] = subprocess.Popen(self.command(argv), **kwargs)
        self._procs.append(proc)
        return proc

    def run(
        self, argv: Sequence[str], timeout: float = 10.0, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the host and return its output; raise :class:`TestHostsError`
        (with its stderr) when it exits non-zero or runs past ``timeout`` seconds."""
        try:
            done = subprocess.run(
                self.command(argv),
                input=input,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise TestHostsError(f"{list(argv)} on {self.name} ran past {timeout} s") from exc
        if done.returncode != 0:
            raise TestHostsError(
                f"{list(argv)} on {self.name} exited with {done.returncode}:\n"
                f"{done.stdout}{done.stderr}"
            )
        return done

    def pids(self) -> list[int]:
        """The processes running in this host's namespace."""
        return namespace_pids(self.ns)

    # -- links -------------------------------------------------------------------------------

    def _port_forwarding(self) -> bool:
        (port,) = _ip_json("-n", self.bridge_ns, "-d", "link", "show", "dev", self.port)
        state = port.get("linkinfo", {}).get("info_slave_data", {}).get("state")
        return "LOWER_UP" in port["flags"] and state == "forwarding"

    def _carrier(self) -> bool:
        (link,) = _ip_json("-n", self.ns, "link", "show", "dev", self.iface)
        return "UP" in link["flags"] and "LOWER_UP" in link["flags"]

    def link_is_up(self) -> bool:
        """Whether the host's link carries traffic (its interface has carrier and the bridge
        forwards on its port)."""
        return self._carrier() and self._port_forwarding()

    def link_down(self, timeout: float = 5.0) -> None:
        """Pull the host's cable: its bridge-side veth end goes down, so nothing it sends
        arrives and nothing reaches it, while it keeps its addresses and routes."""
        _ip("-n", self.bridge_ns, "link", "set", self.port, "down")
        _wait_until(lambda: not self._carrier(), timeout, f"{self.name}'s link to go down")

    def link_up(self, timeout: float = 5.0) -> None:
        """Plug the cable back in and wait until the bridge forwards the host's traffic. Any
        address the kernel dropped is added again; neighbour entries that failed while the link
        was down (here and on the peers) are flushed so that the next packet resolves anew."""
        _ip("-n", self.bridge_ns, "link", "set", self.port, "up")
        _ip("-n", self.ns, "link", "set", self.iface, "up")
        self._ensure_addresses()
        _wait_until(self.link_is_up, timeout, f"{self.name}'s link to come up")
        _ip("-n", self.ns, "neigh", "flush", "dev", self.iface, check=False)
        for peer in self.group.hosts:
            if peer is not self:
                for address in self.addresses:
                    _ip("-n", peer.ns, "neigh", "flush", "to", address, check=False)

    def _ensure_addresses(self) -> None:
        # `replace` adds an address that is missing and leaves one that is there.
        if self.ipv4 is not None:
            v4 = f"{self.ipv4}/{self.ipv4_prefix}"
            _ip("-n", self.ns, "addr", "replace", v4, "dev", self.iface)
        v6 = f"{self.ipv6}/{self.ipv6_prefix}"
        _ip("-n", self.ns, "-6", "addr", "replace", v6, "dev", self.iface, "nodad")

    # -- cutting one peer --------------------------------------------------------------------

    def _cut_rule(self, action: str, peer: Host) -> None:
        for family, address in (("-4", peer.ipv4), ("-6", peer.ipv6)):
            if address is None:
                continue
            _ip(
                *("-n", self.ns, family, "rule", action, "pref", str(CUT_RULE_PRIORITY)),
                *("from", address, "iif", self.iface, "blackhole"),
            )

    def _drop_from(self, peer: Host) -> None:
        if peer.name not in self._dropping_from:
            self._cut_rule("add", peer)
            self._dropping_from.add(peer.name)

    def _undrop_from(self, peer: Host) -> None:
        if peer.name in self._dropping_from:
            self._cut_rule("del", peer)
            self._dropping_from.discard(peer.name)

    def blackhole(self, peer: Host) -> None:
        """Silently drop all traffic between this host and ``peer`` (IPv4 and IPv6, both
        directions); both keep reaching every other host. Idempotent."""
        if peer is self:
            raise ValueError(f"{self.name} cannot be cut off from itself")
        self._drop_from(peer)
        peer._drop_from(self)

    def unblackhole(self, peer: Host) -> None:
        """Undo :meth:`blackhole` (either host's call undoes either's). Idempotent."""
        self._undrop_from(peer)
        peer._undrop_from(self)

    def _reap(self, timeout: float) -> None:
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout)
        self._procs.clear()


class TestHosts:
    """A group of ``count`` test hosts on one bridge. Use as a context manager (or call
    :meth:`start` and :meth:`close`); cleanup always runs, also when the body raises."""

    __test__ = False  # not a pytest test class

    def __init__(self, count: int, *, settle_timeout: float = 5.0, ipv4: bool = True) -> None:
        if not 1 <= count <= MAX_HOSTS:
            raise ValueError(f"count must be between 1 and {MAX_HOSTS}, not {count}")
        self.count = count
        self.settle_timeout = settle_timeout
        self.ipv4 = ipv4  #: False: IPv6-only hosts (no IPv4 address but loopback's)
        number = next(_counter)
        self.prefix = f"{PREFIX}-{os.getpid()}-{number}"
        self.subnet = (os.getpid() * 7 + number) % 250 + 1
        self.bridge_ns = f"{self.prefix}-br"
        self.ipv4_network = ipaddress.IPv4Network(f"10.231.{self.subnet}.0/24")
        self.ipv6_network = ipaddress.IPv6Network(f"fdea:a11e:d0ce:{self.subnet:x}::/64")
        self.hosts: tuple[Host, ...] = tuple(self._host(i) for i in range(1, count + 1))
        self._made: list[str] = []  # namespaces created, in order
        self._closed = False

    def _host(self, i: int) -> Host:
        return Host(
            name=f"h{i}",
            ns=f"{self.prefix}-h{i}",
            iface=f"enp{i}s0",
            ipv4=str(self.ipv4_network[i]) if self.ipv4 else None,
            ipv6=str(self.ipv6_network[i]),
            ipv4_prefix=self.ipv4_network.prefixlen,
            ipv6_prefix=self.ipv6_network.prefixlen,
            bridge_ns=self.bridge_ns,
            port=f"port{i}",
            group=self,
        )

    # -- access ------------------------------------------------------------------------------

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def __repr__(self) -> str:
        return f"TestHosts({self.prefix}, {', '.join(h.name for h in self.hosts)})"

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of the group: the bridge's, then the hosts'."""
        return [self.bridge_ns, *(host.ns for host in self.hosts)]

    def processes(self) -> dict[str, list[int]]:
        """The processes in each of the group's namespaces that still exist (empty lists
        left out)."""
        present = set(all_namespaces())
        found = {ns: namespace_pids(ns) for ns in self.namespaces if ns in present}
        return {ns: pids for ns, pids in found.items() if pids}

    # -- setup -------------------------------------------------------------------------------

    def start(self) -> TestHosts:
        """Make the namespaces, the bridge, the links and the addresses; wait until every link
        forwards. Removes what dead earlier runs left first; cleans up after itself on error."""
        if self._made or self._closed:
            raise TestHostsError(f"{self!r} was already started")
        remove_stale()
        _open_groups.add(self)
        try:
            self._add_namespace(self.bridge_ns)
            _ip(
                "-n", self.bridge_ns, "link", "add", BRIDGE, "type", "bridge", "mcast_snooping", "0"
            )
            _ip("-n", self.bridge_ns, "link", "set", BRIDGE, "up")
            for host in self.hosts:
                self._add_host(host)
            for host in self.hosts:
                _wait_until(host.link_is_up, self.settle_timeout, f"{host.name}'s link to come up")
        except BaseException:
            self.close()
            raise
        log.info("test hosts %s up: %s", self.prefix, [(h.ns, h.ipv4, h.ipv6) for h in self])
        return self

    def _add_namespace(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def _add_host(self, host: Host) -> None:
        self._add_namespace(host.ns)
        _ip(
            *("link", "add", host.iface, "netns", host.ns, "type", "veth"),
            *("peer", "name", host.port, "netns", self.bridge_ns),
        )
        _ip("-n", self.bridge_ns, "link", "set", host.port, "master", BRIDGE, "up")
        for family in ("-4", "-6"):  # the blackhole rules must come before the local table
            _ip(
                "-n",
                host.ns,
                family,
                "rule",
                "add",
                "pref",
                str(LOCAL_RULE_PRIORITY),
                "table",
                "local",
            )
            _ip("-n", host.ns, family, "rule", "del", "pref", "0", "table", "local")
        host._ensure_addresses()
        _ip("-n", host.ns, "link", "set", host.iface, "up")
        _write_hosts_file(host)

    # -- cleanup -----------------------------------------------------------------------------

    def close(self, timeout: float = 5.0) -> None:
        """Kill every process in the group's namespaces and delete them (idempotent). Raises
        :class:`TestHostsError` if something could not be removed, after trying everything."""
        if self._closed:
            return
        self._closed = True
        _open_groups.discard(self)
        problems: list[str] = []
        for ns in reversed(self._made):  # hosts first, the bridge last
            try:
                kill_namespace(ns, timeout)
            except TestHostsError as exc:
                problems.append(str(exc))
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        with contextlib.suppress(OSError):
            NETNS_ETC.rmdir()  # only when no other group's files are left in it
        for host in self.hosts:
            host._reap(timeout)
        left = [ns for ns in all_namespaces() if ns in self._made]
        if left:
            problems.append(f"namespaces still present: {left}")
        if problems:
            raise TestHostsError(f"cleanup of {self.prefix} failed: " + "; ".join(problems))

    def __enter__(self) -> TestHosts:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except TestHostsError:  # do not hide the body's exception behind the cleanup's
            log.exception("cleanup after %s raised %s failed", self.prefix, exc_type.__name__)


@atexit.register
def _close_open_groups() -> None:
    for group in list(_open_groups):
        with contextlib.suppress(TestHostsError):
            group.close()
