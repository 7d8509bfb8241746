"""A plain Horovod elastic script that keeps TCP connections of its own (the ring guard's test).

It opens one connection to the test's echo server (--server HOST:PORT) before ``hvd.init()``
and one after it, each held for the whole run, as a script's object-storage or metrics client
would. The server greets each connection with its id. At every commit the script sends a line on
both and prints {"event": "commit", "step": S, "size": N, "rank": R, "conns": [ID, ID],
"echo": "ok" | ERROR}: the ids the server echoed back, so the test sees whether the very same
connections still work after the ring was re-formed. {"event": "done", ...} at the end.
"""

import argparse
import json
import os
import socket
import time

import horovod.tensorflow as hvd
import tensorflow as tf
import tiny_model

parser = argparse.ArgumentParser()
parser.add_argument("--server", required=True)
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--commit-every", type=int, default=5)
parser.add_argument("--step-delay", type=float, default=0.02)
parser.add_argument("--payload", type=int, default=0, help="floats to allreduce too, per step")
args = parser.parse_args()
host, port = args.server.rsplit(":", 1)


class Connection:
    """One persistent line-based connection to the echo server."""

    def __init__(self) -> None:
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.reader = self.sock.makefile("r")
        self.id = int(self.reader.readline().split()[1])  # "conn <id>"

    def ping(self, text: str) -> int:
        """Send a line; the id of the connection the server echoed it on."""
        self.sock.sendall(f"{text}\n".encode())
        reply = self.reader.readline()
        if not reply:
            raise ConnectionError("the server's end closed (or this end was shut down)")
        conn, echoed = reply.split(maxsplit=1)
        assert echoed.strip() == text, reply
        return int(conn)


early = Connection()
hvd.init()
late = Connection()

model, optimizer, train_step = tiny_model.build()


payload = tf.ones([args.payload]) if args.payload else None


def report(event: str, state) -> None:
    conns: list[int] = []
    echo = "ok"
    try:
        conns = [c.ping(f"{event} {state.step}") for c in (early, late)]
    except (OSError, ValueError) as exc:
        echo = f"{type(exc).__name__}: {exc}"
    print(
        json.dumps(
            {
                "event": event,
                "step": state.step,
                "size": hvd.size(),
                "rank": hvd.rank(),
                "slot": os.environ.get("HOROVOD_HOSTNAME"),
                "conns": conns,
                "opened": [early.id, late.id],
                "echo": echo,
            }
        ),
        flush=True,
    )


@hvd.elastic.run
def train(state):
    while state.step < args.steps:
        train_step()
        if payload is not None:
            hvd.allreduce(payload, name="payload")
        state.step += 1
        if state.step % args.commit_every == 0:
            state.commit()
            report("commit", state)
        if args.step_delay:  # after the commit: a peer killed when it is seen dies mid-sleep
            time.sleep(args.step_delay)


state = hvd.elastic.TensorFlowKerasState(model, optimizer, step=0)
train(state)
report("done", state)
