"""At which commit a host-update notification interrupts training (one process, real Horovod).

Prints one JSON line per state kind (elastic_allreduce.State and, with the bootstrap's hooks
installed, Horovod's TensorFlowKerasState): the commits after the notification until
HostsUpdatedInterrupt, with ELASTIC_ALLREDUCE_HOST_CHECK_INTERVAL as the environment sets it.
"""

import json

import horovod.tensorflow as hvd
import tensorflow as tf
from horovod.common.exceptions import HostsUpdatedInterrupt
from horovod.runner.elastic.worker import HostUpdateResult

import elastic_allreduce as ea
from elastic_allreduce.bootstrap import hooks
from elastic_allreduce.errors import StateValueError
from elastic_allreduce.store import EmbeddedEtcd, EtcdStore

ea.init()
model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
model.build((None, 2))
optimizer = tf.keras.optimizers.SGD(0.1)
optimizer.build(model.trainable_variables)


def commits_until_interrupt(state, limit=500):
    """Sync, commit twice (the first two commits after a sync vote: the second measures the
    pace), queue a notification as Horovod's listener does, then commit until the interrupt;
    how many commits that took."""
    state.sync()
    state.commit()
    state.commit()
    state._host_messages.put((state._last_updated_timestamp + 1, int(HostUpdateResult.added)))
    for count in range(1, limit + 1):
        try:
            state.commit()
        except HostsUpdatedInterrupt:
            return count
    return None


def explicit_check_interrupts_at_once(state):
    state.sync()
    state.commit()
    state._host_messages.put((state._last_updated_timestamp + 1, int(HostUpdateResult.added)))
    try:
        state.check_host_updates()
    except HostsUpdatedInterrupt:
        return True
    return False


def refusal_waits_for_the_vote(state):
    """A tuple set before a commit that does not vote: that commit passes, the error comes at
    the next vote; how many commits after the refused one that was (None: never)."""
    state.sync()
    state.commit()
    state.commit()
    state.history = (1, 2)
    try:
        state.commit()
    except StateValueError:
        return 0
    state.history = []
    for count in range(1, 500):
        try:
            state.commit()
        except StateValueError:
            return count
    return None


results = {
    "ea_state": commits_until_interrupt(ea.State(model, optimizer, step=0)),
    "ea_state_explicit": explicit_check_interrupts_at_once(ea.State(model, optimizer, step=0)),
    "refusal": refusal_waits_for_the_vote(ea.State(model, optimizer, step=0, history=[])),
}
with EmbeddedEtcd() as etcd, EtcdStore(etcd.endpoints_text, "votes") as store:
    hooks.install(store)
    results["horovod_state"] = commits_until_interrupt(
        hvd.elastic.TensorFlowKerasState(model, optimizer, batch=0)
    )
print(json.dumps(results))
