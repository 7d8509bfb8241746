"""A TCP forwarder between network namespaces, and the namespace switch it is built on.

A process that holds a socket keeps it in the network namespace the socket was made in, even
after the process itself moves to another namespace. So the forwarder binds its listening socket
where the clients are (``--listen-netns``, else the namespace it was started in), then moves its
only thread into ``--connect-netns`` with ``setns(2)`` — before any other thread exists, so that
every thread, and every connection it opens to ``--connect HOST:PORT``, lives there. Each
accepted connection is copied both ways until either side closes it.

The test cluster (:mod:`tests.helpers.kube.cluster`) uses it to make its API server, which
listens inside the control plane's namespace, reachable from the root namespace on
``127.0.0.1:<free port>``, without adding an interface or an address to the root namespace.

Run it as ``python -m tests.helpers.kube.forward --listen 127.0.0.1:0 --connect-netns NS
--connect 10.233.0.1:6443 [--ready-fd FD]``: once it listens and has moved, it writes the port
it listens on (a line) to ``FD`` (else stdout) and closes it, so a starter can wait for that
line, or for end of file if the forwarder died first.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import queue
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

#: ``ip netns add NAME`` bind-mounts the namespace at ``NETNS_RUN/NAME``.
NETNS_RUN = Path("/run/netns")
_CLONE_NEWNET = 0x40000000
_CHUNK = 64 * 1024

T = TypeVar("T")


class NamespaceError(RuntimeError):
    """A network namespace could not be entered."""


def enter_netns(name: str) -> None:
    """Move the calling *thread* into the named network namespace (``ip netns`` name).

    Only this thread moves; threads it starts afterwards inherit the namespace. Sockets opened
    before stay where they were made."""
    path = NETNS_RUN / name
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise NamespaceError(
            f"network namespace {name!r} cannot be opened at {path}: {exc}"
        ) from exc
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise NamespaceError(
                f"setns into network namespace {name!r} failed: {os.strerror(errno)} "
                "(it needs root, CAP_SYS_ADMIN)"
            )
    finally:
        os.close(fd)


def call_in_netns(name: str, function: Callable[[], T], timeout: float = 30.0) -> T:
    """Run ``function`` in a fresh thread that first enters network namespace ``name``, and
    return its result (or raise its exception). The calling thread stays where it is."""
    results: queue.Queue[tuple[bool, object]] = queue.Queue(maxsize=1)

    def body() -> None:
        try:
            enter_netns(name)
            results.put((True, function()))
        except BaseException as exc:  # handed to the caller
            results.put((False, exc))

    thread = threading.Thread(target=body, name=f"netns-{name}", daemon=True)
    thread.start()
    try:
        ok, value = results.get(timeout=timeout)
    except queue.Empty:
        raise TimeoutError(f"a call in network namespace {name!r} ran past {timeout} s") from None
    thread.join(timeout)
    if not ok:
        assert isinstance(value, BaseException)
        raise value
    return value  # type: ignore[return-value]


def _endpoint(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, not {text!r}")
    return host.strip("[]"), int(port)


def listen(host: str, port: int, netns: str | None = None) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one) in namespace ``netns``
    (None: this thread's)."""

    def make() -> socket.socket:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        return sock

    return make() if netns is None else call_in_netns(netns, make)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()  # half-close: the other direction may still carry data
    except (ConnectionError, OSError):
        writer.close()


async def _serve(server_socket: socket.socket, target: tuple[str, int], timeout: float) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            target_r, target_w = await asyncio.wait_for(asyncio.open_connection(*target), timeout)
        except (OSError, TimeoutError) as exc:
            print(f"forward: cannot connect to {target[0]}:{target[1]}: {exc}", file=sys.stderr)
            client_w.close()
            return
        try:
            await asyncio.gather(_pump(client_r, target_w), _pump(target_r, client_w))
        finally:
            for writer in (client_w, target_w):
                writer.close()
                with contextlib.suppress(ConnectionError, OSError):
                    await writer.wait_closed()

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    server = await asyncio.start_server(handle, sock=server_socket)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.helpers.kube.forward",
        description="Forward TCP connections from one network namespace to another.",
    )
    parser.add_argument("--listen", type=_endpoint, required=True, help="HOST:PORT (port 0: free)")
    parser.add_argument("--listen-netns", help="namespace to listen in (default: this one)")
    parser.add_argument("--connect", type=_endpoint, required=True, help="HOST:PORT to reach")
    parser.add_argument("--connect-netns", help="namespace to connect from (default: this one)")
    parser.add_argument("--connect-timeout", type=float, default=10.0)
    parser.add_argument("--ready-fd", type=int, help="write the port here, then close it")
    args = parser.parse_args(argv)
    try:
        host, port = args.listen
        server_socket = listen(host, port, netns=args.listen_netns)
        if args.connect_netns:
            # Only this thread exists (call_in_netns' thread has ended): every thread and
            # connection made from now on lives in the target namespace.
            enter_netns(args.connect_netns)
    except (OSError, NamespaceError) as exc:
        print(f"forward: {exc}", file=sys.stderr)
        return 1
    port = server_socket.getsockname()[1]
    if args.ready_fd is not None:
        with os.fdopen(args.ready_fd, "w") as ready:
            ready.write(f"{port}\n")
    else:
        print(port, flush=True)
    asyncio.run(_serve(server_socket, args.connect, args.connect_timeout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
