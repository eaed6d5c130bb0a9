#!/usr/bin/env bash
# Megatron RL (megatron/rl, examples/rl) with QUADS asymmetric NVFP4 QAT on the MoE experts.
# Nothing in Megatron-LM is edited: quads_megatron.launch applies the patches, then runs the
# script exactly as torchrun would. Keep your usual arguments; the mismatch correction flags
# (--rl-inference-logprobs-is-correction, --rl-importance-sampling-truncation-coef) compose.
set -euo pipefail
MEGATRON_LM=${MEGATRON_LM:-/path/to/Megatron-LM}
export QUADS_CONFIG=${QUADS_CONFIG:-$(dirname "$0")/quads.yaml}
torchrun --nproc-per-node "${GPUS:-8}" -m quads_megatron.launch \
  "$MEGATRON_LM/train_rl.py" \
  --expert-model-parallel-size 8 --moe-grouped-gemm \
  --rl-inference-logprobs-is-correction --rl-importance-sampling-truncation-coef 2.0 \
  "$@"
