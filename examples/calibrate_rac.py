"""Static RAC plans and ModelOpt input scales from a Megatron-Core model, for `quads convert`.

    python examples/calibrate_rac.py [OUT_DIR [QUADS_YAML]]

Runs on a CPU: builds a real megatron-core MoE layer (SwiGLU experts), feeds it a few calibration
batches with the hooks on, and writes rac_plans.safetensors, input_amax.json and
calibration_stats.safetensors to ./calib (or OUT_DIR). The QUADS config (QUADS_YAML, else
$QUADS_CONFIG, else examples/quads.yaml) gives the block statistic (rollout.rac.metric), the
compensated fraction (rollout.rac.ratio) and the activations' NVFP4 variant (nvfp4). In a real job,
wrap the script's own forward-only passes over representative prompts (after loading the
checkpoint, with or without quads_megatron.apply()) on every rank:

    from quads_megatron.config import load_config
    from quads_megatron.integrations.megatron.calibration import record_expert_inputs
    cfg = load_config("quads.yaml")
    with record_expert_inputs(model, config=cfg) as cal:   # model: the module or its pipeline chunks
        for batch in calibration_batches:
            forward_only(model, batch)
    cal = cal.merged()                                     # collective: every rank calls it
    if torch.distributed.get_rank() == 0:
        calibration.save_calibration(out, cal, cfg.rollout.rac.num_channels, num_moe_experts)

then convert with the plans embedded (the quads_nvfp4 method picks them up when the rollout config
says `rac: {selection: static}`), and static activation scales if the config asks for them:

    quads convert CKPT OUT --rac-plans calib/rac_plans.safetensors --quads-config quads.yaml \\
        [--input-amax calib/input_amax.json]
"""

import os
import sys

import torch

from quads_megatron.config import load_config
from quads_megatron.demo.cpu_megatron import (
    build_moe_layer,
    init_distributed,
    install_cpu_shims_for_megatron,
    moe_config,
)
from quads_megatron.integrations.megatron.calibration import record_expert_inputs
from quads_megatron.rollout import calibration


def main(out: str = "calib", config: str | None = None) -> dict[str, str]:
    config = config or os.environ.get("QUADS_CONFIG") or os.path.join(os.path.dirname(__file__), "quads.yaml")
    cfg = load_config(config)
    install_cpu_shims_for_megatron()
    init_distributed()
    experts = 4
    mcfg = moe_config(num_experts=experts, hidden=64, ffn=64, activation_func=torch.nn.functional.silu)
    layer = build_moe_layer(mcfg, layer_number=1)
    g = torch.Generator().manual_seed(0)
    with record_expert_inputs(layer, config=cfg) as cal:
        for _ in range(4):  # calibration batches: [sequence, batch, hidden]
            layer(torch.randn(32, 2, 64, generator=g) * torch.exp(torch.randn(64, generator=g)))
    cal = cal.merged()
    channels = cfg.rollout.rac.num_channels
    paths = calibration.save_calibration(out, cal, channels, experts)
    print(f"{config}: metric {cal.metric}, ratio {cfg.rollout.rac.ratio}")
    for name, plan in cal.plans(channels).items():
        print(f"{name}: {cal.tokens[name]} rows, amax {cal.amax[name]:.3g}, RAC blocks {plan.blocks.tolist()}")
    print("wrote", ", ".join(paths.values()))
    return paths


if __name__ == "__main__":
    main(*sys.argv[1:])
