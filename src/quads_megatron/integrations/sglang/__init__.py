"""SGLang adapter: the ``quads_nvfp4`` quantization method and its live weight loader.

``register`` is the ``sglang.srt.plugins`` entry point; ``load_weights`` is the custom weight loader
(``--custom-weight-loader quads_megatron.integrations.sglang.load_weights``), which checks a whole update
(check_update) before its first write. compat.py keeps what differs between the supported SGLang
versions. Importing this package imports SGLang.
"""

from quads_megatron.errors import QuadsSglangError
from quads_megatron.integrations.sglang.method import (
    METHOD,
    QuadsNvfp4Config,
    QuadsNvfp4MoEMethod,
    check_device,
    check_expert_params,
    check_input_scales,
    check_version,
    register,
    unregister,
)
from quads_megatron.integrations.sglang.weight_sync import check_update, load_weights

__all__ = [
    "METHOD",
    "QuadsNvfp4Config",
    "QuadsNvfp4MoEMethod",
    "QuadsSglangError",
    "check_device",
    "check_expert_params",
    "check_input_scales",
    "check_update",
    "check_version",
    "load_weights",
    "register",
    "unregister",
]
