"""Megatron-Core adapters: asymmetric NVFP4 QAT of expert weights (qat) and RAC calibration hooks (calibration)."""
