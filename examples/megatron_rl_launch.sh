#!/usr/bin/env bash
# Megatron RL (megatron/rl, examples/rl) with QUADS asymmetric NVFP4 QAT on the MoE experts.
# Nothing in Megatron-LM is edited: quads_megatron.launch applies the patches, then runs the
# script exactly as `python train_rl.py` would (its directory first on sys.path, __file__, argv).
# Keep your usual arguments; the mismatch correction flags
# (--rl-inference-logprobs-is-correction, --rl-importance-sampling-truncation-coef) compose.
#
# Two ways, pick one:
#  * the launcher (below): torchrun starts every rank through quads_megatron.launch;
#  * the startup hook: with quads-megatron installed, any process started with QUADS_CONFIG set
#    applies QUADS when it builds its first MoE layer, so plain `torchrun ... train_rl.py` works too
#    (this is the route for launchers that build the model in other processes, e.g. Ray workers:
#    see slime_launch.sh).
# Megatron settings QUADS refuses with a clear error: the TE op fuser, delay_wgrad_compute /
# overlap_dispatch_backward_with_experts_wgrad without --gradient-accumulation-fusion,
# moe_single_grouped_weight, Megatron-FSDP.
set -euo pipefail
MEGATRON_LM=${MEGATRON_LM:-/path/to/Megatron-LM}
export QUADS_CONFIG=$(realpath "${QUADS_CONFIG:-$(dirname "$0")/quads.yaml}")
torchrun --nproc-per-node "${GPUS:-8}" -m quads_megatron.launch \
  "$MEGATRON_LM/train_rl.py" \
  --expert-model-parallel-size 8 --moe-grouped-gemm \
  --rl-inference-logprobs-is-correction --rl-importance-sampling-truncation-coef 2.0 \
  "$@"
