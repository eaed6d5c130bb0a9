#!/usr/bin/env bash
# On a bare GPU machine (its own torch, Triton and pytest; no install, no carry): the activation quantization of
# 2026-12-08 (dynamic RAC on a row in two pieces, docs/kernel-notes.md v35) checked, then timed at prefill sizes
# before and after its tile sweep, in one call from this checkout's src/. Usage: bash dev/device/bare_rac.sh
# [SECONDS] (default 540; each part gets its share and a timeout, so what finished comes back in $OUT):
#   cuda.log           tests/test_gpu_cuda.py -k "two_pieces or triton_matches_reference or fused_block_pieces or
#                      four_over_six" (the two-piece row at 1 / 2 / 4 warps in three RAC modes, the block against
#                      the reference, the fused pieces, 4over6: the shipped tiles' code changed too)
#   pieces_before.log  dev/probe_block_pieces.py --tokens 4096,16384 --rac none,dyn50 on the shipped tiles
#                      (before/block_pieces.json)
#   act_tiles.log      dev/probe_act_quant_tiles.py --inputs both --rows 2048,16384,131072 --block-m 1,2
#                      --warps 1,2,4 --write-config (split_row swept); act_quant.json: the rewritten
#                      configs/act_quant.json, to copy into the checkout
#   pieces_after.log   the pieces again on the tiles just written (after/block_pieces.json)
set -u
cd "$(dirname "$0")/../.."
. dev/device/bare_env.sh "${1:-540}"
part cuda 28 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_cuda.py \
  -k "two_pieces or triton_matches_reference or fused_block_pieces or four_over_six"
tail -3 "$OUT/cuda.log"
part pieces_before 16 python3 dev/probe_block_pieces.py --tokens 4096,16384 --rac none,dyn50 --out "$OUT/before"
tail -4 "$OUT/pieces_before.log" | cut -c1-400
part act_tiles 38 python3 dev/probe_act_quant_tiles.py --inputs both --rows 2048,16384,131072 --block-m 1,2 \
  --warps 1,2,4 --write-config
grep -E "^fc|rule|written" "$OUT/act_tiles.log"
cp src/quads_megatron/kernels/configs/act_quant.json "$OUT/"
part pieces_after 16 python3 dev/probe_block_pieces.py --tokens 4096,16384 --rac none,dyn50 --out "$OUT/after"
tail -4 "$OUT/pieces_after.log" | cut -c1-400
