"""The live sync's fast paths: experts quantized in batches (nvfp4.quantize_each, megatron_expert_tensors)
give the bits of one-by-one quantization, and flat buckets (checkpoint.flat_buckets) carry those bits
unchanged; malformed flat buckets and bad weights are refused with the same one-line errors."""

import pytest
import torch

from quads_megatron import checkpoint, nvfp4
from quads_megatron.checkpoint import live_sync, modelopt
from quads_megatron.config import NVFP4Config
from quads_megatron.errors import ConvertError

RECIPES = [
    nvfp4.NVFP4Recipe(),
    nvfp4.NVFP4Recipe(True, 256, "MAE"),
    nvfp4.NVFP4Recipe(True, 448, "MSE"),
]


def experts(n: int, rows: int, k: int, seed: int) -> torch.Tensor:
    """[n, rows, k] bf16 weights whose experts differ in scale by up to 1000x (global scales differ), with
    a zero expert (S_enc = 1) and an all-equal one."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, rows, k, generator=g) * torch.logspace(-2, 1, n).view(n, 1, 1)
    w[1] = 0
    w[2] = 0.37
    return w.bfloat16()


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"4o6={r.use_4over6}-{r.e4m3_max}-{r.err_mode}")
@pytest.mark.parametrize("shared", [False, True])
def test_quantize_each_is_quantize_of_every_slice(recipe, shared):
    w = experts(6, 8, 64, seed=1)
    amax = torch.logspace(-1, 2, 6) if shared else None
    got = nvfp4.quantize_each(w, amax, recipe)
    for b in range(w.shape[0]):
        want = nvfp4.quantize(w[b], "tensor", None if amax is None else amax[b], recipe=recipe)
        assert got[b].same_bits(want), b
        assert got[b].global_decode.shape == ()


def test_quantize_each_refuses_bad_input():
    w = experts(3, 4, 32, seed=2)
    with pytest.raises(nvfp4.NVFP4InputError, match="needs 3 values"):
        nvfp4.quantize_each(w, torch.ones(2))
    with pytest.raises(nvfp4.NVFP4InputError, match="finite and non-negative"):
        nvfp4.quantize_each(w, torch.tensor([1.0, -1.0, 1.0]))
    with pytest.raises(nvfp4.NVFP4InputError, match="expected \\[B, ..., K\\]"):
        nvfp4.quantize_each(w[0, 0])


def te_names(layers: int, n: int, w1: torch.Tensor, w2: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """TEGroupedMLP parameter names (linear_fc1.weight{i}), attention params between the layers."""
    out = []
    for layer in range(layers):
        out.append((f"decoder.layers.{layer}.self_attention.linear_qkv.weight", torch.zeros(4, 4)))
        out += [(f"decoder.layers.{layer}.mlp.experts.linear_fc1.weight{i}", w1[layer * n + i]) for i in range(n)]
        out += [(f"decoder.layers.{layer}.mlp.experts.linear_fc2.weight{i}", w2[layer * n + i]) for i in range(n)]
    return out


def one_by_one(named, ep_rank, n, cfg):
    """megatron_expert_tensors' output as it was before batching: each expert quantized alone."""
    out = []
    for name, w in named:
        m = live_sync._MCORE_TE.match(name) or live_sync._MCORE_SEQ.match(name)
        if m is None:
            continue
        base = f"model.layers.{int(m['layer'])}.mlp.experts.{ep_rank * n + int(m['i'])}"
        q = modelopt.quantize_linear(w, name, recipe=cfg.weights)
        if m["fc"] == "fc2":
            out += modelopt.modelopt_tensors(f"{base}.down_proj", q, None).items()
            continue
        half = q.codes.shape[0] // 2
        for proj, rows in (("gate_proj", slice(0, half)), ("up_proj", slice(half, None))):
            part = nvfp4.NVFP4Tensor(q.codes[rows], q.block_scales[rows], q.global_decode)
            out += modelopt.modelopt_tensors(f"{base}.{proj}", part, None).items()
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


@pytest.mark.parametrize("four_over_six", ["none", "weights"])
def test_batched_expert_tensors_are_the_one_by_one_tensors(four_over_six, monkeypatch):
    n, layers = 5, 2
    w1, w2 = experts(layers * n, 16, 32, seed=3), experts(layers * n, 32, 16, seed=4)
    named = te_names(layers, n, w1, w2)
    cfg = NVFP4Config(nvfp4_4over6=four_over_six)
    assert cfg.weights.use_4over6 == (four_over_six == "weights")
    monkeypatch.setattr(live_sync, "RUN_BYTES", 3 * 16 * 32 * 4)  # runs cut into batches of 3 experts
    got = list(checkpoint.megatron_expert_tensors(named, ep_rank=1, num_local_experts=n, nvfp4_config=cfg))
    want = one_by_one(named, 1, n, cfg)
    assert [name for name, _ in got] == [name for name, _ in want]
    for (name, a), (_, b) in zip(got, want, strict=True):
        assert same_bits(a, b), name
    storages = [t.untyped_storage().data_ptr() for _, t in got]
    assert len(set(storages)) == len(storages)  # own storage per tensor (safetensors, receivers)


def test_a_bad_expert_is_named_in_a_batch():
    w1, w2 = experts(4, 16, 32, seed=5), experts(4, 32, 16, seed=6)
    w1[2, 3, 5] = float("nan")
    named = te_names(1, 4, w1, w2)
    with pytest.raises(ConvertError, match=r"linear_fc1\.weight2: contains NaN"):
        list(checkpoint.megatron_expert_tensors(named, num_local_experts=4))
    odd = [(f"decoder.layers.0.mlp.experts.linear_fc1.weight{i}", torch.ones(3, 32)) for i in range(2)]
    with pytest.raises(ConvertError, match="weight0: fc1 has an odd row count 3"):
        list(checkpoint.megatron_expert_tensors(odd, num_local_experts=2))


def test_flat_bucket_round_trip_keeps_every_bit():
    w1, w2 = experts(3, 16, 32, seed=7), experts(3, 32, 16, seed=8)
    tensors = list(checkpoint.megatron_expert_tensors(te_names(1, 3, w1, w2), num_local_experts=3))
    tensors.append(("model.norm.weight", torch.randn(7, dtype=torch.bfloat16)))
    flats = list(checkpoint.flat_buckets(tensors, bucket_bytes=1500))
    assert len(flats) > 1 and all(len(b) == 1 for b in flats)
    back = [pair for b in flats for pair in live_sync.unflatten_bucket(*b[0])]
    assert [n for n, _ in back] == [n for n, _ in tensors]
    for (name, a), (_, b) in zip(tensors, back, strict=True):
        assert same_bits(a, b), name
    for _, flat in (b[0] for b in flats):
        assert flat.dtype == torch.uint8 and flat.dim() == 1


def test_malformed_flat_buckets_are_refused():
    name, flat = live_sync.flatten_bucket([("a.weight", torch.ones(4, 16)), ("a.weight_scale_2", torch.tensor(1.0))])
    meta = name[len(live_sync.FLAT_PREFIX) :]
    bad = {
        "unreadable metadata": (live_sync.FLAT_PREFIX + "[[", flat),
        "bad entry": (live_sync.FLAT_PREFIX + '[["a", "complex64", [2], 0]]', flat),
        "outside the": (live_sync.FLAT_PREFIX + meta.replace("[4,16],0", "[400,16],0"), flat),
        "expected a 1-D uint8 tensor": (name, flat.view(torch.int8)),
    }
    for msg, (n, t) in bad.items():
        with pytest.raises(ValueError, match=msg):
            live_sync.unflatten_bucket(n, t)
    with pytest.raises(ValueError, match="no flat form"):
        live_sync.flatten_bucket([("b", torch.ones(2, dtype=torch.complex64))])


@pytest.mark.parametrize("join_bytes", [64 << 20, 100], ids=["joined", "cut"])
def test_the_loaders_batched_value_tests_answer_as_per_tensor_tests(join_bytes, monkeypatch):
    """weight_sync._failing (tensors of a test, dtype and size tested together) gives each tensor the
    answer its own test gives: NaN/Inf anywhere, a negative element, an element not > 0; empty tensors,
    -0.0, fp8 and one-element tensors included."""
    from quads_megatron.integrations.sglang import weight_sync

    monkeypatch.setattr(weight_sync, "JOIN_BYTES", join_bytes)  # 100: groups cut into a few tensors each

    def own(test, t):
        x = t if t.dtype in (torch.bfloat16, torch.float32) else t.float()
        if test == "nonfinite":
            return not bool(torch.isfinite(x).all())
        return bool((x < 0).any()) if test == "negative" else not bool((x > 0).all())

    g = torch.Generator().manual_seed(9)
    tests = []
    for i in range(60):
        shape = [(4, 8), (4, 8), (), (1,), (0,), (3, 5)][i % 6]
        t = torch.rand(shape, generator=g) + 0.1
        if t.numel() and i % 4 == 1:
            bad = [float("nan"), -0.0, -1.0, 0.0, float("inf")][(i // 4) % 5]
            t.view(-1)[int(torch.randint(0, t.numel(), (1,), generator=g))] = bad
        dtype = [torch.float32, torch.bfloat16, torch.float8_e4m3fn][i % 3]
        for test in ("nonfinite", "negative", "nonpositive"):
            tests.append((test, t.to(dtype)))
    want = [own(test, t) for test, t in tests]
    assert weight_sync._failing(tests) == want
    assert any(want) and not all(want)
