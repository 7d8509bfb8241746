#!/usr/bin/env bash
# What a machine with NVIDIA GPUs can do for elastic-allreduce, with no network: the driver and
# GPUs (nvidia-smi), Python, whether TensorFlow and Horovod with NCCL import; where they do, an
# NCCL allreduce bus-bandwidth sweep with Horovod and one elastic kill-and-recover on the GPUs.
# Every figure goes to a JSON report; what could not be checked is said, with the reason.
#
#   scripts/gpu-check.sh [REPORT.json] [--python PY] [--sizes-mib 1,4,16,64,256] [--timeout S]
#                        [--cpu-dry-run]   (--help: what each does)
#
# REPORT defaults to $OUT/gpu-check.json where $OUT is set, else ./gpu-check.json. The Python
# used is $PYTHON, else this checkout's .venv, else python3.11 or python3 from PATH; the
# checkout's packages need not be installed (they are put on PYTHONPATH). Exit code: 0 when
# nothing that was checked failed (including when nothing could be checked), 1 when a check
# failed. scripts/gpu_check.py does the work; docs/gpu.md explains the figures.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

python=""
for candidate in "${PYTHON:-}" "$root/.venv/bin/python" python3.11 python3; do
  if [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 &&
    "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
    python=$candidate
    break
  fi
done

if [ -z "$python" ]; then
  report=${1:-${OUT:+$OUT/gpu-check.json}}
  report=${report:-gpu-check.json}
  echo "gpu-check: no Python >= 3.10 here (set PYTHON): nothing could be checked" >&2
  printf '{"schema": "elastic-allreduce/gpu-check/1", "verdict": "not checked: no Python >= 3.10", "not_checked": ["everything: no Python >= 3.10"], "failed": []}\n' >"$report"
  exit 0
fi

exec "$python" "$root/scripts/gpu_check.py" --python "$python" "$@"
