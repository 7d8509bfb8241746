"""The first program of every pod container the process kubelet starts: it makes the pod's
mounts and host name, then execs the container's process (whose pid, session and process group
it keeps).

The kubelet runs ``ip netns exec <pod namespace> python pod_init.py SPEC.json --status-fd N``.
``ip netns exec`` gives it the pod's network namespace and a mount namespace of its own (with
the pod's ``/etc/hosts`` and ``/etc/resolv.conf`` bind-mounted over the machine's), so every
mount made here is seen by the pod's processes only and goes away with them. Standard library
only, and run as a file, not a module: it starts in tens of milliseconds.

SPEC.json (written by :mod:`tests.helpers.kube.kubelet`)::

    {"argv": [...], "env": {...}, "cwd": "/dir", "hostname": "pod-0",
     "scratch": "DIR/pods/<uid>/scratch",           (stash mount points, under the pod's folder)
     "tmpfs": [{"path": "...", "size": bytes}],      (memory emptyDirs, mounted at their folder)
     "mounts": [{"source": "...", "target": "/in/the/pod", "readonly": true}]}

A mount target (or the working directory) that does not exist on the machine is never created
on the machine's file system: its deepest existing ancestor is *shadowed* first — a tmpfs is
mounted over it in this mount namespace and every entry of the original is bind-mounted back
into it (sub-mounts included) — and the missing folders are made in the tmpfs. When that
ancestor is ``/`` itself, a new root is built the same way in the pod's scratch folder and the
process ``chroot``s into it. ``/proc``, ``/dev``, ``/sys`` and every other mount stay visible.
Writes into a shadowed folder land in its tmpfs (gone with the pod); writes into its original
entries reach the machine, as they would through any bind mount.

Then a UTS namespace of its own gets the pod's host name, and the container's process is
exec'd with the pod's environment. The kubelet learns the outcome from file descriptor N
(close-on-exec): end of file without a byte means the exec succeeded; a JSON line
``{"reason": ..., "message": ...}`` says why it did not (this program then exits with 128, the
code a container runtime reports for a container that could not start).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import stat
import sys
from collections.abc import Sequence
from typing import Any, Final

#: Exit status when the container's process could not be started.
START_FAILED: Final = 128

MS_RDONLY: Final = 0x1
MS_REMOUNT: Final = 0x20
MS_BIND: Final = 0x1000
MS_REC: Final = 0x4000
MS_PRIVATE: Final = 0x40000
MNT_DETACH: Final = 0x2
CLONE_NEWUTS: Final = 0x04000000

_libc = ctypes.CDLL(None, use_errno=True)


class InitError(Exception):
    """The pod's mounts, host name or process could not be set up (``reason``, message)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise InitError("StartError", f"{what}: {os.strerror(errno)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    """mount(2); InitError naming the mount when it fails."""
    _check(
        _libc.mount(
            None if source is None else source.encode(),
            target.encode(),
            None if fstype is None else fstype.encode(),
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {source or fstype} on {target}",
    )


def bind(source: str, target: str, *, readonly: bool = False) -> None:
    """A recursive bind mount, read-only when asked."""
    mount(source, target, None, MS_BIND | MS_REC)
    if readonly:
        mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY)


def _mount_point_like(original: os.DirEntry[str], where: str) -> None:
    """Make at ``where`` an entry to bind ``original`` onto (a symlink is copied instead)."""
    if original.is_symlink():
        os.symlink(os.readlink(original.path), where)
        return
    if original.is_dir():
        os.mkdir(where)
    else:
        with open(where, "x"):
            pass
    bind(original.path, where)


class Shadows:
    """The folders shadowed so far, and the folders made inside them: where it is safe to
    create a path without touching the machine's file system."""

    def __init__(self, scratch: str) -> None:
        self.scratch = scratch
        self.safe: set[str] = set()
        self._count = 0

    def _stash(self) -> str:
        self._count += 1
        path = os.path.join(self.scratch, f"stash-{self._count}")
        os.makedirs(path, exist_ok=True)
        return path

    def shadow(self, folder: str) -> None:
        """Cover ``folder`` with a tmpfs that holds bind mounts of its original entries."""
        stash = self._stash()
        bind(folder, stash)
        mode = stat.S_IMODE(os.stat(folder).st_mode)
        mount("tmpfs", folder, "tmpfs", 0, f"mode={mode:o}")
        with os.scandir(stash) as entries:
            for entry in entries:
                _mount_point_like(entry, os.path.join(folder, entry.name))
        _check(_libc.umount2(stash.encode(), MNT_DETACH), f"unmount {stash}")
        self.safe.add(folder)

    def new_root(self) -> None:
        """Build a root of the same entries as ``/`` on a tmpfs in the scratch folder and
        ``chroot`` into it: ``/`` itself is then a shadowed folder."""
        root = os.path.join(self.scratch, "root")
        os.makedirs(root, exist_ok=True)
        mount("tmpfs", root, "tmpfs", 0, "mode=755")
        with os.scandir("/") as entries:
            for entry in entries:
                _mount_point_like(entry, os.path.join(root, entry.name))
        os.chroot(root)
        os.chdir("/")
        self.safe.add("/")

    def ensure(self, path: str, *, is_file: bool) -> None:
        """Make ``path`` exist in this mount namespace only (shadowing its deepest existing
        ancestor unless that is already safe)."""
        path = os.path.realpath(path)
        if os.path.lexists(path):
            return
        missing: list[str] = []
        ancestor = path
        while not os.path.lexists(ancestor):
            missing.append(ancestor)
            ancestor = os.path.dirname(ancestor)
        if ancestor not in self.safe:
            if ancestor == "/":
                self.new_root()
            else:
                self.shadow(ancestor)
        for number, part in enumerate(reversed(missing)):
            if is_file and number == len(missing) - 1:
                with open(part, "x"):
                    pass
            else:
                os.mkdir(part, 0o755)
                self.safe.add(part)

    @staticmethod
    def needs_new_root(paths: Sequence[str]) -> bool:
        """Whether a missing path among ``paths`` has ``/`` as its deepest existing ancestor."""
        for path in paths:
            ancestor = os.path.realpath(path)
            if os.path.lexists(ancestor):
                continue
            while not os.path.lexists(ancestor):
                ancestor = os.path.dirname(ancestor)
            if ancestor == "/":
                return True
        return False


def _hold(path: str) -> str:
    """Open ``path`` (O_PATH, closed at exec) and name it by its descriptor, which keeps naming
    it when a later mount covers its folder."""
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    return f"/proc/self/fd/{fd}"


def set_up(spec: dict[str, Any]) -> None:
    """Mounts, working directory and host name, as ``spec`` says."""
    # Nothing mounted here may reach the machine, whatever `ip netns exec` left propagating.
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    shadows = Shadows(spec["scratch"])
    mounts = sorted(spec.get("mounts") or [], key=lambda m: m["target"].count("/"))
    cwd = spec.get("cwd") or "/"
    if shadows.needs_new_root([m["target"] for m in mounts] + [cwd]):
        shadows.new_root()  # first: the mounts below are made inside the new root
    for tmpfs in spec.get("tmpfs") or []:
        size = f",size={int(tmpfs['size'])}" if tmpfs.get("size") else ""
        mount("tmpfs", tmpfs["path"], "tmpfs", 0, f"mode=1777{size}")
    # Every source and the scratch folder are held open before the first mount at a target: a
    # mount at /tmp must not hide the sources of the mounts after it (the pod folders are
    # under /tmp in the tests), so they are bound through /proc/self/fd/N.
    os.makedirs(shadows.scratch, exist_ok=True)
    shadows.scratch = _hold(shadows.scratch)
    held: list[tuple[str, bool, dict[str, Any]]] = []
    for entry in mounts:
        source, target = entry["source"], entry["target"]
        if not os.path.exists(source):
            raise InitError("StartError", f"volume source {source} for {target} does not exist")
        held.append((_hold(source), os.path.isdir(source), entry))
    for source, is_dir, entry in held:
        target = entry["target"]
        shadows.ensure(target, is_file=not is_dir)
        bind(source, target, readonly=bool(entry.get("readonly")))
    shadows.ensure(cwd, is_file=False)
    os.chdir(cwd)
    hostname = spec.get("hostname")
    if hostname:
        _check(_libc.unshare(CLONE_NEWUTS), "unshare the UTS namespace")
        raw = hostname.encode()
        _check(_libc.sethostname(raw, len(raw)), f"set the host name {hostname!r}")


def _report(fd: int, reason: str, message: str) -> None:
    line = json.dumps({"reason": reason, "message": message}) + "\n"
    with contextlib.suppress(OSError):  # the kubelet is gone: the log still has it
        os.write(fd, line.encode())
    print(f"pod_init: {reason}: {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="set up a process kubelet pod, then exec it")
    parser.add_argument("spec")
    parser.add_argument("--status-fd", type=int, required=True)
    args = parser.parse_args(argv)
    fd = args.status_fd
    os.set_inheritable(fd, False)  # closed by a successful exec: the kubelet reads EOF
    try:
        with open(args.spec) as source:
            spec = json.load(source)
        set_up(spec)
        command = list(spec["argv"])
        if not command:
            raise InitError("StartError", "the container has no command")
        # Python ignores SIGPIPE (and SIGXFSZ); an exec'd program must get the defaults.
        for signum in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(signum, signal.SIG_DFL)
        try:
            os.execvpe(command[0], command, spec["env"])  # noqa: S606 - the container
        except FileNotFoundError:
            raise InitError(
                "StartError",
                f'exec: "{command[0]}": executable file not found in $PATH '
                f"({spec['env'].get('PATH', '')})",
            ) from None
        except OSError as exc:
            raise InitError("StartError", f'exec: "{command[0]}": {exc.strerror}') from exc
    except InitError as exc:
        _report(fd, exc.reason, str(exc))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        _report(fd, "StartError", f"setting up the container failed: {exc!r}")
    return START_FAILED


if __name__ == "__main__":
    sys.exit(main())
