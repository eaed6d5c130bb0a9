"""Megatron dist checkpoints (EP=1 and EP=2, real megatron-core dist_checkpointing on gloo) convert to
identical bytes, equal to the HF-path conversion of the same weights."""

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from helpers import free_port
from quads_megatron import checkpoint
from quads_megatron.checkpoint import ConvertError, ConvertOptions
from quads_megatron.checkpoint import output as convert_output
from test_convert import E, F, H, L, hf_moe_state, read_all, write_hf

NQ, NKV, HD = 4, 2, 8  # attention of the full-model case: q [32, 32], k/v [16, 32]


def full_hf_state() -> dict[str, torch.Tensor]:
    """hf_moe_state plus every non-expert weight of a Qwen3-MoE layer."""
    g = torch.Generator().manual_seed(7)
    sd = hf_moe_state()
    for layer in range(L):
        p = f"model.layers.{layer}"
        sd[f"{p}.self_attn.k_proj.weight"] = torch.randn(NKV * HD, H, generator=g).bfloat16()
        sd[f"{p}.self_attn.v_proj.weight"] = torch.randn(NKV * HD, H, generator=g).bfloat16()
        sd[f"{p}.self_attn.o_proj.weight"] = torch.randn(H, NQ * HD, generator=g).bfloat16()
        for n, size in (("self_attn.q_norm", HD), ("self_attn.k_norm", HD), ("input_layernorm", H)):
            sd[f"{p}.{n}.weight"] = (1 + 0.1 * torch.randn(size, generator=g)).bfloat16()
        sd[f"{p}.post_attention_layernorm.weight"] = (1 + 0.1 * torch.randn(H, generator=g)).bfloat16()
    sd["model.norm.weight"] = (1 + 0.1 * torch.randn(H, generator=g)).bfloat16()
    return sd


def megatron_non_expert(sd: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """What Megatron-Core's TE GPT layer holds for HF layer `layer` (fused QKV, fused input norm)."""
    from helpers import fuse_qkv
    from quads_megatron.checkpoint.hf_mapping import AttentionShape

    p, a = f"model.layers.{layer}", AttentionShape(NQ, NKV, HD)
    qkv = fuse_qkv(*(sd[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv"), a)
    return {
        "self_attention.linear_qkv.weight": qkv,
        "self_attention.linear_qkv.layer_norm_weight": sd[f"{p}.input_layernorm.weight"],
        "self_attention.linear_proj.weight": sd[f"{p}.self_attn.o_proj.weight"],
        "self_attention.q_layernorm.weight": sd[f"{p}.self_attn.q_norm.weight"],
        "self_attention.k_layernorm.weight": sd[f"{p}.self_attn.k_norm.weight"],
        "pre_mlp_layernorm.weight": sd[f"{p}.post_attention_layernorm.weight"],
    }


def _save_worker(rank: int, world: int, port: int, ckpt: str, stacked: bool = False, full: bool = False) -> None:
    """Megatron dist checkpoint of L MoE layers: per-layer keys (decoder.layers.N.*) or layer-stacked
    keys (decoder.layers.*, leading layer axis: what TransformerBlock writes for homogeneous layers)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

    from quads_megatron.demo.cpu_megatron import (
        build_moe_layer,
        init_distributed,
        install_cpu_shims_for_megatron,
        moe_config,
    )

    install_cpu_shims_for_megatron()
    init_distributed(rank, world, port=port, ep=world)
    sd = full_hf_state() if full else hf_moe_state()
    local = E // world
    sharded = {}
    for layer_idx in range(L):
        layer = build_moe_layer(moe_config(num_experts=E, hidden=H, ffn=F), seed=layer_idx, layer_number=layer_idx + 1)
        p = f"model.layers.{layer_idx}.mlp"
        with torch.no_grad():
            layer.router.weight.copy_(sd[f"{p}.gate.weight"].float())
            for i, ex in enumerate(layer.experts.local_experts):
                g = rank * local + i
                ex.linear_fc1.weight.copy_(
                    torch.cat([sd[f"{p}.experts.{g}.gate_proj.weight"], sd[f"{p}.experts.{g}.up_proj.weight"]]).float()
                )
                ex.linear_fc2.weight.copy_(sd[f"{p}.experts.{g}.down_proj.weight"].float())
        if stacked:
            part = layer.sharded_state_dict(
                prefix=f"decoder.layers.{layer_idx}.mlp.", sharded_offsets=((0, layer_idx, L),)
            )
            replace_prefix_for_sharding(part, f"decoder.layers.{layer_idx}.", "decoder.layers.")
        else:
            part = layer.sharded_state_dict(prefix=f"decoder.layers.{layer_idx}.mlp.")
        sharded.update(part)
        if full:  # non-expert weights, replicated across EP ranks
            for rest, t in megatron_non_expert(sd, layer_idx).items():
                key = f"decoder.layers.{rest}" if stacked else f"decoder.layers.{layer_idx}.{rest}"
                offsets = [(0, layer_idx, L)] if stacked else []
                sharded[f"{layer_idx}.{rest}"] = ShardedTensor.from_rank_offsets(
                    key, t.float(), *offsets, replica_id=rank, prepend_axis_num=len(offsets)
                )
    if full:
        for key, hf_name in (
            ("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
            ("decoder.final_layernorm.weight", "model.norm.weight"),
            ("output_layer.weight", "lm_head.weight"),
        ):
            sharded[key] = ShardedTensor.from_rank_offsets(key, sd[hf_name].float(), replica_id=rank)
        # optimizer state lives in the same checkpoint under optimizer.*; the converter must skip it
        for key in ("optimizer.state.exp_avg.embedding.word_embeddings.weight",):
            sharded[key] = ShardedTensor.from_rank_offsets(key, torch.randn(50, H), replica_id=rank)
        key = "optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc1.weight"
        sharded[key] = ShardedTensor.from_rank_offsets(key, torch.randn(L, E, 2 * F, H), replica_id=rank)
    dist_checkpointing.save(sharded, ckpt)
    torch.distributed.destroy_process_group()


def interrupt_second_shard_write(ckpt: str, dst: str, base: str, monkeypatch) -> list[str]:
    """Run a conversion that is killed while writing its second shard; afterwards record every
    shard written (the caller's next conversion resumes)."""
    real_save, calls = convert_output.save_file, []

    def failing_save(tensors, path, metadata=None):
        calls.append(os.path.basename(path))
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(convert_output, "save_file", failing_save)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.convert_megatron_dist(ckpt, dst, base, ConvertOptions(progress=False), non_expert="hf")
    assert not os.path.exists(dst)
    monkeypatch.setattr(
        convert_output, "save_file", lambda *a, **k: (calls.append(os.path.basename(a[1])), real_save(*a, **k))
    )
    return calls


def test_ep1_and_ep2_dist_checkpoints_convert_to_identical_bytes(tmp_path, monkeypatch):
    pytest.importorskip("psutil")  # megatron's dist_checkpointing writer needs it
    base_sd = {k: v.float().bfloat16() for k, v in hf_moe_state().items()}
    base_sd["model.layers.1.self_attn.q_proj.weight"][0, 3] = float("nan")  # copied from base; verify compares bytes
    base = write_hf(tmp_path / "hf", base_sd)
    outs = {}
    for world in (1, 2):
        ckpt = str(tmp_path / f"mcore_ep{world}")
        os.makedirs(ckpt)
        # EP=1 with per-layer keys, EP=2 layer-stacked: both layouts, both EP sizes, one output
        mp.spawn(_save_worker, args=(world, free_port(), ckpt, world == 2), nprocs=world, join=True)
        dst = str(tmp_path / f"nvfp4_ep{world}")
        calls = interrupt_second_shard_write(ckpt, dst, str(base), monkeypatch) if world == 2 else None
        summary = checkpoint.convert_megatron_dist(
            ckpt, dst, str(base), ConvertOptions(progress=False, verify=True), non_expert="hf"
        )
        if calls is not None:  # resumed: the unfinished shard was redone, the finished one was not
            assert calls[2] == calls[1] and calls.count(calls[0]) == 1
        assert summary["quantized_modules"] == L * E * 3
        outs[world] = read_all(dst)
    # HF path on the same weights (megatron stored fp32 params; bf16 values are exact in fp32)
    checkpoint.convert_hf(str(base), str(tmp_path / "nvfp4_hf"), ConvertOptions(progress=False))
    hf = read_all(tmp_path / "nvfp4_hf")
    assert outs[1].keys() == outs[2].keys() == hf.keys()
    as_bytes = lambda t: t.reshape(-1).view(torch.uint8) if t.dtype != torch.bfloat16 else t.view(torch.int16)
    for k in hf:
        assert torch.equal(as_bytes(outs[1][k]), as_bytes(outs[2][k])), k
        if ".experts." in k:  # experts: from megatron fp32 params; the codes must equal the HF-path ones
            assert torch.equal(as_bytes(outs[1][k]), as_bytes(hf[k])), k
    cfg = json.loads((tmp_path / "nvfp4_ep2" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_algo"] == "NVFP4"


def test_non_expert_weights_are_mapped_from_the_megatron_checkpoint(tmp_path):
    """A layer-stacked checkpoint with attention, norms, embeddings: everything comes from Megatron
    (fused QKV split per KV group, fused input norm) and equals the HF-path conversion byte for byte."""
    pytest.importorskip("psutil")
    sd = full_hf_state()
    base = write_hf(tmp_path / "hf", sd)
    cfg = json.loads((base / "config.json").read_text())
    cfg.update(num_attention_heads=NQ, num_key_value_heads=NKV, head_dim=HD)
    (base / "config.json").write_text(json.dumps(cfg))
    ckpt = tmp_path / "mcore"
    os.makedirs(ckpt)
    mp.spawn(_save_worker, args=(1, free_port(), str(ckpt), True, True), nprocs=1, join=True)
    opts = ConvertOptions(progress=False, verify=True)
    summary = checkpoint.convert_megatron_dist(str(ckpt), str(tmp_path / "out"), str(base), opts)
    assert summary["layers"] == L and summary["quantized_modules"] == L * E * 3
    got = read_all(tmp_path / "out")
    checkpoint.convert_hf(str(base), str(tmp_path / "nvfp4_hf"), ConvertOptions(progress=False))
    hf = read_all(tmp_path / "nvfp4_hf")
    assert got.keys() == hf.keys()
    for k in hf:
        assert got[k].dtype == hf[k].dtype, k
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), hf[k].reshape(-1).view(torch.uint8)), k
    # a checkpoint without the attention weights cannot stand in for them: a clear error, no output
    bare = tmp_path / "mcore_experts_only"
    os.makedirs(bare)
    mp.spawn(_save_worker, args=(1, free_port(), str(bare), True, False), nprocs=1, join=True)
    with pytest.raises(ConvertError, match="non-expert-from hf"):
        checkpoint.convert_megatron_dist(str(bare), str(tmp_path / "out2"), str(base), ConvertOptions(progress=False))
    assert not os.path.exists(tmp_path / "out2") and not os.path.exists(tmp_path / "out2.partial")  # refused first


def test_megatron_conversion_has_the_same_protections(tmp_path):
    """Calibration inputs are checked against the Megatron layers, sources are never removed, a
    partial the converter did not write is left alone: the same checks as the HF path, before any write."""
    pytest.importorskip("psutil")
    base = write_hf(tmp_path / "hf", hf_moe_state())
    ckpt = tmp_path / "mcore"
    os.makedirs(ckpt)
    mp.spawn(_save_worker, args=(1, free_port(), str(ckpt)), nprocs=1, join=True)
    one_layer = {"model.layers.0.mlp.experts": {"w13": [0], "w2": [0]}}
    amax = {"model.layers.0.mlp.experts.0.gate_proj": 3.0}
    cases = [
        (tmp_path / "out", {"quads": {"rac_plans": one_layer}}, "cover 1 of 2 MoE layers converted"),
        (
            tmp_path / "out",
            {"quads": {"rac_plans": {**one_layer, "model.layers.1.mlp.experts": {"w13": [0], "w2": [3]}}}},
            r"block index 3 is out of range \[0, 3\) for K=48",
        ),
        (tmp_path / "out", {"input_amax": amax}, "covers 1 of 24 quantized modules"),
        (tmp_path / "out", {"quads": {"rollout": {"activation_scale": "static"}}}, "no input amax"),
        (base, {"overwrite": True}, "refusing to remove it: it is the source"),
        (ckpt, {"overwrite": True}, "refusing to remove it: it is the source"),
        (tmp_path, {"overwrite": True}, "refusing to remove it: it contains the source"),
    ]
    before = sorted(os.listdir(tmp_path))
    for dst, opts, message in cases:
        with pytest.raises(ConvertError, match=message):
            checkpoint.convert_megatron_dist(str(ckpt), str(dst), str(base), ConvertOptions(progress=False, **opts))
        assert sorted(os.listdir(tmp_path)) == before
    (tmp_path / "out.partial").mkdir()
    (tmp_path / "out.partial" / "keep").write_text("x")
    with pytest.raises(ConvertError, match="out.partial: refusing to remove it: it was not written by quads convert"):
        checkpoint.convert_megatron_dist(str(ckpt), str(tmp_path / "out"), str(base), ConvertOptions(progress=False))
    assert (tmp_path / "out.partial" / "keep").read_text() == "x"


def test_megatron_names_map_to_hf_and_unknown_ones_are_refused():
    from helpers import fuse_qkv
    from quads_megatron.checkpoint.hf_mapping import AttentionShape, MappingError, megatron_to_hf, split_qkv

    a = AttentionShape(8, 2, 4)
    q, k, v = torch.randn(32, 16), torch.randn(8, 16), torch.randn(8, 16)
    qkv = fuse_qkv(q, k, v, a)
    assert torch.equal(qkv[:16], q[:16]) and torch.equal(qkv[16:20], k[:4]) and torch.equal(qkv[20:24], v[:4])
    assert all(torch.equal(x, y) for x, y in zip(split_qkv(qkv, a), (q, k, v), strict=True))
    out = dict(megatron_to_hf("module.decoder.layers.3.self_attention.linear_qkv.weight", qkv, a, layer_offset=2))
    assert list(out) == [f"model.layers.5.self_attn.{p}_proj.weight" for p in "qkv"]
    fc1 = torch.randn(12, 16)
    out = dict(megatron_to_hf("decoder.layers.0.mlp.shared_experts.linear_fc1.weight", fc1, a))
    assert torch.equal(out["model.layers.0.mlp.shared_expert.up_proj.weight"], fc1[6:])
    assert megatron_to_hf("decoder.layers.0.self_attention.linear_proj._extra_state", torch.zeros(1), a) == []
    with pytest.raises(MappingError, match="routed-expert"):
        megatron_to_hf("decoder.layers.0.mlp.experts.experts.linear_fc1.weight", fc1, a)
    with pytest.raises(MappingError, match="no HF"):
        megatron_to_hf("decoder.layers.0.self_attention.core_attention.sinks", fc1, a)
    with pytest.raises(MappingError, match="need 48"):
        split_qkv(torch.randn(40, 16), a)
    with pytest.raises(MappingError, match="attention sizes"):
        split_qkv(qkv, None)


def test_unknown_layout_and_mismatch_are_refused(tmp_path):
    base = write_hf(tmp_path / "hf", hf_moe_state())
    with pytest.raises(ConvertError, match="not a readable torch_dist"):
        checkpoint.convert_megatron_dist(str(base), str(tmp_path / "out"), str(base), ConvertOptions(progress=False))
