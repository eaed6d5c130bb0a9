"""Live weight sync (quads_megatron.integrations.sglang.load_weights) into a real SGLang Qwen3-MoE model
on CPU: packed and BF16 updates written in place, and every bad update refused before its first write.
"""

import os

import pytest
import torch

if os.environ.get("QUADS_REQUIRE_SGLANG") == "1":
    import sglang  # noqa: F401  (CI: a missing sglang is a failure, not a skip)
sglang = pytest.importorskip("sglang")

from quads_megatron import checkpoint, nvfp4  # noqa: E402
from quads_megatron.checkpoint import modelopt  # noqa: E402
from quads_megatron.integrations import sglang as plug  # noqa: E402
from quads_megatron.rollout.moe_block import moe_w4a4  # noqa: E402
from sglang_env import (  # noqa: E402
    LAYERS,
    E,
    expected_experts,
    experts_of,
    param_bytes,
    rank_model,
    read_dir,
    routing,
)

pytest_plugins = ["sglang_env"]


# ----------------------------------------------------------------------------- live weight sync


def snapshot(model):
    return {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters() if ".experts." in n}


def perturbed_bf16(checkpoints, seed):
    g = torch.Generator().manual_seed(seed)
    src = read_dir(checkpoints / "bf16")
    return {n: (t.float() * (1 + 0.3 * torch.rand(t.shape, generator=g))).bfloat16() for n, t in src.items()}


@pytest.mark.parametrize("flat", [False, True], ids=["tensors", "flat"])
def test_trainer_packed_weights_sync_in_place(checkpoints, loaded, flat):
    """The trainer's export (megatron_expert_tensors) -> load_weights: written in place, used at once;
    the same as flat buckets (one uint8 tensor per bucket, unflattened by the loader)."""
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    new = perturbed_bf16(checkpoints, 11 if flat else 1)
    megatron = []
    for layer in range(LAYERS):
        for e in range(E):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            fc1 = torch.cat([new[f"{p}.gate_proj.weight"], new[f"{p}.up_proj.weight"]])
            megatron.append((f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc1.weight", fc1))
            megatron.append(
                (
                    f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc2.weight",
                    new[f"{p}.down_proj.weight"],
                )
            )
    packed = dict(checkpoint.megatron_expert_tensors(megatron, num_local_experts=E))
    before = snapshot(loaded)
    buckets = checkpoint.flat_buckets if flat else checkpoint.bucketed
    for bucket in buckets(packed.items(), bucket_bytes=1200):  # smaller than one gate+up pair
        plug.load_weights(loaded, bucket)
    after = snapshot(loaded)
    assert all(after[n][0] == before[n][0] for n in before)  # same storage: CUDA graphs stay valid
    assert any(not torch.equal(after[n][1], before[n][1]) for n in before)
    x, ids, w = routing(seed=3)
    for layer in range(LAYERS):
        moe = experts_of(loaded, layer)
        want = moe_w4a4(x, ids, w, expected_experts(packed, layer), moe.quant_method.rac, impl="reference")
        assert torch.equal(moe(x, StandardTopKOutput(w, ids, torch.zeros(x.shape[0], E))), want)


def test_bf16_sync_quantizes_with_the_contract(checkpoints, loaded):
    new = perturbed_bf16(checkpoints, 2)
    p = "model.layers.0.mlp.experts.2"
    names = [f"{p}.gate_proj.weight", f"{p}.down_proj.weight", f"{p}.up_proj.weight"]
    plug.load_weights(loaded, [(n, new[n]) for n in names])
    got = experts_of(loaded, 0).quant_method.expert_weights(experts_of(loaded, 0))
    gate, up = new[names[0]], new[names[2]]
    assert got.expert(2, "w13").same_bits(
        nvfp4.quantize(torch.cat([gate, up]), global_amax=nvfp4.shared_amax(gate, up))
    )
    assert got.expert(2, "w2").same_bits(nvfp4.quantize(new[names[1]]))


def test_bad_updates_are_refused_and_nothing_is_written(checkpoints, loaded):
    new = perturbed_bf16(checkpoints, 4)
    p = "model.layers.1.mlp.experts.0"
    good = dict(
        modelopt.modelopt_tensors(f"{p}.down_proj", modelopt.quantize_linear(new[f"{p}.down_proj.weight"], "d"), None)
    )
    gate_q = modelopt.quantize_linear(new[f"{p}.gate_proj.weight"], "g")
    gate = modelopt.modelopt_tensors(f"{p}.gate_proj", gate_q, None)
    up = modelopt.modelopt_tensors(f"{p}.up_proj", modelopt.quantize_linear(new[f"{p}.up_proj.weight"], "u"), None)
    nan = new["model.layers.1.self_attn.o_proj.weight"].clone()
    nan[0, 0] = float("nan")
    cases = {
        "NaN/Inf": [*good.items(), ("model.layers.1.self_attn.o_proj.weight", nan)],
        "differs from": [*good.items(), *gate.items(), *up.items()],  # gate/up quantized with separate amaxes
        "send gate and up global scales together": [*good.items(), *gate.items()],
        "same update": [*good.items(), (f"{p}.gate_proj.weight", new[f"{p}.gate_proj.weight"])],
        "negative block scales": [
            *{
                **good,
                f"{p}.down_proj.weight_scale": (-good[f"{p}.down_proj.weight_scale"].float()).to(torch.float8_e4m3fn),
            }.items()
        ],
    }
    before = {n: t.detach().clone() for n, t in loaded.state_dict().items()}
    for msg, update in cases.items():
        with pytest.raises(plug.QuadsSglangError, match=msg):
            plug.load_weights(loaded, update)
        assert all(torch.equal(before[n], t) for n, t in loaded.state_dict().items()), msg


# ----------------------------------------------------------------------------- refusals

P1 = "model.layers.1.mlp.experts.3"  # the packed expert of the good update
BF = "model.layers.0.mlp.experts.2"  # the BF16 expert of the good update


def packed_expert(new, p: str) -> dict[str, torch.Tensor]:
    """ModelOpt tensors of one expert (gate/up quantized with their shared amax) and its input scales."""
    gate, up, down = (new[f"{p}.{proj}.weight"] for proj in ("gate_proj", "up_proj", "down_proj"))
    amax = nvfp4.shared_amax(gate, up)
    out = {}
    for proj, w, a in (("gate_proj", gate, amax), ("up_proj", up, amax), ("down_proj", down, None)):
        out.update(modelopt.modelopt_tensors(f"{p}.{proj}", modelopt.quantize_linear(w, proj, a), 0.5))
    return out


def _nan_e4m3(t):
    t = t.clone()
    t.view(torch.uint8)[0, 0] = 0x7F  # e4m3 NaN
    return t


#: case -> (message regex, the bad tensors (name, tensor) given the new BF16 weights and the packed
#: expert P1). Each passed silently, or was half-written, before every tensor was resolved and checked.
BAD = {
    "unknown name": ("unknown: no parameter", lambda n, q: [("model.layers.0.self_attn.o_proj.weigth", q["o"])]),
    "expert out of range": (
        r"expert 7 outside \[0, 4\)",
        lambda n, q: [("model.layers.0.mlp.experts.7.down_proj.weight", q[f"{P1}.down_proj.weight"])],
    ),
    "projection name of another model family": (
        "expert projection 'w1'",
        lambda n, q: [("model.layers.0.mlp.experts.1.w1.weight", q[f"{P1}.gate_proj.weight"])],
    ),
    "fused FusedMoE parameter": (
        "fused FusedMoE parameter",
        lambda n, q: [("model.layers.0.mlp.experts.w2_weight", q[f"{P1}.down_proj.weight"].expand(4, -1, -1))],
    ),
    "un-gathered expert-TP fc1 shard": (  # half of the rows of gate (codes and block scales)
        r"shape \(16, 32\), expected \(32, 32\).*gather expert-TP shards",
        lambda n, q: [
            (f"{P1}.gate_proj.weight", q[f"{P1}.gate_proj.weight"][:16]),
            (f"{P1}.gate_proj.weight_scale", q[f"{P1}.gate_proj.weight_scale"][:16]),
        ],
    ),
    "un-gathered expert-TP fc2 shard": (
        r"shape \(64, 8\), expected \(64, 16\)",
        lambda n, q: [(f"{P1}.down_proj.weight", q[f"{P1}.down_proj.weight"][:, :8])],
    ),
    "BF16 weight of the wrong width": (
        r"shape \(32, 48\), expected \(32, 64\)",
        lambda n, q: [(f"{BF}.up_proj.weight", n[f"{BF}.up_proj.weight"][:, :48])],
    ),
    "codes not uint8": (
        "dtype torch.int8, expected torch.uint8",
        lambda n, q: [(f"{P1}.down_proj.weight", q[f"{P1}.down_proj.weight"].view(torch.int8))],
    ),
    "block scales not e4m3": (
        "dtype torch.uint8, expected torch.float8_e4m3fn",
        lambda n, q: [(f"{P1}.down_proj.weight_scale", q[f"{P1}.down_proj.weight_scale"].view(torch.uint8))],
    ),
    "global scale not fp32": (
        "dtype torch.bfloat16, expected torch.float32",
        lambda n, q: [(f"{P1}.down_proj.weight_scale_2", q[f"{P1}.down_proj.weight_scale_2"].bfloat16())],
    ),
    "FP16 expert weight": (
        r"dtype torch.float16, expected torch.uint8 \(packed\) or bfloat16/float32",
        lambda n, q: [(f"{P1}.down_proj.weight", n[f"{P1}.down_proj.weight"].half())],
    ),
    "global scale not a scalar": (
        "one scalar per expert",
        lambda n, q: [(f"{P1}.down_proj.weight_scale_2", q[f"{P1}.down_proj.weight_scale_2"].reshape(1).repeat(2))],
    ),
    "NaN block scale": (
        "NaN/Inf",
        lambda n, q: [(f"{P1}.down_proj.weight_scale", _nan_e4m3(q[f"{P1}.down_proj.weight_scale"]))],
    ),
    "zero input scale": (
        "input_scale must be positive",
        lambda n, q: [(f"{P1}.down_proj.input_scale", torch.tensor(0.0))],
    ),
    "gate and up input scales differ": (
        "differs from .*gate_proj.input_scale",
        lambda n, q: [
            (f"{P1}.gate_proj.input_scale", torch.tensor(0.5)),
            (f"{P1}.up_proj.input_scale", torch.tensor(0.25)),
        ],
    ),
    "BF16 and packed for one projection": (
        "both as a BF16 weight and as packed",
        lambda n, q: [(f"{BF}.up_proj.weight_scale", q[f"{P1}.up_proj.weight_scale"])],
    ),
    "BF16 and packed for the down projection": (
        "down_proj.weight: sent both as a BF16 weight and as packed",
        lambda n, q: [(f"{BF}.down_proj.weight_scale_2", q[f"{P1}.down_proj.weight_scale_2"])],
    ),
    "same name twice": ("appears twice", lambda n, q: [(f"{P1}.down_proj.weight", q[f"{P1}.down_proj.weight"])]),
    "q_proj sent as k_proj": (
        r"shape \(64, 64\), expected \(32, 64\) for model.layers.0.self_attn.qkv_proj",
        lambda n, q: [("model.layers.0.self_attn.k_proj.weight", n["model.layers.0.self_attn.q_proj.weight"])],
    ),
    "dense weight of the wrong shape": (
        r"shape \(64, 63\), expected \(64, 64\)",
        lambda n, q: [("model.layers.1.self_attn.o_proj.weight", q["o"][:, :63])],
    ),
    "integer dense weight": (
        "dtype torch.int32, expected bfloat16 or float32",
        lambda n, q: [("model.layers.1.post_attention_layernorm.weight", torch.ones(64, dtype=torch.int32))],
    ),
    "non-finite dense weight": ("NaN/Inf", lambda n, q: [("model.norm.weight", torch.full((64,), float("inf")))]),
}


@pytest.fixture(scope="module")
def good_update(checkpoints):
    """A good mixed update: one expert packed (with input scales), one expert BF16, a BF16 attention weight."""
    new = perturbed_bf16(checkpoints, 7)
    q = packed_expert(new, P1)
    items = list(q.items())
    items += [(f"{BF}.{proj}.weight", new[f"{BF}.{proj}.weight"]) for proj in ("gate_proj", "up_proj", "down_proj")]
    items += [("model.layers.1.self_attn.o_proj.weight", new["model.layers.1.self_attn.o_proj.weight"])]
    q["o"] = new["model.layers.1.self_attn.o_proj.weight"]
    return new, q, items


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_tensor_last_refuses_the_whole_update_and_writes_nothing(loaded, good_update, case):
    new, q, good = good_update
    pattern, bad = BAD[case]
    bad = bad(new, q)
    if case != "same name twice":  # the bad tensors replace the good ones of their names, at the end
        good = [(n, t) for n, t in good if n not in dict(bad)]
    before = param_bytes(loaded)
    with pytest.raises(plug.QuadsSglangError, match=f"nothing was written: .*{pattern}") as err:
        plug.load_weights(loaded, good + bad)
    assert "\n" not in str(err.value)
    assert param_bytes(loaded) == before  # every parameter: same storage, same bytes


def test_a_flat_bucket_is_checked_like_its_tensors(loaded, good_update):
    """A bad tensor inside a flat bucket, or a malformed bucket, refuses the update with one line before
    anything is written; the good update as one flat bucket is written."""
    from quads_megatron.checkpoint.live_sync import FLAT_PREFIX, flatten_bucket

    new, q, good = good_update
    bad = BAD["NaN block scale"][1](new, q)
    mixed = [(n, t) for n, t in good if n not in dict(bad)] + bad
    name, flat = flatten_bucket(mixed)
    before = param_bytes(loaded)
    for update, pattern in (
        ([(name, flat)], BAD["NaN block scale"][0]),
        ([(name, flat[:-64])], "outside the"),
        ([(FLAT_PREFIX + "{", flat)], "unreadable metadata"),
    ):
        with pytest.raises(plug.QuadsSglangError, match=f"nothing was written: .*{pattern}") as err:
            plug.load_weights(loaded, update)
        assert "\n" not in str(err.value)
        assert param_bytes(loaded) == before
    plug.load_weights(loaded, [flatten_bucket(good)])
    moe = experts_of(loaded, 1)
    assert torch.equal(moe.quant_method.expert_weights(moe).expert(3, "w2").codes, q[f"{P1}.down_proj.weight"])


def test_the_refusal_counts_every_problem(loaded, good_update):
    new, q, good = good_update
    bad = BAD["unknown name"][1](new, q) + BAD["zero input scale"][1](new, q) + BAD["same name twice"][1](new, q)
    with pytest.raises(plug.QuadsSglangError, match=r"o_proj.weigth: unknown: .* \(3 problems in this update\)"):
        plug.load_weights(loaded, good + bad)


def test_the_good_update_is_written(loaded, good_update):
    """The update the refusal tests extend is itself accepted: full-size packed and BF16 experts, input
    scales of the global expert index, a BF16 attention weight."""
    new, q, good = good_update
    plug.load_weights(loaded, good)
    moe = experts_of(loaded, 1)
    got = moe.quant_method.expert_weights(moe).expert(3, "w2")
    assert torch.equal(got.codes, q[f"{P1}.down_proj.weight"])
    s = nvfp4.input_scale_from_amax(torch.tensor(0.5))
    assert torch.equal(moe.w13_input_scale[3], s.expand(2)) and torch.equal(moe.w2_input_scale[3], s)
    o = loaded.model.layers[1].self_attn.o_proj.weight
    assert torch.equal(o, new["model.layers.1.self_attn.o_proj.weight"])


def test_every_checkpoint_tensor_is_accepted_at_its_full_hf_shape(checkpoints, loaded):
    """The converted checkpoint's own tensors (q/k/v and gate/up parts, embeddings, norms, router, packed
    experts) all resolve and pass the checks: the rules refuse nothing SGLang's loader takes."""
    from quads_megatron.integrations.sglang.weight_sync import check_update

    conv = read_dir(checkpoints / "nvfp4")
    targets = check_update(loaded, list(conv.items()))
    assert len(targets) == len(conv) and all(t.param is not None for t in targets)
    assert {t.shard for t in targets} >= {"q", "k", "v", "w1", "w2", "w3"}
    skipped = check_update(loaded, [("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8))])
    assert skipped[0].param is None  # SGLang's loaders skip it on purpose


# ----------------------------------------------------------------------------- tensor and expert parallel


def _parallel_worker(rank: int, world: int, port: int, ckpt: str, ep: int) -> None:
    """One rank of a TP=2 SGLang model on CPU (gloo): ep=1 -> attention and expert TP 2, ep=2 -> attention
    TP 2 and expert parallel 2 (two experts a rank). Asserts what this rank loads, writes and refuses."""
    import pathlib

    model = rank_model(rank, world, port, f"{ckpt}/nvfp4", ep)
    moe = experts_of(model, 0)
    new = perturbed_bf16(pathlib.Path(ckpt), 11)
    experts = {e: packed_expert(new, f"model.layers.0.mlp.experts.{e}") for e in range(E)}
    update = [item for e in range(E) for item in experts[e].items()]
    q_proj = ("model.layers.0.self_attn.q_proj.weight", new["model.layers.0.self_attn.q_proj.weight"])

    def refused(bad, pattern):  # the bad tensors replace those of their names, at the end
        before = param_bytes(model)
        with pytest.raises(plug.QuadsSglangError, match=pattern):
            plug.load_weights(model, [(n, t) for n, t in update if n not in dict(bad)] + bad)
        assert param_bytes(model) == before

    if ep == 1:  # expert TP 2: this rank holds rows [16r, 16r + 16) of gate and up, columns of down
        assert moe.moe_tp_size == 2 and moe.w13_weight.shape == (E, 32, 32) and moe.w2_weight.shape == (E, 64, 8)
        gate = experts[1]["model.layers.0.mlp.experts.1.gate_proj.weight"]
        refused(
            [("model.layers.0.mlp.experts.1.gate_proj.weight", gate[16 * rank : 16 * rank + 16])],
            r"shape \(16, 32\), expected \(32, 32\)",
        )
        refused([(q_proj[0], q_proj[1][32 * rank : 32 * rank + 32])], r"shape \(32, 64\), expected \(64, 64\)")
        plug.load_weights(model, update + [q_proj])
        got = moe.quant_method.expert_weights(moe)
        assert torch.equal(got.w13_codes[1, :16], gate[16 * rank : 16 * rank + 16])
        down = experts[2]["model.layers.0.mlp.experts.2.down_proj.weight"]
        assert torch.equal(got.w2_codes[2], down[:, 8 * rank : 8 * rank + 8])
        qkv = model.model.layers[0].self_attn.qkv_proj.weight
        assert torch.equal(qkv[:32], q_proj[1][32 * rank : 32 * rank + 32])
    else:  # EP 2: this rank holds experts 2r, 2r + 1; the others' tensors are checked, then skipped
        assert moe.moe_ep_size == 2 and moe.num_local_experts == 2 and moe.w13_weight.shape == (2, 64, 32)
        refused(
            [
                (
                    "model.layers.0.mlp.experts.4.down_proj.weight",
                    experts[0]["model.layers.0.mlp.experts.0.down_proj.weight"],
                )
            ],
            r"expert 4 outside \[0, 4\)",
        )
        nan = experts[3]["model.layers.0.mlp.experts.3.down_proj.weight_scale"].clone()
        nan.view(torch.uint8)[0, 0] = 0x7F
        refused([("model.layers.0.mlp.experts.3.down_proj.weight_scale", nan)], "NaN/Inf")  # held by rank 1 alone
        plug.load_weights(model, update)
        got = moe.quant_method.expert_weights(moe)
        for local in range(2):
            e = 2 * rank + local
            assert torch.equal(got.w2_codes[local], experts[e][f"model.layers.0.mlp.experts.{e}.down_proj.weight"])


@pytest.mark.parametrize("ep", [1, 2], ids=["expert_tp2", "ep2"])
def test_tensor_and_expert_parallel_ranks_check_the_full_update_and_write_their_part(checkpoints, ep):
    import torch.multiprocessing as mp

    from helpers import free_port

    mp.spawn(_parallel_worker, args=(2, free_port(), str(checkpoints), ep), nprocs=2)
