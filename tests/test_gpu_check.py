"""scripts/gpu-check.sh on a machine without an NVIDIA GPU (this one): it says so, checks what it
can, writes its JSON report and exits 0; its reading of nvidia-smi and of the sweep's figures,
with a stand-in nvidia-smi. The GPU runs themselves need a GPU (docs/gpu.md)."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import io
import json
import os
import queue
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def load_gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = load_gpu_check()


@pytest.mark.skipif(
    shutil.which("nvidia-smi") is not None or os.path.exists("/usr/bin/nvidia-smi"),
    reason="this machine has nvidia-smi: the script would run the GPU checks",
)
def test_without_a_gpu_it_says_so_writes_the_report_and_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(SCRIPT)],
        env={**os.environ, "OUT": str(out), "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no NVIDIA GPU" in done.stdout
    report = json.loads((out / "gpu-check.json").read_text())  # $OUT/gpu-check.json
    assert report["schema"] == "elastic-allreduce/gpu-check/1"
    assert report["no_nvidia_gpu"] is True
    assert report["verdict"].startswith("no NVIDIA GPU")
    assert report["gpus"] == [] and report["driver"]["found"] is False
    assert report["failed"] == []
    assert {c["status"] for c in report["checks"].values()} == {"not checked"}
    assert len(report["not_checked"]) == 3
    # What it could still check: the software it would run with.
    tensorflow = importlib.metadata.version("tensorflow-cpu")
    assert report["software"]["tensorflow"]["version"] == tensorflow
    assert report["software"]["horovod"]["tensorflow"]["nccl_built"] is False


FAKE_SMI = """#!/bin/sh
case "$1" in
  --query-gpu=*)
    echo "0, NVIDIA H200, GPU-aaaa, 00000000:19:00.0, 143771, 9.0"
    echo "1, NVIDIA H200, GPU-bbbb, 00000000:3B:00.0, 143771, 9.0" ;;
  topo) echo "GPU0 X NV18" ;;
  *) echo "| NVIDIA-SMI 550.90.07   Driver Version: 550.90.07   CUDA Version: 12.4 |" ;;
esac
"""


def test_nvidia_smi_is_read_into_driver_gpus_and_topology(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    monkeypatch.setattr(gpu_check, "find_nvidia_smi", lambda: str(smi))
    driver, gpus, topology = gpu_check.machine()
    assert (driver["found"], driver["version"], driver["cuda_version"]) == (
        True,
        "550.90.07",
        "12.4",
    )
    assert [(g["index"], g["name"], g["memory_total_mib"], g["compute_cap"]) for g in gpus] == [
        (0, "NVIDIA H200", 143771, "9.0"),
        (1, "NVIDIA H200", 143771, "9.0"),
    ]
    assert topology == "GPU0 X NV18"
    # GPUs, but TensorFlow sees none: the GPU checks are not run, and the report says why.
    found: dict[str, Any] = {
        "tensorflow": {"importable": True, "gpus": []},
        "torch": {"importable": False, "error": "ModuleNotFoundError: torch"},
        "horovod": {"importable": True, "tensorflow": {"nccl_built": False}},
    }
    assert "TensorFlow sees no GPU" in gpu_check.blocker(gpus, driver, found)
    found["tensorflow"]["gpus"] = ["/physical_device:GPU:0", "/physical_device:GPU:1"]
    assert "without NCCL" in gpu_check.blocker(gpus, driver, found)
    found["horovod"]["tensorflow"]["nccl_built"] = True
    assert gpu_check.blocker(gpus, driver, found) is None
    assert gpu_check.framework_for(found) == ("tensorflow", "")


def test_without_tensorflow_horovods_checks_run_on_pytorch_and_the_elastic_one_does_not() -> None:
    """The lent device machine's case: PyTorch and a Horovod built against it, no TensorFlow."""
    found: dict[str, Any] = {
        "tensorflow": {"importable": False, "error": "ModuleNotFoundError: tensorflow"},
        "torch": {"importable": True, "gpus": ["NVIDIA H200"]},
        "horovod": {"importable": True, "torch": {"nccl_built": True}},
        "elastic_allreduce": {"importable": True},
        "etcd": {"found": True},
    }
    assert gpu_check.framework_for(found) == ("torch", "")
    found["horovod"]["torch"]["nccl_built"] = False
    framework, why = gpu_check.framework_for(found)
    assert framework is None
    assert "TensorFlow is not importable" in why and "horovod.torch was built without NCCL" in why
    args = argparse.Namespace(cpu_dry_run=False, sizes_mib="1", timeout=1.0, python="python3")
    checks = gpu_check.run_checks(args, found, gpu_check.blocker([{"index": 0}], {}, found))
    assert {c["status"] for c in checks.values()} == {"not checked"}
    # The elastic job needs TensorFlow even where Horovod's checks can run on PyTorch.
    found["horovod"]["torch"]["nccl_built"] = True
    found["horovod"]["horovodrun"] = False  # so that nothing is started here
    checks = dict(gpu_check.run_checks(args, found, None), nccl_failure=None)
    assert checks["elastic_recovery"]["status"] == "not checked"
    assert "TensorFlow programs" in checks["elastic_recovery"]["reason"]


FAST = ("--large-mib", "16", "--deadline", "60")


def test_the_failure_check_sees_a_killed_peer_fail_the_survivor_which_re_initialises() -> None:
    """gpu_check_nccl_failure.py on the CPU (Gloo, real processes, a real SIGKILL): the plumbing
    the GPU run uses, and Horovod's own reset with a new peer in elastic mode."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check_nccl_failure.py"), "--cpu", *FAST],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=ROOT,
    )
    report = gpu_check.result_line(done.stdout)
    assert report is not None, done.stdout + done.stderr
    assert report["status"] == "ok", json.dumps(report, indent=1) + done.stderr[-3000:]
    steps = report["steps"]
    assert steps["reinit_without_failure"]["correct"] == [True, True]
    for name in ("killed_between_collectives", "killed_inside_collectives"):
        assert steps[name]["detected"] is True
        # Gloo's read error, or Horovod's "has been shut down" after it, by timing.
        assert "Horovod" in steps[name]["error"] or "Read error" in steps[name]["error"]
    assert steps["reinit_with_a_new_peer"]["sizes"] == [2, 2]
    assert steps["reinit_with_a_new_peer"]["correct"] == [True, True]
    assert steps["alone"] == {"size": 1, "correct": True}


def test_the_failure_check_sees_an_event_after_an_unended_log_line() -> None:
    """A full run once hung for 60 s: a worker's C++ log line, written in pieces, was cut by an
    event line, which the parent then did not see. Events are written in one piece and found
    anywhere in a line (NCCL's debug output shares stdout)."""
    spec = importlib.util.spec_from_file_location(
        "gpu_check_nccl_failure", ROOT / "scripts" / "gpu_check_nccl_failure.py"
    )
    assert spec is not None and spec.loader is not None
    failure_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(failure_check)
    worker = object.__new__(failure_check.Worker)
    worker.lines, worker.events = [], queue.Queue()
    event = {"event": "error", "at": 1.0, "error": "Read error"}
    worker._read(io.StringIO(f"[2026-12-05 14:36:10{failure_check.EVENT}{json.dumps(event)}\n"))
    assert worker.events.get_nowait() == event
    assert worker.lines == [f"[2026-12-05 14:36:10{failure_check.EVENT}{json.dumps(event)}"]


def test_bus_bandwidth_is_nccl_tests_allreduce_formula() -> None:
    # 1 GB in 0.1 s: algbw 10 GB/s; busbw = algbw * 2 (n - 1) / n.
    assert gpu_check.bus_bandwidth(10**9, 0.1, 2) == {"algbw_gbps": 10.0, "busbw_gbps": 10.0}
    assert gpu_check.bus_bandwidth(10**9, 0.1, 8) == {"algbw_gbps": 10.0, "busbw_gbps": 17.5}
    assert gpu_check.layout(1) == {"processes": 2, "share_gpu": True}
    assert gpu_check.layout(4) == {"processes": 4, "share_gpu": False}


def test_only_the_processes_own_result_lines_count() -> None:
    output = "\n".join(
        [
            '[job-1 e1 r0 n0.0] GPU_CHECK_RESULT {"event": "start", "slot": "n0.0"}',
            '[1]<stdout>:GPU_CHECK_RESULT {"size": 2}',
            'INFO elastic-run: slot n0.1 crashed; last output: GPU_CHECK_RESULT {"event": "kill"}',
            "[job-1 e1 r1 n0.1] GPU_CHECK_RESULT {truncated",
            "NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC",
            "NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/IPC",
        ]
    )
    assert gpu_check.result_records(output) == [
        {"event": "start", "slot": "n0.0"},
        {"size": 2},
    ]
    assert gpu_check.transports(output) == ["P2P/IPC"]


def _records(seen: int, selected: list[int | None]) -> list[dict[str, object]]:
    device = "/job:localhost/replica:0/task:0/device:GPU:0"
    starts: list[dict[str, object]] = [
        {"event": "start", "slot": f"n0.{i}", "physical_gpus": seen, "gpu_index": i, "selected": s}
        for i, s in enumerate(selected)
    ]
    return [
        *starts,
        {"event": "kill", "slot": "n0.1", "step": 20},
        {"event": "start", "slot": "n0.1", "incarnation": 2, "physical_gpus": seen,
         "gpu_index": 1, "selected": selected[1]},
        *(
            {"event": "done", "slot": f"n0.{i}", "step": 60, "size": 2, "checksum": 1.5,
             "device": device, "incarnation": 1 + i}
            for i in range(2)
        ),
    ]  # fmt: skip


def test_the_elastic_run_is_judged_on_recovery_and_on_each_process_seeing_every_gpu() -> None:
    judged = gpu_check.judge_recovery(_records(2, [0, 1]), 60, 2, share=False)
    assert judged["status"] == "ok", judged["reason"]
    # One GPU visible per process (CUDA_VISIBLE_DEVICES=<index>, as before issue #20): a failure.
    judged = gpu_check.judge_recovery(_records(1, [0, 0]), 60, 2, share=False)
    assert judged["status"] == "failed"
    assert "should see all 2 GPUs" in judged["reason"]
    assert "do not compute on their slot's GPU" in judged["reason"]
