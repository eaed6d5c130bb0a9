#!/usr/bin/env bash
# The `quads rl` study on one H200: a Megatron-Core MoE (TE spec, TEGroupedMLP) trained with GRPO, an SGLang
# engine on the same GPU synced every step; arms bf16, naive NVFP4, QUADS, the RAC sweep and naive + TIS
# (docs/rl.md). Runs in pieces of 8 minutes (--budget-s 480; a stage that overruns it is stopped within 30 s
# more), each resuming from the last checkpoint, until done.
#   bash examples/rl_h200.sh [DIR] [quads rl arguments...]     e.g. bash examples/rl_h200.sh runs/rl --arms main
# The studies measured on an H100 (2026-12-06): the 2-layer model (dev/results/rl_summary_2026-12-06_h100_add4_main/)
#   bash examples/rl_h200.sh runs/rl_main --model smoke --arms main --digits 4 --steps 200 --lr 2e-4
# and the default 108M model, all arms learning (dev/results/rl_summary_2026-12-06_h100_108m_add4_lr1e-4/)
#   bash examples/rl_h200.sh runs/rl_108m --arms main,bf16@5e-5 --digits 4 --steps 300 --lr 1e-4
# Without a GPU: quads rl --out runs/rl_dry --dry-run (a tiny model and a CPU stand-in for the engine).
set -uo pipefail
OUT=${1:-runs/rl_h200}
shift || true
while true; do
  quads rl --out "$OUT" --budget-s 480 "$@"
  rc=$?
  [ "$rc" -eq 75 ] || break   # 75: stopped at the budget with work left
done
echo "summary: $OUT/summary/rl_summary.md (exit $rc)"
exit "$rc"
