"""The loopback TCP bound: one process streams bytes to another over 127.0.0.1.

``python tcp_loopback.py --bytes N --repeats K`` starts a sender (this script with --send)
and receives N bytes K times; prints one JSON record per repeat:
{"event": "loopback", "bytes": N, "seconds": s}, timed from the first byte received to the last.
"""

import argparse
import json
import socket
import subprocess
import sys
import time

CHUNK = 4 << 20

parser = argparse.ArgumentParser()
parser.add_argument("--bytes", type=int, default=1 << 30)
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--send", type=int, metavar="PORT", help="internal: be the sender")
args = parser.parse_args()

if args.send is not None:
    payload = memoryview(bytearray(CHUNK))
    with socket.create_connection(("127.0.0.1", args.send)) as conn:
        for _ in range(args.repeats):
            left = args.bytes
            while left > 0:
                sent = conn.send(payload[: min(CHUNK, left)])
                left -= sent
            conn.recv(1)  # the receiver's acknowledgement: one transfer at a time
    sys.exit(0)

with socket.create_server(("127.0.0.1", 0)) as server:
    port = server.getsockname()[1]
    sender = subprocess.Popen(
        [sys.executable, __file__, "--send", str(port), "--bytes", str(args.bytes),
         "--repeats", str(args.repeats)]
    )  # fmt: skip
    server.settimeout(60)
    conn, _ = server.accept()
    conn.settimeout(60)
    buffer = memoryview(bytearray(CHUNK))
    with conn:
        for _ in range(args.repeats):
            first = received = conn.recv_into(buffer)
            start = time.perf_counter()
            while received < args.bytes:
                got = conn.recv_into(buffer)
                if got == 0:
                    raise SystemExit("the sender closed the connection early")
                received += got
            seconds = time.perf_counter() - start
            conn.sendall(b"k")
            # The first chunk arrived before the clock started: count only what came after.
            record = {"event": "loopback", "bytes": args.bytes - first, "seconds": seconds}
            print(json.dumps(record), flush=True)
    sender.wait(timeout=60)
