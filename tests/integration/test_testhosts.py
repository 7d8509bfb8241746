"""The test hosts fixture does what it says, checked with real TCP traffic between namespaces
(small Python servers and clients run with ``ip netns exec``; ``ping`` is not available here)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from tests.helpers import testhosts
from tests.helpers.testhosts import Host, TestHosts
from tests.integration.conftest import MakeTestHosts, assert_no_processes_left

pytestmark = pytest.mark.timeout(60)

PORT = 7001
#: How long a probe waits for a connection that should fail (a silent drop is a timeout).
CUT_TIMEOUT = 0.5

# Listens on PORT over IPv4 and IPv6 (two sockets, so each family's peer address is exact) and
# answers every connection with the address it came from. argv: lifetime in seconds, port.
SERVER = """
import selectors, socket, sys, time
sel = selectors.DefaultSelector()
for family, address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
    s = socket.socket(family)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    s.bind((address, int(sys.argv[2])))
    s.listen(64)
    sel.register(s, selectors.EVENT_READ)
print("ready", flush=True)
deadline = time.monotonic() + float(sys.argv[1])
while time.monotonic() < deadline:
    for key, _ in sel.select(timeout=0.2):
        conn, peer = key.fileobj.accept()
        with conn:
            conn.sendall(peer[0].encode())
"""

# Connects to port argv[2] of every address in argv[3:] at once (threads), each with a timeout of
# argv[1] seconds, and prints {address: "seen <what the server saw>" | "error <exception>"}.
PROBE = """
import json, socket, sys, threading
timeout, port = float(sys.argv[1]), int(sys.argv[2])
results = {}
def probe(address):
    try:
        with socket.create_connection((address, port), timeout=timeout) as s:
            s.settimeout(timeout)
            results[address] = "seen " + s.recv(256).decode()
    except OSError as exc:
        results[address] = "error " + type(exc).__name__ + ": " + str(exc)
threads = [threading.Thread(target=probe, args=(a,)) for a in sys.argv[3:]]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(results))
"""

# Starts a child that sleeps, says "ok", and sleeps.
SPAWNER = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print("ok", flush=True)
time.sleep(60)
"""


def python(*args: str) -> list[str]:
    return [sys.executable, "-I", "-c", *args]


def start_server(host: Host, lifetime: float = 30.0) -> subprocess.Popen[str]:
    proc = host.popen(
        python(SERVER, str(lifetime), str(PORT)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 10.0)
    line = proc.stdout.readline() if ready else ""
    assert line.strip() == "ready", f"server on {host.name} did not start: {line!r}"
    return proc


def start_probe(source: Host, targets: Sequence[str], timeout: float) -> subprocess.Popen[str]:
    argv = python(PROBE, str(timeout), str(PORT), *targets)
    return source.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def probe_result(proc: subprocess.Popen[str], targets: Sequence[str]) -> dict[str, str]:
    out, _ = proc.communicate(timeout=15)
    assert proc.returncode == 0, out
    results = json.loads(out)
    assert sorted(results) == sorted(targets), out
    return {str(k): str(v) for k, v in results.items()}


def probe(source: Host, targets: Sequence[str], timeout: float = 2.0) -> dict[str, str]:
    """Connect from ``source`` to each address; what each server saw, or the error."""
    return probe_result(start_probe(source, targets, timeout), targets)


def addresses(*hosts: Host) -> list[str]:
    return [address for host in hosts for address in (host.ipv4, host.ipv6)]


Paths = Sequence[tuple[Host, Sequence[Host]]]


def check(*, reach: Paths = (), cut: Paths = ()) -> None:
    """Probe all the paths at once. Over every ``reach`` path the source connects to each
    target over IPv4 and IPv6, from its own address. Over every ``cut`` path each connection
    times out: the packets vanish silently, as in a real partition (no local error such as
    EINVAL or ENETUNREACH)."""
    started = [
        (source, targets, expect, start_probe(source, addresses(*targets), timeout))
        for paths, expect, timeout in ((reach, True, 2.0), (cut, False, CUT_TIMEOUT))
        for source, targets in paths
    ]
    for source, targets, expect, proc in started:
        results = probe_result(proc, addresses(*targets))
        for target in targets:
            where = (source.name, target.name, results)
            if expect:
                assert results[target.ipv4] == f"seen {source.ipv4}", where
                assert results[target.ipv6] == f"seen {source.ipv6}", where
            else:
                assert results[target.ipv4].startswith("error TimeoutError"), where
                assert results[target.ipv6].startswith("error TimeoutError"), where


def link_names(ns: str | None = None) -> list[str]:
    prefix = ["ip", "-n", ns] if ns else ["ip"]
    out = subprocess.run(
        [*prefix, "-j", "link", "show"], capture_output=True, text=True, check=True, timeout=10
    ).stdout
    return [str(link["ifname"]) for link in json.loads(out)]


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# -- addresses and reachability ----------------------------------------------------------------


def test_hosts_reach_each_other_over_ipv4_and_ipv6_from_their_own_addresses(
    test_hosts: MakeTestHosts,
) -> None:
    h1, h2 = test_hosts(2)
    for host in (h1, h2):
        start_server(host)

    check(reach=[(h1, [h2]), (h2, [h1])])
    # Loopback is up inside a host, and a host reaches its own address.
    results = probe(h1, ["127.0.0.1", "::1", h1.ipv4, h1.ipv6])
    assert results == {
        "127.0.0.1": "seen 127.0.0.1",
        "::1": "seen ::1",
        h1.ipv4: f"seen {h1.ipv4}",
        h1.ipv6: f"seen {h1.ipv6}",
    }


def test_hosts_have_distinct_private_addresses_on_a_realistic_interface(
    test_hosts: MakeTestHosts,
) -> None:
    hosts = test_hosts(3)
    assert len({h.ipv4 for h in hosts}) == 3
    assert len({h.ipv6 for h in hosts}) == 3
    for host in hosts:
        assert ipaddress.ip_address(host.ipv4).is_private
        assert ipaddress.ip_address(host.ipv6) in ipaddress.ip_network("fc00::/7")  # ULA
        assert host.iface != "eth0"
        assert len(host.iface) <= 15
        # Inside the host: only lo and its interface, which holds both addresses.
        shown = json.loads(host.run(["ip", "-j", "addr", "show"]).stdout)
        assert sorted(link["ifname"] for link in shown) == sorted(["lo", host.iface])
        (iface,) = (link for link in shown if link["ifname"] == host.iface)
        local = {info["local"] for info in iface["addr_info"] if info["scope"] == "global"}
        assert local == {host.ipv4, host.ipv6}
        assert "UP" in iface["flags"]
        # The machine's host name resolves to the host's own address inside it (its own
        # /etc/hosts), as on a machine of a real cluster.
        name = socket.gethostname()
        resolved = host.run(["getent", "ahostsv4", name]).stdout.split()[0]
        assert resolved == host.ipv4
    assert hosts[0].endpoint(80) == f"{hosts[0].ipv4}:80"
    assert hosts[0].endpoint(80, socket.AF_INET6) == f"[{hosts[0].ipv6}]:80"
    # Nothing of the group is in the root namespace.
    root = link_names()
    for host in hosts:
        assert host.iface not in root
        assert host.port not in root


# -- faults ------------------------------------------------------------------------------------


def test_link_down_cuts_the_host_off_and_link_up_restores_it(test_hosts: MakeTestHosts) -> None:
    h1, h2, h3 = test_hosts(3)
    for host in (h1, h2, h3):
        start_server(host)
    check(reach=[(h1, [h2, h3])])

    h1.link_down()
    assert not h1.link_is_up()
    check(cut=[(h1, [h2, h3]), (h2, [h1]), (h3, [h1])], reach=[(h2, [h3])])  # the others talk
    # The host keeps its addresses while its cable is out (a partition, not a local failure).
    assert probe(h1, [h1.ipv4, h1.ipv6]) == {h1.ipv4: f"seen {h1.ipv4}", h1.ipv6: f"seen {h1.ipv6}"}

    h1.link_up()
    assert h1.link_is_up()
    check(reach=[(h1, [h2, h3]), (h2, [h1]), (h3, [h1])])


def test_link_up_restores_addresses_the_kernel_dropped(test_hosts: MakeTestHosts) -> None:
    """If the host-side interface went down (the kernel then deletes its IPv6 address and the
    IPv4 connected route), link_up puts everything back."""
    h1, h2 = test_hosts(2)
    start_server(h2)
    h1.run(["ip", "link", "set", h1.iface, "down"])
    assert h1.ipv6 not in h1.run(["ip", "-6", "addr", "show", "dev", h1.iface]).stdout

    h1.link_up()
    check(reach=[(h1, [h2])])


def test_blackhole_cuts_one_peer_only_and_unblackhole_restores_it(
    test_hosts: MakeTestHosts,
) -> None:
    h1, h2, h3 = test_hosts(3)
    for host in (h1, h2, h3):
        start_server(host)

    h1.blackhole(h2)
    check(cut=[(h1, [h2]), (h2, [h1])], reach=[(h1, [h3]), (h3, [h1, h2]), (h2, [h3])])

    h2.unblackhole(h1)  # either side undoes it
    check(reach=[(h1, [h2, h3]), (h2, [h1, h3])])


# -- cleanup -----------------------------------------------------------------------------------


def test_processes_left_inside_are_killed_and_everything_is_deleted_at_exit(
    netns_available: None,
) -> None:
    with TestHosts(2) as hosts:
        h1, h2 = hosts
        names = hosts.namespaces
        tracked = h1.popen(python("import time; time.sleep(60)"))
        # Not started through Host.popen, in a session of its own, with a child: cleanup must
        # find these through the namespace, not through what it started.
        untracked = subprocess.Popen(
            h2.command(python(SPAWNER)),
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert untracked.stdout is not None
        assert untracked.stdout.readline().strip() == "ok"
        wait_for(lambda: len(h2.pids()) == 2, 10, "the spawner and its child in h2")
        inside = h1.pids() + h2.pids()
        assert tracked.pid in inside
        assert untracked.pid in inside
        assert len(inside) == 3
        assert set(hosts.processes()) == {h1.ns, h2.ns}

    assert tracked.returncode == -9  # SIGKILLed (and reaped) by the cleanup
    assert untracked.wait(timeout=5) == -9
    assert not set(names) & set(testhosts.all_namespaces())
    assert not any(Path("/run/netns", name).exists() for name in names)
    assert_no_processes_left(hosts, inside)


def test_everything_is_deleted_when_the_body_raises(netns_available: None) -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom), TestHosts(2) as hosts:
        names = hosts.namespaces
        assert set(names) <= set(testhosts.all_namespaces())
        assert testhosts.BRIDGE in link_names(hosts.bridge_ns)
        assert {h.port for h in hosts} <= set(link_names(hosts.bridge_ns))
        sleeper = hosts[0].popen(python("import time; time.sleep(60)"))
        raise Boom

    assert sleeper.returncode == -9
    assert not set(names) & set(testhosts.all_namespaces())
    assert not any((testhosts.NETNS_ETC / ns).exists() for ns in names)
    root = link_names()
    assert not {testhosts.BRIDGE, *(h.port for h in hosts), *(h.iface for h in hosts)} & set(root)


def test_namespaces_of_dead_runs_are_removed_and_live_ones_kept(netns_available: None) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=10)
    assert not os.path.exists(f"/proc/{dead.pid}")
    stale = f"{testhosts.PREFIX}-{dead.pid}-1-h1"
    live = f"{testhosts.PREFIX}-{os.getpid()}-999999-h1"
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=10)
    try:
        subprocess.run(["ip", "netns", "add", live], check=True, timeout=10)
        # A process left in the stale namespace must not keep it alive.
        leftover = subprocess.Popen(
            ["ip", "netns", "exec", stale, *python("import time; time.sleep(60)")]
        )
        wait_for(lambda: testhosts.namespace_pids(stale) != [], 10, "the leftover process")

        removed = testhosts.remove_stale()

        assert stale in removed
        assert live not in removed
        present = testhosts.all_namespaces()
        assert stale not in present
        assert live in present
        assert leftover.wait(timeout=5) == -9
    finally:
        for name in (stale, live):
            with contextlib.suppress(testhosts.TestHostsError):
                testhosts.kill_namespace(name)
