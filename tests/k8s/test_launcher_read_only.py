"""The launcher runs a whole job on a read-only root filesystem, as in its pod
(``readOnlyRootFilesystem: true``, an emptyDir at /tmp, the checkpoint claim for a TensorBoard
folder): a real `elastic-run run --kubernetes` against the fake cluster, inside a mount
namespace where every filesystem is read-only except a fresh tmpfs at /tmp. It writes its events
file and its TensorBoard summaries (after a recovery) there, and nothing else.

Needs root (a mount namespace of its own: `unshare --mount`); skipped otherwise. Not a
container runtime: the same files, not the image's."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from elastic_allreduce.store import EmbeddedEtcd
from tests.conftest import fresh_job_id, require_checkout_outside_tmp
from tests.helpers.fake_kube import FakeKube
from tests.k8s.conftest import PodOutput, join_template, launcher_pod, phase, wait_showing

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SCRIPT = str(Path(__file__).parent.parent / "scripts" / "train_until.py")
ELASTIC_RUN = str(Path(sys.executable).parent / "elastic-run")
#: Runs "$@" with every mount read-only but the kernel's, and a tmpfs at /tmp; then lists what
#: was written there.
SANDBOX = r"""
set -e
for m in $(awk '{print $2}' /proc/self/mounts | sort -u); do
  case "$m" in /proc|/proc/*|/sys|/sys/*|/dev|/dev/*) continue;; esac
  mount -o remount,bind,ro "$m" 2>/dev/null || true
done
mount -t tmpfs -o size=64m tmpfs /tmp
if touch "$PROBE" 2>/dev/null; then echo "sandbox: $PROBE is writable"; exit 99; fi
set +e
"$@"; code=$?
for f in $(find /tmp -type f | sort); do echo "written: $f"; done
exit $code
"""


def usable() -> str | None:
    """Why the sandbox cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root for a mount namespace of its own"
    if shutil.which("unshare") is None:
        return "no unshare (util-linux)"
    return None


@pytest.fixture
def outside_tmp() -> Iterator[Path]:
    """A folder the sandbox's tmpfs does not hide (for the worker template it reads)."""
    folder = Path(tempfile.mkdtemp(prefix="elastic-rofs-", dir="/var/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def sandboxed_launcher_pod(job_id: str, argv: list[str], probe: Path) -> dict[str, Any]:
    sandbox = ["unshare", "--mount", "--propagation", "private", "sh", "-c", SANDBOX, "sh"]
    # As in the images, which set no TMPDIR: Python's temp folder is /tmp.
    env = [{"name": "PROBE", "value": str(probe)}, {"name": "TMPDIR", "value": "/tmp"}]
    return launcher_pod(f"{job_id}-launcher", [*sandbox, *argv], env)


def test_the_launcher_writes_only_to_tmp_and_its_tensorboard_folder(
    etcd_server: EmbeddedEtcd, kube: FakeKube, output: PodOutput, outside_tmp: Path
) -> None:
    if (why := usable()) is not None:
        pytest.skip(why)
    require_checkout_outside_tmp("the read-only sandbox")
    job_id = fresh_job_id("rofs")
    template, stop = outside_tmp / "worker-pod.yaml", outside_tmp / "stop"
    template.write_text(json.dumps(join_template()))
    tensorboard = f"/tmp/checkpoints/tensorboard/{job_id}"  # the claim, here on the tmpfs
    argv = [
        ELASTIC_RUN, "run", "--kubernetes", "--worker-template", str(template),
        "--kube-api", kube.url, "--etcd", etcd_server.endpoints_text, "--job-id", job_id,
        "--workers", "2", "--min-workers", "1", "--max-workers", "2", "--max-restarts", "0",
        "--tensorboard-dir", tensorboard, "--metrics-port", "0",
        "--", "python", SCRIPT, "--stop-file", str(stop), "--step-delay", "0.03",
    ]  # fmt: skip
    launcher = f"{job_id}-launcher"
    with kube.api_client() as api:
        client.CoreV1Api(api).create_namespaced_pod(
            "default", sandboxed_launcher_pod(job_id, argv, outside_tmp / "probe")
        )
    # A recovery (a worker killed) makes the launcher write its TensorBoard summary.
    wait_showing(kube, output, lambda: len(output.commits(size=2)) >= 2, 120, "2-rank commits")
    kube.kill(f"{job_id}-worker-1")
    wait_showing(kube, output, lambda: len(output.commits(size=1)) >= 2, 60, "1-rank commits")
    stop.touch()
    wait_showing(
        kube, output, lambda: phase(kube.pod(launcher)) in ("Succeeded", "Failed"), 60, "the end"
    )
    lines = output.of(launcher)
    assert phase(kube.pod(launcher)) == "Succeeded", "\n".join(lines)
    assert f"elastic-run: job {job_id} succeeded" in "\n".join(lines)
    written = sorted(line.split("written: ", 1)[1] for line in lines if "written: " in line)
    assert [Path(p).parent for p in written] == [
        Path(f"{tensorboard}/launcher"),
        Path("/tmp/elastic-run"),
    ], written
    assert written[1] == f"/tmp/elastic-run/{job_id}.events.jsonl"
    assert not [line for line in lines if "Read-only file system" in line], lines
