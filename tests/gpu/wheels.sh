#!/usr/bin/env bash
# Fetch, on a machine with pip's index, the wheels the GPU checks carry to a machine without
# one: flash-linear-attention's core (fla-core; pure Python over Triton and einops, which the GPU
# machine has), for the chunk_rwkv7 timing beside ours. Saved in .whl/ (ignored by git);
# tests/gpu/run.sh installs what it finds there.
set -euo pipefail
cd "$(dirname "$0")/../.." || exit 2
python3 -m pip download --no-deps --only-binary=:all: -d .whl "fla-core==0.6.0"
