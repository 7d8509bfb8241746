"""Item 10: the cost of the observability features on steady throughput.

Two features are on in a job that is watched: the launcher's ``--metrics-port`` (the dashboard,
Prometheus ``/metrics`` and the JSON API, served from a thread of the launcher, which keeps its
metrics up to date whether or not they are served) and ``--tensorboard-dir`` (rank 0's
summaries, :mod:`elastic_allreduce.training.tensorboard`: a step listener that buffers a few
scalars per
step and writes them every ``FLUSH_SECONDS``; the launcher's own summaries are written only
when a ring re-forms, never in a steady job). This item runs item 1's workload
(bench/scripts/hvd_steps.py, ~1 M parameters, ``elastic-run --workers 2``) with
``--summaries``: the script attaches rank 0's summaries as ``ea.State`` does and passes each
step's global batch and loss to ``report_step``. Alternating A/B rounds, a fresh job per round,
measured the same way (:func:`bench.jobs.step_rate`):

* A, observed: ``--metrics-port 0 --tensorboard-dir DIR``, and a thread of the suite GETs
  ``/metrics`` once a second for the whole job, as Prometheus would;
* B, not observed: neither flag (the same script: ``attach`` finds no directory and adds no
  listener) and nothing scraping.

Within a round the order alternates (A B, then B A, ...: :func:`bench.rounds.alternate`).
Overhead = (1 - median(A) / median(B)) x 100 %. A round of A that wrote no event file or answered
no scrape is a failure (the A/B would compare nothing).

On a small shared machine the rounds' own spread is often larger than 1 %, so the item also
times the costs directly: rank 0's step listener per call and one flush of ``FLUSH_SECONDS`` of
points at A's step rate (bench/scripts/summaries_cost.py, a process of its own: TensorFlow stays
out of the suite's), and one ``/metrics`` render and one whole scrape (in the suite's process,
against a launcher's dashboard server with the metrics of a 2-rank job); from them the share of
a training process's CPU.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from bench.horovodrun_baseline import MANY_STEPS, WORKLOAD
from bench.items.context import Context
from bench.items.throughput import PARAMS
from bench.jobs import (
    ROOT,
    SCRIPTS,
    STARTUP_LIMIT_S,
    BenchError,
    ElasticRunJob,
    Record,
    step_rate,
    summarize,
)
from bench.rounds import ab_figures, alternate, rates
from elastic_allreduce.records.values import JobSettings
from launcher.observe.metrics import JobMetrics
from launcher.observe.observer import JobObserver, ObserverSettings
from launcher.observe.server import DashboardServer

#: The largest overhead of the observability on rank 0's steps/s the issue accepts (%).
TARGET_OVERHEAD_PCT = 1.0
#: Seconds between two GETs of /metrics (Prometheus' scrape interval, at its most eager).
SCRAPE_INTERVAL_S = 1.0
#: The launcher's log line that names its dashboard (``Launcher._serve_dashboard``).
_DASHBOARD_LINE = re.compile(r"dashboard at http://(?P<address>\S+?)/ ")
#: Ranks of the job whose metrics the direct /metrics render shows.
_RANKS = 2


class _ObservedJob(ElasticRunJob):
    """An ``elastic-run`` job that also catches the address its launcher serves /metrics at."""

    dashboard: str | None = None

    def parse(self, line: str, arrived: float) -> Record | None:
        """A worker's record, as ElasticRunJob parses it; remembers the dashboard's address."""
        if self.dashboard is None:
            match = _DASHBOARD_LINE.search(line)
            if match is not None:
                # Set before _read takes the lock and notifies: wait_for sees it.
                self.dashboard = match["address"]
        return super().parse(line, arrived)


class _Scraper:
    """GETs a /metrics URL every :data:`SCRAPE_INTERVAL_S` from a thread, as Prometheus would.

    A context manager: leaving it stops the thread (a stop event and a join). Keeps the count
    of answered and failed scrapes, each answer's wall time and the last body's size.
    """

    def __init__(self, url: str, interval: float = SCRAPE_INTERVAL_S) -> None:
        self.url = url
        self.interval = interval
        self.latencies: list[float] = []
        self.failures = 0
        self.body_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-scraper", daemon=True)

    def __enter__(self) -> _Scraper:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop scraping and join the thread (idempotent)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        due = time.monotonic()
        while not self._stop.is_set():
            started = time.perf_counter()
            try:
                with urllib.request.urlopen(self.url, timeout=5) as reply:  # noqa: S310 - http
                    body = reply.read()
            except OSError:
                self.failures += 1
            else:
                self.latencies.append(time.perf_counter() - started)
                self.body_bytes = len(body)
            due += self.interval
            self._stop.wait(max(0.0, due - time.monotonic()))


def _event_bytes(folder: Path) -> int:
    """Bytes of the TensorBoard event files under ``folder``."""
    return sum(path.stat().st_size for path in folder.rglob("events.out.tfevents.*"))


def _rate(ctx: Context, seconds: float, observed: bool) -> dict[str, float]:
    """Rank 0's steps per second (and CPU) of one fresh 2-worker job, observed or not."""
    # --min-workers 2: a lost worker fails the job instead of shrinking it to one rank.
    flags = ["--workers", "2", "--min-workers", "2", "--max-restarts", "0"]
    with contextlib.ExitStack() as stack:
        folder: Path | None = None
        if observed:
            folder = Path(
                stack.enter_context(
                    tempfile.TemporaryDirectory(prefix="bench-tb-", ignore_cleanup_errors=True)
                )
            )
            flags += ["--metrics-port", "0", "--tensorboard-dir", str(folder)]
        job = _ObservedJob(
            ctx.endpoints,
            ctx.job_id("observability"),
            flags=flags,
            script=str(WORKLOAD),
            script_args=("--steps", str(MANY_STEPS), "--params", str(PARAMS), "--summaries"),
        )
        stack.enter_context(job)  # leaving the stack stops the job, then removes the folder
        scraper: _Scraper | None = None
        if observed:
            job.wait_for(
                lambda: job.dashboard is not None, STARTUP_LIMIT_S, "the launcher's dashboard"
            )
            scraper = stack.enter_context(_Scraper(f"http://{job.dashboard}/metrics"))
        etcd = (ctx.etcd.pid,) if ctx.etcd.pid else ()
        measured = step_rate(job, seconds, 2, settle_s=ctx.pick(2.0, 3.0), extra_pids=etcd)
        if scraper is None or folder is None:
            return measured
        scraper.stop()
        written = _event_bytes(folder)
        if written == 0:
            raise BenchError(f"rank 0 wrote no TensorBoard summaries in {folder}: {job.why()}")
        if not scraper.latencies:
            raise BenchError(f"no scrape of {scraper.url} answered: {job.why()}")
        return {
            **measured,
            "scrapes": float(len(scraper.latencies)),
            "scrape_failures": float(scraper.failures),
            "scrape_wall_s": statistics.median(scraper.latencies),
            "metrics_bytes": float(scraper.body_bytes),
            "event_bytes": float(written),
        }


def _fill(metrics: JobMetrics) -> None:
    """Set every series a steady 2-rank job's launcher shows (its first ring, no failures)."""
    metrics.ring_epoch.set(1)
    metrics.ring_size.set(_RANKS)
    metrics.target.set(_RANKS)
    metrics.changes.labels("joined").inc(_RANKS)
    metrics.changes.labels("reformed").inc()
    metrics.reform_seconds.labels("start").observe(0.4)
    metrics.last_commit_step.set(12_340)
    metrics.steps_per_second.set(65.0)
    metrics.goodput.set(0.93)
    metrics.kept_step_seconds.set(190.0)
    metrics.samples_per_second.set(8_300.0)
    for rank in range(_RANKS):
        slot = f"node-{rank}.0"
        metrics.rank_step.labels(slot).set(12_345)
        metrics.rank_step_seconds.labels(slot).set(0.015)


def metrics_cost(renders: int = 2_000, scrapes: int = 300) -> dict[str, float]:
    """CPU seconds of one ``/metrics`` render and of one whole scrape, in this process.

    The render is ``JobMetrics.exposition()`` alone (this thread's CPU); a scrape is one GET of
    ``/metrics`` from a launcher's :class:`DashboardServer` on loopback, the server's thread and
    the client's both counted (this process's CPU): an upper bound of the launcher's side.
    """
    settings = JobSettings(min_workers=_RANKS, max_workers=_RANKS, nproc_per_node=1, max_restarts=0)
    observer = JobObserver("bench-observability", settings, ObserverSettings(metrics_port=0))
    _fill(observer.metrics)
    body = observer.metrics.exposition()
    start = time.thread_time()
    for _ in range(renders):
        observer.metrics.exposition()
    per_render = (time.thread_time() - start) / renders
    server = DashboardServer(observer, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.start()}/metrics"
    try:
        start = time.process_time()
        for _ in range(scrapes):
            with urllib.request.urlopen(url, timeout=5) as reply:
                reply.read()
        per_scrape = (time.process_time() - start) / scrapes
    finally:
        server.stop()
        observer.close()
    return {
        "render_cpu_s": per_render,
        "scrape_cpu_s": per_scrape,
        "render_bytes": float(len(body)),
    }


def summaries_cost(steps_per_s: float, timeout: float = 300.0) -> dict[str, float]:
    """Rank 0's summaries timed by bench/scripts/summaries_cost.py at ``steps_per_s``."""
    command = [
        sys.executable,
        str(SCRIPTS / "summaries_cost.py"),
        *("--steps-per-second", f"{steps_per_s:.3f}", "--batch", "128"),
    ]
    try:
        done = subprocess.run(
            command,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},  # no TensorFlow start-up lines
        )
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"summaries_cost.py did not finish in {timeout:.0f} s") from exc
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = " | ".join((done.stdout + done.stderr).splitlines()[-10:])
        raise BenchError(f"summaries_cost.py failed (exit code {done.returncode}): {tail}")
    figures: dict[str, float] = json.loads(lines[-1])
    return figures


def _direct(
    summaries: dict[str, float], metrics: dict[str, float], steps_per_s: float, process_cpu: float
) -> dict[str, Any]:
    """The costs timed directly, per second of a steady job, as shares of a training process's
    CPU: rank 0's listener at ``steps_per_s`` and its flushes (on rank 0's training thread),
    and the launcher's answer to one scrape a second (on the same cores)."""
    rank0 = (
        summaries["on_step_cpu_s"] * steps_per_s
        + summaries["flush_cpu_s"] / summaries["flush_seconds"]
    )
    launcher = metrics["scrape_cpu_s"] / SCRAPE_INTERVAL_S

    def share(cpu: float) -> float | None:
        return cpu / process_cpu * 100.0 if process_cpu > 0 else None

    return {
        **summaries,
        **metrics,
        "steps_per_s": steps_per_s,
        "scrape_interval_s": SCRAPE_INTERVAL_S,
        "rank0_cpu_s_per_s": rank0,
        "launcher_cpu_s_per_s": launcher,
        "process_cpu_s_per_s": process_cpu,
        "rank0_pct": share(rank0),
        "launcher_pct": share(launcher),
        "overhead_pct": share(rank0 + launcher),
        # Rank 0 stops training for each flush; every rank waits for it at the next allreduce.
        "flush_pause_pct": summaries["flush_wall_s"] / summaries["flush_seconds"] * 100.0,
    }


def run(ctx: Context) -> dict[str, Any]:
    """Alternating rounds observed (A) and not (B); the overhead of A, and the costs timed."""
    rounds = ctx.pick(2, 3)
    seconds = ctx.pick(5.0, 20.0)
    load_start = os.getloadavg()[0]
    on, off = alternate(
        rounds,
        functools.partial(_rate, ctx, seconds),
        what="observability",
        on="observed",
        off="not observed",
    )
    a, b = rates(on), rates(off)
    measured = ab_figures(on, off)
    process_cpu = statistics.median([r["workers_cpu"] for r in off]) / 2
    load_end = os.getloadavg()[0]
    direct = _direct(
        summaries_cost(statistics.median(a)), metrics_cost(), statistics.median(a), process_cpu
    )
    return {
        "what": (
            "steps/s of rank 0 under elastic-run at 2 ranks, ~1 M parameters (item 1's "
            "workload, rank 0's summaries attached as ea.State does), observed vs not"
        ),
        "params": PARAMS,
        # Where and under what load the rounds ran (1-minute load average before and after).
        "cores": os.cpu_count(),
        "load_average": {"start": load_start, "end": load_end},
        "rounds": rounds,
        "seconds_per_round": seconds,
        "observed": summarize(a),
        "not_observed": summarize(b),
        "observed_flags": "--metrics-port 0 --tensorboard-dir DIR",
        "scrape_interval_s": SCRAPE_INTERVAL_S,
        # What the A rounds' scraper and rank 0 saw.
        "scrapes": summarize([r["scrapes"] for r in on]),
        "scrape_failures": sum(int(r["scrape_failures"]) for r in on),
        "scrape_wall_s": summarize([r["scrape_wall_s"] for r in on]),
        "metrics_bytes": max(r["metrics_bytes"] for r in on),
        "event_bytes": summarize([r["event_bytes"] for r in on]),
        # The A/B figures (bench/rounds.py); the training processes' CPU includes rank 0's
        # summaries, and the rest of the CPU (launcher with its dashboard server, agents, etcd)
        # answers the scrapes.
        **measured,
        "direct": direct,
        "target_overhead_pct": TARGET_OVERHEAD_PCT,
        "met": measured["overhead_pct"] <= TARGET_OVERHEAD_PCT,
    }
