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
. dev/device/bare_env.sh "${1:-540}"
part cuda 25 env QUADS_ROUTING=fused python3 -m pytest -q -p no:cacheprovider tests/test_gpu_cuda.py -k "routing_with_row_tiles or test_mma_gemm"
tail -3 "$OUT/cuda.log"
part mma_tiles 45 python3 dev/probe_mma_tiles.py --tokens 16,64 --budget-s $((budget * 36 / 100)) --write-config
grep -E "^(fc|  fc|tokens|every|used)" "$OUT/mma_tiles.log"
cp src/quads_megatron/kernels/configs/mma_gemm.json "$OUT/"
part pieces 25 env QUADS_ROUTING=fused python3 dev/probe_block_pieces.py --tokens 16,64,256 --rac none --out "$OUT"
tail -8 "$OUT/pieces.log"
