"""gpu-check's NCCL failure check: what Horovod's NCCL allreduce does when a peer is SIGKILLed,
and whether the survivor can re-initialise -- the steps an elastic reset asks of NCCL.

Horovod's tracker has reports of NCCL hanging or aborting survivors under elastic resets
(issues 3111, 3264, 3611); elastic-allreduce's ring guard only cuts Gloo's sockets. This runs
the reset at Horovod's level, with Horovod's own rendezvous server in elastic mode
(``HOROVOD_ELASTIC=1``, as elastic-run's workers run), each process a host of its own:

1. ranks A and B allreduce on the GPU, shut Horovod down and re-initialise (a reset without a
   failure: NCCL communicators made again with the same peers);
2. B SIGKILLs itself *between* collectives (it never submits the next one): how long until
   A's allreduce fails, and with what;
3. A shuts Horovod down and re-initialises with a new process C (a restarted peer): the NCCL
   communicator is made again with a new member, and the sums are right;
4. C is SIGKILLed from outside while both are *inside* back-to-back large allreduces: again how
   long until A's fails (or whether it hangs);
5. A alone re-initialises at size 1 and allreduces.

Each step's figures go into one line ``GPU_CHECK_RESULT {json}`` (the parent's). A hang is a
finding: after ``--deadline`` seconds the parent takes the survivor's stacks (SIGUSR1,
faulthandler) and reports it. ``python gpu_check_nccl_failure.py --framework torch``; ``--cpu``
runs it on Gloo alone (the plumbing, no NCCL). The parent needs only Horovod's runner.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any

from horovod.runner.common.util.hosts import HostInfo, get_host_assignments
from horovod.runner.elastic.rendezvous import create_rendezvous_handler
from horovod.runner.http.http_server import RendezvousServer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_check_framework import FRAMEWORKS, Framework

MARK = "GPU_CHECK_RESULT "
RANK_VARIABLES = tuple(
    f"HOROVOD_{name}"
    for name in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")
)
EVENT = "NCCL_FAILURE_EVENT "


# -- the worker -------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    """Obey one command per line of stdin; say what happened as one EVENT line each."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    fw = Framework(args.framework, args.cpu)
    hvd = fw.hvd

    def say(event: str, **fields: Any) -> None:  # noqa: ANN401
        # One write of a line shorter than PIPE_BUF: no other writer's bytes land inside it.
        sys.stdout.write(EVENT + json.dumps({"event": event, "at": time.time(), **fields}) + "\n")
        sys.stdout.flush()

    round_ = 0
    for line in sys.stdin:
        command, *rest = line.split()
        started = called = time.perf_counter()
        try:
            if command == "init":  # init RANK SIZE LOCAL_RANK LOCAL_SIZE CROSS_RANK CROSS_SIZE
                # Read by the first hvd.init(); a re-initialisation asks the rendezvous server.
                os.environ.update(zip(RANK_VARIABLES, rest, strict=True))
                fw.init()
                # Tensor names count from here, so that a new peer's match the survivor's:
                # Horovod waits until every rank has submitted a tensor of the same name.
                round_ = 0
                say("init", rank=hvd.rank(), size=hvd.size(), seconds=time.perf_counter() - started)
            elif command == "shutdown":
                hvd.shutdown()
                say("shutdown", seconds=time.perf_counter() - started)
            elif command == "steps":  # steps N MIB KILL_AT: N allreduces; rank 1 dies at KILL_AT
                steps, mib, kill_at = (int(word) for word in rest)
                tensor, right = fw.ones(mib * 2**18), True
                round_ += 1
                for step in range(steps):
                    if step == kill_at and hvd.rank() == 1:
                        say("kill", step=step)
                        os.kill(os.getpid(), signal.SIGKILL)
                    called = time.perf_counter()
                    summed = fw.allreduce(tensor, f"probe.{round_}")
                    right = right and fw.value(summed, -1) == hvd.size()
                say("steps", correct=right, size=hvd.size(), seconds=time.perf_counter() - started)
            elif command == "exit":
                break
        except Exception as exc:  # what Horovod raises when a peer is gone is the finding
            say(
                "error",
                command=command,
                error=f"{type(exc).__name__}: {str(exc)[:400]}",
                in_call_seconds=time.perf_counter() - called if command == "steps" else None,
            )


# -- the parent -------------------------------------------------------------------------------


class Driver:
    """What Horovod's elastic rendezvous handler asks of a driver: each host's slot."""

    def __init__(self) -> None:
        self.slots: dict[str, Any] = {}

    def record_ready(self, host: str, local_rank: int) -> None:
        pass

    def get_slot_info(self, host: str, local_rank: int) -> Any:  # noqa: ANN401
        return self.slots[host]

    def register_worker_server(self, *args: object) -> None:
        pass


class Worker:
    """One probe process, its stdin for commands and a thread queueing its EVENT lines."""

    def __init__(self, host: str, args: argparse.Namespace, port: int) -> None:
        self.host, self.events, self.lines = host, queue.Queue[dict[str, Any]](), list[str]()
        env = {
            **os.environ,
            "HOROVOD_HOSTNAME": host,
            "HOROVOD_ELASTIC": "1",
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_IFACE": "lo",
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
            "NCCL_SOCKET_IFNAME": "lo",
            "NCCL_HOSTID": f"gpu-check-{host}",  # each its own host: they may share one GPU
            "PYTHONUNBUFFERED": "1",
        }
        command = [sys.executable, os.path.abspath(__file__), "--worker"]
        command += ["--framework", args.framework] + (["--cpu"] if args.cpu else [])
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # A pipe of its own: Horovod's C++ log lines, written in pieces, once cut an EVENT
            # line in two where both shared one pipe, and the parent never saw that event.
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append(line.rstrip())
            # NCCL's debug lines share stdout and may leave an unended line before an event.
            if (start := line.find(EVENT)) >= 0:
                with contextlib.suppress(ValueError):
                    self.events.put(json.loads(line[start + len(EVENT) :]))

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def expect(self, deadline: float, *events: str) -> dict[str, Any]:
        """The next event that is one of ``events``; Hung after ``deadline`` seconds."""
        ends = time.monotonic() + deadline
        while (left := ends - time.monotonic()) > 0:
            try:
                event = self.events.get(timeout=left)
            except queue.Empty:
                break
            if event["event"] in events:
                return event
        raise Hung(self, events, deadline)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class Hung(Exception):
    def __init__(self, worker: Worker, events: tuple[str, ...], deadline: float) -> None:
        alive = worker.proc.poll() is None
        state = "still running" if alive else f"exited {worker.proc.returncode}"
        super().__init__(f"{worker.host}: no {'/'.join(events)} in {deadline:.0f} s ({state})")


def stacks(workers: list[Worker]) -> dict[str, list[str]]:
    """Each live worker's stacks (SIGUSR1: faulthandler) and every worker's last lines."""
    live = [w for w in workers if w.proc.poll() is None]
    for w in live:
        w.proc.send_signal(signal.SIGUSR1)
    time.sleep(1.0 if live else 0.0)
    return {w.host: w.lines[-40:] for w in workers}


def parent(args: argparse.Namespace) -> dict[str, Any]:  # noqa: PLR0915 (one step after another)
    driver = Driver()
    server = RendezvousServer()
    port = server.start(create_rendezvous_handler(driver))
    workers: list[Worker] = []
    report: dict[str, Any] = {"framework": args.framework, "cpu": args.cpu, "steps": {}}

    def plan(*hosts: Worker) -> None:
        slots = get_host_assignments([HostInfo(w.host, 1) for w in hosts], len(hosts))
        driver.slots = {slot.hostname: slot for slot in slots}
        server.init(slots)

    def start(host: str) -> Worker:
        workers.append(Worker(host, args, port))
        return workers[-1]

    def init(*members: Worker) -> list[dict[str, Any]]:
        plan(*members)
        for member in members:
            slot = driver.slots[member.host]
            member.send("init " + slot.to_response_string().replace(",", " "))
        return [member.expect(args.deadline + 120, "init", "error") for member in members]

    def steps(members: tuple[Worker, ...], count: int, mib: int, kill_at: int = -1) -> None:
        for member in members:
            member.send(f"steps {count} {mib} {kill_at}")

    def failure(survivor: Worker, killed_at: float) -> dict[str, Any]:
        event = survivor.expect(args.deadline, "error", "steps")
        if event["event"] != "error":
            return {"detected": False, "event": event}
        return {
            "detected": True,
            "seconds_after_kill": round(event["at"] - killed_at, 3),
            "error": event["error"],
        }

    record = report["steps"]
    try:
        a, b = start("a"), start("b")
        inits = init(a, b)
        record["start"] = {"sizes": [e.get("size") for e in inits], "errors": errors(inits)}
        steps((a, b), 20, args.small_mib)
        warm = [w.expect(args.deadline, "steps", "error") for w in (a, b)]
        record["warm"] = {"correct": [e.get("correct") for e in warm], "errors": errors(warm)}

        # A reset without a failure: the same two shut down, re-initialise and allreduce.
        for w in (a, b):
            w.send("shutdown")
        for w in (a, b):
            w.expect(args.deadline, "shutdown", "error")
        inits = init(a, b)
        steps((a, b), 20, args.small_mib)
        again = [w.expect(args.deadline, "steps", "error") for w in (a, b)]
        record["reinit_without_failure"] = {
            "sizes": [e.get("size") for e in inits],
            "correct": [e.get("correct") for e in again],
            "errors": errors(inits + again),
        }

        steps((a, b), 10_000, args.small_mib, kill_at=10)
        kill = b.expect(args.deadline, "kill")
        record["killed_between_collectives"] = failure(a, kill["at"])
        a.send("shutdown")
        record["shutdown_after_failure"] = a.expect(args.deadline, "shutdown", "error")
        b.stop()

        c = start("c")
        inits = init(a, c)
        record["reinit_with_a_new_peer"] = {
            "sizes": [e.get("size") for e in inits],
            "survivor_init_seconds": inits[0].get("seconds"),
            "errors": errors(inits),
        }
        steps((a, c), 20, args.small_mib)
        again = [w.expect(args.deadline + 60, "steps", "error") for w in (a, c)]
        record["reinit_with_a_new_peer"]["correct"] = [e.get("correct") for e in again]
        record["reinit_with_a_new_peer"]["errors"] += errors(again)

        steps((a, c), 10_000, args.large_mib)
        time.sleep(args.kill_after)
        killed_at = time.time()
        c.proc.kill()
        record["killed_inside_collectives"] = failure(a, killed_at)
        a.send("shutdown")
        record["shutdown_after_failure_2"] = a.expect(args.deadline, "shutdown", "error")

        inits = init(a)
        steps((a,), 5, args.small_mib)
        alone = a.expect(args.deadline, "steps", "error")
        record["alone"] = {"size": inits[0].get("size"), "correct": alone.get("correct")}
        report.update(judge(record))
    except Hung as hung:
        report.update(status="failed", reason=f"hung: {hung}", output_tail=stacks(workers))
    finally:
        if args.logs:
            os.makedirs(args.logs, exist_ok=True)
            for w in workers:
                with open(os.path.join(args.logs, f"worker-{w.host}.log"), "w") as log:
                    log.write("\n".join(w.lines) + "\n")
        for w in workers:
            with contextlib.suppress(OSError):
                w.send("exit")
            w.stop()
        server.stop()
    return report


def errors(events: list[dict[str, Any]]) -> list[str]:
    return [e["error"] for e in events if e["event"] == "error"]


def judge(record: dict[str, Any]) -> dict[str, Any]:
    problems = []
    if record["start"]["errors"] or record["warm"]["correct"] != [True, True]:
        problems.append("the first two ranks did not allreduce correctly")
    again = record["reinit_without_failure"]
    if again["errors"] or again["correct"] != [True, True]:
        problems.append(f"re-initialising without a failure: {again}")
    for name in ("killed_between_collectives", "killed_inside_collectives"):
        if not record[name]["detected"]:
            problems.append(f"{name}: the survivor's allreduce did not fail")
    for name in ("shutdown_after_failure", "shutdown_after_failure_2"):
        if record[name]["event"] != "shutdown":
            problems.append(f"{name}: {record[name].get('error')}")
    reinit = record["reinit_with_a_new_peer"]
    if reinit["errors"] or reinit["correct"] != [True, True] or reinit["sizes"] != [2, 2]:
        problems.append(f"re-initialising with a new peer: {reinit}")
    if record["alone"] != {"size": 1, "correct": True}:
        problems.append(f"re-initialising alone: {record['alone']}")
    if problems:
        return {"status": "failed", "reason": "; ".join(problems)}
    return {
        "status": "ok",
        "reason": "a SIGKILLed peer failed the survivor's allreduce (between collectives after "
        f"{record['killed_between_collectives']['seconds_after_kill']} s, inside them after "
        f"{record['killed_inside_collectives']['seconds_after_kill']} s); it re-initialised "
        "with a new peer and alone, every sum right",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=FRAMEWORKS, default="tensorflow")
    parser.add_argument("--cpu", action="store_true", help="Gloo only, no GPU")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=90.0, help="a hang after this (s)")
    parser.add_argument("--small-mib", type=int, default=4)
    parser.add_argument("--large-mib", type=int, default=256)
    parser.add_argument("--logs", help="write each worker's output to DIR/worker-HOST.log")
    parser.add_argument("--kill-after", type=float, default=2.0, help="s into the large ones")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print(MARK + json.dumps(parent(args)), flush=True)


if __name__ == "__main__":
    main()
