"""Trainer-side patches on a real megatron-core MoELayer (SequentialMLP experts, gloo, CPU)."""

import pytest
import torch

import quads_megatron
from quads_megatron import fake_quant, nvfp4
from quads_megatron.demo.cpu_megatron import build_moe_layer, moe_config
from quads_megatron.integrations.megatron import qat as megatron_core

pytestmark = pytest.mark.usefixtures("megatron_world", "clean_quads_patches")


def expert_weights(layer):
    return {n: p for n, p in layer.named_parameters() if ".local_experts." in n}


def qdq_copy_of(layer_seed=0, layer_number=1, linears=("fc1", "fc2"), **cfg_kw):
    """An unpatched layer whose expert weights were replaced by qdq(W): the expected model (kept BF16
    while QUADS is applied)."""
    ref = build_moe_layer(moe_config(**cfg_kw), seed=layer_seed, layer_number=layer_number)
    with torch.no_grad():
        for n, p in expert_weights(ref).items():
            if any(f"linear_{lin}." in n for lin in linears):
                p.copy_(nvfp4.qdq(p))
    megatron_core.leave_unquantized(ref)
    return ref


def run(layer, x):
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def test_forward_and_ste_gradients_match_qdq_weights_exactly():
    ref = qdq_copy_of()
    quads_megatron.apply()
    layer = build_moe_layer(moe_config(), seed=0)  # tagged at construction
    x = torch.randn(6, 2, 32)
    out, gx, grads = run(layer, x)
    out_ref, gx_ref, grads_ref = run(ref, x)
    assert torch.equal(out, out_ref)
    assert torch.equal(gx, gx_ref)
    assert grads.keys() == grads_ref.keys()
    for n in grads:  # STE: dL/dW equals dL/d(qdq W), router included
        assert torch.equal(grads[n], grads_ref[n]), n
    unquantized = build_moe_layer(moe_config(), seed=0)
    quads_megatron.remove()
    out_plain, _, _ = run(unquantized, x)
    assert not torch.equal(out, out_plain)  # the patch really changed the numbers


def test_state_dict_and_parameters_unchanged():
    plain = build_moe_layer(moe_config(), seed=0)
    quads_megatron.apply()
    layer = build_moe_layer(moe_config(), seed=0)
    run(layer, torch.randn(4, 2, 32))
    sd, sd_plain = layer.state_dict(), plain.state_dict()
    assert sd.keys() == sd_plain.keys()
    for k in sd:
        if isinstance(sd[k], torch.Tensor):
            assert torch.equal(sd[k], sd_plain[k]), k  # master weights stay unquantized
        else:
            assert sd[k] == sd_plain[k], k  # e.g. _extra_state
    assert [n for n, _ in layer.named_buffers()] == [n for n, _ in plain.named_buffers()]
    assert len(list(layer.parameters())) == len(list(plain.parameters()))


def test_apply_is_idempotent_and_remove_restores():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.moe_layer import MoELayer

    originals = (ColumnParallelLinear.forward, RowParallelLinear.forward, MoELayer.__init__)
    quads_megatron.apply()
    quads_megatron.apply()
    assert ColumnParallelLinear.forward.__wrapped__ is originals[0]  # wrapped once, not twice
    layer = build_moe_layer(moe_config(), seed=0)
    run(layer, torch.randn(4, 2, 32))
    assert fake_quant.STATS.qdq_calls == 8  # 4 experts x (fc1, fc2), once each
    quads_megatron.remove()
    assert (ColumnParallelLinear.forward, RowParallelLinear.forward, MoELayer.__init__) == originals
    plain = build_moe_layer(moe_config(), seed=0)
    x = torch.randn(4, 2, 32)
    assert torch.equal(run(layer, x)[0], run(plain, x)[0])  # tags are inert after remove()


def test_qdq_cached_per_weight_version():
    quads_megatron.apply()
    layer = build_moe_layer(moe_config(), seed=0)
    x = torch.randn(4, 2, 32)
    for _ in range(3):  # three micro-batches, one weight version
        run(layer, x)
    assert fake_quant.STATS.qdq_calls == 8 and fake_quant.STATS.cache_hits == 16
    with torch.no_grad():
        layer.experts.local_experts[0].linear_fc1.weight.mul_(2)  # in-place edit bumps _version
    run(layer, x)
    assert fake_quant.STATS.qdq_calls == 9  # only the edited weight
    torch.optim.SGD(layer.parameters(), lr=0.1).step()  # new version via the optimizer hook
    out_after, _, _ = run(layer, x)
    assert fake_quant.STATS.qdq_calls == 17
    quads_megatron.remove()
    ref = build_moe_layer(moe_config(), seed=0)
    with torch.no_grad():
        for (_, p), (_, q) in zip(expert_weights(ref).items(), expert_weights(layer).items(), strict=True):
            p.copy_(nvfp4.qdq(q))
        ref.router.weight.copy_(layer.router.weight)
    assert torch.equal(out_after, run(ref, x)[0])  # the recomputed QDQ is of the updated weights


def test_config_selects_layers_and_linears():
    quads_megatron.apply({"trainer": {"layers": [2]}})
    layer1 = build_moe_layer(moe_config(), seed=0, layer_number=1)
    x = torch.randn(4, 2, 32)
    out1 = run(layer1, x)[0]
    assert fake_quant.STATS.qdq_calls == 0
    quads_megatron.remove()
    assert torch.equal(out1, run(build_moe_layer(moe_config(), seed=0), x)[0])
    ref = qdq_copy_of(linears=("fc2",))
    quads_megatron.apply({"trainer": {"linears": ["fc2"]}})
    layer = build_moe_layer(moe_config(), seed=0)
    assert torch.equal(run(layer, x)[0], run(ref, x)[0])
    assert fake_quant.STATS.qdq_calls == 4


def test_model_built_before_apply_is_tagged_with_model_argument():
    ref = qdq_copy_of()
    layer = build_moe_layer(moe_config(), seed=0)
    quads_megatron.apply(model=[layer])
    x = torch.randn(4, 2, 32)
    assert torch.equal(run(layer, x)[0], run(ref, x)[0])


class _CpuFusedWgradShim:
    """CPU stand-in for the CUDA extension fused_weight_gradient_mlp_cuda (main_grad += g^T x)."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
        main_grad.add_(
            grad_output.reshape(-1, grad_output.shape[-1]).t() @ total_input.reshape(-1, total_input.shape[-1])
        )

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


def test_gradient_accumulation_fusion_accumulates_into_main_grad(monkeypatch):
    from megatron.core.tensor_parallel import layers

    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", _CpuFusedWgradShim, raising=False)
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", True)
    quads_megatron.apply()
    layer = build_moe_layer(moe_config(gradient_accumulation_fusion=True), seed=0)
    ref = qdq_copy_of()
    for p in expert_weights(layer).values():  # what Megatron's DDP sets up
        p.main_grad = torch.zeros_like(p)
        p.grad_added_to_main_grad = False
    x = torch.randn(4, 2, 32)
    run(layer, x)
    _, _, grads_ref = run(ref, x)
    for n, p in expert_weights(layer).items():
        assert p.grad_added_to_main_grad, n  # forwarded from the fake-quant tensor: DDP won't add twice
        assert torch.allclose(p.main_grad, grads_ref[n], rtol=1e-5, atol=1e-6), n


def test_version_guard():
    assert megatron_core.check_version("0.16.1") == "0.16.1"
    assert megatron_core.check_version("0.19.2") == "0.19.2"
    with pytest.raises(megatron_core.QuadsPatchError, match="outside the versions"):
        megatron_core.check_version("0.13.0")
    with pytest.raises(megatron_core.QuadsPatchError, match="QUADS_ALLOW_UNTESTED_MEGATRON"):
        megatron_core.check_version("1.0.0")


def test_version_guard_override(monkeypatch):
    monkeypatch.setenv(megatron_core.ALLOW_UNTESTED_ENV, "1")
    assert megatron_core.check_version("0.25.0") == "0.25.0"


def test_bad_weights_raise_clear_errors():
    quads_megatron.apply()
    layer = build_moe_layer(moe_config(), seed=0)
    with torch.no_grad():
        layer.experts.local_experts[1].linear_fc2.weight[0, 0] = float("nan")
    before = layer.experts.local_experts[1].linear_fc2.weight.detach().clone()
    with pytest.raises(nvfp4.NVFP4InputError, match="expert weight: contains NaN"):
        layer(torch.randn(4, 2, 32))
    after = layer.experts.local_experts[1].linear_fc2.weight.detach()
    assert torch.equal(before.nan_to_num(), after.nan_to_num())
    assert "weight" not in layer.experts.local_experts[1].linear_fc2.__dict__  # shadow cleaned up


def test_odd_ffn_size_is_refused():
    quads_megatron.apply()
    layer = build_moe_layer(moe_config(ffn=40), seed=0)  # fc2 K=40 is not a multiple of 16
    with pytest.raises(nvfp4.NVFP4InputError, match="multiple of 16"):
        layer(torch.randn(4, 2, 32))


class FakeTEGroupedLinearForCPU(torch.nn.Module):
    """Stand-in for TE's GroupedLinear (no CPU build of TE): weight{i} params + _get_weight_tensors."""

    def __init__(self, experts=3, n=32, k=48, grouped=False):
        super().__init__()
        if grouped:
            self.weight = torch.nn.Parameter(torch.randn(experts, n, k))
        else:
            for i in range(experts):
                self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.randn(n, k) * (i + 1)))
        self.grouped, self.experts = grouped, experts

    def _get_weight_tensors(self):
        return [self.weight] if self.grouped else [getattr(self, f"weight{i}") for i in range(self.experts)]


@pytest.mark.parametrize("batch_bytes", [128 << 20, 32 * 48 * 4], ids=["one-pass", "expert-by-expert"])
@pytest.mark.parametrize("grouped", [False, True])
def test_te_grouped_weight_hook_quantizes_each_expert_separately(grouped, batch_bytes, monkeypatch):
    monkeypatch.setattr(fake_quant, "QDQ_BATCH_BYTES", batch_bytes)
    mod = FakeTEGroupedLinearForCPU(grouped=grouped)
    mod._quads_target = megatron_core.QuadsTarget("routed", "fc1", lambda: None)
    megatron_core.STATE.config = quads_megatron.load_config(None)
    try:
        hook = megatron_core._wrap_get_weight_tensors(FakeTEGroupedLinearForCPU._get_weight_tensors)
        got = hook(mod)
    finally:
        megatron_core.STATE.config = None
    weights = list(mod.weight) if grouped else mod._get_weight_tensors()
    got = list(got[0]) if grouped else got
    for w, g in zip(weights, got, strict=True):
        assert torch.equal(g, nvfp4.qdq(w.detach()))  # one global scale per expert


@pytest.mark.parametrize("recipe", [nvfp4.NVFP4Recipe(), nvfp4.NVFP4Recipe(True, 256, "MSE")], ids=["plain", "4over6"])
@pytest.mark.parametrize("batch_bytes", [128 << 20, 2 * 16 * 32 * 4], ids=["one-stack", "stacks-of-2"])
def test_a_grouped_linears_experts_are_fake_quantized_together(recipe, batch_bytes, monkeypatch):
    """fake_quant_weights: the same values and STE gradients as fake_quant_weight of each weight; only the
    weights the cache lacks are quantized (together, in stacks of at most QDQ_BATCH_BYTES), the others are
    hits; other shapes go one by one."""
    monkeypatch.setattr(fake_quant, "QDQ_BATCH_BYTES", batch_bytes)
    ws = [torch.nn.Parameter(torch.randn(16, 32) * 4**i) for i in range(4)] + [torch.nn.Parameter(torch.randn(8, 32))]
    spec = fake_quant.FakeQuantSpec(recipe=recipe)
    fake_quant.clear_cache()
    fake_quant.reset_stats()
    fake_quant.fake_quant_weight(ws[1], spec)  # cached before the group
    out = fake_quant.fake_quant_weights(ws, spec)
    assert (fake_quant.STATS.qdq_calls, fake_quant.STATS.cache_hits) == (5, 1)
    for w, o in zip(ws, out, strict=True):
        assert torch.equal(o, nvfp4.qdq(w.detach(), recipe=recipe))
    sum((o * (i + 1)).sum() for i, o in enumerate(out)).backward()
    for i, w in enumerate(ws):
        assert torch.equal(w.grad, torch.full_like(w, i + 1.0))  # straight through
    fake_quant.fake_quant_weights(ws, spec)
    assert (fake_quant.STATS.qdq_calls, fake_quant.STATS.cache_hits) == (5, 6)
    bad = [torch.randn(16, 32), torch.full((16, 32), float("nan"))]
    with pytest.raises(nvfp4.NVFP4InputError, match="expert weight: contains NaN"):
        fake_quant.fake_quant_weights(bad, spec, cache=False)


# ----------------------------------------------------------------------------- built before apply()


def test_layer_built_before_apply_refuses_to_run_unquantized():
    from quads_megatron.errors import QuadsPatchError

    layer = build_moe_layer(moe_config(), seed=0)  # no tags: apply() has not run yet
    x = torch.randn(4, 2, 32)
    quads_megatron.apply()
    with pytest.raises(QuadsPatchError, match=r"MoE layer 1 was built before quads_megatron.apply\(\).*model="):
        layer(x)
    with pytest.raises(QuadsPatchError, match="built before"):  # every call, not only the first
        layer(x)
    assert fake_quant.STATS.qdq_calls == 0
    quads_megatron.apply(model=layer)  # the fix the message names
    assert torch.equal(run(layer, x)[0], run(qdq_copy_of(), x)[0])


def test_layer_built_before_apply_runs_when_the_config_leaves_it_alone():
    layer = build_moe_layer(moe_config(), seed=0, layer_number=1)
    x = torch.randn(4, 2, 32)
    quads_megatron.apply({"trainer": {"layers": [2]}})  # layer 1 is not quantized anyway
    out = run(layer, x)[0]
    quads_megatron.apply({"trainer": {"enabled": False}})
    assert torch.equal(run(layer, x)[0], out)


def test_leave_unquantized_marks_a_reference_model():
    ref = build_moe_layer(moe_config(), seed=0)
    x = torch.randn(4, 2, 32)
    want = run(build_moe_layer(moe_config(), seed=0), x)[0]
    quads_megatron.apply()
    assert megatron_core.leave_unquantized([ref]) == 1
    assert torch.equal(run(ref, x)[0], want) and fake_quant.STATS.qdq_calls == 0
    tagged = build_moe_layer(moe_config(), seed=0)  # built after apply(): quantized
    megatron_core.leave_unquantized(tagged)  # tags removed too
    assert torch.equal(run(tagged, x)[0], want)


def test_remove_restores_moe_forward():
    from megatron.core.transformer.moe.moe_layer import MoELayer

    original = MoELayer.forward
    layer = build_moe_layer(moe_config(), seed=0)
    quads_megatron.apply()
    assert MoELayer.forward is not original
    quads_megatron.remove()
    assert MoELayer.forward is original
    layer(torch.randn(4, 2, 32))  # runs: nothing is applied


# ----------------------------------------------------------------------------- refused Megatron settings


def config_with(**fields):
    """A valid CPU MoE config, then fields set the way a GPU run's TransformerConfig carries them
    (delay_wgrad_compute asserts an EP>1 bf16 alltoall setup at construction, which a CPU test lacks;
    the refusal reads the fields only)."""
    cfg = moe_config()
    for k, v in fields.items():
        setattr(cfg, k, v)
    return cfg


@pytest.mark.parametrize("field", ["delay_wgrad_compute", "overlap_dispatch_backward_with_experts_wgrad"])
def test_delayed_expert_wgrad_without_fusion_is_refused(field, monkeypatch):
    from megatron.core.tensor_parallel import layers

    from quads_megatron.errors import QuadsPatchError

    quads_megatron.apply()
    with pytest.raises(QuadsPatchError, match=rf"^{field}=True without gradient_accumulation_fusion.*backward_dw"):
        build_moe_layer(config_with(**{field: True}), seed=0)
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", _CpuFusedWgradShim, raising=False)
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", True)
    fused = build_moe_layer(config_with(**{field: True, "gradient_accumulation_fusion": True}), seed=0)
    assert fused.experts.local_experts[0].linear_fc1._quads_target.linear == "fc1"  # TE accumulates into main_grad
    quads_megatron.apply({"trainer": {"enabled": False}})
    build_moe_layer(config_with(**{field: True}), seed=0)  # nothing to quantize: not refused


def test_single_grouped_expert_weight_is_refused():
    from quads_megatron.errors import QuadsPatchError

    quads_megatron.apply()
    with pytest.raises(QuadsPatchError, match="^moe_single_grouped_weight=True .*GroupedTensor.*=False"):
        build_moe_layer(config_with(moe_single_grouped_weight=True), seed=0)
    layer = build_moe_layer(moe_config(), seed=0)
    layer.config = config_with(moe_single_grouped_weight=True)
    with pytest.raises(QuadsPatchError, match="moe_single_grouped_weight"):  # apply(model=...) checks too
        quads_megatron.apply(model=layer)


def test_megatron_fsdp_is_refused():
    from quads_megatron.errors import QuadsPatchError

    quads_megatron.apply()
    with pytest.raises(QuadsPatchError, match=r"^Megatron-FSDP .*use_megatron_fsdp=False"):
        build_moe_layer(config_with(init_model_with_meta_device=True), seed=0)
    layer = build_moe_layer(moe_config(), seed=0)
    w = layer.experts.local_experts[0].linear_fc1.weight
    before = w.detach().clone()
    w.__fsdp_param__ = True  # what Megatron-FSDP sets on the parameters it manages
    with pytest.raises(QuadsPatchError, match="Megatron-FSDP"):
        layer(torch.randn(4, 2, 32))
    assert torch.equal(w.detach(), before) and w.grad is None
    assert "weight" not in layer.experts.local_experts[0].linear_fc1.__dict__


def test_dtensor_expert_weights_are_refused_by_apply_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from quads_megatron.errors import QuadsPatchError

    layer = build_moe_layer(moe_config(), seed=0)
    fc2 = layer.experts.local_experts[1].linear_fc2
    mesh = init_device_mesh("cpu", (1,))
    fc2.weight = torch.nn.Parameter(distribute_tensor(fc2.weight.detach(), mesh, [Replicate()]))
    with pytest.raises(QuadsPatchError, match="Megatron-FSDP"):
        quads_megatron.apply(model=layer)
    assert not any(hasattr(m, "_quads_target") for m in layer.modules())  # refused before tagging anything


def test_te_single_grouped_weight_module_is_refused_by_the_hook():
    mod = FakeTEGroupedLinearForCPU()
    mod.single_grouped_weight = True  # TE's GroupedLinear attribute when moe_single_grouped_weight is on
    mod._quads_target = megatron_core.QuadsTarget("routed", "fc1", lambda: None)
    megatron_core.STATE.config = quads_megatron.load_config(None)
    try:
        hook = megatron_core._wrap_get_weight_tensors(FakeTEGroupedLinearForCPU._get_weight_tensors)
        with pytest.raises(megatron_core.QuadsPatchError, match="moe_single_grouped_weight"):
            hook(mod)
    finally:
        megatron_core.STATE.config = None
