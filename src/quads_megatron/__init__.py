"""quads_megatron: NVFP4 RL for Megatron-Core MoE (QUADS: asymmetric QAT + RAC rollout).

Trainer side, one line in an existing Megatron RL script (before the model is built)::

    import quads_megatron; quads_megatron.apply("quads.yaml")

or without editing the script: ``QUADS_CONFIG=quads.yaml torchrun ... -m quads_megatron.launch train.py ...``,
or, where workers build the model (slime, verl: Ray actors), with QUADS_CONFIG=/abs/quads.yaml in
the workers' environment: the installed startup hook (quads_megatron._startup) applies it there.

Importing this package imports neither torch nor megatron (the startup hook relies on that).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quads_megatron.config import QuadsConfig

__version__ = "0.1.0"
__all__ = ["apply", "remove", "is_applied", "QuadsConfig", "QuadsConfigError", "load_config", "__version__"]
_FROM_CONFIG = ("QuadsConfig", "QuadsConfigError", "load_config")


def __getattr__(name: str) -> Any:
    if name in _FROM_CONFIG:
        from quads_megatron import config

        return getattr(config, name)
    raise AttributeError(f"module 'quads_megatron' has no attribute {name!r}")


def apply(
    config: QuadsConfig | dict[str, Any] | str | os.PathLike[str] | None = None, model: Any = None
) -> QuadsConfig:
    """Patch Megatron-Core MoE experts for asymmetric NVFP4 QAT (idempotent).

    config: QuadsConfig, dict, YAML path, or None (then $QUADS_CONFIG, else defaults).
    model: optional module (or list of chunks) built before apply(), to tag its MoE layers; a MoE
        layer built before apply() and not passed here refuses to run (QuadsPatchError).
    """
    from quads_megatron import fake_quant
    from quads_megatron.config import load_config
    from quads_megatron.integrations.megatron import qat as megatron_core

    if config is None and os.environ.get("QUADS_CONFIG"):
        config = os.environ["QUADS_CONFIG"]
    cfg = load_config(config)
    megatron_core.apply(cfg, model)
    fake_quant.install_optimizer_hook()
    fake_quant.mark_weights_updated()
    return cfg


def remove() -> None:
    """Undo apply(): original Megatron-Core classes, no optimizer hook, empty QDQ cache."""
    from quads_megatron import fake_quant
    from quads_megatron.integrations.megatron import qat as megatron_core

    megatron_core.remove()
    fake_quant.remove_optimizer_hook()
    fake_quant.clear_cache()


def is_applied() -> bool:
    from quads_megatron.integrations.megatron import qat as megatron_core

    return megatron_core.is_applied()
