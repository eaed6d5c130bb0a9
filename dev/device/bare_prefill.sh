#!/usr/bin/env bash
# On a bare GPU machine (its own torch, Triton and pytest; no install, no carry): the routing at prefill sizes
# and the activation quantization's two-piece row, checked and timed in one call from this checkout's src/.
# Usage: bash dev/device/bare_prefill.sh [SECONDS] (default 540; each part gets its share and a timeout, so
# what finished comes back in $OUT):
#   cuda.log    tests/test_gpu_cuda.py -k "chunked or two_pieces" (the chunked routing on the GPU's histogram
#               and sort, the block on it and on the torch routing, the two-piece row)
#   route.log   dev/probe_route_chunked.py (pairs per chunk vs the one-launch and the torch routing)
#   block.log   benchmarks/bench_moe_block.py --tokens 1024,4096,16384, our arms only (no SGLang here):
#               the routing and two-piece-row A/B arms next to ours (moe_block.json / .md)
#   pieces.log  dev/probe_block_pieces.py --tokens 4096,16384 --rac none (every routing path timed;
#               block_pieces.json)
#   act.log     dev/probe_act_quant_tiles.py --rows 2048,16384,131072 --inputs fc2 (the two-piece row's A/B)
set -u
cd "$(dirname "$0")/../.."
. dev/device/bare_env.sh "${1:-540}"
part cuda 18 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_cuda.py -k "chunked or two_pieces"
tail -3 "$OUT/cuda.log"
part route 20 python3 dev/probe_route_chunked.py
cat "$OUT/route.log"
part block 30 python3 benchmarks/bench_moe_block.py --tokens 1024,4096,16384 \
  --arms ours,ours_rac50,ours_torch_route,ours_other_routing,ours_whole_row --out "$OUT"
grep -E "PASS|FAIL|times" "$OUT/block.log"
part pieces 17 python3 dev/probe_block_pieces.py --tokens 4096,16384 --rac none --out "$OUT"
tail -4 "$OUT/pieces.log"
part act 15 python3 dev/probe_act_quant_tiles.py --rows 2048,16384,131072 --inputs fc2
tail -12 "$OUT/act.log"
