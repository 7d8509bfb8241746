"""Start one training process of an elastic job: ``python -m elastic_allreduce.bootstrap SCRIPT``.

The agent runs every training process through this module, which

1. registers the process in the store (``procs/<slot>``) under its node's lease, which the
   agent keeps alive (:class:`Registration`): the agent deletes the record when the process
   exits and kills a stopped one, the launcher's watchdogs replace a hung one;
2. imports TensorFlow and Horovod -- the slow part -- *before* saying it is ready, so that once
   its epoch starts it reaches ``hvd.init()`` in moments;
3. waits at the launcher's rendezvous until every member of its first epoch is ready, then sets
   Horovod's rank variables and ``HOROVOD_ELASTIC=1`` (re-initialisations then ask the launcher)
   -- except a warm joiner (``--warm-join`` and a ring without its slot), which runs the script
   at once as a ring of one and does this when the script enters its elastic run
   (:mod:`elastic_allreduce.training.warm`);
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
   :mod:`elastic_allreduce.bootstrap.follow`);
6. installs :mod:`elastic_allreduce.bootstrap.hooks` into Horovod's elastic API (state syncs agree
on the
   state's shape first; a slot removed from the ring exits quietly at its reset; every
   ``hvd.init()`` tells the guard which connections are Gloo's);
7. runs the user's script (or ``-m module``) as ``__main__``.
"""

from __future__ import annotations

import json
import logging
import os
import runpy
import sys
import threading
import traceback
from collections.abc import Sequence
from dataclasses import replace
from typing import Final

from elastic_allreduce import env, runtime
from elastic_allreduce._process import print_stacks_on_sigusr1
from elastic_allreduce.bootstrap.admission import (
    Admission,
    job_has_trained,
)
from elastic_allreduce.bootstrap.follow import LeaderFollower
from elastic_allreduce.bootstrap.registration import Registration
from elastic_allreduce.bootstrap.sockets import GlooSockets
from elastic_allreduce.errors import (
    ConfigError,
    StateMismatchError,
    StoreError,
)
from elastic_allreduce.progress import ticks as progress_ticks
from elastic_allreduce.records.values import (
    MAX_ERROR_KIND,
    MAX_ERROR_LINES,
    MAX_ERROR_MESSAGE,
    NOT_ADMITTED_EXIT_CODE,
    STATE_MISMATCH_EXIT_CODE,
    ProcPhase,
    ProcRecord,
    ScriptError,
)
from elastic_allreduce.rendezvous import protocol
from elastic_allreduce.rendezvous.relay import HorovodRendezvous
from elastic_allreduce.store import EtcdStore
from elastic_allreduce.training import warm

log = logging.getLogger("elastic_allreduce.bootstrap")


def _required(value: str | None, name: str) -> str:
    if not value:
        raise ConfigError(
            f"{name} is not set: training processes are started by `elastic-run`, not directly"
        )
    return value


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
    # What the agent gave this process, read once (the same record for every later reader).
    contract = runtime.fix_contract()
    slot = _required(contract.slot, env.SLOT)
    store = EtcdStore(
        _required(contract.etcd, env.ETCD_ENDPOINTS),
        _required(contract.job_id, env.JOB_ID),
        outage_timeout=contract.outage_timeout,
    )
    # The slow import happens before this process registers: until its record appears the
    # launcher counts the process as not started yet (its agent reports its exit either way).
    import horovod.tensorflow  # noqa: F401, PLC0415

    record = ProcRecord(os.getpid(), contract.incarnation, ProcPhase.STARTING)
    node_lease = _required(
        None if contract.node_lease is None else str(contract.node_lease), env.NODE_LEASE
    )
    registration = Registration(store, slot, record, int(node_lease))

    host = _required(contract.rendezvous_addr, env.HOROVOD_RENDEZVOUS_ADDR)
    given_port = contract.rendezvous_port
    port = int(
        _required(None if given_port is None else str(given_port), env.HOROVOD_RENDEZVOUS_PORT)
    )
    # The token stays out of the script's environment (and its children's).
    os.environ.pop(env.RENDEZVOUS_TOKEN, None)
    endpoint = protocol.Endpoint(protocol.host_port(host, port), contract.rendezvous_token)
    # Every client of this process -- Horovod's and its own -- reaches the launcher through
    # the relay, which adds the launcher's token and follows a launcher that takes over.
    horovod_rendezvous = HorovodRendezvous()
    follower = LeaderFollower(store, slot, endpoint, horovod_rendezvous)
    follower.start(store)
    relay = horovod_rendezvous.relay
    assert relay is not None  # made by follower.start
    gloo = GlooSockets({port, relay.port, *(etcd.port for etcd in store.endpoints)}, (relay.port,))
    admit = Admission(store, slot, record, registration, follower, relay.address, host, port, gloo)
    if contract.warm_join and job_has_trained(store, slot):
        # The script runs at once as a ring of one; its elastic run asks to join (warm.join).
        from elastic_allreduce.bootstrap import hooks  # noqa: PLC0415 - imports TensorFlow

        warm.defer(replace(admit, warm=True))
        hooks.install(store, gloo)
        return _run_script(args, registration)
    try:
        admit()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    from elastic_allreduce.bootstrap import hooks  # noqa: PLC0415 - imports TensorFlow

    hooks.install(store, gloo)

    return _run_script(args, registration)


def _run_script(args: list[str], registration: Registration) -> int:
    """Run the user's script as ``__main__``; its exit code (0 when it returned)."""
    slot = _required(runtime.contract().slot, env.SLOT)
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
            # Said before the interpreter shuts down, which may take a while (the launcher
            # waits for it); a script that ends with sys.exit(0) has finished too.
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

    from elastic_allreduce.training import loop  # noqa: PLC0415 - TensorFlow, loaded already

    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None or code in (0, NOT_ADMITTED_EXIT_CODE, STATE_MISMATCH_EXIT_CODE):
            return None
        message = f"exit code {code}" if isinstance(code, int) else str(code)
    elif isinstance(
        exc, (HorovodInternalError, HostsUpdatedInterrupt, StateMismatchError)
    ) or loop.is_collective_failure(exc):
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
    path = runtime.contract().error_file
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
