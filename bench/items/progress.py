"""Item 8: the cost of the training processes' progress reporting on steady throughput.

Under ``elastic-run`` every training process counts its steps in memory
(:func:`elastic_allreduce.progress.report_step`, an attribute write per step) and a daemon
thread (:class:`elastic_allreduce.progress.Beacon`) PUTs a small JSON report to the launcher's
rendezvous server once a second, for the hang watchdog. This item runs item 1's workload
(bench/scripts/hvd_steps.py, ~1 M parameters, ``elastic-run --workers 2``) in alternating A/B
rounds, a fresh job per round, measured the same way (:func:`bench.jobs.step_rate`):

* A, reporting on: the default interval, and the script calls ``report_step(step)`` after every
  step (``--report-steps``);
* B, reporting off: ``ELASTIC_ALLREDUCE_PROGRESS_INTERVAL=0`` (no beacon thread) and no
  per-step call.

Within a round the order alternates (A B, then B A, ...: :func:`bench.rounds.alternate`), so a
load that drifts during the run does not always favour the same side. Overhead = (1 - median(A) /
median(B)) x 100 %.

On a small shared machine the rounds' own spread is often larger than 1 %, so the item also
times the reporting directly, in the suite's process (:func:`direct_cost`): the CPU of one
``report_step`` call and of one report as the beacon sends it (against a local HTTP server that
answers like the launcher's), and from them the share of a training process's CPU.
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from bench.horovodrun_baseline import MANY_STEPS, WORKLOAD
from bench.items.context import Context
from bench.items.throughput import PARAMS
from bench.jobs import ElasticRunJob, step_rate, summarize
from bench.rounds import ab_figures, alternate, rates
from elastic_allreduce import env as ea_env
from elastic_allreduce import progress
from elastic_allreduce.progress import REPORT_INTERVAL
from elastic_allreduce.rendezvous import protocol

#: The largest overhead of the reporting on rank 0's steps/s the issue accepts (%).
TARGET_OVERHEAD_PCT = 1.0
#: A: the default interval, set explicitly (the suite's own environment may set another).
REPORTING_ON: dict[str, str] = {ea_env.PROGRESS_INTERVAL: f"{REPORT_INTERVAL:g}"}
#: B: no beacon thread (the interval 0 turns it off).
REPORTING_OFF: dict[str, str] = {ea_env.PROGRESS_INTERVAL: "0"}


def _rate(ctx: Context, seconds: float, reporting: bool) -> dict[str, float]:
    """Rank 0's steps per second (and CPU) of one fresh 2-worker job, reporting on or off."""
    report_flag = ("--report-steps",) if reporting else ()
    with ElasticRunJob(
        ctx.endpoints,
        ctx.job_id("progress"),
        # --min-workers 2: a lost worker fails the job instead of shrinking it to one rank.
        flags=("--workers", "2", "--min-workers", "2", "--max-restarts", "0"),
        script=str(WORKLOAD),
        script_args=("--steps", str(MANY_STEPS), "--params", str(PARAMS), *report_flag),
        env=REPORTING_ON if reporting else REPORTING_OFF,
    ) as job:
        etcd = (ctx.etcd.pid,) if ctx.etcd.pid else ()
        return step_rate(job, seconds, 2, settle_s=ctx.pick(2.0, 3.0), extra_pids=etcd)


class _Launcher(BaseHTTPRequestHandler):
    """Answers a progress report the way the launcher's rendezvous server does (no stacks)."""

    def do_PUT(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = protocol.ProgressReply().encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: no line per request."""


def direct_cost(steps: int = 200_000, reports: int = 300) -> dict[str, float]:
    """CPU seconds of one ``report_step`` call and of one beacon report, in this thread.

    A report is what :class:`~elastic_allreduce.progress.Beacon` does once per interval: build
    and encode the report, PUT it, decode the reply (the server's side runs in the launcher,
    counted in the A/B rounds' "rest"). Loop overhead is included: these are upper bounds.
    """
    start = time.thread_time()
    for step in range(steps):
        progress.report_step(step)
    per_step = (time.thread_time() - start) / steps
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Launcher)
    serving = threading.Thread(target=server.serve_forever, name="fake-launcher", daemon=True)
    serving.start()
    try:
        url = protocol.progress_url(f"127.0.0.1:{server.server_address[1]}", "bench-0")
        start = time.thread_time()
        for _ in range(reports):
            body = progress.current_report(1).encode()
            protocol.ProgressReply.decode(progress._put(url, body))
        per_report = (time.thread_time() - start) / reports
    finally:
        server.shutdown()
        server.server_close()
        serving.join(timeout=5)
    return {"report_step_cpu_s": per_step, "report_cpu_s": per_report}


def run(ctx: Context) -> dict[str, Any]:
    """Alternating rounds with the reporting on (A) and off (B); the overhead of A."""
    rounds = ctx.pick(2, 3)
    seconds = ctx.pick(5.0, 20.0)
    on, off = alternate(
        rounds,
        functools.partial(_rate, ctx, seconds),
        what="progress",
        on="reporting on",
        off="off",
    )
    a, b = rates(on), rates(off)
    measured = ab_figures(on, off)
    direct = direct_cost()
    # CPU seconds per second the reporting costs one training process at A's step rate, and
    # its share of what one training process uses with the reporting off (B, 2 processes).
    direct_cpu = (
        direct["report_step_cpu_s"] * statistics.median(a)
        + direct["report_cpu_s"] / REPORT_INTERVAL
    )
    process_cpu = statistics.median([r["workers_cpu"] for r in off]) / 2
    return {
        "what": (
            "steps/s of rank 0 under elastic-run at 2 ranks, ~1 M parameters (item 1's "
            "workload), progress reporting on vs off"
        ),
        "params": PARAMS,
        "rounds": rounds,
        "seconds_per_round": seconds,
        "reporting_on": summarize(a),
        "reporting_off": summarize(b),
        "on_env": REPORTING_ON,
        "off_env": REPORTING_OFF,
        # The A/B figures (bench/rounds.py); the training processes' CPU includes their beacon
        # thread, and the rest of the CPU (launcher with its rendezvous server, agents, etcd)
        # serves the reports.
        **measured,
        # The reporting's CPU timed directly (see direct_cost), per training process.
        "direct": {
            **direct,
            "cpu_per_process_s_per_s": direct_cpu,
            "process_cpu_s_per_s": process_cpu,
            "overhead_pct": direct_cpu / process_cpu * 100.0 if process_cpu > 0 else None,
        },
        "target_overhead_pct": TARGET_OVERHEAD_PCT,
        "met": measured["overhead_pct"] <= TARGET_OVERHEAD_PCT,
    }
