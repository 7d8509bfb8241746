"""The agent -> training process contract (elastic_allreduce.runtime.ProcessContract): what the
agent writes is what the process reads back, a value that does not parse is one clear error,
and the bootstrap's reading holds for the rest of the process."""

from __future__ import annotations

import pytest

from elastic_allreduce import env, runtime
from elastic_allreduce.errors import ConfigError
from elastic_allreduce.runtime import ProcessContract

FULL = ProcessContract(
    slot="gpu-node-7.3",
    incarnation=4,
    etcd="10.0.0.1:2379,10.0.0.2:2379",
    job_id="job-1",
    node_lease=0x694D8A2F0C31E5,
    outage_timeout=12.5,
    local_size=8,
    gpu_index=3,
    rendezvous_token="s3cret",  # noqa: S106 - a test value
    warm_join=True,
    checkpoint_dir="/ckpt",
    keep_checkpoints=4,
    tensorboard_dir="/tb",
    snapshot_dir="/dev/shm/x/job-1/gpu-node-7.3",
    persist_fd=7,
    error_file="/tmp/e.json",
    rendezvous_addr="fd00::1",
    rendezvous_port=29400,
    gloo_iface="eth0",
)


def test_what_the_agent_writes_the_process_reads_back() -> None:
    written = FULL.environ()
    assert written[env.SLOT] == written[env.HOROVOD_HOSTNAME] == "gpu-node-7.3"
    assert written[env.WARM_JOIN] == "1" and written[env.PERSIST_FD] == "7"
    assert ProcessContract.from_environ(written) == FULL


def test_unset_fields_write_no_variable_and_read_back_unset() -> None:
    bare = ProcessContract(slot="n0.0", etcd="e:1", job_id="j")
    written = bare.environ()
    for name in (env.WARM_JOIN, env.CHECKPOINT_DIR, env.SNAPSHOT_DIR, env.PERSIST_FD):
        assert name not in written
    assert written[env.GPU_INDEX] == ""  # always written: an inherited index never applies
    assert ProcessContract.from_environ(written) == bare


def test_outside_elastic_run_every_field_is_unset() -> None:
    assert ProcessContract.from_environ({}) == ProcessContract()


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (env.INCARNATION, "two", r"ELASTIC_ALLREDUCE_INCARNATION='two': give a whole number"),
        (env.NODE_LEASE, "0x1f", r"ELASTIC_ALLREDUCE_NODE_LEASE='0x1f': give a whole number"),
        (env.OUTAGE_TIMEOUT, "-1", r"ELASTIC_ALLREDUCE_OUTAGE_TIMEOUT='-1': give seconds"),
        (env.GPU_INDEX, "cuda:0", r"is not a GPU index"),
        (env.KEEP_CHECKPOINTS, "0", r"ELASTIC_ALLREDUCE_KEEP_CHECKPOINTS='0'"),
        (env.LOCAL_SIZE, "3", r"slot n0\.3 has index 3"),
        (env.PERSIST_FD, "fd", r"ELASTIC_ALLREDUCE_PERSIST_FD='fd'"),
    ],
)
def test_a_value_that_does_not_parse_is_one_error_naming_it(
    name: str, value: str, message: str
) -> None:
    written = ProcessContract(slot="n0.3", local_size=4).environ()
    with pytest.raises(ConfigError, match=message):
        ProcessContract.from_environ({**written, name: value})


def test_the_bootstraps_reading_holds_for_the_rest_of_the_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in FULL.environ().items():
        monkeypatch.setenv(name, value)
    try:
        assert runtime.fix_contract() == FULL
        monkeypatch.setenv(env.SLOT, "other.0")  # a script changing its environment
        monkeypatch.delenv(env.RENDEZVOUS_TOKEN)  # the bootstrap removes the token
        assert runtime.contract() == FULL
        assert runtime.slot() == "gpu-node-7.3"
        assert (runtime.local_rank(), runtime.local_size()) == (3, 8)
    finally:
        runtime._fixed.clear()
    assert runtime.slot() == "other.0"  # unfixed: the environment as it is
