"""What a machine with NVIDIA GPUs can do for elastic-allreduce, checked offline.

Run by ``scripts/gpu-check.sh`` (its header says how). Standard library only, so it reports
even where nothing else is installed. In order:

1. the machine: driver and CUDA version, the GPUs and their topology (``nvidia-smi``), Python;
2. the software, imported in a child interpreter (a crash there is a finding, not the end):
   TensorFlow (its version, whether it was built with CUDA, the GPUs it sees), Horovod (whether
   it was built with NCCL and Gloo), this checkout's packages and an etcd server binary;
3. where a GPU and Horovod with NCCL are there, on TensorFlow (the product's framework) or,
   where TensorFlow cannot run, on PyTorch (scripts/gpu_check_framework.py): an allreduce
   bus-bandwidth sweep with Horovod over NCCL (``horovodrun``, one process per GPU, or two
   sharing the only GPU), busbw = algbw * 2(n-1)/n as nccl-tests computes it for allreduce;
4. NCCL under a failure: a peer SIGKILLed between and inside allreduces, the survivor's
   error and its re-initialisation with a new peer and alone, in Horovod's elastic mode
   (scripts/gpu_check_nccl_failure.py);
5. with TensorFlow and an etcd binary too: one elastic job on the GPUs (``elastic-run``, 2
   training processes) in which one process is SIGKILLed and the job must recover and finish.

Every figure goes into one JSON file. What could not be checked is said, with the reason, and
is no failure: the exit code is 1 only when something that was checked failed, else 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
SCHEMA = "elastic-allreduce/gpu-check/1"
NOT_CHECKED = "not checked"
OK = "ok"
FAILED = "failed"
#: Message sizes of the sweep, in MiB (each a float32 tensor of that size).
DEFAULT_SIZES_MIB = (1, 4, 16, 64, 256)
GPU_FIELDS = "index,name,uuid,pci.bus_id,memory.total,compute_cap"
#: Marks the result line of the sweep's and the elastic script's rank 0.
RESULT_MARK = "GPU_CHECK_RESULT "

#: Run by the interpreter under test: what it can import, as one JSON line.
SOFTWARE_PROBE = r"""
import json, os, shutil
out = {}
try:
    import tensorflow as tf
    info = tf.sysconfig.get_build_info()
    out["tensorflow"] = {
        "importable": True,
        "version": tf.__version__,
        "built_with_cuda": bool(tf.test.is_built_with_cuda()),
        "cuda_version": info.get("cuda_version"),
        "cudnn_version": info.get("cudnn_version"),
        "gpus": [d.name for d in tf.config.list_physical_devices("GPU")],
    }
except Exception as exc:
    out["tensorflow"] = {"importable": False, "error": f"{type(exc).__name__}: {exc}"}
try:
    import torch
    out["torch"] = {
        "importable": True,
        "version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }
except Exception as exc:
    out["torch"] = {"importable": False, "error": f"{type(exc).__name__}: {exc}"}
try:
    import horovod
    out["horovod"] = {"importable": True, "version": horovod.__version__}
    import horovod.runner.launch
    out["horovod"]["horovodrun"] = True
except Exception as exc:
    out.setdefault("horovod", {"importable": False})
    out["horovod"]["error"] = f"{type(exc).__name__}: {exc}"
for framework in ("tensorflow", "torch"):
    if not out["horovod"].get("importable") or not out[framework]["importable"]:
        continue
    try:
        hvd = __import__(f"horovod.{framework}", fromlist=["init"])
        out["horovod"][framework] = {
            "nccl_built": bool(hvd.nccl_built()),
            "gloo_built": bool(hvd.gloo_built()),
            "cuda_built": bool(hvd.cuda_built()),
        }
    except Exception as exc:
        out["horovod"][framework] = {"error": f"{type(exc).__name__}: {exc}"}
try:
    import elastic_allreduce, launcher.cli
    path = os.path.dirname(elastic_allreduce.__file__)
    out["elastic_allreduce"] = {"importable": True, "path": path}
except Exception as exc:
    out["elastic_allreduce"] = {"importable": False, "error": f"{type(exc).__name__}: {exc}"}
try:
    from elastic_allreduce.store.embedded import find_etcd_binary
    out["etcd"] = {"found": True, "path": find_etcd_binary()}
except Exception as exc:
    out["etcd"] = {"found": False, "error": f"{type(exc).__name__}: {exc}"}
print("GPU_CHECK_RESULT " + json.dumps(out))
"""


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def run(command: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``command``; its exit code (None: not started or timed out), output and duration."""
    started = time.monotonic()
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
            cwd=ROOT,
        )
    except FileNotFoundError as exc:
        return {"returncode": None, "output": str(exc), "seconds": 0.0}
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"") + (exc.stderr or b"")
        text = output.decode(errors="replace") if isinstance(output, bytes) else str(output)
        return {
            "returncode": None,
            "output": text + f"\n[timed out after {timeout:.0f} s]",
            "seconds": round(time.monotonic() - started, 1),
        }
    return {
        "returncode": done.returncode,
        "output": done.stdout + done.stderr,
        "seconds": round(time.monotonic() - started, 1),
    }


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def result_records(output: str) -> list[dict[str, Any]]:
    """Every JSON object that follows RESULT_MARK in ``output`` (unreadable ones skipped: the
    lines of several processes may interleave)."""
    decoder = json.JSONDecoder()
    records = []
    for line in output.splitlines():
        # At the start of a line or after elastic-run's "[job e1 r0 n0.0] " or horovodrun's
        # "[0]<stdout>:" prefix; not where a log line quotes a process's output.
        found = re.search(r"(?:^|\] |<stdout>:)" + RESULT_MARK, line)
        if found is None:
            continue
        try:
            record, _ = decoder.raw_decode(line[found.end() :])
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def result_line(output: str) -> dict[str, Any] | None:
    """The last JSON object after RESULT_MARK in ``output``, or None."""
    records = result_records(output)
    return records[-1] if records else None


# -- 1. the machine ---------------------------------------------------------------------------


def find_nvidia_smi() -> str | None:
    for candidate in (
        shutil.which("nvidia-smi"),
        "/usr/bin/nvidia-smi",
        "/usr/local/nvidia/bin/nvidia-smi",
    ):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def parse_gpus(csv_text: str, fields: str = GPU_FIELDS) -> list[dict[str, Any]]:
    """``nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits`` as dicts."""
    names = [field.replace(".", "_") for field in fields.split(",")]
    gpus = []
    for line in csv_text.strip().splitlines():
        values = [value.strip() for value in line.split(",")]
        if len(values) != len(names):
            continue
        gpu: dict[str, Any] = dict(zip(names, values, strict=True))
        gpu["index"] = int(gpu["index"])
        if "memory_total" in gpu:
            gpu["memory_total_mib"] = int(float(gpu.pop("memory_total")))
        gpus.append(gpu)
    return gpus


def parse_versions(smi_text: str) -> dict[str, str | None]:
    """Driver and CUDA versions from ``nvidia-smi``'s banner."""
    driver = re.search(r"Driver Version:\s*([\d.]+)", smi_text)
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", smi_text)
    return {
        "version": driver.group(1) if driver else None,
        "cuda_version": cuda.group(1) if cuda else None,
    }


def machine() -> tuple[dict[str, Any], list[dict[str, Any]], str | None]:
    """(driver, gpus, topology) from nvidia-smi; driver["reason"] says why there are no GPUs."""
    driver: dict[str, Any] = {"found": False, "version": None, "cuda_version": None}
    proc_version = Path("/proc/driver/nvidia/version")
    if proc_version.is_file():
        driver["kernel_module"] = proc_version.read_text().strip().splitlines()[0]
    smi = find_nvidia_smi()
    if smi is None:
        driver["reason"] = "nvidia-smi not found: no NVIDIA driver installed, or not on PATH"
        return driver, [], None
    banner = run([smi], timeout=60)
    if banner["returncode"] != 0:
        driver["reason"] = f"nvidia-smi failed: {tail(banner['output'], 5)}"
        return driver, [], None
    driver.update(parse_versions(banner["output"]), found=True, nvidia_smi=smi)
    query = run([smi, f"--query-gpu={GPU_FIELDS}", "--format=csv,noheader,nounits"], timeout=60)
    fields = GPU_FIELDS
    if query["returncode"] != 0:  # older drivers lack compute_cap
        fields = GPU_FIELDS.replace(",compute_cap", "")
        query = run([smi, f"--query-gpu={fields}", "--format=csv,noheader,nounits"], 60)
    gpus = parse_gpus(query["output"], fields) if query["returncode"] == 0 else []
    if not gpus:
        driver["reason"] = "nvidia-smi lists no GPU"
    topology = run([smi, "topo", "-m"], timeout=60)
    return driver, gpus, topology["output"].strip() if topology["returncode"] == 0 else None


# -- 2. the software --------------------------------------------------------------------------


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every child: this checkout first on the Python path."""
    environ = dict(os.environ)
    paths = [str(ROOT), *filter(None, environ.get("PYTHONPATH", "").split(os.pathsep))]
    environ["PYTHONPATH"] = os.pathsep.join(paths)
    environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    environ.update(extra or {})
    return environ


def software(python: str) -> dict[str, Any]:
    probe = run([python, "-c", SOFTWARE_PROBE], timeout=300, env=child_env())
    found = result_line(probe["output"]) if probe["returncode"] == 0 else None
    if found is None:
        return {"probe_failed": tail(probe["output"]), "returncode": probe["returncode"]}
    return found


# -- 3. the allreduce sweep -------------------------------------------------------------------


def layout(gpu_count: int) -> dict[str, Any]:
    """How many processes, and whether they share the only GPU."""
    if gpu_count >= 2:
        return {"processes": gpu_count, "share_gpu": False}
    return {"processes": 2, "share_gpu": True}


def bus_bandwidth(size_bytes: int, seconds: float, processes: int) -> dict[str, float]:
    """Algorithm and bus bandwidth of one allreduce, in GB/s (10^9 bytes/s)."""
    algbw = size_bytes / seconds / 1e9
    return {
        "algbw_gbps": round(algbw, 3),
        "busbw_gbps": round(algbw * 2 * (processes - 1) / processes, 3),
    }


def sweep(
    python: str,
    gpu_count: int,
    sizes_mib: list[int],
    timeout: float,
    *,
    cpu: bool = False,
    framework: str = "tensorflow",
) -> dict[str, Any]:
    plan = layout(gpu_count) if not cpu else {"processes": 2, "share_gpu": False, "cpu": True}
    n = plan["processes"]
    command = [
        python,
        "-m",
        "horovod.runner.launch",
        "-np",
        str(n),
        "-H",
        f"localhost:{n}",
        "--gloo",
        python,
        str(SCRIPTS / "gpu_check_allreduce.py"),
        "--sizes-mib",
        ",".join(str(size) for size in sizes_mib),
        "--framework",
        framework,
        *(["--share-gpu"] if plan["share_gpu"] else []),
        *(["--cpu"] if cpu else []),
    ]
    done = run(command, timeout, env=child_env({"NCCL_DEBUG": "INFO"}))
    result: dict[str, Any] = {
        **plan,
        "framework": framework,
        "command": " ".join(command),
        "seconds": done["seconds"],
        "nccl_transports": transports(done["output"]),
        "note": "Horovod's allreduce timed per call (with its own coordination), so small sizes "
        "read lower than nccl-tests would"
        + (
            "; the 2 processes share one GPU and talk through NCCL's network transport"
            if plan["share_gpu"]
            else ""
        ),
    }
    measured = result_line(done["output"])
    if done["returncode"] != 0 or measured is None:
        return {
            **result,
            "status": FAILED,
            "reason": "the sweep did not finish",
            "output_tail": tail(done["output"]),
        }
    rows = []
    for row in measured["results"]:
        rows.append({**row, **bus_bandwidth(row["bytes"], row["seconds"], n)})
    wrong = [row["bytes"] for row in rows if not row["correct"]]
    status = FAILED if wrong else OK
    reason = f"wrong sums at sizes {wrong}" if wrong else "every sum was right"
    return {
        **result,
        "status": status,
        "reason": reason,
        "world_size": measured["size"],
        "results": rows,
    }


def transports(output: str) -> list[str]:
    """NCCL's INFO lines that say how ranks are connected (P2P, SHM, NET), deduplicated."""
    seen: list[str] = []
    for line in output.splitlines():
        match = re.search(r"via (\S+)", line) if "NCCL INFO" in line and "Channel" in line else None
        if match and match.group(1) not in seen:
            seen.append(match.group(1))
    return seen


# -- 4. NCCL under a failure and a reset ------------------------------------------------------


def nccl_failure(python: str, framework: str, timeout: float, cpu: bool = False) -> dict[str, Any]:
    """A peer SIGKILLed between and inside NCCL allreduces; the survivor re-initialises
    (scripts/gpu_check_nccl_failure.py says what each step shows)."""
    command = [python, str(SCRIPTS / "gpu_check_nccl_failure.py"), "--framework", framework]
    # A survivor that has not failed after this long counts as hung (Gloo's own timeout is 30 s).
    command += ["--deadline", str(round(min(90.0, max(40.0, timeout / 3))))]
    command += ["--cpu"] if cpu else []
    done = run(command, timeout, env=child_env({"NCCL_DEBUG": "WARN"}))
    measured = result_line(done["output"])
    result: dict[str, Any] = {"command": " ".join(command), "seconds": done["seconds"]}
    if measured is None:
        return {
            **result,
            "status": FAILED,
            "reason": f"the check did not finish (exit {done['returncode']})",
            "output_tail": tail(done["output"]),
        }
    return {**result, **measured}


# -- 5. elastic kill-and-recover --------------------------------------------------------------


def elastic(python: str, gpu_count: int, timeout: float, cpu: bool = False) -> dict[str, Any]:
    """Two training processes on the GPUs, one SIGKILLed once; the job must finish."""
    if gpu_count >= 2 or cpu:  # one node, two slots: the agent's GPU selection and NCCL's P2P/SHM
        nodes, nproc, share = 1, 2, False
    else:  # two nodes of one slot each, on the only GPU
        nodes, nproc, share = 2, 1, True
    steps = 60
    command = [
        python,
        "-m",
        "launcher.cli",
        "run",
        "--workers",
        str(nodes),
        "--min-workers",
        str(nodes),
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "2",
        "--wait-timeout",
        "120",
        "--",
        "python",
        str(SCRIPTS / "gpu_check_elastic.py"),
        "--steps",
        str(steps),
        "--kill-at-step",
        "20",
        *(["--share-gpu"] if share else []),
        *(["--cpu"] if cpu else []),
    ]
    done = run(command, timeout, env=child_env({"NCCL_DEBUG": "INFO"}))
    records = result_records(done["output"])
    result: dict[str, Any] = {
        "nodes": nodes,
        "processes_per_node": nproc,
        "share_gpu": share,
        "command": " ".join(command),
        "seconds": done["seconds"],
        "returncode": done["returncode"],
        "nccl_transports": transports(done["output"]),
    }
    verdict = judge_recovery(records, steps, gpu_count, share, cpu)
    result.update(verdict)
    if done["returncode"] != 0 and verdict["status"] == OK:
        result.update(status=FAILED, reason=f"elastic-run exited {done['returncode']}")
    if result["status"] != OK:
        result["output_tail"] = tail(done["output"], 60)
    return result


def judge_recovery(
    records: list[dict[str, Any]], steps: int, gpu_count: int, share: bool, cpu: bool = False
) -> dict[str, Any]:
    """Whether the elastic script's records show a kill, a recovery and a finish on the GPUs."""
    kills = [r for r in records if r["event"] == "kill"]
    done = [r for r in records if r["event"] == "done"]
    devices = sorted({r["device"] for r in records if r.get("device")})
    summary: dict[str, Any] = {
        "killed": [f"{r['slot']} at step {r['step']}" for r in kills],
        "finished": sorted(r["slot"] for r in done),
        "restarted": sorted({r["slot"] for r in records if r.get("incarnation", 1) > 1}),
        "devices": devices,
        "gpus_seen_per_process": sorted(
            {r["physical_gpus"] for r in records if "physical_gpus" in r}
        ),
        "gpu_of_each_start": [
            (r["slot"], r.get("selected")) for r in records if r["event"] == "start"
        ],
        "checksums": sorted({r["checksum"] for r in done}),
    }
    problems = []
    if not kills:
        problems.append("no process was killed")
    finished = sorted((r["slot"], r["step"], r["size"]) for r in done)
    if len(done) != 2 or len({r["step"] for r in done}) != 1 or done[0]["step"] < steps:
        problems.append(f"expected 2 processes to finish {steps}+ steps together, got {finished}")
    if any(r["size"] != 2 for r in done) or not summary["restarted"]:
        problems.append("the restarted process did not rejoin the ring")
    if len(summary["checksums"]) > 1:
        problems.append("the finished processes hold different weights")
    if not cpu:
        problems += gpu_problems(records, devices, gpu_count, share)
    if problems:
        return {**summary, "status": FAILED, "reason": "; ".join(problems)}
    return {**summary, "status": OK, "reason": "killed, recovered and finished with equal weights"}


def gpu_problems(
    records: list[dict[str, Any]], devices: list[str], gpu_count: int, share: bool
) -> list[str]:
    """What the records show wrong about the GPUs: where the weights live, how many GPUs each
    process sees (all of them, for NCCL's P2P and SHM), which one it computes on (its slot's)."""
    problems = []
    if not devices or any("GPU" not in device for device in devices):
        problems.append(f"training did not run on GPUs only: {devices}")
    seen = sorted({r["physical_gpus"] for r in records if r["event"] == "start"})
    if not share and seen != [gpu_count]:
        problems.append(f"each process should see all {gpu_count} GPUs, saw {seen}")
    starts = [r for r in records if r["event"] == "start"]
    wrong = [r for r in starts if r.get("selected") is None or r["selected"] != r["gpu_index"]]
    if wrong:
        problems.append(f"processes that do not compute on their slot's GPU: {wrong[:2]}")
    return problems


# -- the report -------------------------------------------------------------------------------


def not_checked(reason: str) -> dict[str, Any]:
    return {"status": NOT_CHECKED, "reason": reason}


def framework_for(found: dict[str, Any], cpu: bool = False) -> tuple[str | None, str]:
    """The framework Horovod's checks run on (TensorFlow, the product's, else PyTorch), or None
    and why neither will do."""
    hvd = found.get("horovod", {})
    if not hvd.get("importable"):
        return None, f"Horovod is not importable: {hvd.get('error', found.get('probe_failed'))}"
    reasons = []
    for name, label in (("tensorflow", "TensorFlow"), ("torch", "PyTorch")):
        framework, built = found.get(name, {}), hvd.get(name, {})
        if not framework.get("importable"):
            reasons.append(f"{label} is not importable ({framework.get('error')})")
        elif "error" in built or not built:
            reasons.append(f"horovod.{name} is not importable ({built.get('error')})")
        elif cpu:
            return name, ""
        elif not framework.get("gpus"):
            reasons.append(f"{label} sees no GPU (a CPU build, or CUDA libraries it cannot load)")
        elif not built.get("nccl_built"):
            reasons.append(f"horovod.{name} was built without NCCL (HOROVOD_GPU_OPERATIONS=NCCL)")
        else:
            return name, ""
    return None, "; ".join(reasons)


def blocker(
    gpus: list[dict[str, Any]], driver: dict[str, Any], found: dict[str, Any]
) -> str | None:
    """Why the GPU checks cannot run here, or None."""
    if not gpus:
        return f"no NVIDIA GPU: {driver.get('reason', 'none found')}"
    framework, reason = framework_for(found)
    return None if framework else reason


def check(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    driver, gpus, topology = machine()
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "started_at": now(),
        "host": socket.gethostname(),
        "python": {"version": platform.python_version(), "executable": args.python},
        "platform": platform.platform(),
        "driver": driver,
        "gpus": gpus,
        "gpu_topology": topology,
        "no_nvidia_gpu": not gpus,
    }
    found = software(args.python)
    report["software"] = found
    reason = blocker(gpus, driver, found)
    report["cpu_dry_run"] = args.cpu_dry_run
    checks = run_checks(args, found, None if args.cpu_dry_run else reason)
    report["checks"] = checks
    report["not_checked"] = [
        f"{name}: {c['reason']}" for name, c in checks.items() if c["status"] == NOT_CHECKED
    ]
    report["failed"] = [
        f"{name}: {c['reason']}" for name, c in checks.items() if c["status"] == FAILED
    ]
    report["verdict"] = verdict(report, reason)
    report["seconds"] = round(time.monotonic() - started, 1)
    return report


def run_checks(
    args: argparse.Namespace, found: dict[str, Any], reason: str | None
) -> dict[str, Any]:
    """The sweep, the NCCL failure check and the elastic job, or why each cannot run
    (``reason``: for none of them)."""
    names = ("allreduce_sweep", "nccl_failure", "elastic_recovery")
    cpu = bool(args.cpu_dry_run)
    framework, why = framework_for(found, cpu)
    if reason is not None or framework is None:
        return {name: not_checked(reason or why) for name in names}
    gpus = 0 if cpu else len(found[framework]["gpus"])
    sizes = [int(size) for size in args.sizes_mib.split(",")]
    hvd, ea, etcd = (found.get(name, {}) for name in ("horovod", "elastic_allreduce", "etcd"))
    checks: dict[str, Any] = {}
    if not hvd.get("horovodrun"):
        checks["allreduce_sweep"] = not_checked(f"horovodrun cannot start: {hvd.get('error')}")
    else:
        checks["allreduce_sweep"] = guarded(
            sweep, args.python, gpus, sizes, args.timeout, cpu=cpu, framework=framework
        )
    checks["nccl_failure"] = guarded(nccl_failure, args.python, framework, args.timeout, cpu)
    if framework != "tensorflow":
        checks["elastic_recovery"] = not_checked(
            "elastic-allreduce's training processes are TensorFlow programs and TensorFlow is "
            f"not usable here ({found.get('tensorflow', {}).get('error')})"
        )
    elif not (ea.get("importable") and etcd.get("found")):
        why = ea.get("error") or etcd.get("error")
        checks["elastic_recovery"] = not_checked(f"elastic-run cannot start here: {why}")
    else:
        checks["elastic_recovery"] = guarded(elastic, args.python, gpus, args.timeout, cpu)
    return checks


def guarded(check: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:  # noqa: ANN401
    """``check(...)``; a bug of this script's while reading the results is a failed check."""
    try:
        return dict(check(*args, **kwargs))
    except Exception as exc:
        return {"status": FAILED, "reason": f"gpu-check could not read the results: {exc!r}"}


def verdict(report: dict[str, Any], reason: str | None) -> str:
    if report["failed"]:
        found = "failed: " + "; ".join(report["failed"])
    elif reason is not None and not report.get("cpu_dry_run"):
        found = reason
    elif report["not_checked"]:
        found = "not all checked: " + "; ".join(report["not_checked"])
    else:
        found = "ok: every check ran and passed"
    if report.get("cpu_dry_run"):
        return f"CPU dry run, no GPU figures ({reason or 'a GPU is there'}): {found}"
    return found


def summary(report: dict[str, Any]) -> list[str]:
    driver = report["driver"]
    lines = [
        f"driver: {driver['version']} (CUDA {driver['cuda_version']})"
        if driver["found"]
        else f"driver: {driver.get('reason')}",
        f"GPUs: {len(report['gpus'])}"
        + "".join(
            f"\n  {g['index']}: {g['name']} ({g.get('memory_total_mib')} MiB)"
            for g in report["gpus"]
        ),
        f"Python {report['python']['version']} ({report['python']['executable']})",
    ]
    for name, info in report["software"].items():
        if isinstance(info, dict):
            lines.append(f"{name}: {json.dumps(info, sort_keys=True)}")
    for name, result in report["checks"].items():
        label = "NOT CHECKED" if result["status"] == NOT_CHECKED else result["status"].upper()
        lines.append(f"{label}: {name}: {result['reason']}")
        for row in result.get("results", []):
            mib, algbw, busbw = row["bytes"] / 2**20, row["algbw_gbps"], row["busbw_gbps"]
            lines.append(f"  {mib:>6.0f} MiB  algbw {algbw:8.2f} GB/s  busbw {busbw:8.2f} GB/s")
    lines.append(f"verdict: {report['verdict']}")
    return lines


def default_output() -> str:
    out = os.environ.get("OUT")
    return os.path.join(out, "gpu-check.json") if out else "gpu-check.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/gpu-check.sh", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "output",
        nargs="?",
        default=default_output(),
        help="the JSON report (default $OUT/gpu-check.json, else ./gpu-check.json)",
    )
    parser.add_argument(
        "--python",
        default=sys.executable,
        help="the interpreter with TensorFlow and Horovod (default: this one)",
    )
    parser.add_argument(
        "--sizes-mib",
        default=",".join(map(str, DEFAULT_SIZES_MIB)),
        help="allreduce sizes in MiB (default %(default)s)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds each of the sweep and the elastic job may take (default %(default)s)",
    )
    parser.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run the sweep and the elastic job on the CPU (Gloo), to test this script where "
        "there is no GPU; the figures are then no GPU figures",
    )
    args = parser.parse_args(argv)
    report = check(args)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    for line in summary(report):
        print(f"gpu-check: {line}")
    code = 1 if report["failed"] else 0
    meaning = "a check failed" if code else "nothing that was checked failed"
    print(f"gpu-check: wrote {output} (exit {code}: {meaning})")
    return code


if __name__ == "__main__":
    sys.exit(main())
