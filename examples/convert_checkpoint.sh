#!/usr/bin/env bash
# HF BF16 checkpoint -> NVFP4 ModelOpt layout (experts only), with the trainer's exact scales.
#   convert_checkpoint.sh SRC_HF_DIR DST_DIR [CALIB_DIR]
# --verify re-reads the output and checks every tensor bit for bit against the contract before it
# is published (DST appears only then, by one rename). Interrupted (Ctrl-C, exit 130)? Run the same
# command again: finished shards in DST.partial are re-checked (size, sha256) and kept. Exit 3 means
# an input or the destination was refused (one line on stderr says which); nothing was changed.
# CALIB_DIR (optional): what examples/calibrate_rac.py writes; with it the checkpoint carries
# calibrated input scales and static RAC plans (needs rollout.rac.selection: static in quads.yaml).
set -euo pipefail
SRC=${1:?usage: convert_checkpoint.sh SRC_HF_DIR DST_DIR [CALIB_DIR]}
DST=${2:?usage: convert_checkpoint.sh SRC_HF_DIR DST_DIR [CALIB_DIR]}
CALIB=${3:-}
if [[ -n "$CALIB" ]]; then
  quads convert "$SRC" "$DST" --verify \
    --input-amax "$CALIB/input_amax.json" \
    --rac-plans "$CALIB/rac_plans.safetensors" --quads-config "$(dirname "$0")/quads.yaml"
else
  # no calibration: every quantized linear gets input_scale 1.0 (for stock loaders; quads_nvfp4 uses
  # dynamic per-token activation scales) and the rollout selects RAC channels dynamically
  quads convert "$SRC" "$DST" --verify
fi
# SGLang with the QUADS plugin (W4A4 + RAC on sm_80+; --quantization may be left out when the
# configs carry a `quads` block, i.e. with CALIB_DIR):
#   python -m sglang.launch_server --model-path "$DST" --quantization quads_nvfp4
# Stock SGLang reads it with its ModelOpt NVFP4 loader (native FP4 needs Blackwell, sm_100+):
#   python -m sglang.launch_server --model-path "$DST" --quantization modelopt_fp4
