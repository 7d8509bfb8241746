"""One job over several hosts (issue #11): a launcher host and worker hosts that join with a bare
`elastic-run join`, a crash, a host cut off from the network and back, and bad input.

The hosts are network namespaces on one bridge (tests/helpers/testhosts.py), each with its own
address and an interface not named eth0. The test process itself stays outside them: it reads
the processes' output and looks at their processes, never at etcd directly.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from elastic_allreduce import logprefix
from tests.conftest import ROOT, fresh_job_id
from tests.helpers import testhosts
from tests.helpers.testhosts import Host, TestHosts
from tests.integration.conftest import MakeTestHosts, assert_no_processes_left
from tests.integration.harness import EA_SCRIPT, ELASTIC_RUN, UNTIL_SCRIPT, until

pytestmark = pytest.mark.slow

TTL = 3


@dataclass
class Output:
    """The lines of every process of the job, each one's JSON events with their arrival time."""

    lines: list[tuple[str, str]] = field(default_factory=list)
    events: list[tuple[float, str, dict[str, object]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    changed: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)

    def read(self, who: str, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            parsed = logprefix.parse_line(line)
            data = None
            if parsed is not None and parsed.text.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    data = json.loads(parsed.text)
            with self.changed:
                self.lines.append((who, line))
                if isinstance(data, dict) and parsed is not None:
                    self.events.append((time.monotonic(), parsed.slot, data))
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def wait_for(self, what: str, predicate: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self.changed:
            while not predicate():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"timed out waiting for {what}; output:\n{self.tail()}")
                self.changed.wait(min(remaining, 0.5))

    def commits(self, size: int, after: float = 0.0) -> list[tuple[float, str, dict[str, object]]]:
        return [
            e
            for e in self.events
            if e[0] > after and e[2].get("event") == "commit" and e[2].get("size") == size
        ]

    def text(self, who: str | None = None) -> str:
        return "\n".join(line for w, line in self.lines if who is None or w == who)

    def tail(self, count: int = 120) -> str:
        return "\n".join(f"[{w}] {line}" for w, line in self.lines[-count:])


def start(host: Host, who: str, argv: list[str], output: Output) -> subprocess.Popen[str]:
    proc: subprocess.Popen[str] = host.popen(
        argv,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    threading.Thread(target=output.read, args=(who, proc), daemon=True).start()
    return proc


def launch_until_stopped(
    hosts: TestHosts,
    output: Output,
    flags: tuple[str, ...],
    stop_file: Path,
    *,
    step_delay: float = 0.03,
    family: socket.AddressFamily = socket.AF_INET,
    ttl: int = TTL,
) -> tuple[subprocess.Popen[str], str, str]:
    """:func:`launch` of UNTIL_SCRIPT: the job trains until ``stop_file`` appears, once the
    test has seen all it needs, not for a guessed step count (on a loaded machine a restarted
    process's TensorFlow import can outlast any fixed number of steps)."""
    return launch(
        hosts,
        output,
        flags,
        until(stop_file, step_delay=step_delay),
        family=family,
        script=UNTIL_SCRIPT,
        ttl=ttl,
    )


def join_the_others(
    hosts: TestHosts, etcd: str, job_id: str, output: Output
) -> dict[str, subprocess.Popen[str]]:
    """`elastic-run join` on every host but the launcher's; each by its host's name."""
    return {
        host.name: start(
            host, host.name, [ELASTIC_RUN, "join", "--etcd", etcd, "--job-id", job_id], output
        )
        for host in list(hosts)[1:]
    }


def training_pids(host: Host) -> list[int]:
    """The training processes (``elastic_allreduce.bootstrap``) running on ``host``."""
    found = []
    for pid in host.pids():
        with contextlib.suppress(OSError):
            if b"elastic_allreduce.bootstrap" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return found


def launch(
    hosts: TestHosts,
    output: Output,
    flags: tuple[str, ...] = (),
    script_args: tuple[str, ...] = (),
    *,
    family: socket.AddressFamily = socket.AF_INET,
    script: str = EA_SCRIPT,
    ttl: int = TTL,
) -> tuple[subprocess.Popen[str], str, str]:
    """`elastic-run run --host H0 --workers 0` on the first host, at its address of
    ``family``; it, its etcd and job id."""
    job_id = fresh_job_id("mh")
    launcher = start(
        hosts[0],
        "launcher",
        [
            ELASTIC_RUN,
            "run",
            "--host",
            hosts[0].address(family),
            "--workers",
            "0",
            "--job-id",
            job_id,
            "--lease-ttl",
            str(ttl),
            *flags,
            "--",
            "python",
            script,
            *script_args,
        ],
        output,
    )
    pattern = re.compile(r"other hosts join with: elastic-run join --etcd (\S+) --job-id (\S+)")
    found: list[str] = []

    def printed() -> bool:
        match = pattern.search(output.text("launcher"))
        if match:
            found[:] = [match.group(1), match.group(2)]
        return bool(match)

    output.wait_for("the launcher's join line", printed, 60)
    assert found[1] == job_id
    return launcher, found[0], job_id


@pytest.mark.timeout(480)
def test_three_hosts_join_bare_survive_a_crash_and_a_cut_link(
    test_hosts: MakeTestHosts, tmp_path: Path
) -> None:
    hosts = test_hosts(4)
    output = Output()
    stop_file = tmp_path / "stop"
    flags = ("--min-workers", "2", "--max-workers", "3", "--max-restarts", "1")
    launcher, etcd, job_id = launch_until_stopped(hosts, output, flags, stop_file)
    assert etcd.startswith(hosts[0].ipv4 + ":")
    joins = join_the_others(hosts, etcd, job_id, output)
    output.wait_for("3 ranks training", lambda: len(output.commits(3)) >= 6, 100)
    for host in list(hosts)[1:]:
        # Each node found its own address and interface (not eth0) by itself.
        assert f"at {host.ipv4} (Gloo on {host.iface})" in output.text(host.name), output.tail()

    # A crash: SIGKILL of one training process on h3.
    (victim,) = training_pids(hosts[3])
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    output.wait_for("survivors at size 2", lambda: len(output.commits(2, killed_at)) >= 2, 60)
    crash_recovery = output.commits(2, killed_at)[0][0] - killed_at
    output.wait_for(
        "the restarted process back at size 3",
        lambda: len(output.commits(3, killed_at)) >= 3,
        120,
    )

    # A partition: h2's link goes down for 20 s.
    cut_host = hosts[2]
    cut_at, lines_at_cut = time.monotonic(), len(output.lines)
    cut_host.link_down()
    output.wait_for("the others at size 2", lambda: len(output.commits(2, cut_at)) >= 2, 30)
    partition_recovery = output.commits(2, cut_at)[0][0] - cut_at
    deadline = cut_at + 2 * TTL + 2
    while training_pids(cut_host) and time.monotonic() < deadline:
        time.sleep(0.2)
    fenced_after = time.monotonic() - cut_at
    assert training_pids(cut_host) == [], f"zombie ranks on {cut_host.name}:\n{output.tail()}"
    assert joins[cut_host.name].poll() is None  # the agent waits to come back
    while time.monotonic() < cut_at + 20:
        time.sleep(0.2)
    back_at, lines_at_back = time.monotonic(), len(output.lines)
    cut_host.link_up()
    assert launcher.poll() is None, "the job ended before the link came back:\n" + output.tail()
    output.wait_for(
        f"{cut_host.name} back in the ring", lambda: len(output.commits(3, back_at)) >= 3, 120
    )

    # Two worker hosts that reach etcd and the launcher but not each other.
    first, second = hosts[1], hosts[2]
    blackholed_at = time.monotonic()
    first.blackhole(second)
    output.wait_for(
        "the ring without one of them", lambda: len(output.commits(2, blackholed_at)) >= 2, 60
    )
    split_recovery = output.commits(2, blackholed_at)[0][0] - blackholed_at
    restored_at = time.monotonic()
    first.unblackhole(second)
    output.wait_for("both back in the ring", lambda: len(output.commits(3, restored_at)) >= 3, 120)

    stop_file.touch()
    assert launcher.wait(timeout=120) == 0, output.tail()
    for name, proc in joins.items():
        assert proc.wait(timeout=60) == 0, f"{name}:\n{output.tail()}"
    print(
        f"crash: size 2 after {crash_recovery:.2f} s; cut link: size 2 after "
        f"{partition_recovery:.2f} s, {cut_host.name}'s ranks gone after {fenced_after:.2f} s; "
        f"two hosts cut from each other: size 2 after {split_recovery:.2f} s"
    )
    launcher_log = output.text("launcher")
    assert "was lost (dead or cut off)" in launcher_log, launcher_log
    # The crash used the one restart; the partition used none (else the job had dropped a slot).
    assert "restarting it (1/1)" in launcher_log
    assert "no restarts left" not in launcher_log, launcher_log
    # The cut host was found through its lease, and the others left their collective with it
    # by themselves (the ring guard): none was replaced as stuck.
    while_cut = [
        line for who, line in output.lines[lines_at_cut:lines_at_back] if who == "launcher"
    ]
    assert any("was lost (dead or cut off)" in line for line in while_cut), output.tail()
    assert not any("did not leave its failed collective" in line for line in while_cut), while_cut
    assert "registering again" in output.text(cut_host.name), output.tail()
    # The pair was reported with the peer's name, one side left out and taken back.
    assert re.search(
        r"node \S+ and \S+ cannot reach each other .* leaving \S+ out of the ring", launcher_log
    ), launcher_log
    assert "reaches every peer again" in launcher_log, launcher_log
    done = [e for e in output.events if e[2].get("event") == "done"]
    assert len(done) == 3, output.tail()
    assert len({json.dumps(e[2]["checksum"]) for e in done}) == 1, done  # the same weights
    deadline = time.monotonic() + 30
    while any(h.pids() for h in hosts) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert_no_processes_left(hosts)


def test_bad_node_input_is_one_clear_error_at_start(test_hosts: MakeTestHosts) -> None:
    hosts = test_hosts(2)
    output = Output()
    launcher, etcd, job_id = launch(hosts, output)
    # A second job on that etcd whose launcher advertises loopback (no --host): unreachable.
    loopback_job = fresh_job_id("mh")
    lone = start(
        hosts[0],
        "loopback",
        [
            ELASTIC_RUN,
            "run",
            "--etcd",
            etcd,
            "--workers",
            "0",
            "--job-id",
            loopback_job,
            "--",
            "python",
            EA_SCRIPT,
        ],
        output,
    )
    output.wait_for("the second launcher", lambda: "events in" in output.text("loopback"), 60)
    cases = [
        (["--host", "10.9.9.9"], "--host 10.9.9.9 is not an address of this machine"),
        (["--gloo-iface", "eth7"], "--gloo-iface 'eth7': this machine has no such network"),
        (["--job-id", loopback_job], "the launcher's rendezvous at 127.0.0.1:"),
        (["name-to-loopback"], "resolves to 127.0.1.1, a loopback address"),
    ]
    hosts_file = testhosts.NETNS_ETC / hosts[1].ns / "hosts"
    own_hosts_file = hosts_file.read_text()
    for case, message in cases:
        flags = [] if case == ["name-to-loopback"] else case
        if case == ["name-to-loopback"]:
            # Debian's default: the host name resolves to 127.0.1.1.
            hosts_file.write_text(f"127.0.0.1 localhost\n127.0.1.1 {socket.gethostname()}\n")
        else:
            hosts_file.write_text(own_hosts_file)
        argv = [ELASTIC_RUN, "join", "--etcd", etcd, "--job-id", job_id, *flags]
        result = subprocess.run(
            hosts[1].command(argv), capture_output=True, text=True, timeout=60, check=False
        )
        assert result.returncode == 2, (flags, result)
        assert message in result.stderr, (flags, result.stderr)
        assert result.stderr.count("error:") == 1 and "Traceback" not in result.stderr
        # Refused before any training process started: no restart loop.
        assert "started incarnation" not in result.stdout + result.stderr, (flags, result)
    assert training_pids(hosts[1]) == []
    for proc in (launcher, lone):
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_etcd_and_nodes_on_ipv6(test_hosts: MakeTestHosts) -> None:
    """etcd listens on an IPv6 address and a bare join finds its IPv6 address by the route to
    it, while the launcher's rendezvous is on IPv4: the families may differ."""
    hosts = test_hosts(2)
    output = Output()
    etcd_proc = start(hosts[0], "etcd", [ELASTIC_RUN, "etcd", "--host", hosts[0].ipv6], output)
    found: list[str] = []

    def serving() -> bool:
        match = re.search(r"pass --etcd (\S+)", output.text("etcd"))
        found[:] = [match.group(1)] if match else []
        return bool(match)

    output.wait_for("etcd on IPv6", serving, 30)
    etcd = found[0]
    assert etcd.startswith(f"[{hosts[0].ipv6}]:"), etcd
    job_id = fresh_job_id("mh")
    launcher = start(
        hosts[0],
        "launcher",
        [
            ELASTIC_RUN,
            "run",
            "--etcd",
            etcd,
            "--host",
            hosts[0].ipv4,
            "--workers",
            "0",
            "--job-id",
            job_id,
            "--",
            "python",
            EA_SCRIPT,
        ],
        output,
    )
    output.wait_for("the launcher", lambda: "rendezvous at" in output.text("launcher"), 60)
    node = start(
        hosts[1], "node", [ELASTIC_RUN, "join", "--etcd", etcd, "--job-id", job_id], output
    )
    line = f"joining job {job_id} at {hosts[1].ipv6} (Gloo on {hosts[1].iface})"
    output.wait_for("the node's address", lambda: line in output.text("node"), 60)
    shown = hosts[1].run(
        [ELASTIC_RUN, "keys", "--etcd", etcd, "--job-id", job_id, "members/"], timeout=30
    )
    (record,) = [json.loads(line)["value"] for line in shown.stdout.splitlines()]
    assert record["host"] == hosts[1].ipv6 and record["probe"] > 0, record
    node.send_signal(signal.SIGTERM)  # a graceful leave
    assert node.wait(timeout=60) == 0, output.tail()
    for proc in (launcher, etcd_proc):
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def interface_addresses(host: Host) -> dict[str, set[str]]:
    """The host's addresses by family ("inet", "inet6") on every interface but loopback."""
    shown = json.loads(host.run(["ip", "-j", "addr", "show"]).stdout)
    found: dict[str, set[str]] = {}
    for link in shown:
        if link["ifname"] != "lo":
            for info in link.get("addr_info", []):
                found.setdefault(info["family"], set()).add(info["local"])
    return found


@pytest.mark.timeout(240)
def test_a_cut_node_is_fenced_in_time_while_its_agent_waits_on_etcd(
    test_hosts: MakeTestHosts, tmp_path: Path
) -> None:
    """No store call may stand between an agent and its fencing deadline. With a 6 s lease, a
    cut node's probes find its peers gone after about 2 s and its agent starts writing that
    into its member record, a store call that waits out an outage, long before the lease is
    due. Still the node's training process is stopped within TTL + 1 s of the cut, and the
    agent waits to come back; the other rank trains on alone."""
    ttl = 6
    stuck_after = ("--stuck-timeout", str(2 * ttl))  # longer than the lease, as the CLI asks
    flags = ("--min-workers", "1", "--max-workers", "2", "--max-restarts", "0", *stuck_after)
    hosts = test_hosts(3)
    output = Output()
    stop_file = tmp_path / "stop"
    launcher, etcd, job_id = launch_until_stopped(hosts, output, flags, stop_file, ttl=ttl)
    joins = join_the_others(hosts, etcd, job_id, output)
    output.wait_for("2 ranks training", lambda: len(output.commits(2)) >= 4, 100)
    cut_host = hosts[2]
    assert len(training_pids(cut_host)) == 1, output.tail()
    cut_at = time.monotonic()
    cut_host.link_down()
    deadline = cut_at + 3 * ttl
    while training_pids(cut_host) and time.monotonic() < deadline:
        time.sleep(0.1)
    fenced_after = time.monotonic() - cut_at
    print(f"the cut node's rank stopped {fenced_after:.2f} s after the cut (TTL {ttl} s)")
    cut_log = output.text(cut_host.name)
    # The store call was under way: the probes had found the peers gone before the fence.
    assert "cannot reach peer nodes" in cut_log.split("cut off from etcd", 1)[0], output.tail()
    assert "cut off from etcd" in cut_log, output.tail()
    assert fenced_after <= ttl + 1.0, output.tail()
    assert joins[cut_host.name].poll() is None  # the agent waits to come back
    output.wait_for("the other rank alone", lambda: len(output.commits(1, cut_at)) >= 2, 60)
    stop_file.touch()
    assert launcher.wait(timeout=120) == 0, output.tail()
    assert joins[hosts[1].name].wait(timeout=60) == 0, output.tail()
    joins[cut_host.name].terminate()
    joins[cut_host.name].wait(timeout=30)


@pytest.mark.timeout(240)
def test_a_job_on_ipv6_only_hosts_trains_through_a_kill(
    netns_available: None, tmp_path: Path
) -> None:
    """Every host has IPv6 addresses only: the launcher (and its etcd) on one, nodes joining
    with a bare `join --etcd [V6]:PORT`. Horovod's own clients reach the launcher through each
    process's local relay, Gloo's pairs connect over IPv6, and the launcher's notifications
    reach the ranks over IPv6 (the restarted rank returns at a resize). A SIGKILLed rank's peer
    trains on alone, the rank is restarted and rejoins, and the job finishes at size 2 with
    equal weights. It trains until the test has seen the rank back (a stop file): on a loaded
    machine the restarted process's import can outlast any fixed number of steps."""
    stop_file = tmp_path / "stop"
    with TestHosts(3, ipv4=False) as hosts:
        for host in hosts:
            assert interface_addresses(host).keys() == {"inet6"}, interface_addresses(host)
        output = Output()
        flags = ("--min-workers", "1", "--max-workers", "2", "--max-restarts", "1")
        dashboard = ("--metrics-port", "0")  # served on IPv6 too
        launcher, etcd, job_id = launch_until_stopped(
            hosts, output, (*flags, *dashboard), stop_file, step_delay=0.02, family=socket.AF_INET6
        )
        assert etcd.startswith(f"[{hosts[0].ipv6}]:"), etcd
        joins = join_the_others(hosts, etcd, job_id, output)
        output.wait_for("2 ranks training", lambda: len(output.commits(2)) >= 4, 100)
        for host in list(hosts)[1:]:
            assert f"at {host.ipv6} (Gloo on {host.iface})" in output.text(host.name)
        relayed = f"to [{hosts[0].ipv6}]:"
        assert output.text().count(relayed) >= 2, output.tail()  # one relay per process

        (victim,) = training_pids(hosts[2])
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        output.wait_for("its peer alone", lambda: len(output.commits(1, killed_at)) >= 1, 60)
        output.wait_for(
            "the restarted rank back at size 2",
            lambda: len(output.commits(2, killed_at)) >= 2,
            120,
        )
        back_after = output.commits(2, killed_at)[0][0] - killed_at

        stop_file.touch()
        assert launcher.wait(timeout=120) == 0, output.tail()
        for name, proc in joins.items():
            assert proc.wait(timeout=60) == 0, f"{name}:\n{output.tail()}"
        print(f"IPv6-only hosts: the killed rank was back at size 2 after {back_after:.1f} s")
        launcher_log = output.text("launcher")
        assert "restarting it (1/1)" in launcher_log, launcher_log
        assert f"dashboard at http://[{hosts[0].ipv6}]:" in launcher_log, launcher_log
        # The rank came back at a resize, which only a delivered notification ends in time.
        after_kill = launcher_log.split("crashed: killed by SIGKILL", 1)[1]
        assert "(resize): 2 ranks" in after_kill, launcher_log
        assert "did not reach a commit in time" not in launcher_log, launcher_log
        assert "notification not delivered" not in output.text(), output.tail()
        done = [e for e in output.events if e[2].get("event") == "done"]
        assert len(done) == 2, output.tail()
        assert len({json.dumps(e[2]["checksum"]) for e in done}) == 1, done  # the same weights
        deadline = time.monotonic() + 30
        while any(h.pids() for h in hosts) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert_no_processes_left(hosts)
