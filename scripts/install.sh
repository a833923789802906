#!/usr/bin/env bash
# The one install path: README, Makefile, CI and the Dockerfile all run this script.
#   scripts/install.sh            cputrain and what training needs
#   scripts/install.sh dev        ... plus the test tools
#   scripts/install.sh dev,deepspeed
# It installs into $CPUTRAIN_VENV (default .venv) unless CPUTRAIN_VENV=none, in which case it
# installs into the current interpreter (the Docker image does that).
set -euo pipefail
extras="${1:-}"
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="${CPUTRAIN_VENV:-$here/.venv}"
python="${PYTHON:-python3}"

if [ "$venv" != "none" ]; then
  if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
  fi
  python="$venv/bin/python"
fi

# torch first and pinned: if another package pulled torch in, pip would take the default
# build with its CUDA libraries (several GB, useless on a CPU host). Where pip is not already
# set up to find a CPU wheel, point TORCH_INDEX_URL at PyTorch's CPU index, e.g.
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu scripts/install.sh
if ! "$python" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
  index_args=()
  if [ -n "${TORCH_INDEX_URL:-}" ]; then index_args=(--extra-index-url "$TORCH_INDEX_URL"); fi
  "$python" -m pip install --quiet "torch==2.13.0" "${index_args[@]}"
fi

# DeepSpeed ships as an sdist. In pip's isolated build environment its build would pull a
# second (CUDA) torch; built against the pinned CPU torch instead, with no ops compiled at
# install (DS_BUILD_OPS=0). The two ops the CPU path uses (CPU Adam for optimizer offload, the
# shared-memory collectives) are then built once here, so no training run waits for a compiler.
if [[ ",$extras," == *",deepspeed,"* ]] && ! "$python" -c 'import deepspeed' 2>/dev/null; then
  "$python" -m pip install --quiet setuptools wheel
  DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "$python" -m pip install --quiet --no-build-isolation "deepspeed>=0.16"
fi
if [[ ",$extras," == *",deepspeed,"* ]]; then  # cached after the first build: quick on re-runs
  # into this environment's own extensions folder, where cputrain's zero3 strategy looks (one per
  # environment: two venvs sharing ~/.cache/torch_extensions rebuild each other's ops in turn)
  prefix="$("$python" -c 'import sys; print(sys.prefix)')"
  if [ -w "$prefix" ]; then export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$prefix/torch_extensions}"; fi
  DS_ACCELERATOR=cpu "$python" - <<'PY' || echo "note: DeepSpeed CPU ops not prebuilt; they compile on first use"
from deepspeed.accelerator import get_accelerator
for op in ("CPUAdamBuilder", "ShareMemCommBuilder"):
    builder = get_accelerator().create_op_builder(op)
    if builder is not None and builder.is_compatible():
        builder.load(verbose=False)
PY
fi

spec="$here"
if [ -n "$extras" ]; then spec="$here[$extras]"; fi
"$python" -m pip install --quiet -e "$spec"
echo "cputrain installed in $("$python" -c 'import sys; print(sys.prefix)')"
