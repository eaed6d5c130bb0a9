"""QAT patch on the real Transformer Engine stack (H200): TEGroupedMLP experts (TEColumnParallelGroupedLinear /
TERowParallelGroupedLinear, per-expert weight{i}) and TE linears for shared experts, BF16 on CUDA.

The patched layer must compute exactly what the same layer computes when it holds qdq(W) (the NVFP4
contract) and no patch: forward, input gradients, weight gradients (STE), with and without Megatron's
gradient-accumulation fusion (TE fuse_wgrad_accumulation into param.main_grad), over several
micro-batches with one QDQ per weight per optimizer step; configurations whose TE paths bypass or
break the weight hook are refused with QuadsPatchError naming the config field.

Bit for bit: both runs go through the same TE grouped GEMMs with the same operands, and Megatron's
token unpermute uses index_add under torch.use_deterministic_algorithms (scatter_add otherwise);
each test first checks that the unpatched layer reproduces itself bit for bit, and if this build does
not, compares with BF16 tolerances instead (printed).
"""

from __future__ import annotations

import pytest
import torch
from megatron_model import build_moe_layer, init_megatron, moe_layer_config, te_skip_reason

import quads_megatron
from quads_megatron import fake_quant, nvfp4
from quads_megatron.errors import QuadsPatchError
from quads_megatron.integrations.megatron import qat

TE_SKIP = te_skip_reason()
pytestmark = pytest.mark.skipif(TE_SKIP is not None, reason=TE_SKIP or "")

E, H, F, TOPK, SF = 8, 256, 128, 2, 256
QAT = {"trainer": {"experts": ["routed", "shared"]}}
N_QAT_WEIGHTS = 2 * E + 2  # routed fc1/fc2 per expert + shared fc1/fc2


def step(name: str, ok: bool, detail: str = "") -> None:
    print(f"[te_qat] {'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)


@pytest.fixture(scope="module", autouse=True)
def world():
    init_megatron()
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(was)


@pytest.fixture(autouse=True)
def clean():
    quads_megatron.remove()
    fake_quant.reset_stats()
    fake_quant.clear_cache()
    yield
    quads_megatron.remove()


def config(shared: bool = True, **kw):
    return moe_layer_config(E, H, F, TOPK, shared_ffn=SF if shared else None, **kw)


def qat_weights(layer) -> dict[str, torch.nn.Parameter]:
    """The weights QAT fake-quantizes: TEGroupedMLP weight{i} of fc1/fc2 and the shared experts' fc1/fc2."""
    out = {}
    for n, p in layer.named_parameters():
        routed = n.startswith("experts.linear_fc") and n.rsplit(".", 1)[1][len("weight") :].isdigit()
        shared = n in ("shared_experts.linear_fc1.weight", "shared_experts.linear_fc2.weight")
        if routed or shared:
            out[n] = p
    return out


def check_te_layout(layer) -> None:
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    assert isinstance(layer.experts, TEGroupedMLP), type(layer.experts)
    assert isinstance(layer.experts.linear_fc1, te_ext.TEColumnParallelGroupedLinear)
    assert isinstance(layer.experts.linear_fc2, te_ext.TERowParallelGroupedLinear)
    if layer.shared_experts is not None:
        assert isinstance(layer.shared_experts.linear_fc1, te_ext.TEColumnParallelLinear)
        assert isinstance(layer.shared_experts.linear_fc2, te_ext.TERowParallelLinear)


def copy_params(dst, src) -> None:
    """dst's parameters <- src's (same layer config, so the same names in the same order)."""
    with torch.no_grad():
        for (n, p), (m, q) in zip(dst.named_parameters(), src.named_parameters(), strict=True):
            assert n == m, (n, m)
            p.copy_(q)


def load_qdq_reference(ref, layer) -> None:
    """ref <- layer's weights, expert weights replaced by their contract QDQ (torch nvfp4.qdq)."""
    copy_params(ref, layer)
    with torch.no_grad():
        for p in qat_weights(ref).values():
            p.copy_(nvfp4.qdq(p))


def attach_main_grads(layer) -> None:
    """What Megatron's DDP sets up for gradient_accumulation_fusion: fp32 main_grad buffers and the flag."""
    for p in layer.parameters():
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        p.grad_added_to_main_grad = False


def ddp_fold(layer) -> None:
    """Megatron DDP's backward hook, once per micro-batch: grads that were not fused into main_grad are added."""
    for p in layer.parameters():
        if p.grad is not None and not p.grad_added_to_main_grad:
            p.main_grad.add_(p.grad.float())
        p.grad = None


def reset_first_microbatch(layer) -> None:
    for m in layer.modules():
        if hasattr(m, "is_first_microbatch"):
            m.is_first_microbatch = True


def micro_batch(layer, x: torch.Tensor, seed: int, fused: bool, delay: bool = False):
    """Forward + backward of a fixed projection of the output; returns (out, dL/dx)."""
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    g = torch.Generator(device="cuda").manual_seed(seed)
    proj = torch.randn(out.shape, generator=g, device="cuda", dtype=torch.float32)
    (out.float() * proj).sum().backward()
    if delay:
        layer.backward_dw(routed_experts=True, shared_experts=True)
    if fused:
        ddp_fold(layer)
    return out.detach(), x.grad.detach()


def grads(layer, fused: bool) -> dict[str, torch.Tensor]:
    return {n: (p.main_grad if fused else p.grad).detach().clone() for n, p in layer.named_parameters()}


def inputs(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(16, 4, H, generator=g, device="cuda").bfloat16() for _ in range(n)]


def reproduces(ref, xs, fused: bool, delay: bool = False) -> bool:
    """Does the unpatched layer give the same bits twice? (then every comparison below is exact)"""
    runs = []
    for _ in range(2):
        if fused:
            attach_main_grads(ref)
        reset_first_microbatch(ref)
        outs = [micro_batch(ref, x, i, fused, delay) for i, x in enumerate(xs)]
        runs.append((outs, grads(ref, fused)))
        ref.zero_grad(set_to_none=True)
    (o1, g1), (o2, g2) = runs
    same = all(torch.equal(a, b) for (a0, a1), (b0, b1) in zip(o1, o2, strict=True) for a, b in ((a0, b0), (a1, b1)))
    same = same and all(torch.equal(g1[n], g2[n]) for n in g1)
    reset_first_microbatch(ref)
    return same


def same(name: str, a: torch.Tensor, b: torch.Tensor, exact: bool) -> None:
    if exact:
        assert torch.equal(a, b), f"{name}: max |diff| {(a.float() - b.float()).abs().max():.3e}"
    else:  # BF16 outputs of GEMMs that do not reproduce themselves: a few ulps
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3, msg=name)


@pytest.mark.parametrize("order", ["apply_then_build", "build_then_apply"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain_wgrad", "grad_accum_fusion"])
def test_patched_te_layer_equals_layer_holding_qdq_weights(fused, order):
    cfg_kw = {"gradient_accumulation_fusion": fused}
    ref = build_moe_layer(config(**cfg_kw))  # no patch installed: the reference is never tagged
    qat.leave_unquantized(ref)  # and runs unpatched after apply()
    if order == "apply_then_build":
        quads_megatron.apply(QAT)
        layer = build_moe_layer(config(**cfg_kw))
    else:
        layer = build_moe_layer(config(**cfg_kw))
        quads_megatron.apply(QAT, model=layer)
    check_te_layout(layer)
    weights = qat_weights(layer)
    assert len(weights) == N_QAT_WEIGHTS, sorted(weights)
    load_qdq_reference(ref, layer)
    for n, w in weights.items():  # the patch's CUDA QDQ (Triton twin) is the torch contract
        assert torch.equal(fake_quant.qdq_weight(w, fake_quant.FakeQuantSpec()), nvfp4.qdq(w.detach())), n

    xs = inputs(3)
    exact = reproduces(ref, xs, fused)
    step(f"unpatched TE layer reproduces itself bit for bit ({order}, fused={fused})", exact)
    if fused:
        attach_main_grads(layer)
        attach_main_grads(ref)
    fake_quant.reset_stats()
    for i, x in enumerate(xs):  # micro-batches of one optimizer step
        out, gx = micro_batch(layer, x, i, fused)
        out_ref, gx_ref = micro_batch(ref, x, i, fused)
        same(f"forward, micro-batch {i}", out, out_ref, exact)
        same(f"input grad, micro-batch {i}", gx, gx_ref, exact)
    g, g_ref = grads(layer, fused), grads(ref, fused)
    for n in g:  # STE: dL/dW (accumulated over the micro-batches) equals dL/d(qdq W); router included
        same(f"{'main_grad' if fused else 'grad'} of {n}", g[n], g_ref[n], exact)
    if fused:
        for n, p in weights.items():
            assert p.grad_added_to_main_grad, f"{n}: the fused wgrad was not flagged for DDP"
            assert p.main_grad.dtype == torch.float32 and p.main_grad.abs().sum() > 0, n
    step("forward / input grads / weight grads == qdq-weight layer", True, f"{'bit for bit' if exact else 'BF16 tol'}")
    assert fake_quant.STATS.qdq_calls == N_QAT_WEIGHTS, fake_quant.STATS
    assert fake_quant.STATS.cache_hits >= 2 * N_QAT_WEIGHTS, fake_quant.STATS

    # an optimizer step starts a new weight version: one new QDQ per weight, of the updated weights
    if fused:
        for p in layer.parameters():
            p.grad = p.main_grad.to(p.dtype)
    torch.optim.SGD(layer.parameters(), lr=0.05).step()
    load_qdq_reference(ref, layer)
    layer.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    x = inputs(1, seed=7)[0]
    out, _ = micro_batch(layer, x, 9, fused)
    out_ref, _ = micro_batch(ref, x, 9, fused)
    same("forward after the optimizer step", out, out_ref, exact)
    assert fake_quant.STATS.qdq_calls == 2 * N_QAT_WEIGHTS, fake_quant.STATS
    step("one QDQ per weight per optimizer step", True, f"{fake_quant.STATS}")

    copy_params(ref, layer)  # master weights, no QDQ: the patch really changes the numbers
    with torch.no_grad():
        assert not torch.equal(ref(x)[0], layer(x)[0])


def test_delayed_wgrad_with_fusion_matches_reference():
    """delay_wgrad_compute with gradient_accumulation_fusion: TE's backward_dw writes the STE weight
    gradient into main_grad (the hook's QDQ tensors carry the parameters' main_grad). Megatron gates
    delay_wgrad_compute behind expert-parallel overlap (EP > 1), so the flag is set after validation."""

    def delayed_config():
        c = config(gradient_accumulation_fusion=True)
        c.delay_wgrad_compute = True
        return c

    ref = build_moe_layer(delayed_config())
    qat.leave_unquantized(ref)
    quads_megatron.apply(QAT)
    layer = build_moe_layer(delayed_config())
    assert layer.experts.linear_fc1.wgrad_store.delay_wgrad_compute()
    load_qdq_reference(ref, layer)
    xs = inputs(2, seed=3)
    exact = reproduces(ref, xs, fused=True, delay=True)
    attach_main_grads(layer)
    attach_main_grads(ref)
    for i, x in enumerate(xs):
        out, gx = micro_batch(layer, x, i, fused=True, delay=True)
        out_ref, gx_ref = micro_batch(ref, x, i, fused=True, delay=True)
        same(f"forward, micro-batch {i}", out, out_ref, exact)
        same(f"input grad, micro-batch {i}", gx, gx_ref, exact)
    g, g_ref = grads(layer, True), grads(ref, True)
    for n in qat_weights(layer):
        assert g[n].abs().sum() > 0, f"{n}: delayed wgrad never reached main_grad"
    for n in g:
        same(f"main_grad of {n}", g[n], g_ref[n], exact)
    step("delayed wgrad + fusion == qdq-weight layer", True, "bit for bit" if exact else "BF16 tol")


REFUSED = {
    # the op fuser builds fused TE ops that never call the grouped linears' _get_weight_tensors
    "use_transformer_engine_op_fuser": {},
    # one GroupedTensor [E, N, K] parameter, read by the op fuser's grouped ops
    "moe_single_grouped_weight": {},
    # without fusion, TE's backward_dw sets .grad on what _get_weight_tensors returns: the QDQ tensors
    "delay_wgrad_compute": {"gradient_accumulation_fusion": False},
}


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_unsupported_te_configs_are_refused(field, monkeypatch):
    """QuadsPatchError naming the config field, whether the model is built after apply() or tagged by
    apply(model=...). Megatron validates some of these only together with others (single grouped weight
    needs the op fuser, delayed wgrad needs EP overlap), so the field is set after validation."""
    if field == "use_transformer_engine_op_fuser":
        # TEGroupedMLP builds its fused path only where TE's CuTe DSL grouped MLP is enabled (sm100
        # kernels); the flag lets the layer be built on Hopper (it is never run here)
        monkeypatch.setenv("NVTE_CUTEDSL_FUSED_GROUPED_MLP", "1")
    layer = build_moe_layer(config(shared=False, **REFUSED[field]))
    setattr(layer.config, field, True)  # the config the layer and its experts share
    with pytest.raises(QuadsPatchError, match=field):
        quads_megatron.apply(QAT, model=layer)
    step(f"{field}: refused at apply(model=...)", True)

    quads_megatron.remove()
    quads_megatron.apply(QAT)
    cfg = config(shared=False, **REFUSED[field])
    setattr(cfg, field, True)
    with pytest.raises(QuadsPatchError, match=field):
        build_moe_layer(cfg)
    step(f"{field}: refused when building after apply()", True)


def test_supported_config_is_not_refused():
    """The control of the refusals: the same layer with fusion (and no unsupported field) is patched."""
    layer = build_moe_layer(config(shared=False, gradient_accumulation_fusion=True))
    quads_megatron.apply(QAT, model=layer)
    attach_main_grads(layer)
    micro_batch(layer, inputs(1)[0], 0, fused=True)
    assert fake_quant.STATS.qdq_calls == 2 * E
