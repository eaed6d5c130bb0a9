"""`quads rl`: GRPO on Megatron-Core MoE with a colocated SGLang rollout, BF16 vs naive NVFP4 vs QUADS.

spec (arms, study settings), task (verifiable synthetic tasks), grpo (loss and metrics), megatron_model
(GPTModel builders and HF mapping), trainer (Megatron trainer, SFT and GRPO steps), rollout (the SGLang
engine and the live sync), emulate (a CPU stand-in for the engine), attribution (per-layer gap), runs
(run directory, checkpoints, time budget), study (the arms in order, resumable), report (tables, plots).
Importing this package imports neither megatron nor sglang.
"""
