"""The worker side of the hang watchdog: counting progress, marking phases, locating a thread."""

from __future__ import annotations

import threading
import time

from elastic_allreduce import progress


def test_steps_commits_and_phases_make_the_report() -> None:
    before = progress.current_report(3)
    progress.report_step(7)
    progress.report_commit()
    report = progress.current_report(3)
    assert report.incarnation == 3
    assert report.ticks == before.ticks + 2
    assert report.step == 7  # a commit without a step keeps the last one
    assert report.phase is None
    with progress.phase("evaluation"), progress.phase("checkpoint"):
        assert progress.current_report(3).phase == "checkpoint"
    assert progress.current_report(3).phase is None


def test_the_global_batch_and_the_rolled_back_steps_travel_with_the_report() -> None:
    before = progress.current_report(1)
    progress.report_step(8, samples=256)
    progress.report_rollback(3)
    progress.report_rollback(0)  # nothing lost: nothing counted
    report = progress.current_report(1)
    assert report.samples_per_step == 256
    assert report.rolled_back_steps == before.rolled_back_steps + 3
    assert type(report).decode(report.encode()) == report


def test_a_thread_sleeping_in_script_code_is_not_in_a_collective() -> None:
    started = threading.Event()
    stop = threading.Event()

    def sleeper() -> None:
        started.set()
        while not stop.is_set():
            time.sleep(0.01)

    thread = threading.Thread(target=sleeper, name="sleeper")
    thread.start()
    try:
        started.wait(5)
        report = progress.stacks_report(1, thread)
    finally:
        stop.set()
        thread.join()
    assert report.collective is None
    assert report.where.startswith("test_progress.py:") and report.where.endswith("in sleeper")
    assert 'Thread "sleeper"' in report.stacks and "time.sleep(0.01)" in report.stacks
