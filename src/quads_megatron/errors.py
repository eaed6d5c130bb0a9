"""Every error quads_megatron raises on purpose derives from QuadsError.

Catch QuadsError to handle any of them; catch the narrower class to handle one kind. Classes that
describe a bad value also derive from ValueError, so code written against the standard exceptions
keeps working. Wrong argument types or values passed by a programmer raise plain TypeError/ValueError.
"""

from __future__ import annotations


class QuadsError(Exception):
    """Base of every quads_megatron error."""


class NVFP4InputError(QuadsError, ValueError):
    """A tensor cannot be quantized to NVFP4: non-finite values, bad shape or dtype."""


class RACPlanError(QuadsError, ValueError):
    """A RAC selection (static plan, dynamic channel count) or calibration record that does not fit its GEMM."""


class QuadsConfigError(QuadsError, ValueError):
    """A QUADS config value or key is invalid; the message names the dotted key."""


class ConvertError(QuadsError, ValueError):
    """A checkpoint conversion cannot proceed; nothing is published at the destination."""


class MappingError(ConvertError):
    """A Megatron tensor the HF name mapping does not know (or cannot split)."""


class DistCheckpointError(ConvertError):
    """Not a readable Megatron-Core torch_dist checkpoint, or a tensor missing from it."""


class QuadsPatchError(QuadsError, RuntimeError):
    """The installed Megatron-Core (or the model) cannot be patched or calibrated safely."""


class QuadsSglangError(QuadsError, ValueError):
    """A checkpoint, config, weight update or SGLang version the quads_nvfp4 method cannot serve."""


class KernelConfigError(QuadsError, ValueError):
    """A kernel tile configuration that the kernels cannot run (bad data file or override)."""
