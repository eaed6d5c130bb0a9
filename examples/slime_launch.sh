#!/usr/bin/env bash
# slime (Megatron trainer + SGLang rollout) with QUADS on the trainer side. slime's own training
# entry point is run through quads_megatron.launch, so no patch file is applied to Megatron.
# TIS composes: keep --use-tis (and --use-rollout-logprobs / --get-mismatch-metrics to watch the gap).
set -euo pipefail
SLIME=${SLIME:-/path/to/slime}
export QUADS_CONFIG=${QUADS_CONFIG:-$(dirname "$0")/quads.yaml}
python -m quads_megatron.launch "$SLIME/train.py" \
  --use-tis --get-mismatch-metrics \
  "$@"
# Rollout side: serve an NVFP4 checkpoint made by `quads convert` (see convert_checkpoint.sh).
# The quads_nvfp4 SGLang plugin (W4A4 + RAC on Hopper, in-place weight sync) is not built yet;
# until then stock SGLang loads the same checkpoint with its modelopt_fp4 method (Blackwell).
