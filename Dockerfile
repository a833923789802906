# The training image: CPU build of torch plus cputrain, installed by scripts/install.sh — the
# same script the README, the Makefile and CI run, so CI exercises these install steps.
#   docker build -t registry.example.com/cputrain:0.1.0 .
FROM python:3.11-slim

# numactl: core/NUMA placement of ranks; libjemalloc2: the allocator cputrain preloads for ranks.
RUN apt-get update \
 && apt-get install -y --no-install-recommends numactl libjemalloc2 \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/cputrain
COPY pyproject.toml README.md ./
COPY scripts/ scripts/
COPY cputrain/ cputrain/

# Into the image's interpreter (no venv), with torch from PyTorch's CPU index: no CUDA wheels.
ENV CPUTRAIN_VENV=none \
    TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1
RUN bash scripts/install.sh

RUN useradd --create-home --uid 1000 trainer
USER trainer
# The manifests of `cputrain k8s` give the command: cputrain train /config/train.yaml
CMD ["cputrain", "--help"]
