#!/usr/bin/env bash
# The GPU checks: run on a machine with a CUDA GPU, CuPy and nvcc (MLX not needed), from anywhere:
#   bash tests/gpu/run.sh [extra pytest args]
# Prints the device, then runs tests/gpu/ (WKV7 and MoBA: oracle checks, then timings); with
# $OUT set, the output is also saved to $OUT/gpu_tests.log. Wheels in .whl/ (tests/gpu/wheels.sh
# fetches them where pip can: flash-linear-attention for the peer timing) are installed first,
# into a folder of their own.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
if compgen -G ".whl/*.whl" >/dev/null; then
    python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/mlx_rwkvx_gpu_site .whl/*.whl && export PYTHONPATH="/tmp/mlx_rwkvx_gpu_site${PYTHONPATH:+:$PYTHONPATH}"
fi
log=/dev/null
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT" && log="$OUT/gpu_tests.log"
fi
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not found"
    python -c "import cupy; print('cupy', cupy.__version__)" 2>/dev/null || echo "cupy: not importable"
    python -m pytest tests/gpu -m gpu -v -s -p no:cacheprovider "$@"
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
