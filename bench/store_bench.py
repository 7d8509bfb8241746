"""Membership store figures on a private etcd (a benchmark, not a test: it only prints).

1. SIGKILL of a process holding a key under a lease (TTL 2 s) -> a watcher sees the DELETE.
2. PUT by one client -> the same PUT seen by another client's watch.
3. Compare-and-swap operations per second (one client, sequential), next to plain PUTs.

Usage: python bench/store_bench.py [--trials N] [--seconds S]
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import time

from elastic_allreduce.records import keys
from elastic_allreduce.store import EmbeddedEtcd, EtcdStore, EventType


def hold(endpoints: str, job_id: str, key: str, ttl: int) -> None:
    """Child mode: hold ``key`` under a lease, say so, and wait to be killed."""
    store = EtcdStore(endpoints, job_id)
    lease = store.grant_lease(ttl)
    store.put(key, {"pid": os.getpid()}, lease=lease)
    print("ready", flush=True)
    sys.stdin.read()


def summary(values: list[float], unit: str = "ms", scale: float = 1000.0) -> str:
    ordered = sorted(v * scale for v in values)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return (
        f"median {statistics.median(ordered):8.2f} {unit}   min {ordered[0]:8.2f}   "
        f"max {ordered[-1]:8.2f}   p99 {p99:8.2f}   (n={len(ordered)})"
    )


def bench_lease_kill(server: EmbeddedEtcd, trials: int, ttl: int) -> list[float]:
    store = EtcdStore(server.endpoints_text, "bench-lease")
    results = []
    try:
        for trial in range(trials):
            key = keys.member(f"holder-{trial}")
            watch = store.watch_prefix(keys.MEMBERS)
            child = subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--hold",
                    server.endpoints_text,
                    "bench-lease",
                    key,
                    str(ttl),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert child.stdout is not None
            if child.stdout.readline().strip() != "ready":
                raise RuntimeError("lease holder did not start")
            event = watch.get(10)
            assert event is not None and event.type is EventType.PUT, event
            killed_at = time.monotonic()
            child.send_signal(signal.SIGKILL)
            event = watch.get(ttl + 10)
            seen_at = time.monotonic()
            assert event is not None and (event.type, event.key) == (EventType.DELETE, key), event
            results.append(seen_at - killed_at)
            child.wait(timeout=10)
            watch.close()
    finally:
        store.close()
    return results


def bench_watch_latency(server: EmbeddedEtcd, trials: int) -> list[float]:
    writer = EtcdStore(server.endpoints_text, "bench-watch")
    watcher = EtcdStore(server.endpoints_text, "bench-watch")
    watch = watcher.watch_prefix("k/")
    results = []
    try:
        for trial in range(trials):
            started = time.monotonic()
            revision = writer.put(f"k/{trial % 10}", trial)
            event = watch.get(10)
            results.append(time.monotonic() - started)
            assert event is not None and event.revision == revision
    finally:
        watcher.close()
        writer.close()
    return results


def bench_ops_per_second(server: EmbeddedEtcd, seconds: float) -> tuple[float, float, int]:
    store = EtcdStore(server.endpoints_text, "bench-cas")
    try:
        revision = store.put("counter", 0)
        deadline = time.monotonic() + seconds
        cas = 0
        started = time.monotonic()
        while time.monotonic() < deadline:
            new_revision = store.compare_and_swap(
                "counter", cas + 1, expected_mod_revision=revision
            )
            if new_revision is None:
                raise RuntimeError("an uncontended CAS failed")
            revision = new_revision
            cas += 1
        cas_rate = cas / (time.monotonic() - started)
        stale = store.compare_and_swap("counter", -1, expected_mod_revision=revision - 1)
        puts = 0
        deadline = time.monotonic() + seconds
        started = time.monotonic()
        while time.monotonic() < deadline:
            store.put("plain", puts)
            puts += 1
        put_rate = puts / (time.monotonic() - started)
        assert stale is None
        return cas_rate, put_rate, cas
    finally:
        store.close()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=10, help="lease-kill trials (default 10)")
    parser.add_argument("--watch-trials", type=int, default=200, help="watch latency trials")
    parser.add_argument("--seconds", type=float, default=3.0, help="duration of each ops/s run")
    parser.add_argument("--ttl", type=int, default=2, help="lease TTL in seconds (default 2)")
    parser.add_argument(
        "--hold", nargs=4, metavar=("ENDPOINTS", "JOB", "KEY", "TTL"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.hold:
        hold(args.hold[0], args.hold[1], args.hold[2], int(args.hold[3]))
        return 0
    with EmbeddedEtcd() as server:
        version = EtcdStore(server.endpoints_text, "bench").check()
        print(
            f"etcd {version} ({server.binary}) on {server.endpoint}; "
            f"python {platform.python_version()}; {os.cpu_count()} CPUs; "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}"
        )
        kills = bench_lease_kill(server, args.trials, args.ttl)
        print(
            f"SIGKILL of lease holder -> watcher sees DELETE (TTL {args.ttl} s): {summary(kills)}"
        )
        latencies = bench_watch_latency(server, args.watch_trials)
        print(f"PUT -> seen by another client's watch:                {summary(latencies)}")
        cas_rate, put_rate, cas_count = bench_ops_per_second(server, args.seconds)
        print(
            f"compare-and-swap, one client, sequential: {cas_rate:8.1f} ops/s ({cas_count} ops); "
            f"plain PUT: {put_rate:8.1f} ops/s; CAS/PUT ratio {cas_rate / put_rate:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
