"""A training process's progress, as the launcher's hang watchdog sees it.

The library counts progress with :func:`report_step` (``ElasticData`` and the Keras feed call it
after every step, ``ea.State`` at every commit) and marks long phases that are not hangs with
:func:`phase` (``ea.State`` around its syncs and checkpoint writes, the model zoo around an
evaluation). Counting is an attribute write: nothing leaves the process per step. Step
listeners see every counted step too: rank 0's TensorBoard summaries
(:mod:`elastic_allreduce.training.tensorboard`) are buffered there.

Under ``elastic-run`` the bootstrap starts a :class:`Beacon`: a daemon thread that sends the
counts to the launcher's rendezvous server about once a second (``PUT /progress/<slot>``, see
:mod:`elastic_allreduce.rendezvous.protocol`). When the launcher's watchdog finds that the ring
made no progress for ``--hang-timeout``, its reply asks for the stacks: the thread formats every
thread's Python stack, names the collective the main thread waits in (if any) and sends them.
The thread runs while the main thread waits in a collective or sleeps, since both release the
GIL.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Final

from elastic_allreduce.errors import ProtocolError
from elastic_allreduce.rendezvous import protocol

log = logging.getLogger(__name__)

#: Seconds between two progress reports.
REPORT_INTERVAL: Final = 1.0
#: The phase of a process that has not finished a step yet (imports, tracing, the first sync).
STARTUP: Final = "startup"


@dataclass
class _Counts:
    ticks: int = 0
    step: int | None = None
    step_seconds: float | None = None
    last_tick: float | None = None
    total: int | None = None
    samples: int | None = None
    rolled_back: int = 0
    commit: protocol.Commit | None = None
    synced: protocol.Synced | None = None
    checkpoints_skipped: int = 0
    checkpoint_skip: str | None = None


_counts = _Counts()
_phases: list[str] = []
_lock = threading.Lock()
#: Seconds the last gradient allreduce waited (elastic_allreduce.training.collective_clock), once a
#: timed tape made the clock.
_collective_clock: Callable[[], float | None] | None = None


#: Called after every counted step with the step number (the script's, else the count of steps),
#: the seconds since the previous step (None for the first), the step's global samples and the
#: script's metrics (both None when not given). Runs on the training thread: must be cheap.
StepListener = Callable[[int, float | None, int | None, Mapping[str, float] | None], None]
_listeners: list[StepListener] = []


def report_step(
    step: int | None = None,
    *,
    total: int | None = None,
    samples: int | None = None,
    metrics: Mapping[str, float] | None = None,
) -> None:
    """Count one finished step of this process; ``step`` is the script's own step number when
    it has one, ``total`` the steps it will take in all (``elastic-run status --watch`` then
    shows a progress bar with an ETA), ``samples`` the samples the step took across the whole
    ring (the global batch: the launcher's samples/s), ``metrics`` the step's scalars, such as
    ``{"loss": 0.3}`` (rank 0 writes them to TensorBoard with ``--tensorboard-dir``). Cheap
    enough to call every step: no I/O."""
    now = time.monotonic()
    counts = _counts
    if total is not None:
        counts.total = total
    if samples is not None:
        counts.samples = samples
    seconds = None if counts.last_tick is None else now - counts.last_tick
    if seconds is not None:
        counts.step_seconds = seconds
    counts.last_tick = now
    counts.step = step if step is not None else counts.step
    counts.ticks += 1
    for listener in _listeners:
        listener(counts.ticks if counts.step is None else counts.step, seconds, samples, metrics)


def ticks() -> int:
    """How many steps and commits this process has counted (0: it has trained no step)."""
    return _counts.ticks


def current_step() -> int:
    """The step :func:`report_step` or :func:`report_commit` last counted (the script's number,
    else the count of steps), as step listeners see it."""
    counts = _counts
    return counts.ticks if counts.step is None else counts.step


def add_step_listener(listener: StepListener) -> None:
    """Call ``listener`` after every step :func:`report_step` counts (TensorBoard summaries)."""
    if listener not in _listeners:
        _listeners.append(listener)


def remove_step_listener(listener: StepListener) -> None:
    """Stop calling ``listener`` (no error when it was not added)."""
    with contextlib.suppress(ValueError):
        _listeners.remove(listener)


def report_rollback(steps: int) -> None:
    """Count steps this process ran past its last commit and lost to a failure (``ea.State``
    calls it when it restores the commit): the launcher's time lost to rollbacks."""
    if steps > 0:
        _counts.rolled_back += steps


def set_collective_clock(read: Callable[[], float | None]) -> None:
    """Where reports read the last allreduce's wait (the straggler watch's input)."""
    global _collective_clock  # noqa: PLW0603 - one clock per process
    _collective_clock = read


def report_checkpoint_skipped(reason: str) -> None:
    """Count a checkpoint that could not be written (a full disk, a write error): the launcher
    turns each new one into a warning event (``CheckpointSkipped``)."""
    printable = "".join(c if c.isprintable() else " " for c in reason)
    if len(printable) > protocol.MAX_NAME:
        printable = printable[: protocol.MAX_NAME - 3] + "..."
    _counts.checkpoint_skip = printable
    _counts.checkpoints_skipped += 1


def report_commit(step: int | None = None, commit_id: int | None = None) -> None:
    """Count a commit as progress (a script without a per-step report makes progress at its
    commits); unlike :func:`report_step` it does not time a step. ``commit_id`` (``ea.State``)
    lets the launcher tell when the newest commit was lost."""
    counts = _counts
    counts.step = step if step is not None else counts.step
    counts.ticks += 1
    if commit_id is not None:
        counts.commit = protocol.Commit(commit_id, step)


def report_sync(epoch: int, commit_id: int, step: int | None) -> None:
    """Say which commit the state sync of ring epoch ``epoch`` gave this process: the
    launcher compares it with the newest commit it saw before that epoch (state lost)."""
    commit = protocol.Commit(commit_id, step)
    _counts.synced = protocol.Synced(epoch, commit)
    _counts.commit = commit


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark a long phase that is not a hang (an evaluation pass, a checkpoint write): the
    launcher's watchdog does not fire while any rank is inside one. Phases nest."""
    with _lock:
        _phases.append(name)
    try:
        yield
    finally:
        with _lock:
            _phases.remove(name)


def current_report(incarnation: int) -> protocol.ProgressReport:
    """What the beacon sends now."""
    counts = _counts
    with _lock:
        marked = _phases[-1] if _phases else None
    if marked is None and counts.ticks == 0:
        marked = STARTUP
    return protocol.ProgressReport(
        incarnation,
        counts.ticks,
        counts.step,
        marked,
        counts.step_seconds,
        counts.total,
        counts.samples,
        counts.rolled_back,
        counts.commit,
        counts.synced,
        counts.checkpoints_skipped,
        counts.checkpoint_skip,
        None if _collective_clock is None else _collective_clock(),
    )


# -- where the main thread is ----------------------------------------------------------------


def _package_root(name: str) -> str | None:
    """The folder of an installed top-level package, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return os.path.join(locations[0], "") if locations else None


_HOROVOD: Final = _package_root("horovod") or f"{os.sep}horovod{os.sep}"
_TENSORFLOW: Final = _package_root("tensorflow") or f"{os.sep}tensorflow{os.sep}"
#: TensorFlow's eager runtime: a compiled function (and the collectives inside it) runs there.
_EAGER: Final = os.path.join(_TENSORFLOW, "python", "eager", "")
_LIBRARY_PATHS: Final = tuple(
    root
    for root in (
        _HOROVOD,
        _TENSORFLOW,
        _package_root("keras"),
        _package_root("tf_keras"),
        os.path.join(os.path.dirname(os.path.abspath(__file__)), ""),
    )
    if root is not None
)


def _describe(frame: FrameType) -> str:
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"


def _is_library(frame: FrameType) -> bool:
    filename = frame.f_code.co_filename
    # Generated op wrappers (a custom op library's) have no file: "<...>".
    return filename.startswith("<") or any(part in filename for part in _LIBRARY_PATHS)


def locate(frame: FrameType | None) -> tuple[str | None, str]:
    """``(collective, where)`` of a thread whose innermost frame is ``frame``.

    ``where``: the innermost frame outside TensorFlow, Keras, Horovod and this library (the
    place to look at in the script). ``collective``: what the thread waits in below that frame
    -- a Horovod call, or a compiled TensorFlow function (whose collectives run inside it) --
    or None when it is elsewhere (sleeping in the script, reading data)."""
    if frame is None:
        return None, "unknown"
    library: list[FrameType] = []
    walker: FrameType | None = frame
    while walker is not None and _is_library(walker):
        library.append(walker)
        walker = walker.f_back
    where = _describe(walker) if walker is not None else _describe(frame)
    horovod = [f for f in library if _HOROVOD in f.f_code.co_filename]
    if horovod:
        outer = horovod[-1]
        return f"Horovod {outer.f_code.co_name} ({_describe(outer)})", where
    if library and _EAGER in library[0].f_code.co_filename:
        name = library[0].f_locals.get("op_name")
        text = name.decode(errors="replace") if isinstance(name, bytes) else name
        shown = f" {text}" if isinstance(text, str) else ""
        return f"a compiled TensorFlow function{shown} ({_describe(library[0])})", where
    return None, where


def stacks_report(incarnation: int, main_thread: threading.Thread) -> protocol.StacksReport:
    """Every thread's Python stack, and where the main thread is."""
    frames = sys._current_frames()
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in frames.items():
        title = names.get(ident, f"thread {ident}")
        parts.append(f'Thread "{title}":\n' + "".join(traceback.format_stack(frame)))
    collective, where = locate(frames.get(main_thread.ident or -1))
    return protocol.StacksReport(incarnation, collective, where, "\n".join(parts))


# -- the beacon --------------------------------------------------------------------------------


class Beacon:
    """The daemon thread that reports this process's progress to the launcher."""

    def __init__(
        self,
        rendezvous: str | Callable[[], str],
        slot: str,
        incarnation: int,
        interval: float = REPORT_INTERVAL,
    ) -> None:
        #: The launcher's address now (a callable follows a launcher that took the job over).
        self._rendezvous = rendezvous if callable(rendezvous) else lambda: rendezvous
        self._slot = slot
        self._incarnation = incarnation
        self._interval = interval
        self._main = threading.main_thread()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress-beacon", daemon=True)
        self._failures = 0

    def start(self) -> None:
        """Start reporting (not at all with an interval of 0)."""
        if self._interval > 0:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            rendezvous = self._rendezvous()
            try:
                reply = protocol.ProgressReply.decode(
                    _put(
                        protocol.progress_url(rendezvous, self._slot),
                        current_report(self._incarnation).encode(),
                    )
                )
                if reply.send_stacks:
                    _put(
                        protocol.stacks_url(rendezvous, self._slot),
                        stacks_report(self._incarnation, self._main).encode(),
                    )
                self._failures = 0
            except (OSError, ProtocolError) as exc:
                # The launcher may be re-forming or gone; the next report tries again.
                self._failures += 1
                if self._failures == 1:
                    log.debug("progress report not delivered: %s", exc)


def _put(url: str, body: bytes) -> bytes:
    request = urllib.request.Request(url, data=body, method="PUT")  # noqa: S310 - http://
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=5) as reply:  # noqa: S310
        data: bytes = reply.read(protocol.MAX_PROGRESS_BYTES + 1)
        return data
