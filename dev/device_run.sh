#!/usr/bin/env bash
# One device call: Python 3.12 + megatron-core 0.19.2 (carried wheel in .whl/) test suite with CUDA
# hidden (the CPU path), then GPU bit-identity checks and the W4A4 MoE benchmark. Writes to $OUT.
# Env: SKIP_TESTS=1, SKIP_CPU_SUITE=1 (CUDA tests only), SKIP_BENCH=1, TEST_TIMEOUT, GPU_TEST_TIMEOUT, BENCH_TIMEOUT,
# BENCH_ARGS.
set -u
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# the package as a plain directory (src/quads_megatron, its kernels' configs/*.json included): the
# device's offline pip cannot be relied on for an install
R=$PWD P=/tmp/quads_pkg
rm -rf $P && mkdir -p $P && cp -r src/quads_megatron $P/ && cp -r benchmarks $P/benchmarks || exit 1
export PYTHONPATH=$P:/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import megatron.core, torch, triton; print('megatron-core', megatron.core.__version__, 'torch', torch.__version__, 'triton', triton.__version__)"
cd /tmp  # import from $P, not from the checkout
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # the CPU paths (CUDA hidden), then the CUDA-only tests (patches on CUDA tensors, MoE block, graph capture)
  if [ "${SKIP_CPU_SUITE:-0}" != 1 ]; then
    CUDA_VISIBLE_DEVICES= timeout "${TEST_TIMEOUT:-400}" python3 -m pytest -q -p no:cacheprovider -p no:warnings $R/tests 2>&1 | tail -25 > "$OUT/pytest_py312_mcore.txt"
    tail -5 "$OUT/pytest_py312_mcore.txt"
  fi
  TRITON_INTERPRET=0 timeout "${GPU_TEST_TIMEOUT:-400}" python3 -m pytest -q -rs -p no:cacheprovider -p no:warnings $R/tests/test_gpu_cuda.py 2>&1 | tail -40 > "$OUT/pytest_gpu_cuda.txt"
  tail -8 "$OUT/pytest_gpu_cuda.txt"
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  TRITON_INTERPRET=0 timeout "${BENCH_TIMEOUT:-420}" python3 $P/benchmarks/bench_moe_w4a4.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tail -60
fi
