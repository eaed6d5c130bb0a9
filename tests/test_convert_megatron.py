"""Megatron dist checkpoints (EP=1 and EP=2, real megatron-core dist_checkpointing on gloo) convert to
identical bytes, equal to the HF-path conversion of the same weights."""

import json
import os

import pytest
import torch
import torch.multiprocessing as mp
from test_convert import E, F, H, L, hf_moe_state, read_all, write_hf
from test_expert_parallel import _port

from quads_megatron import convert
from quads_megatron.convert import ConvertError, ConvertOptions


def _save_worker(rank: int, world: int, port: int, ckpt: str) -> None:
    from megatron.core import dist_checkpointing

    from quads_megatron.cpu_megatron import (
        build_moe_layer,
        init_distributed,
        install_cpu_shims_for_megatron,
        moe_config,
    )

    install_cpu_shims_for_megatron()
    init_distributed(rank, world, port=port, ep=world)
    sd = hf_moe_state()
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
        sharded.update(layer.sharded_state_dict(prefix=f"decoder.layers.{layer_idx}.mlp."))
    dist_checkpointing.save(sharded, ckpt)
    torch.distributed.destroy_process_group()


def interrupt_second_shard_write(ckpt: str, dst: str, base: str, monkeypatch) -> list[str]:
    """Run a conversion that is killed while writing its second shard; afterwards record every
    shard written (the caller's next conversion resumes)."""
    real_save, calls = convert.save_file, []

    def failing_save(tensors, path, metadata=None):
        calls.append(os.path.basename(path))
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(convert, "save_file", failing_save)
    with pytest.raises(KeyboardInterrupt):
        convert.convert_megatron_dist(ckpt, dst, base, ConvertOptions(progress=False))
    assert not os.path.exists(dst)
    monkeypatch.setattr(
        convert, "save_file", lambda *a, **k: (calls.append(os.path.basename(a[1])), real_save(*a, **k))
    )
    return calls


def test_ep1_and_ep2_dist_checkpoints_convert_to_identical_bytes(tmp_path, monkeypatch):
    pytest.importorskip("psutil")  # megatron's dist_checkpointing writer needs it
    base = write_hf(tmp_path / "hf", {k: v.float().bfloat16() for k, v in hf_moe_state().items()})
    outs = {}
    for world in (1, 2):
        ckpt = str(tmp_path / f"mcore_ep{world}")
        os.makedirs(ckpt)
        mp.spawn(_save_worker, args=(world, _port(), ckpt), nprocs=world, join=True)
        dst = str(tmp_path / f"nvfp4_ep{world}")
        calls = interrupt_second_shard_write(ckpt, dst, str(base), monkeypatch) if world == 2 else None
        summary = convert.convert_megatron_dist(ckpt, dst, str(base), ConvertOptions(progress=False, verify=True))
        if calls is not None:  # resumed: the unfinished shard was redone, the finished one was not
            assert calls[2] == calls[1] and calls.count(calls[0]) == 1
        assert summary["quantized_modules"] == L * E * 3
        outs[world] = read_all(dst)
    # HF path on the same weights (megatron stored fp32 params; bf16 values are exact in fp32)
    convert.convert_hf(str(base), str(tmp_path / "nvfp4_hf"), ConvertOptions(progress=False))
    hf = read_all(tmp_path / "nvfp4_hf")
    assert outs[1].keys() == outs[2].keys() == hf.keys()
    as_bytes = lambda t: t.reshape(-1).view(torch.uint8) if t.dtype != torch.bfloat16 else t.view(torch.int16)
    for k in hf:
        assert torch.equal(as_bytes(outs[1][k]), as_bytes(outs[2][k])), k
        if ".experts." in k:  # experts: from megatron fp32 params; the codes must equal the HF-path ones
            assert torch.equal(as_bytes(outs[1][k]), as_bytes(hf[k])), k
    cfg = json.loads((tmp_path / "nvfp4_ep2" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_algo"] == "NVFP4"


def test_unknown_layout_and_mismatch_are_refused(tmp_path):
    base = write_hf(tmp_path / "hf", hf_moe_state())
    with pytest.raises(ConvertError, match="not a readable torch_dist"):
        convert.convert_megatron_dist(str(base), str(tmp_path / "out"), str(base), ConvertOptions(progress=False))
