"""What a node is started with on another host: its devices, its command and working directory,
its address and interface, and the job's timeouts (issue #11, items 1 and 5)."""

from __future__ import annotations

import argparse
import math
import socket
from pathlib import Path

import pytest

from elastic_allreduce import netinfo
from elastic_allreduce.errors import ConfigError, MalformedValueError
from elastic_allreduce.records.values import JobConfig, JobSettings, OnStateLoss
from launcher import job_options
from launcher.node.processes import check_command, resolve_command, slot_devices

# -- CUDA devices --------------------------------------------------------------------------------


def test_each_slot_gets_its_index_within_the_devices_the_node_was_given() -> None:
    # Indices among the visible GPUs (CUDA numbers them 0.. within CUDA_VISIBLE_DEVICES), which
    # every slot keeps seeing: the agent no longer narrows CUDA_VISIBLE_DEVICES per slot.
    assert slot_devices("4,5,6,7", 2) == ["0", "1"]
    assert slot_devices("GPU-a1b2, GPU-c3d4", 2) == ["0", "1"]
    assert slot_devices(None, 3) == ["0", "1", "2"]
    assert slot_devices("", 2) == ["", ""]  # no GPU for anyone stays so


def test_fewer_devices_than_processes_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"given 1 GPUs \(CUDA_VISIBLE_DEVICES=3\) but runs 2"):
        slot_devices("3", 2)


# -- the command and its working directory -----------------------------------------------------


def test_the_script_is_stored_as_an_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    command = resolve_command(("python", "train.py", "--epochs", "2"))
    assert command == ("python", str(tmp_path / "train.py"), "--epochs", "2")
    assert resolve_command(("-m", "pkg.train")) == ("-m", "pkg.train")
    # From another directory (another host with the same layout) it is found.
    monkeypatch.chdir("/")
    check_command(command, str(tmp_path))


def test_a_relative_script_runs_from_the_jobs_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir("/")
    check_command(("python", "train.py"), str(tmp_path))
    with pytest.raises(ConfigError, match="does not exist on this host"):
        check_command(("python", "train.py"), None)


def test_a_missing_script_or_directory_on_this_host_fails_at_once(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"training script {tmp_path}/gone.py .* on this host"):
        check_command(("python", str(tmp_path / "gone.py")), str(tmp_path))
    with pytest.raises(ConfigError, match=f"working directory {tmp_path}/nowhere .* not exist"):
        check_command(("python", "train.py"), str(tmp_path / "nowhere"))


def test_the_working_directory_is_part_of_the_stored_job() -> None:
    config = JobConfig(JobSettings(1, 2, 1, 0), ("python", "/w/train.py"), None, "/w")
    assert JobConfig.from_json("config/job", config.to_json()) == config
    # A record of an older version (no workdir) still reads.
    older = {k: v for k, v in config.to_json().items() if k != "workdir"}  # type: ignore[union-attr]
    assert JobConfig.from_json("config/job", older).workdir is None


# -- addresses and interfaces ------------------------------------------------------------------


def test_the_source_address_towards_a_host_is_one_of_this_machines() -> None:
    address = netinfo.source_address("127.0.0.1", 2379)
    assert address == "127.0.0.1"
    assert netinfo.source_address("::1", 2379) == "::1"
    assert netinfo.interface_of(address) == "lo"
    assert netinfo.interface_of("::1") == "lo"
    assert netinfo.interface_of("192.0.2.254") is None  # TEST-NET-1: not ours


def test_a_host_that_is_not_this_machines_address_is_refused() -> None:
    assert netinfo.check_local_address("127.0.0.1") == "127.0.0.1"
    with pytest.raises(ConfigError, match=r"--host 203\.0\.113\.9 is not an address of this"):
        netinfo.check_local_address("203.0.113.9")
    with pytest.raises(ConfigError, match="--host 'node-7' is not an IP address"):
        netinfo.check_local_address("node-7")


def test_an_interface_that_does_not_exist_is_refused() -> None:
    assert netinfo.check_interface("lo") == "lo"
    with pytest.raises(ConfigError, match=r"no such network interface \(it has: .*lo"):
        netinfo.check_interface("ens99")


def test_a_name_that_does_not_resolve_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"cannot resolve 'no-such-host\.invalid'"):
        netinfo.source_address("no-such-host.invalid", 2379)


def test_loopback_is_told_apart() -> None:
    assert netinfo.is_loopback("127.0.0.1") and netinfo.is_loopback("::1")
    assert netinfo.is_loopback("localhost")
    assert not netinfo.is_loopback("10.0.0.1") and not netinfo.is_loopback("fd00::1")


# -- the timeouts --------------------------------------------------------------------------------


def test_the_timeouts_are_job_options_with_their_defaults_stored() -> None:
    options = job_options.job_options(["python", "t.py"], lease_ttl=2, stuck_timeout=4)
    settings = job_options.job_settings(options)
    assert (settings.lease_ttl, settings.stuck_timeout, settings.resize_timeout) == (2, 4.0, 60.0)
    assert JobSettings.from_json("config/job", settings.to_json()) == settings
    assert job_options.job_settings(job_options.job_options(["python", "t.py"])).lease_ttl == 3
    # The flags written for the launcher pod read back as the same options.
    parser = argparse.ArgumentParser()
    job_options.add_job_flags(parser)
    job_options.add_command(parser)
    assert job_options.from_args(parser.parse_args(job_options.to_args(options))) == options


def test_on_state_loss_is_a_job_option_stored_with_the_job() -> None:
    parser = argparse.ArgumentParser()
    job_options.add_job_flags(parser)
    job_options.add_command(parser)
    default = job_options.job_options(["python", "t.py"])
    assert default.on_state_loss is OnStateLoss.RESTART_FROM_CHECKPOINT
    assert "--on-state-loss" not in job_options.to_args(default)  # the manifests stay as they are
    failing = job_options.job_options(["python", "t.py"], on_state_loss="fail")
    assert failing.on_state_loss is OnStateLoss.FAIL
    assert job_options.from_args(parser.parse_args(job_options.to_args(failing))) == failing
    settings = job_options.job_settings(failing)
    assert JobSettings.from_json("config/job", settings.to_json()) == settings
    stored = settings.to_json()
    older = {k: v for k, v in stored.items() if k != "on_state_loss"}  # an older version's
    assert (
        JobSettings.from_json("config/job", older).on_state_loss
        is OnStateLoss.RESTART_FROM_CHECKPOINT
    )
    with pytest.raises(MalformedValueError, match="'on_state_loss' must be one of"):
        JobSettings.from_json("config/job", {**older, "on_state_loss": "shrug"})
    with pytest.raises(
        ConfigError, match="--on-state-loss must be restart-from-checkpoint or fail"
    ):
        job_options.job_options(["python", "t.py"], on_state_loss="shrug")


def test_the_start_grace_is_a_job_option_stored_with_the_job() -> None:
    parser = argparse.ArgumentParser()
    job_options.add_job_flags(parser)
    job_options.add_command(parser)
    default = job_options.job_options(["python", "t.py"])
    assert job_options.job_settings(default).start_grace == 10.0
    assert "--start-grace" not in job_options.to_args(default)  # the manifests stay as they are
    parsed = job_options.from_args(parser.parse_args(["--start-grace", "90", "--", "t.py"]))
    assert parsed.start_grace == 90.0
    settings = job_options.job_settings(parsed)
    assert settings.start_grace == 90.0
    assert JobSettings.from_json("config/job", settings.to_json()) == settings
    assert job_options.from_args(parser.parse_args(job_options.to_args(parsed))) == parsed
    assert job_options.job_options(["t.py"], start_grace=0).start_grace == 0.0  # allowed
    assert "--start-grace S" in parser.format_help()
    for bad, shown in [(-1.0, "-1"), (math.inf, "inf"), (math.nan, "nan")]:
        with pytest.raises(ConfigError) as caught:
            job_options.job_options(["python", "t.py"], start_grace=bad)
        assert str(caught.value) == f"--start-grace must be 0 or more seconds, got {shown}"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"lease_ttl": 0}, "--lease-ttl must be at least 1 second, got 0"),
        ({"lease_ttl": 5}, "--stuck-timeout (5 s) must be longer than --lease-ttl (5 s)"),
        (
            {"stuck_timeout": 60.0},
            "--resize-timeout (60 s) must be longer than --stuck-timeout (60 s)",
        ),
        (
            {"stuck_timeout": 20.0, "hang_timeout": 15.0},
            "--hang-timeout must be 0 (no watchdog) or at least 20 seconds",
        ),
    ],
)
def test_timeouts_out_of_order_are_refused(overrides: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        job_options.job_options(["python", "t.py"], **overrides)  # type: ignore[arg-type]
    assert message in str(caught.value)


def test_a_job_of_joining_nodes_only() -> None:
    options = job_options.job_options(["python", "t.py"], workers=0, min_workers=3)
    assert (options.workers, options.min_workers, options.max_workers) == (0, 3, 3)
    with pytest.raises(ConfigError, match="need --min-workers <= --max-workers, got 3 <= 2"):
        job_options.job_options(["python", "t.py"], workers=0, min_workers=3, max_workers=2)


def test_a_host_name_that_resolves_to_loopback_is_refused_for_other_hosts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Horovod's Gloo binds its process-set contexts to the host name's address."""
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")
    with pytest.raises(ConfigError) as caught:
        netinfo.check_host_name("10.1.2.3")
    message = str(caught.value)
    assert "this host's name 'localhost' resolves to" in message
    assert "the line '10.1.2.3 localhost' in /etc/hosts" in message
    netinfo.check_host_name("127.0.0.1")  # a node on this machine only: no peer elsewhere
    monkeypatch.setattr(socket, "gethostname", lambda: "no-such-host.invalid")
    with pytest.raises(ConfigError, match=r"'no-such-host\.invalid' does not resolve"):
        netinfo.check_host_name("10.1.2.3")
