#!/usr/bin/env bash
# On a bare GPU machine (its own torch, Triton and pytest; no install, no carry): the decode path's GPU checks
# and probes in one call, from this checkout's src/. Usage: bash dev/device/bare_decode.sh [SECONDS]
# (default 540; each part gets its share and a timeout, so what finished comes back in $OUT):
#   cuda.log       tests/test_gpu_cuda.py -k "routing_with_row_tiles or test_mma_gemm" with QUADS_ROUTING=fused
#                  (the fused routing's GPU histogram; the decode-size GEMM on every tile, tiled weights
#                  included; the wgmma GEMM's test compiles ~35 tiles, too long for this share)
#   mma_tiles.log  dev/probe_mma_tiles.py --tokens 16,64 --write-config (tiles, weights_first, tiled A/B);
#                  mma_gemm.json: the rewritten configs/mma_gemm.json, to copy into the checkout
#   pieces.log     dev/probe_block_pieces.py --tokens 16,64,256 --rac none with QUADS_ROUTING=fused (both
#                  first launches timed; block_pieces.json), on the tiles just written
set -u
cd "$(dirname "$0")/../.."
export TRITON_INTERPRET=0 PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
budget=${1:-540}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/gpu.txt"
part() { local name=$1 share=$2; shift 2; local t0; t0=$(date +%s)
  timeout $((budget * share / 100)) "$@" > "$OUT/$name.log" 2>&1; echo "$name: rc $? in $(( $(date +%s) - t0 )) s"; }
part cuda 25 env QUADS_ROUTING=fused python3 -m pytest -q -p no:cacheprovider tests/test_gpu_cuda.py -k "routing_with_row_tiles or test_mma_gemm"
tail -3 "$OUT/cuda.log"
part mma_tiles 45 python3 dev/probe_mma_tiles.py --tokens 16,64 --budget-s $((budget * 36 / 100)) --write-config
grep -E "^(fc|  fc|tokens|every|used)" "$OUT/mma_tiles.log"
cp src/quads_megatron/kernels/configs/mma_gemm.json "$OUT/"
part pieces 25 env QUADS_ROUTING=fused python3 dev/probe_block_pieces.py --tokens 16,64,256 --rac none --out "$OUT"
tail -8 "$OUT/pieces.log"
