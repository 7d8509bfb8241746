"""A whole job over ``https://`` etcd with client certificates and the job's own etcd user.

The etcd requires a client certificate signed by its CA (--client-cert-auth) and has etcd's auth
on; the job gets a user whose role covers only its keys. The launcher, its agents and every
training process open their own stores with the settings ``elastic-run`` was given; the same
job with a CA that did not sign etcd's certificate, or without a client certificate, fails at
start with one line and exit code 2.
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest

from elastic_allreduce import env
from elastic_allreduce.records.snapshot import read_job
from elastic_allreduce.records.values import JobPhase
from elastic_allreduce.store import EtcdSecurity, EtcdStore
from launcher.security import certs
from tests.conftest import ROOT, fresh_job_id
from tests.helpers.tls import TlsEtcd
from tests.integration.harness import ELASTIC_RUN, HVD_SCRIPT, UNTIL_SCRIPT, Job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TRAIN = ("--", "python", HVD_SCRIPT, "--steps", "20", "--commit-every", "5")


def flags(security: EtcdSecurity) -> list[str]:
    """The command-line flags of ``security`` (only those that are set)."""
    pairs = (
        ("--etcd-cacert", security.cacert),
        ("--etcd-cert", security.cert),
        ("--etcd-key", security.key),
        ("--etcd-user", security.user),
        ("--etcd-password-file", security.password_file),
    )
    return [part for flag, value in pairs if value for part in (flag, value)]


def clean_env() -> dict[str, str]:
    """This process's environment without any etcd security variable: flags are the only source."""
    return {k: v for k, v in os.environ.items() if k not in env.ETCD_SECURITY}


def start(command: list[str], job_id: str, environ: dict[str, str], tls: TlsEtcd) -> Job:
    """Run ``command`` in the background and read its output like a job's (the test's own
    store on the job's keys signs in as the job's user)."""
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    job = Job(
        proc, job_id, EtcdStore(tls.endpoints, job_id, security=tls.client(job_id, user=job_id))
    )
    threading.Thread(target=job._read, daemon=True).start()
    return job


def test_a_job_runs_over_https_with_client_certificates_and_its_own_user(
    tls_etcd: TlsEtcd, jobs: list[Job], tmp_path: Path
) -> None:
    """The launcher gets the settings as flags and hands them to its local agent and training
    processes; a node joins with `elastic-run join`, configured partly by flags and partly by
    variables (a worker pod on Kubernetes has variables only), and hands them on the same way."""
    job_id = fresh_job_id("tls")
    security = tls_etcd.add_job(job_id)
    stop_file = tmp_path / "stop"
    command = [
        ELASTIC_RUN,
        *("--etcd", tls_etcd.endpoints, *flags(security)),
        *("--job-id", job_id, "--workers", "1", "--max-workers", "2", "--max-restarts", "0"),
        *("--", "python", UNTIL_SCRIPT, "--stop-file", str(stop_file), "--commit-every", "5"),
    ]
    job = start(command, job_id, clean_env(), tls_etcd)
    jobs.append(job)
    job.wait_for(lambda: len(job.commits(1)) >= 2, 90, "commits at size 1")
    # The joiner: TLS files as flags, the rest (endpoints, job, user, password) as variables.
    assert security.user is not None and security.password_file is not None
    joiner_env = {
        **clean_env(),
        env.ETCD_ENDPOINTS: tls_etcd.endpoints,
        env.JOB_ID: job_id,
        env.ETCD_USER: security.user,
        env.ETCD_PASSWORD_FILE: security.password_file,
    }
    files = flags(EtcdSecurity(security.cacert, security.cert, security.key))
    joiner = start([ELASTIC_RUN, "join", *files], job_id, joiner_env, tls_etcd)
    jobs.append(joiner)
    joiner.wait_for(lambda: len(joiner.commits(2)) >= 2, 120, "the joiner's commits")
    stop_file.touch()
    assert job.finish(timeout=120) == 0, job.tail()
    assert joiner.finish(30) == 0, joiner.tail()
    done = job.done() + joiner.done()
    assert len(done) == 2, job.tail()
    assert len({(e.data["step"], e.data["checksum"]) for e in done}) == 1, done
    assert f"on etcd {tls_etcd.endpoints}" in "\n".join(job.lines)
    # The launcher wrote the outcome, and rank 0's training process its progress, each through
    # its own store under the job's user.
    snapshot = read_job(job.store)
    assert snapshot.status is not None and snapshot.status.record.phase is JobPhase.SUCCEEDED
    assert snapshot.progress is not None and snapshot.progress.record.size == 2


@pytest.mark.parametrize("wrong", ["another CA", "no client certificate"])
def test_the_same_job_with_a_wrong_ca_or_no_client_certificate_fails_at_start_with_one_line(
    tls_etcd: TlsEtcd, tmp_path: Path, wrong: str
) -> None:
    job_id = fresh_job_id("tls")
    security = tls_etcd.add_job(job_id)
    if wrong == "another CA":
        certs.make_certificates(tmp_path)
        security = EtcdSecurity(
            str(tmp_path / certs.CA_CERT),
            security.cert,
            security.key,
            security.user,
            security.password_file,
        )
        expected = "presented a certificate that --etcd-cacert"
    else:
        security = EtcdSecurity(security.cacert, None, None, security.user, security.password_file)
        expected = "it requires a client certificate; pass --etcd-cert"
    done = subprocess.run(
        [
            ELASTIC_RUN,
            *("--etcd", tls_etcd.endpoints, *flags(security)),
            *("--job-id", job_id, "--workers", "2"),
            *TRAIN,
        ],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"elastic-run run: error: etcd at {tls_etcd.endpoints} ")
    assert expected in lines[0]
    assert "elastic-run: job" not in done.stdout  # nothing started


def test_the_private_etcd_stays_plain_whatever_the_environment_says(jobs: list[Job]) -> None:
    """`elastic-run` without --etcd ignores (and hides from its processes) etcd settings left in
    the environment: --standalone needs no configuration."""
    junk = {variable: "/nonexistent/etcd-setting" for variable in env.ETCD_SECURITY}
    junk[env.ETCD_PASSWORD_FILE] = ""  # one way of giving the password, as required
    done = subprocess.run(
        [ELASTIC_RUN, "--workers", "1", "--", "python", HVD_SCRIPT, "--steps", "10"],
        cwd=ROOT,
        env={**clean_env(), **junk},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "succeeded" in done.stdout
