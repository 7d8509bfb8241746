"""The launcher's hold of vanished records after an etcd outage, step by step (pure)."""

from __future__ import annotations

from elastic_allreduce.store import KeyValue
from launcher.leader.leadership import OutageHold as _OutageHold


def kv(key: str, create_revision: int) -> KeyValue:
    return KeyValue.decode(
        key,
        b'{"schema":1,"data":{}}',
        mod_revision=create_revision,
        create_revision=create_revision,
        version=1,
        lease=7,
    )


def test_records_that_vanish_during_the_hold_are_kept_until_it_ends() -> None:
    hold = _OutageHold(8.0)
    member, proc, ring = kv("members/n1", 5), kv("procs/n1.0", 6), kv("ring", 4)
    assert hold.items({"members/n1": member, "procs/n1.0": proc, "ring": ring}, 0.0)
    # No outage: a vanished record is gone at once.
    assert hold.items({"ring": ring}, 1.0) == {"ring": ring}
    hold.items({"members/n1": member, "procs/n1.0": proc, "ring": ring}, 2.0)
    hold.outage(3.0)
    held = hold.items({}, 4.0)
    assert held == {"members/n1": member, "procs/n1.0": proc}  # the ring is not held
    assert hold.items({}, 10.9) == {"members/n1": member, "procs/n1.0": proc}
    assert hold.items({}, 11.0) == {}  # the hold ended: now they are deaths


def test_a_holder_that_registers_again_keeps_its_first_revision() -> None:
    hold = _OutageHold(8.0)
    assert hold.registered("members/n1", 4242, 5) == 5
    assert hold.registered("members/n1", 4242, 19) == 5  # same agent, new lease
    assert hold.registered("members/n1", 5151, 21) == 21  # another agent on that node id
