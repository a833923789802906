#!/usr/bin/env bash
# tcmalloc (gperftools' minimal build) from the distribution's packages: the allocator
# hardware.allocator=auto preloads into every rank where it is installed. On a sharded rank it is
# most of the speed (fsdp and zero3 free and allocate every gathered block again each micro-batch;
# glibc maps and zeroes those pages each time): docs/benchmarks/network.md, block sharded_rank.
# `make install` runs it; the training image installs the same library (Dockerfile). Without root
# or apt-get it says so and installs nothing: cputrain then runs on glibc and `cputrain doctor`
# names the package.
set -euo pipefail
for dir in /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64 /usr/lib; do
  if compgen -G "$dir/libtcmalloc*.so*" >/dev/null; then exit 0; fi
done
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "note: tcmalloc not installed (needs root and apt-get: apt-get install libtcmalloc-minimal4); cputrain runs on glibc"
  exit 0
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libtcmalloc-minimal4 >/dev/null
echo "installed: $(ls /usr/lib/*/libtcmalloc_minimal.so.4 2>/dev/null | head -1)"
