#!/usr/bin/env bash
# Serve a QUADS NVFP4 checkpoint with SGLang (quads_nvfp4 method: W4A4 experts + RAC on Hopper).
# Installing quads-megatron in the server's environment registers the method (sglang.srt.plugins).
set -euo pipefail
MODEL=${1:?usage: sglang_serve.sh /path/to/out-nvfp4 [extra sglang args]}
shift
# Optional: the trainer's YAML overrides the checkpoint's rollout settings (RAC ratio/selection).
# export QUADS_CONFIG=examples/quads.yaml
python -m sglang.launch_server \
  --model-path "$MODEL" \
  --quantization quads_nvfp4 \
  --custom-weight-loader quads_megatron.integrations.sglang.load_weights \
  "$@"
