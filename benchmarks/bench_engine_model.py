"""The model of bench_engine.py: a random Qwen3-MoE checkpoint written straight to safetensors (one shard
per decoder layer), its `quads convert` output with static RAC plans and input scales calibrated on random
hidden states, and the folders each quads arm serves (the converted tensors symlinked, the quantization
config selecting the arm's rollout settings; optionally only the first layers).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import bench_env

QUADS_ARMS = ("quads_off", "quads_dyn", "quads_dyn_rows", "quads_static")
_DYN = {"activation_scale": "dynamic", "rac": {"enabled": True, "ratio": 0.5, "selection": "dynamic"}}
ROLLOUT = {  # each quads arm's rollout section (quads_megatron.config); weight_layout auto (tiled) unless named
    "quads_off": {"activation_scale": "dynamic", "rac": {"enabled": False}},
    "quads_dyn": _DYN,
    "quads_dyn_rows": {**_DYN, "weight_layout": "row_major"},  # the A/B of the tiled expert weights
    "quads_static": {"activation_scale": "static", "rac": {"enabled": True, "ratio": 0.5, "selection": "static"}},
}
SHAPE = {"hidden": 2048, "moe_inter": 768, "experts": 128, "topk": 8, "heads": 32, "kv_heads": 4, "head_dim": 128}
TINY = {"hidden": 256, "moe_inter": 128, "experts": 8, "topk": 2, "heads": 4, "kv_heads": 2, "head_dim": 64}
DONE = ".quads_bench_complete"


# ----------------------------------------------------------------------------- the model


def model_config(layers: int, vocab: int, shape: dict) -> dict:
    """config.json of a Qwen3MoeForCausalLM of these shapes (every layer MoE, no shared expert)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": shape["hidden"],
        "intermediate_size": 3 * shape["hidden"],
        "moe_intermediate_size": shape["moe_inter"],
        "num_hidden_layers": layers,
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv_heads"],
        "head_dim": shape["head_dim"],
        "num_experts": shape["experts"],
        "num_experts_per_tok": shape["topk"],
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def layer_tensors(cfg: dict, layer: int) -> dict[str, tuple[tuple[int, ...], float]]:
    """HF names of one decoder layer -> (shape, std); std 0 means ones (norm weights)."""
    h, hd, e, i = cfg["hidden_size"], cfg["head_dim"], cfg["num_experts"], cfg["moe_intermediate_size"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    p = f"model.layers.{layer}"
    out = {
        f"{p}.input_layernorm.weight": ((h,), 0.0),
        f"{p}.post_attention_layernorm.weight": ((h,), 0.0),
        f"{p}.self_attn.q_proj.weight": ((q, h), 0.02),
        f"{p}.self_attn.k_proj.weight": ((kv, h), 0.02),
        f"{p}.self_attn.v_proj.weight": ((kv, h), 0.02),
        f"{p}.self_attn.o_proj.weight": ((h, q), 0.02),
        f"{p}.self_attn.q_norm.weight": ((hd,), 0.0),
        f"{p}.self_attn.k_norm.weight": ((hd,), 0.0),
        f"{p}.mlp.gate.weight": ((e, h), 0.02),
    }
    for x in range(e):  # experts at different magnitudes: distinct NVFP4 global scales
        std = 0.02 * (1 + 3 * x / max(e - 1, 1))
        for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            out[f"{p}.mlp.experts.{x}.{proj}.weight"] = (shape, std)
    return out


def write_random_checkpoint(dst: str, cfg: dict, device: str, seed: int = 0) -> dict:
    """Random bf16 weights for cfg as HF safetensors: one shard per decoder layer plus one for the
    embeddings, final norm and head; tensors made on device, written from there. Returns sizes/time."""
    import torch
    from safetensors.torch import save_file

    t0 = time.time()
    os.makedirs(dst, exist_ok=True)
    g = torch.Generator(device=device).manual_seed(seed)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    shards = {"model-embed-head.safetensors": {
        "model.embed_tokens.weight": ((v, h), 0.02), "model.norm.weight": ((h,), 0.0), "lm_head.weight": ((v, h), 0.02)
    }}  # fmt: skip
    for layer in range(cfg["num_hidden_layers"]):
        shards[f"model-layer-{layer:03d}.safetensors"] = layer_tensors(cfg, layer)
    weight_map, total = {}, 0
    for shard, specs in shards.items():
        tensors = {}
        for name, (shape, std) in specs.items():
            t = torch.ones(shape, device=device) if std == 0 else torch.randn(shape, generator=g, device=device) * std
            tensors[name] = t.to(torch.bfloat16).cpu()
            total += tensors[name].numel() * 2
            weight_map[name] = shard
        save_file(tensors, os.path.join(dst, shard), metadata={"format": "pt"})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return {"bytes": total, "shards": len(shards), "write_s": time.time() - t0}


def calibrate_random(dst: str, cfg: dict, device: str, rows: int = 512) -> dict[str, str]:
    """Static RAC plans (50%) and input amaxes from random outlier-channel hidden states for every MoE
    layer (timing only), as the files `quads convert --rac-plans/--input-amax` takes."""
    import torch

    from quads_megatron.config import RACConfig
    from quads_megatron.rollout.calibration import RACCalibrator, save_calibration

    g = torch.Generator(device=device).manual_seed(1)
    cal = RACCalibrator()
    for layer in range(cfg["num_hidden_layers"]):
        for gemm, k in (("w13", cfg["hidden_size"]), ("w2", cfg["moe_intermediate_size"])):
            chan = torch.exp(torch.randn(k, generator=g, device=device))
            x = (torch.randn(rows, k, generator=g, device=device) * chan).bfloat16()
            cal.observe(f"model.layers.{layer}.mlp.experts.{gemm}", x)
    return save_calibration(dst, cal, RACConfig(ratio=0.5).num_channels, cfg["num_experts"])


def rollout_config(arm: str) -> dict:
    """The arm's rollout section as the converter would embed it (validated by quads_megatron.config)."""
    from quads_megatron.config import load_config

    return load_config({"rollout": ROLLOUT[arm]}).to_dict()["rollout"]


def serving_dir(src: str, dst: str, rollout: dict | None = None, layers: int | None = None) -> str:
    """A folder serving src's tensors (symlinked, nothing copied) whose quantization configs carry this
    rollout section, and, with layers, only the first `layers` decoder layers (shards, index, config)."""
    if os.path.lexists(dst):
        if not os.path.exists(os.path.join(dst, DONE)):
            raise RuntimeError(f"{dst} exists but was not made by this benchmark; remove it")
        shutil.rmtree(dst)
    os.makedirs(dst)
    with open(os.path.join(src, "model.safetensors.index.json")) as f:
        index = json.load(f)
    keep = set(index["weight_map"].values())
    if layers is not None:
        keep = {s for s in keep if not s.startswith("model-layer-") or int(s[len("model-layer-") : -12]) < layers}
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v in keep}
    for name in os.listdir(src):
        if name.endswith(".safetensors") and name in keep:
            os.symlink(os.path.abspath(os.path.join(src, name)), os.path.join(dst, name))
        elif name not in ("config.json", "hf_quant_config.json", "model.safetensors.index.json", DONE):
            path = os.path.join(src, name)
            if os.path.isfile(path) and not name.endswith(".safetensors"):
                shutil.copy2(path, os.path.join(dst, name))
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=1)
    for name in ("config.json", "hf_quant_config.json"):
        if not os.path.exists(os.path.join(src, name)):
            continue
        with open(os.path.join(src, name)) as f:
            cfg = json.load(f)
        if name == "config.json" and layers is not None:
            cfg["num_hidden_layers"] = layers
        quads = cfg.get("quads") if name == "hf_quant_config.json" else cfg.get("quantization_config", {}).get("quads")
        if quads is not None and rollout is not None:
            quads["rollout"] = rollout
        if quads is not None and layers is not None and "rac_plans" in quads:
            quads["rac_plans"] = {p: v for p, v in quads["rac_plans"].items() if int(p.split(".")[2]) < layers}
        with open(os.path.join(dst, name), "w") as f:
            json.dump(cfg, f, indent=1)
    open(os.path.join(dst, DONE), "w").close()
    return dst


def remove_own(path: str) -> None:
    """Delete a checkpoint folder this benchmark wrote (random bf16 shards, or a `quads convert` output);
    refuse anything else."""
    if not os.path.lexists(path):
        return
    names = set(os.listdir(path)) if os.path.isdir(path) else {"?"}
    ours = {"config.json", "model.safetensors.index.json", "hf_quant_config.json", DONE}
    foreign = [n for n in names if n not in ours and not (n.startswith("model-") and n.endswith(".safetensors"))]
    if foreign:
        raise RuntimeError(f"{path} holds files this benchmark did not write ({sorted(foreign)[:3]}); remove it")
    shutil.rmtree(path)


def prepare(args, log) -> dict:
    """The bf16 checkpoint, its conversion and the serving folders under the workdir (reused when an
    earlier run of the same settings left them complete). The conversion only where an arm serves it (a
    run of fp8 / fp8_tuned / bf16 alone skips its minutes), or for --prepare-only."""
    shape = TINY if args.tiny else SHAPE
    cfg = model_config(args.layers, args.vocab, shape)
    root = os.path.join(args.workdir, f"{'tiny-' if args.tiny else ''}L{args.layers}-V{args.vocab}")
    bf16, nvfp4, calib = (os.path.join(root, n) for n in ("bf16", "nvfp4", "calib"))
    info_path = os.path.join(root, "prepare.json")
    info = json.load(open(info_path)) if os.path.exists(info_path) else {}
    marker = os.path.join(bf16, DONE)
    if not (os.path.exists(marker) and json.load(open(marker)) == cfg):
        for path in (bf16, nvfp4):
            remove_own(path)
        log(f"writing a random {args.layers}-layer checkpoint to {bf16} ({args.device})")
        info = {"write": write_random_checkpoint(bf16, cfg, args.device)}
        with open(marker, "w") as f:
            json.dump(cfg, f)
        bench_env.write_json(info_path, info)
    quantized = args.prepare_only or any(a in QUADS_ARMS or a == "layercheck" for a in args.arms)
    if quantized and not os.path.exists(os.path.join(nvfp4, "hf_quant_config.json")):
        remove_own(nvfp4)  # a conversion cut short (the converter itself resumes from nvfp4.partial)
        files = calibrate_random(calib, cfg, args.device)
        yaml_path = os.path.join(root, "static.yaml")
        import yaml

        with open(yaml_path, "w") as f:
            yaml.safe_dump({"rollout": ROLLOUT["quads_static"]}, f)
        cmd = [sys.executable, "-m", "quads_megatron.cli", "convert", bf16, nvfp4, "--quiet"]
        cmd += ["--rac-plans", files["rac_plans"], "--input-amax", files["input_amax"], "--quads-config", yaml_path]
        log("converting: " + " ".join(cmd[1:]))
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.time() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"quads convert failed ({proc.returncode}): {proc.stderr[-2000:]}")
        size = sum(os.path.getsize(os.path.join(nvfp4, n)) for n in os.listdir(nvfp4) if n.endswith(".safetensors"))
        with open(os.path.join(bf16, "model.safetensors.index.json")) as f:
            size_in = json.load(f)["metadata"]["total_size"]
        info["convert"] = {"seconds": seconds, "bytes_out": size, "mb_per_s_in": size_in / 1e6 / seconds}
        info["convert"]["cpu_count"] = os.cpu_count()
        info["convert"]["stdout"] = proc.stdout.strip()[-300:]
        bench_env.write_json(info_path, info)
    dirs = {"bf16": bf16, "fp8": bf16, "fp8_tuned": bf16}
    if not quantized:
        return {"config": cfg, "dirs": dirs, **info}
    for arm in QUADS_ARMS:
        dirs[arm] = serving_dir(nvfp4, os.path.join(root, arm), rollout_config(arm))
    dirs["layercheck"] = serving_dir(
        nvfp4,
        os.path.join(root, f"quads_dyn_{args.check_layers}layers"),
        rollout_config("quads_dyn"),
        args.check_layers,
    )
    return {"config": cfg, "dirs": dirs, **info}
