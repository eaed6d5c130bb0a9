"""quads_nvfp4 layers that serve their expert weights tiled (integrations/sglang/tiled_layout.py), in real SGLang
Qwen3-MoE models on CPU with hidden and intermediate sizes of 128 (tileable): the bytes once loaded, every write
path (SGLang's own loader, quads_nvfp4's live sync, a reload with post-processing, expert parallelism) compared
byte for byte with a twin model kept row-major (rollout.weight_layout: row_major), and failed writes.
"""

import os
import pathlib

import pytest
import torch

if os.environ.get("QUADS_REQUIRE_SGLANG") == "1":
    import sglang  # noqa: F401  (CI: a missing sglang is a failure, not a skip)
sglang = pytest.importorskip("sglang")

from quads_megatron import nvfp4  # noqa: E402
from quads_megatron.checkpoint import modelopt  # noqa: E402
from quads_megatron.integrations import sglang as plug  # noqa: E402
from quads_megatron.integrations.sglang import tiled_layout  # noqa: E402
from quads_megatron.kernels.weight_layout import tile_weights  # noqa: E402
from quads_megatron.rollout.moe_block import moe_w4a4  # noqa: E402
from sglang_env import (  # noqa: E402
    LAYERS,
    E,
    build_model,
    expected_experts,
    experts_of,
    param_bytes,
    rank_model,
    read_dir,
    routing,
    write_checkpoints,
)

pytest_plugins = ["sglang_env"]

WIDE = 256  # hidden and moe_intermediate: multiples of 128 (tileable), two chunks (K = 128 tiles to the same order)
P1 = "model.layers.1.mlp.experts"


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return write_checkpoints(tmp_path_factory.mktemp("wide"), hidden_size=WIDE, moe_intermediate_size=WIDE)


def yaml_config(tmp_path_factory, layout):
    path = tmp_path_factory.mktemp("cfg") / f"{layout}.yaml"
    path.write_text(f"rollout:\n  weight_layout: {layout}\n")
    return str(path)


def build_with_layout(path, layout_yaml):
    old = os.environ.get(plug.method.CONFIG_ENV)
    os.environ[plug.method.CONFIG_ENV] = layout_yaml
    try:
        return build_model(path)[1]
    finally:
        if old is None:
            os.environ.pop(plug.method.CONFIG_ENV)
        else:
            os.environ[plug.method.CONFIG_ENV] = old


@pytest.fixture()
def twins(wide, sglang_runtime, tmp_path_factory):
    """The wide checkpoint built twice: tiled (the default, auto) and row-major."""
    return build_model(wide / "nvfp4")[1], build_with_layout(wide / "nvfp4", yaml_config(tmp_path_factory, "row_major"))


def tiled_bytes_of(row_major_model) -> dict[str, torch.Tensor]:
    """What a tiled model's four expert parameters per layer must hold: the row-major twin's, tiled."""
    out = {}
    for layer in range(LAYERS):
        moe = experts_of(row_major_model, layer)
        for w, s in (("w13_weight", "w13_weight_scale"), ("w2_weight", "w2_weight_scale")):
            codes, scales = tile_weights(getattr(moe, w).data, getattr(moe, s).data.view(torch.uint8))
            out[f"model.layers.{layer}.mlp.experts.{w}"] = codes.reshape(-1)
            out[f"model.layers.{layer}.mlp.experts.{s}"] = scales.reshape(-1)
    return out


def assert_same_weights(tiled, rows):
    """tiled holds the tiled bytes of rows' expert weights, and the same bytes everywhere else."""
    want = tiled_bytes_of(rows)
    for (name, p), (name2, q) in zip(tiled.named_parameters(), rows.named_parameters(), strict=True):
        assert name == name2
        got = p.detach().reshape(-1).view(torch.uint8)
        assert torch.equal(got, want[name] if name in want else q.detach().reshape(-1).view(torch.uint8)), name
    for layer in range(LAYERS):
        assert tiled_layout.is_tiled(experts_of(tiled, layer)) and not tiled_layout.is_tiled(experts_of(rows, layer))


def assert_same_outputs(tiled, rows, seed):
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    x, ids, w = routing(seed=seed, hidden=WIDE)
    for layer in range(LAYERS):
        a, b = experts_of(tiled, layer), experts_of(rows, layer)
        topk = StandardTopKOutput(w, ids, torch.zeros(x.shape[0], E))
        assert torch.equal(a(x, topk), b(x, topk))


def test_loaded_layers_are_tiled_in_place_and_serve_the_checkpoint(wide, twins):
    """Each layer's four parameters hold the checkpoint's bytes tiled, at the shapes SGLang made; the method
    hands the kernels the tiled 5-D views; the outputs are the same bits as the row-major twin's."""
    tiled, rows = twins
    assert_same_weights(tiled, rows)
    for name, want in tiled_bytes_of(rows).items():  # the tiled order is not the row-major one at these sizes
        assert not torch.equal(want, dict(rows.named_parameters())[name].detach().reshape(-1).view(torch.uint8))
    tensors = read_dir(wide / "nvfp4")
    for layer in range(LAYERS):
        moe = experts_of(tiled, layer)
        assert moe.w13_weight.shape == (E, 2 * WIDE, WIDE // 2) and moe.w2_weight_scale.shape == (E, WIDE, WIDE // 16)
        got = moe.quant_method.expert_weights(moe)
        assert got.tiled and got.w13_codes.data_ptr() == moe.w13_weight.data_ptr()
        want = expected_experts(tensors, layer)
        back = got.as_row_major()
        for name in ("w13_codes", "w13_scales", "w13_sdec", "w2_codes", "w2_scales", "w2_sdec"):
            assert torch.equal(getattr(back, name), getattr(want, name)), name
        x, ids, w = routing(seed=layer, hidden=WIDE)
        ref = moe_w4a4(x, ids, w, want, moe.quant_method.rac, impl="reference")
        assert torch.equal(moe_w4a4(x, ids, w, got, moe.quant_method.rac, impl="reference"), ref)
    assert_same_outputs(tiled, rows, seed=5)


def packed_update(wide, seed):
    """Packed experts 1 and 3 of layer 1 (gate, up, down: weights, block and global scales) and a BF16 attention
    weight, from a perturbed copy of the checkpoint."""
    g = torch.Generator().manual_seed(seed)
    src = read_dir(wide / "bf16")
    items = []
    for e in (1, 3):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            name = f"{P1}.{e}.{proj}"
            w = src[f"{name}.weight"].float() * (1 + 0.3 * torch.rand(src[f"{name}.weight"].shape, generator=g))
            items.append((name, w.bfloat16()))
    out = []
    for e in (1, 3):
        gate, up = (dict(items)[f"{P1}.{e}.{p}"] for p in ("gate_proj", "up_proj"))
        amax = nvfp4.shared_amax(gate, up)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            name = f"{P1}.{e}.{proj}"
            q = modelopt.quantize_linear(dict(items)[name], name, global_amax=None if proj == "down_proj" else amax)
            out += [
                (k, v) for k, v in modelopt.modelopt_tensors(name, q, None).items() if not k.endswith("input_scale")
            ]
    out.append(("model.layers.1.self_attn.o_proj.weight", src["model.layers.1.self_attn.o_proj.weight"] * 2))
    return out


@pytest.mark.parametrize("path", ["sglang_loader", "live_sync"])
def test_every_write_lands_row_major_and_the_layer_stays_tiled(wide, twins, path, monkeypatch):
    """The same update through SGLang's own loader (model.load_weights: update_weights_from_tensor's default
    format, _from_distributed, the initial load) and through quads_nvfp4's live sync, into both twins: the tiled
    model then holds the tiled bytes of the row-major one, in the same storage; the live sync untiles and tiles
    each written layer once, SGLang's loader one expert slab per write."""
    tiled, rows = twins
    ptrs = {n: p.data_ptr() for n, p in tiled.named_parameters()}
    update = packed_update(wide, seed=7)
    calls = []
    real = tiled_layout.set_tiled
    monkeypatch.setattr(tiled_layout, "set_tiled", lambda layer, t: (calls.append(t), real(layer, t))[1])
    if path == "live_sync":
        plug.load_weights(tiled, update)
        plug.load_weights(rows, update)
        assert calls == [False, True]  # layer 1 only, once each way
    else:
        tiled.load_weights(update)
        rows.load_weights(update)
        assert calls == []
    assert {n: p.data_ptr() for n, p in tiled.named_parameters()} == ptrs
    before = tiled_bytes_of(build_model(wide / "nvfp4")[1])
    assert not torch.equal(tiled_bytes_of(rows)[f"{P1}.w2_weight"], before[f"{P1}.w2_weight"])  # it was written
    assert_same_weights(tiled, rows)
    assert_same_outputs(tiled, rows, seed=6)


def test_a_write_that_fails_leaves_the_layer_tiled_and_unchanged(twins, wide):
    """SGLang's loader raising inside a guarded write (a tensor of the wrong size) and the live sync refusing an
    update: every byte as before, the layer still tiled."""
    tiled, _ = twins
    before = param_bytes(tiled)
    down = read_dir(wide / "nvfp4")[f"{P1}.2.down_proj.weight"]
    wider = torch.cat([down, down], dim=1)  # twice K/2: SGLang's copy_ into the expert's slab raises
    with pytest.raises(RuntimeError, match="size"):
        tiled.load_weights([(f"{P1}.2.down_proj.weight", wider)])
    assert param_bytes(tiled) == before and tiled_layout.is_tiled(experts_of(tiled, 1))
    with pytest.raises(plug.QuadsSglangError, match="nothing was written"):
        plug.load_weights(tiled, [(f"{P1}.2.down_proj.weight", wider)])
    assert param_bytes(tiled) == before and tiled_layout.is_tiled(experts_of(tiled, 1))


def test_a_reload_with_post_processing_keeps_one_tiling(twins, wide):
    """update_weights_from_disk's order: SGLang's loader over a whole checkpoint, then every method's
    process_weights_after_loading again: the layers are tiled once, not twice, and hold the new checkpoint."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    tiled, rows = twins
    new = packed_update(wide, seed=9)
    for model in (tiled, rows):
        DefaultModelLoader.load_weights_and_postprocess(model, iter(new), torch.device("cpu"))
    assert_same_weights(tiled, rows)
    assert_same_outputs(tiled, rows, seed=8)


def test_weight_layout_choices(checkpoints, wide, sglang_runtime, tmp_path_factory):
    """tiled refuses a layer it cannot tile (hidden 64 there) with one line; auto keeps such a layer row-major;
    row_major never tiles."""
    with pytest.raises(plug.QuadsSglangError, match="rollout.weight_layout is tiled .* must be multiples of 128"):
        build_with_layout(checkpoints / "nvfp4", yaml_config(tmp_path_factory, "tiled"))
    narrow = build_model(checkpoints / "nvfp4")[1]
    assert not any(tiled_layout.is_tiled(experts_of(narrow, layer)) for layer in range(LAYERS))
    forced = build_with_layout(wide / "nvfp4", yaml_config(tmp_path_factory, "tiled"))
    assert all(tiled_layout.is_tiled(experts_of(forced, layer)) for layer in range(LAYERS))


def _ep_worker(rank, world, port, ckpt):
    """EP 2 on the wide checkpoint: this rank's two experts tiled; SGLang's loader writes of every expert land in
    this rank's slabs (local ids) or nowhere."""
    model = rank_model(rank, world, port, f"{ckpt}/nvfp4", ep=world)
    moe = experts_of(model, 1)
    assert moe.num_local_experts == 2 and tiled_layout.is_tiled(moe)
    update = packed_update(pathlib.Path(ckpt), seed=7)
    model.load_weights([(n, t) for n, t in update if ".experts." in n])
    got = moe.quant_method.expert_weights(moe).as_row_major()
    new, old = dict(update), read_dir(pathlib.Path(ckpt) / "nvfp4")
    for local in range(2):
        e = 2 * rank + local
        src = new if e in (1, 3) else old
        assert torch.equal(got.w2_codes[local], src[f"{P1}.{e}.down_proj.weight"])
        gate_up = torch.cat([src[f"{P1}.{e}.gate_proj.weight_scale"], src[f"{P1}.{e}.up_proj.weight_scale"]])
        assert torch.equal(got.w13_scales[local], gate_up.view(torch.uint8))


def test_expert_parallel_ranks_write_their_tiled_slabs(wide):
    import torch.multiprocessing as mp

    from helpers import free_port

    mp.spawn(_ep_worker, args=(2, free_port(), str(wide)), nprocs=2)
