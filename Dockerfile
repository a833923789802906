# The training image: CPU build of torch plus cputrain, installed by scripts/install.sh — the
# same script the README, the Makefile and CI run, so CI exercises these install steps.
#   docker build -t registry.example.com/cputrain:0.1.0 .
#   docker build --build-arg CPUTRAIN_EXTRAS=deepspeed -t registry.example.com/cputrain-deepspeed:0.1.0 .
FROM python:3.11-slim

# The extras of scripts/install.sh: empty, or "deepspeed" for parallel.strategy=zero3.
ARG CPUTRAIN_EXTRAS=""

# numactl: core/NUMA placement of ranks; libgoogle-perftools4: tcmalloc, the allocator cputrain
# preloads into its ranks (hardware.allocator=auto; measured faster than glibc and jemalloc).
# With DeepSpeed, g++: its CPU ops (CPU Adam, shared-memory collectives) are C++ built on the host.
RUN apt-get update \
 && apt-get install -y --no-install-recommends numactl libgoogle-perftools4 \
    $(case ",${CPUTRAIN_EXTRAS}," in *,deepspeed,*) echo g++ libc6-dev ;; esac) \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/cputrain
COPY pyproject.toml README.md ./
COPY scripts/ scripts/
COPY cputrain/ cputrain/

# Into the image's interpreter (no venv), with torch from PyTorch's CPU index: no CUDA wheels.
# TORCH_EXTENSIONS_DIR: DeepSpeed's ops, built once by install.sh, where the run's user finds them.
ENV CPUTRAIN_VENV=none \
    TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
    TORCH_EXTENSIONS_DIR=/opt/torch_extensions \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1
RUN bash scripts/install.sh "${CPUTRAIN_EXTRAS}" && mkdir -p /opt/torch_extensions && chmod -R a+rwX /opt/torch_extensions

RUN useradd --create-home --uid 1000 trainer
USER trainer
# The manifests of `cputrain k8s` give the command: cputrain train /config/train.yaml
CMD ["cputrain", "--help"]
