#!/usr/bin/env bash
# What the benchmark suite needs beyond `make setup`: Open MPI (the distribution's packages, for
# the MPI comparison) and, in the project's virtual environment, mpi4py built against it and
# matplotlib (bench/requirements.txt). Idempotent: a second run checks and returns in seconds.
# Without root or apt it says what to install and carries on: the suite then reports MPI as
# not measured.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
say() { printf '[setup-bench] %s\n' "$*"; }
pip=("$VENV/bin/python" -m pip --disable-pip-version-check --quiet)

if command -v mpirun >/dev/null 2>&1 && command -v mpicc >/dev/null 2>&1; then
  say "Open MPI: $(mpirun --version 2>/dev/null | head -1)"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  say "installing Open MPI from the distribution (openmpi-bin libopenmpi-dev)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q openmpi-bin libopenmpi-dev >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null && apt-get install -y -q openmpi-bin libopenmpi-dev >/dev/null; }
else
  say "warning: no mpirun/mpicc and no root with apt-get: install Open MPI (Debian/Ubuntu:"
  say "  'sudo apt-get install openmpi-bin libopenmpi-dev') and rerun; the suite skips MPI meanwhile"
fi

"${pip[@]}" install -c constraints.txt "$(grep '^matplotlib==' bench/requirements.txt)"
mpi4py_pin=$(grep '^mpi4py==' bench/requirements.txt)
if "$VENV/bin/python" -c "import mpi4py, sys; sys.exit(0 if mpi4py.__version__ == '${mpi4py_pin#mpi4py==}' else 1)" 2>/dev/null; then
  say "mpi4py ${mpi4py_pin#mpi4py==} is installed"
elif command -v mpicc >/dev/null 2>&1; then
  say "building $mpi4py_pin against $(command -v mpicc) (about a minute the first time)"
  "${pip[@]}" install --no-binary mpi4py "$mpi4py_pin"
else
  say "warning: no mpicc: mpi4py not installed; the suite reports MPI as not measured"
fi
say "done"
