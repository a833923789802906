#!/usr/bin/env bash
# MPICH and Open MPI from the distribution's packages, for the tests that start cputrain with a
# real mpirun (tests/distributed/test_launch_modes.py). CI runs it before `make test`. Without
# root or apt-get it says so and installs nothing: those tests then skip with a reason.
set -euo pipefail
if command -v mpiexec.hydra >/dev/null && command -v mpirun.openmpi >/dev/null; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "note: MPICH and Open MPI not installed (needs root and apt-get); the real-mpirun tests will skip"
  exit 0
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mpich openmpi-bin >/dev/null
echo "installed: $(mpiexec.hydra --version | sed -n 's/ *Version: *//p' | head -1) (MPICH), $(mpirun.openmpi --version | head -1)"
