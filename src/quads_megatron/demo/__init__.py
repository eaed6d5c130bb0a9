"""The CPU RL demo (``quads demo``): BF16 vs naive NVFP4 vs QUADS rollout on a tiny Megatron MoE."""
