"""Start one training process of an elastic job: ``python -m elastic_allreduce.bootstrap SCRIPT``.

The agent runs every training process through this module, which

1. registers the process in the store under a lease of its own (``procs/<slot>``), so a hung
   process (SIGSTOP, a deadlock) is noticed when its lease expires; a lease that etcd let
   expire during an outage is replaced and the record written again (:class:`Registration`);
2. imports TensorFlow and Horovod -- the slow part -- *before* saying it is ready, so that once
   its epoch starts it reaches ``hvd.init()`` in moments;
3. waits at the launcher's rendezvous until every member of its first epoch is ready, then sets
   Horovod's rank variables and ``HOROVOD_ELASTIC=1`` (re-initialisations then ask the launcher)
   -- except a warm joiner (``--warm-join`` and a ring without its slot), which runs the script
   at once as a ring of one and does this when the script enters its elastic run
   (:mod:`elastic_allreduce.warm`);
   every client of the process, Horovod's included, reaches the launcher through a relay of
   the process on IPv4 loopback that adds the launcher's token (and reaches an IPv6 launcher,
   which Horovod's own clients cannot: :mod:`elastic_allreduce.rendezvous.relay`); the process
   follows a launcher that takes the job over, also while it waits for its first epoch;
4. starts a guard thread that, when the launcher re-forms the ring after a failure while this
   process has not yet asked for its new rank, shuts down Gloo's connections of the failed
   epoch (those that ``hvd.init()`` opened; the script's own connections stay): a Gloo
   collective waiting on a peer that already gave up then fails at once instead of after
   Gloo's timeout;
5. starts the progress beacon (:mod:`elastic_allreduce.progress`): about once a second it tells
   the launcher's hang watchdog how far this process got, and sends its stacks when asked (the
   relay follows the launcher to a new address when another one takes the job over:
   :mod:`elastic_allreduce.follow`);
6. installs :mod:`elastic_allreduce.hooks` into Horovod's elastic API (state syncs agree on the
   state's shape first; a slot removed from the ring exits quietly at its reset; every
   ``hvd.init()`` tells the guard which connections are Gloo's);
7. runs the user's script (or ``-m module``) as ``__main__``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import runpy
import socket
import sys
import threading
import traceback
import urllib.request
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from http.client import HTTPException
from typing import Final

from elastic_allreduce import env, ipv6, runtime, warm
from elastic_allreduce._process import print_stacks_on_sigusr1
from elastic_allreduce.errors import (
    ConfigError,
    ElasticAllreduceError,
    StateMismatchError,
    StoreError,
)
from elastic_allreduce.follow import LeaderFollower, capture_registration, each_record
from elastic_allreduce.progress import REPORT_INTERVAL, Beacon
from elastic_allreduce.progress import ticks as progress_ticks
from elastic_allreduce.records import keys
from elastic_allreduce.records.values import (
    MAX_ERROR_KIND,
    MAX_ERROR_LINES,
    MAX_ERROR_MESSAGE,
    NOT_ADMITTED_EXIT_CODE,
    STATE_MISMATCH_EXIT_CODE,
    EpochCause,
    ProcPhase,
    ProcRecord,
    Ring,
    RingState,
    ScriptError,
)
from elastic_allreduce.rendezvous import protocol
from elastic_allreduce.rendezvous.relay import HorovodRendezvous
from elastic_allreduce.store import EtcdStore, Lease, Watch

log = logging.getLogger("elastic_allreduce.bootstrap")

_TCP_ESTABLISHED = "01"


def _required(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise ConfigError(
            f"{name} is not set: training processes are started by `elastic-run`, not directly"
        )
    return value


@dataclass(frozen=True)
class TcpSocket:
    """One TCP socket of this network namespace: a row of ``/proc/net/tcp`` or ``tcp6``."""

    inode: int
    state: str
    local_port: int
    remote_port: int

    @property
    def established(self) -> bool:
        return self.state == _TCP_ESTABLISHED


def tcp_sockets() -> dict[int, TcpSocket]:
    """The TCP sockets (IPv4 and IPv6) of this process's network namespace, by inode."""
    found: dict[int, TcpSocket] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as handle:
            next(handle, None)
            for line in handle:
                fields = line.split()
                if len(fields) < 10 or fields[9] == "0":  # inode 0: no longer owned
                    continue
                inode = int(fields[9])
                local_port = int(fields[1].rsplit(":", 1)[1], 16)
                remote_port = int(fields[2].rsplit(":", 1)[1], 16)
                found[inode] = TcpSocket(inode, fields[3], local_port, remote_port)
    return found


def own_sockets() -> dict[int, int]:
    """This process's open sockets (of any kind): inode -> one file descriptor holding it."""
    found: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{name}")
                if target.startswith("socket:["):
                    found.setdefault(int(target[8:-1]), int(name))
    return found


def gloo_connections(
    opened: Collection[int],
    sockets: Mapping[int, TcpSocket],
    excluded_ports: Collection[int],
    excluded_local_ports: Collection[int] = (),
) -> frozenset[int]:
    """Of the sockets ``opened`` while ``hvd.init()`` ran, the inodes of Gloo's connections:
    established TCP connections whose remote port is not one of ``excluded_ports`` (etcd, the
    launcher's rendezvous or this process's relay to it -- which Horovod's Gloo store and this
    process's threads also talk to during an init) and whose local port is not one of
    ``excluded_local_ports`` (the relay's end of Horovod's connections to it)."""
    return frozenset(
        inode
        for inode in opened
        if (tcp := sockets.get(inode)) is not None
        and tcp.established
        and tcp.remote_port not in excluded_ports
        and tcp.local_port not in excluded_local_ports
    )


class GlooSockets:
    """The TCP connections Horovod's Gloo context holds in this process, learnt at each init.

    Horovod creates Gloo's TCP devices and connects the full mesh of each context (global,
    local, cross, the global process set's) inside ``hvd.init()``: its background thread does
    it before ``initialization_done``, which ``horovod_init`` waits for. So the connections
    that appear while ``hvd.init()`` runs and are still open when it returns are Gloo's; a
    script's connections opened before or after it are not.
    :func:`elastic_allreduce.hooks.install` brackets every init with :meth:`begin` and
    :meth:`end`; the ring guard cuts :meth:`established`. Thread-safe.
    """

    def __init__(
        self, excluded_ports: Collection[int], excluded_local_ports: Collection[int] = ()
    ) -> None:
        self._excluded = frozenset(excluded_ports)
        self._excluded_local = frozenset(excluded_local_ports)
        self._lock = threading.Lock()
        self._inodes: frozenset[int] = frozenset()

    def begin(self) -> frozenset[int]:
        """Before ``hvd.init()``: the inodes of this process's sockets now (pass to :meth:`end`)."""
        return frozenset(own_sockets())

    def end(self, before: frozenset[int]) -> int:
        """After ``hvd.init()`` (returned or raised): remember Gloo's connections; how many.

        Those of an earlier init that are still open stay (a second ``hvd.init()`` without a
        ``shutdown()`` between connects nothing); those closed by a ``shutdown()`` drop out."""
        now = own_sockets()
        with self._lock:
            kept = self._inodes & now.keys()
            self._inodes = kept | gloo_connections(
                now.keys() - before, tcp_sockets(), self._excluded, self._excluded_local
            )
            return len(self._inodes)

    def established(self) -> tuple[dict[int, int], int]:
        """Gloo's established connections now (file descriptor -> socket inode), and how many
        other established TCP connections this process holds (the script's, etcd, rendezvous)."""
        sockets = tcp_sockets()
        with self._lock:
            gloo = self._inodes
        descriptors: dict[int, int] = {}
        others = 0
        for inode, fd in own_sockets().items():
            tcp = sockets.get(inode)
            if tcp is None or not tcp.established:
                continue
            if inode in gloo:
                descriptors[fd] = inode
            else:
                others += 1
        return descriptors, others


def shutdown_sockets(descriptors: Mapping[int, int]) -> int:
    """shutdown(2) each socket (file descriptor -> the inode it held when listed); return how
    many. The descriptors stay open for their owner. One that holds another socket by now is
    left alone: Horovod may have closed it meanwhile and the number been reused (its HTTP
    store's request, the relay's connection)."""
    done = 0
    for fd, inode in descriptors.items():
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=os.dup(fd))
            try:
                if os.fstat(sock.fileno()).st_ino != inode:
                    continue
                sock.shutdown(socket.SHUT_RDWR)
                done += 1
            finally:
                sock.close()
    return done


class RingGuard:
    """Watches the ring; unblocks this process's collectives when its epoch failed, by shutting
    down Gloo's connections of that epoch (only those: see :class:`GlooSockets`)."""

    def __init__(self, store: EtcdStore, slot: str, epoch: int, gloo: GlooSockets) -> None:
        self._store = store
        self._slot = slot
        self._epoch = epoch
        self._gloo = gloo
        self._stop = threading.Event()
        self._watch: Watch = store.watch_prefix(keys.RING)
        self._thread = threading.Thread(target=self._run, name=f"ring-guard-{slot}", daemon=True)
        self._handled = epoch

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        each_record(self._watch, self._stop, Ring.from_json, self._on_ring, "ring (ring guard)")

    def _on_ring(self, ring: Ring) -> None:
        if ring.state is RingState.RUNNING and self._slot in ring.slots:
            self._epoch = max(self._epoch, ring.epoch)
            return
        if (
            ring.state is RingState.FORMING
            and ring.cause is EpochCause.FAILURE
            and ring.epoch > max(self._epoch, self._handled)
            and self._slot in ring.waiting
        ):
            self._handled = ring.epoch
            if not self._still_waiting(ring.epoch):
                log.info(
                    "slot %s: epoch %d failed; this process has already left epoch %d "
                    "(nothing to shut down)",
                    self._slot,
                    ring.epoch,
                    self._epoch,
                )
                return
            descriptors, others = self._gloo.established()
            count = shutdown_sockets(descriptors)
            log.info(
                "slot %s: epoch %d failed; shut down %d Gloo connections of epoch %d "
                "(kept %d other TCP connections)",
                self._slot,
                ring.epoch,
                count,
                self._epoch,
                others,
            )

    def _still_waiting(self, epoch: int) -> bool:
        """Whether the stored ring still waits for this slot in a failure epoch >= ``epoch``.
        An event can arrive late: once the slot asked for its rank, its next ``hvd.init()`` may
        already have connected a newer epoch, whose connections must stay. Unknown (the store
        does not answer): True, as the event says."""
        try:
            stored = self._store.get(keys.RING)
            current = None if stored is None else Ring.from_json(stored.key, stored.value)
        except ElasticAllreduceError as exc:
            log.warning("slot %s: ring guard could not re-read the ring: %s", self._slot, exc)
            return True
        return current is None or (
            current.epoch >= epoch
            and current.state is RingState.FORMING
            and current.cause is EpochCause.FAILURE
            and self._slot in current.waiting
        )

    def stop(self) -> None:
        self._stop.set()
        self._watch.close()


class Registration:
    """This process's ``procs/<slot>`` record, under a lease of its own.

    etcd lets every lease expire when it was unreachable for longer than the TTL (a stopped or
    stalled etcd revokes them as soon as it runs again), although this process lived on. So a
    lease reported lost is replaced and the record written again under the new one: the
    launcher, which holds back its decisions about vanished records for a while after such an
    outage, sees the same process again and the rank keeps training. A lease that lapsed
    without an outage (a keep-alive too late on a loaded machine) is replaced the same way,
    which spares a process not yet in a ring its restart (``RingPolicy._settle_lost_leases``).
    A process that really died writes nothing, and its record stays gone.
    """

    def __init__(self, store: EtcdStore, slot: str, record: ProcRecord, ttl: int) -> None:
        self._store = store
        self._key = keys.proc(slot)
        self._ttl = ttl
        self._lock = threading.Lock()
        self.lease = store.grant_lease(ttl, on_lost=self._on_lost)
        self.record = replace(record, lease=self.lease.id)
        store.put(self._key, self.record.to_json(), lease=self.lease)

    def update(self, record: ProcRecord) -> None:
        """Write a new version of the record (phase, epoch) under the current lease."""
        with self._lock:
            self.record = replace(record, lease=self.lease.id)
            self._store.put(self._key, self.record.to_json(), lease=self.lease)

    def _on_lost(self, lost: Lease) -> None:
        # On the lost lease's keep-alive thread, which ends after this returns.
        with self._lock:
            if lost is not self.lease:
                return
            try:
                self.lease = self._store.grant_lease(self._ttl, on_lost=self._on_lost)
                self.record = replace(self.record, lease=self.lease.id)
                self._store.put(self._key, self.record.to_json(), lease=self.lease)
            except StoreError as exc:
                log.warning(
                    "%s: could not register again after losing its lease: %s", self._key, exc
                )
                return
        log.info("%s: lease %x expired while etcd was away; registered again", self._key, lost.id)


def _progress_interval() -> float:
    hint = f"between progress reports; default {REPORT_INTERVAL:g}, 0 turns them off"
    return env.seconds(env.PROGRESS_INTERVAL, REPORT_INTERVAL, below=3600, hint=hint)


#: Seconds a fresh process waits for a new launcher when the one it waited at went away.
FOLLOW_TIMEOUT: Final = 60.0


def _wait_for_first_epoch(
    follower: LeaderFollower, relay: str, slot: str, *, warm: bool = False
) -> protocol.Admission:
    """Wait at the launcher's readiness barrier (through the relay) for this slot's first
    epoch; when the launcher goes away meanwhile and another takes the job over, wait again at
    the new one's (the relay follows it). ``warm``: a warm joiner's barrier."""
    url = protocol.ready_url(relay, slot, warm=warm)
    while True:
        asked = follower.endpoint
        try:
            with urllib.request.urlopen(url, timeout=None) as reply:  # noqa: S310 - http://
                return protocol.decode_admission(reply.read())
        except (OSError, HTTPException) as exc:
            if not follower.wait_for_move(asked, FOLLOW_TIMEOUT):
                raise
            log.info(
                "the launcher at %s went away while this process waited (%s); waiting at the "
                "new one",
                asked.address,
                exc,
            )


def main(argv: Sequence[str] | None = None) -> int:
    """Register, wait for the first epoch, and run the training script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        raise SystemExit(
            "usage: python -m elastic_allreduce.bootstrap SCRIPT [ARGS] | -m MODULE [ARGS]"
        )
    # The agent prefixes every line with the job, ring epoch, rank and slot; messages that
    # need the slot name it themselves.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    # The agent asks for them before it kills a live process it replaces (stuck, hung).
    print_stacks_on_sigusr1()
    slot = _required(env.SLOT)
    store = EtcdStore(
        _required(env.ETCD_ENDPOINTS),
        _required(env.JOB_ID),
        outage_timeout=_outage_timeout(),
    )
    record = ProcRecord(os.getpid(), int(os.environ.get(env.INCARNATION, "1")), ProcPhase.STARTING)
    registration = Registration(store, slot, record, int(os.environ.get(env.PROCESS_TTL, "3")))

    # The slow import happens before this process says it is ready.
    import horovod.tensorflow  # noqa: F401, PLC0415

    host = _required(env.HOROVOD_RENDEZVOUS_ADDR)
    port = int(_required(env.HOROVOD_RENDEZVOUS_PORT))
    # The token stays out of the script's environment (and its children's).
    endpoint = protocol.Endpoint(
        protocol.host_port(host, port), os.environ.pop(env.RENDEZVOUS_TOKEN, None)
    )
    # Every client of this process -- Horovod's and its own -- reaches the launcher through
    # the relay, which adds the launcher's token and follows a launcher that takes over.
    horovod_rendezvous = HorovodRendezvous()
    follower = LeaderFollower(store, slot, endpoint, horovod_rendezvous)
    follower.start(store)
    relay = horovod_rendezvous.relay
    assert relay is not None  # made by follower.start
    gloo = GlooSockets({port, relay.port, *(etcd.port for etcd in store.endpoints)}, (relay.port,))
    admit = Admission(store, slot, record, registration, follower, relay.address, host, port, gloo)
    if os.environ.get(env.WARM_JOIN) == "1" and _job_has_trained(store, slot):
        # The script runs at once as a ring of one; its elastic run asks to join (warm.join).
        from elastic_allreduce import hooks  # noqa: PLC0415 - imports TensorFlow

        warm.defer(replace(admit, warm=True))
        hooks.install(store, gloo)
        return _run_script(args, registration)
    try:
        admit()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    from elastic_allreduce import hooks  # noqa: PLC0415 - imports TensorFlow

    hooks.install(store, gloo)

    return _run_script(args, registration)


def _job_has_trained(store: EtcdStore, slot: str) -> bool:
    """Whether some ring epoch of the job has run: then this process is a newcomer to ranks
    that hold a state (a restart, a replacement, a node that joins), and warms up before it
    joins (--warm-join) -- also when the forming epoch already names its slot, since the
    ranks there sync as soon as they are admitted. Before the first epoch ran, every process
    starts with the first ring, its code before the elastic run beside the others'."""
    try:
        stored = store.get(keys.RING)
        ring = None if stored is None else Ring.from_json(stored.key, stored.value)
    except ElasticAllreduceError as exc:
        log.warning("slot %s: could not read the ring (%s); joining without a warm-up", slot, exc)
        return False
    return ring is not None and ring.trained


@dataclass
class Admission:
    """This process's admission to its first ring epoch (called once): wait at the launcher's
    readiness barrier, then set Horovod's rank variables and start what needs the epoch (the
    ring guard, the progress beacon). Exits with NOT_ADMITTED_EXIT_CODE when not admitted."""

    store: EtcdStore
    slot: str
    record: ProcRecord
    registration: Registration
    follower: LeaderFollower
    relay: str
    host: str
    port: int
    gloo: GlooSockets
    #: A warm joiner's admission (elastic_allreduce.warm), after its ring of one.
    warm: bool = False

    def __call__(self, warmup_step: float | None = None) -> int:
        """Wait for the first ring epoch; its number. ``warmup_step``: a warm joiner's seconds
        for one step of its warm-up, written to its record for the launcher first."""
        if warmup_step is not None:
            registration = self.registration
            registration.update(replace(registration.record, warmup_step=warmup_step))
        admission = _wait_for_first_epoch(self.follower, self.relay, self.slot, warm=self.warm)
        if not admission.admitted:
            print(f"slot {self.slot}: not admitted to any ring epoch; exiting", file=sys.stderr)
            raise SystemExit(NOT_ADMITTED_EXIT_CODE)
        ranks = admission.assignment.as_tuple()
        for name, value in zip(env.HOROVOD_RANK_VARIABLES, ranks, strict=True):
            os.environ[name] = str(value)
        os.environ[env.RING_EPOCH] = str(admission.epoch)
        os.environ["HOROVOD_ELASTIC"] = "1"
        registration = self.registration
        registration.update(
            replace(registration.record, phase=ProcPhase.TRAINING, epoch=admission.epoch)
        )
        if protocol.is_ipv6(self.host):
            ipv6.serve_notifications_over_ipv6(self.host, self.port)
        RingGuard(self.store, self.slot, admission.epoch, self.gloo).start()
        Beacon(self.relay, self.slot, self.record.incarnation, _progress_interval()).start()
        capture_registration()
        return admission.epoch


def _outage_timeout() -> float:
    return env.seconds(env.OUTAGE_TIMEOUT, 0.0, below=86400, hint="the job's --outage-timeout")


def _run_script(args: list[str], registration: Registration) -> int:
    """Run the user's script as ``__main__``; its exit code (0 when it returned)."""
    slot = _required(env.SLOT)
    code = 1
    try:
        try:
            if args[0] == "-m":
                sys.argv = args[1:]
                runpy.run_module(args[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = args
                sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
                runpy.run_path(args[0], run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise
        # The script ended (returned, or sys.exit(0)): a warm joiner must have joined.
        warm.check_joined()
        code = 0
    except warm.NeverJoinedError as exc:
        print(exc, file=sys.stderr, flush=True)
        write_script_error(exc)
        code = 1
    except StateMismatchError:
        # Every rank raised it: the launcher fails the job instead of restarting processes
        # that would meet the same mismatch.
        traceback.print_exc()
        code = STATE_MISMATCH_EXIT_CODE
    except SystemExit as exc:
        # sys.exit(N) in the script, or a slot removed from the ring (hooks): keep N.
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        write_script_error(exc)
        raise
    except Exception as exc:
        write_script_error(exc)
        raise
    finally:
        if code == 0:
            # Said before the interpreter shuts down, which may outlast this lease's keep-alive;
            # a script that ends with sys.exit(0) has finished too.
            try:
                registration.update(replace(registration.record, phase=ProcPhase.FINISHED))
            except StoreError as exc:
                print(
                    f"slot {slot}: could not report the end of the script: {exc}", file=sys.stderr
                )
        _exit_within(EXIT_GRACE, code, slot)
    return code


def script_error(exc: BaseException) -> ScriptError | None:
    """What the launcher is told of the error the script ended with: its type, message, the
    traceback's last lines, the ring epoch and whether this process trained a step. None for
    what is no bug of the script: a failed collective (a peer died), a slot let go by the
    ring, a state mismatch (exit code 76, judged on its own), ``sys.exit(0)``."""
    from horovod.common.exceptions import (  # noqa: PLC0415
        HorovodInternalError,
        HostsUpdatedInterrupt,
    )

    from elastic_allreduce import elastic_run  # noqa: PLC0415 - TensorFlow, loaded already

    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None or code in (0, NOT_ADMITTED_EXIT_CODE, STATE_MISMATCH_EXIT_CODE):
            return None
        message = f"exit code {code}" if isinstance(code, int) else str(code)
    elif isinstance(
        exc, (HorovodInternalError, HostsUpdatedInterrupt, StateMismatchError)
    ) or elastic_run.is_collective_failure(exc):
        return None
    else:
        message = str(exc)
    kind = type(exc).__qualname__
    if type(exc).__module__ not in ("builtins", "__main__"):
        kind = f"{type(exc).__module__}.{kind}"
    lines = [
        line[:MAX_ERROR_MESSAGE]
        for chunk in traceback.format_exception(exc)
        for line in chunk.rstrip("\n").splitlines()
        if line.strip(" ^~")  # not the markers under a line
    ]
    return ScriptError(
        kind[:MAX_ERROR_KIND],
        message[:MAX_ERROR_MESSAGE],
        runtime.ring_epoch(),
        progress_ticks() > 0,
        tuple(lines[-MAX_ERROR_LINES:]),
    )


def write_script_error(exc: BaseException) -> None:
    """Write :func:`script_error` where the agent reads it (``ELASTIC_ALLREDUCE_ERROR_FILE``),
    in one rename; nothing outside `elastic-run` or for what is no bug of the script."""
    path = os.environ.get(env.ERROR_FILE)
    if not path:
        return
    try:
        error = script_error(exc)
        if error is None:
            return
        partial = f"{path}.partial"
        with open(partial, "w", encoding="utf-8") as handle:
            json.dump(error.to_json(), handle)
        os.replace(partial, path)
    except Exception as failure:  # never hides the script's own error
        log.warning("could not write the script's error for the agent: %r", failure)


#: Seconds the interpreter may take to shut down after the script has ended.
EXIT_GRACE: Final = 15.0


def _exit_within(seconds: float, code: int, slot: str) -> None:
    """Arm a watchdog that ends the process if interpreter shutdown hangs (a library thread
    that never stops); a finished worker that hangs would otherwise look like a hung one."""

    def watchdog() -> None:
        if threading.Event().wait(seconds):
            return
        print(
            f"slot {slot}: the script ended but the process had not exited {seconds:.0f} s "
            f"later (a thread that does not stop?); exiting with code {code}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(code)

    sys.stdout.flush()
    sys.stderr.flush()
    threading.Thread(target=watchdog, name="exit-watchdog", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
