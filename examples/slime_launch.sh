#!/usr/bin/env bash
# slime (Megatron trainer + SGLang rollout, both in Ray actors) with QUADS.
#
# Trainer side: slime builds the Megatron model inside Ray actor processes, which never run
# quads_megatron.launch. Installing quads-megatron puts a startup hook in site-packages
# (quads_megatron_startup.pth): every Python process started with QUADS_CONFIG set applies QUADS
# as soon as it builds its first Megatron-Core MoE layer (processes that never build one, such as
# the SGLang engines, are left alone). So: install quads-megatron in the workers' environment and
# give the workers QUADS_CONFIG (an absolute path readable on every node) through the Ray runtime env.
# TIS composes: keep --use-tis (and --get-mismatch-metrics to watch the gap).
#
# Rollout side: the quads_nvfp4 SGLang method (W4A4 experts + RAC on Hopper), registered by the same
# install through SGLang's plugin entry point. slime passes SGLang server flags with a --sglang- prefix.
# The engines read the rollout section of the same QUADS_CONFIG. --hf-checkpoint is the NVFP4
# checkpoint written by `quads convert` (see convert_checkpoint.sh). --sglang-custom-weight-loader
# allows the quads_nvfp4 live-sync loader: weight updates must reach the engines as
# update_weights_from_tensor(..., load_format="quads_megatron.integrations.sglang.load_weights")
# (the trainer's megatron_expert_tensors, or BF16 expert weights it quantizes with the contract);
# check that your slime version's weight updater passes that load_format.
#
# verl: the same route; put QUADS_CONFIG in its Ray runtime env, e.g.
#   python -m verl.trainer.main_ppo ... +ray_kwargs.ray_init.runtime_env.env_vars.QUADS_CONFIG=/abs/quads.yaml
set -euo pipefail
SLIME=${SLIME:-/path/to/slime}
QUADS_CONFIG=$(realpath "${QUADS_CONFIG:-$(dirname "$0")/quads.yaml}")
RAY_ADDRESS=${RAY_ADDRESS:-http://127.0.0.1:8265}

# A Ray head started here (skip if the cluster is already up). Workers started by a `ray start`
# that already had QUADS_CONFIG exported inherit it as well; the runtime env below is explicit.
if [[ "${START_RAY:-1}" == 1 ]]; then
  ray start --head --disable-usage-stats
fi

RUNTIME_ENV_JSON="{\"env_vars\": {\"QUADS_CONFIG\": \"${QUADS_CONFIG}\"}}"

cd "$SLIME"
ray job submit --address="$RAY_ADDRESS" --runtime-env-json="$RUNTIME_ENV_JSON" -- \
  python3 train.py \
  --use-tis --get-mismatch-metrics \
  --sglang-quantization quads_nvfp4 \
  --sglang-custom-weight-loader quads_megatron.integrations.sglang.load_weights \
  "$@"
