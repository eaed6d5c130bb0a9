"""SGLang adapter: the ``quads_nvfp4`` quantization method and its live weight loader.

``register`` is the ``sglang.srt.plugins`` entry point; ``load_weights`` is the custom weight loader
(``--custom-weight-loader quads_megatron.integrations.sglang.load_weights``). Importing this package
imports SGLang.
"""

from quads_megatron.errors import QuadsSglangError
from quads_megatron.integrations.sglang.method import (
    METHOD,
    QuadsNvfp4Config,
    QuadsNvfp4MoEMethod,
    check_expert_params,
    check_version,
    register,
    unregister,
)
from quads_megatron.integrations.sglang.weight_sync import load_weights

__all__ = [
    "METHOD",
    "QuadsNvfp4Config",
    "QuadsNvfp4MoEMethod",
    "QuadsSglangError",
    "check_expert_params",
    "check_version",
    "load_weights",
    "register",
    "unregister",
]
