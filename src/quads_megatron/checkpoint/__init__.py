"""Checkpoints: HF and Megatron-Core dist checkpoints to NVFP4 (ModelOpt layout), and live sync tensors.

hf.convert_hf / megatron.convert_megatron_dist write a checkpoint directory; live_sync turns a running
trainer's expert parameters into the same tensors for an engine's weight update; modelopt holds the
names, tensors and configs both share; output (with ownership) is the checked, locked, resumable
output directory both write through; calibration_inputs reads and checks --input-amax, --rac-plans and
the rollout settings.
"""

from quads_megatron.checkpoint.calibration_inputs import load_input_amax, load_rac_plans, quads_extras
from quads_megatron.checkpoint.hf import convert_hf, verify_conversion
from quads_megatron.checkpoint.live_sync import bucketed, flat_buckets, gather_expert_tp, megatron_expert_tensors
from quads_megatron.checkpoint.megatron import convert_megatron_dist
from quads_megatron.checkpoint.modelopt import INDEX, UNCALIBRATED_INPUT_SCALE, ConvertOptions
from quads_megatron.errors import ConvertError

__all__ = [
    "INDEX",
    "UNCALIBRATED_INPUT_SCALE",
    "ConvertError",
    "ConvertOptions",
    "bucketed",
    "convert_hf",
    "convert_megatron_dist",
    "flat_buckets",
    "gather_expert_tp",
    "load_input_amax",
    "load_rac_plans",
    "megatron_expert_tensors",
    "quads_extras",
    "verify_conversion",
]
