"""Rollout side: W4A4 NVFP4 expert GEMMs with RAC (torch reference), the MoE block, and RAC calibration."""
