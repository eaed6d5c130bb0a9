#!/usr/bin/env bash
# HF BF16 checkpoint -> NVFP4 ModelOpt layout (experts only), with the trainer's exact scales.
# --verify re-reads the output and checks every tensor bit for bit against the contract.
set -euo pipefail
SRC=${1:?usage: convert_checkpoint.sh SRC_HF_DIR DST_DIR}
DST=${2:?usage: convert_checkpoint.sh SRC_HF_DIR DST_DIR}
quads convert "$SRC" "$DST" --verify
# Stock SGLang reads it with its ModelOpt NVFP4 loader (native FP4 needs Blackwell, sm_100+):
#   python -m sglang.launch_server --model-path "$DST" --quantization modelopt_fp4
