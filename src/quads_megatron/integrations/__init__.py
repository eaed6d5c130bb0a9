"""Thin adapters onto host libraries: Megatron-Core (trainer QAT, calibration hooks) and SGLang (rollout)."""
