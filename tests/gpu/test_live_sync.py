"""A Megatron-Core Qwen3-MoE trainer and a colocated SGLang engine, kept in sync live (the real stack).

* test_hf_megatron_mapping_round_trips (any machine, CI): megatron_model's HF -> Megatron mapping loads the
  tiny Qwen3-MoE checkpoint into a real GPTModel (local spec), the library's megatron_to_hf maps it back
  bit for bit, live_sync's expert tensors equal `quads convert`'s, and the Megatron forward equals the HF
  transformers forward (architecture: QK norm, RoPE base, RMSNorm eps, renormalized top-k routing).
* test_sync_stream_loads_into_sglang_qwen3_moe (CPU, CI): the sync's tensors (packed or BF16 experts)
  leave SGLang's own Qwen3-MoE model (built on the CPU) exactly as loading the converted checkpoint of
  the same weights does.
* test_te_gpt_model_matches_hf (H200): the same with the Transformer Engine spec (TEGroupedMLP) in BF16.
* test_live_sync_into_sglang_engine (H200): the TE GPTModel with QAT, an SGLang engine serving the
  `quads convert` output with quads_nvfp4 (dynamic RAC 50%, CUDA graphs); one optimizer step, a bucketed
  live sync of packed NVFP4 experts + BF16 non-expert weights, then engine vs trainer logprobs, the
  BF16 sync path, flat buckets, CUDA graphs seeing the new weights, and the sync's time.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import engine_worker as ew
import pytest
import torch
from megatron_model import (
    build_gpt_model,
    hf_expert_weights_bf16,
    hf_non_expert_weights,
    hf_to_megatron,
    init_megatron,
    load_hf_state,
    load_hf_weights,
    te_skip_reason,
    token_logprobs,
)
from tiny_moe import qwen3_moe_config, write_checkpoint

from quads_megatron import checkpoint, nvfp4


def step(name: str, ok: bool, detail: str = "") -> None:
    """One PASS/FAIL line per step, so that the device log reads on its own."""
    print(f"[live_sync] {'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (float8 and fp32 scalars included)."""
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def seq_ids(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 1, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def world():
    init_megatron()
    yield


# ----------------------------------------------------------------------------- mapping (CI)


def _cpu_rng_fork_stand_in(*args, **kwargs):
    """CPU stand-in for megatron's CUDA RNG tracker fork (attention dropout is 0: nothing is drawn)."""
    return contextlib.nullcontext()


def test_hf_megatron_mapping_round_trips(world, tmp_path, monkeypatch):
    from megatron.core import tensor_parallel
    from transformers import Qwen3MoeForCausalLM

    from quads_megatron.checkpoint.hf_mapping import EXPERT_PARAM

    cfg = qwen3_moe_config()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # megatron's local attention forks the CUDA RNG state even without dropout
        monkeypatch.setattr(tensor_parallel.get_cuda_rng_tracker(), "fork", _cpu_rng_fork_stand_in)
    src = write_checkpoint(tmp_path / "hf", cfg)
    hf = load_hf_state(src)
    assert any(".mlp.experts.0.gate_proj.weight" in n for n in hf), "tiny_moe must save per-expert HF names"

    model = build_gpt_model(
        cfg, spec="local", dtype=torch.float32, device=device, moe_token_dispatcher_type="allgather"
    )
    used = load_hf_weights(model, hf, cfg)
    assert sorted(used) == sorted(hf), f"HF tensors never loaded: {sorted(set(hf) - set(used))[:4]}"

    # non-expert weights: Megatron -> HF through the library is the identity on the checkpoint
    back = dict(hf_non_expert_weights(model.named_parameters(), cfg))
    want = {n for n in hf if not EXPERT_PARAM.search(n)}
    assert set(back) == want
    for n, t in back.items():
        assert torch.equal(t.to(hf[n].dtype).cpu(), hf[n]), n
    # BF16 expert names for the loader's quantizing path
    bf16 = dict(hf_expert_weights_bf16(model.named_parameters(), num_local_experts=cfg["num_experts"]))
    assert set(bf16) == {n for n in hf if EXPERT_PARAM.search(n)}
    for n, t in bf16.items():
        assert torch.equal(t.to(hf[n].dtype).cpu(), hf[n]), n

    # routed experts: the live-sync tensors are the converter's, bit for bit
    dst = str(tmp_path / "nvfp4")
    checkpoint.convert_hf(src, dst, checkpoint.ConvertOptions(progress=False))
    converted = load_hf_state(dst)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    live = dict(checkpoint.megatron_expert_tensors(named, ep_rank=0, num_local_experts=cfg["num_experts"]))
    conv_experts = {n: t for n, t in converted.items() if ".mlp.experts." in n and not n.endswith("input_scale")}
    assert set(live) == set(conv_experts)
    for n, t in live.items():
        assert same_bits(t, conv_experts[n]), n

    # TE-spec names map to the same tensors (the GPU tests load through them)
    te_names = {
        "layers.1.self_attention.linear_qkv.layer_norm_weight": "layers.1.input_layernorm.weight",
        "layers.1.mlp.experts.linear_fc1.weight5": "layers.1.mlp.experts.local_experts.5.linear_fc1.weight",
        "layers.0.mlp.experts.linear_fc2.weight15": "layers.0.mlp.experts.local_experts.15.linear_fc2.weight",
    }
    for te_name, local_name in ((f"decoder.{a}", f"decoder.{b}") for a, b in te_names.items()):
        assert torch.equal(hf_to_megatron(te_name, hf, cfg), hf_to_megatron(local_name, hf, cfg)), te_name
    with pytest.raises(KeyError, match="no Qwen3-MoE HF source"):
        hf_to_megatron("decoder.layers.0.mlp.linear_fc1.weight", hf, cfg)

    # the architecture matches: Megatron's forward equals transformers' (fp32)
    ref = Qwen3MoeForCausalLM.from_pretrained(src, torch_dtype=torch.float32).to(device).eval()
    ids = seq_ids(cfg["vocab_size"], 24, seed=5)
    with torch.no_grad():
        lp_meg = token_logprobs(model.eval(), ids)
        logits = ref(torch.tensor([ids], device=device)).logits[0, :-1].float()
        lp_hf = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:], device=device)[:, None])[:, 0]
    diff = (lp_meg - lp_hf).abs()
    step("fp32 Megatron (local spec) vs transformers logprobs", bool(diff.max() < 2e-3), f"max |diff| {diff.max():.2e}")
    assert diff.max() < 2e-3, f"Megatron and HF disagree: max |logprob diff| {diff.max():.3e}"


@pytest.fixture(scope="module")
def sglang_cpu_model():
    """SGLang's own Qwen3-MoE model on this CPU, built by SGLang's loader as the CPU method tests build it
    (tests/sglang_env.py: gloo world, the rotary stand-in `vllm_rope_stub_for_cpu`)."""
    if torch.cuda.is_available():
        pytest.skip("CPU SGLang model; on a GPU the engine test syncs into a real engine")
    pytest.importorskip("sglang")
    import sglang_env

    with sglang_env.cpu_runtime():
        yield lambda path: sglang_env.build_model(path)[1]


def test_sync_stream_loads_into_sglang_qwen3_moe(world, tmp_path, sglang_cpu_model):
    """What the live sync sends (megatron_to_hf BF16 non-expert tensors + packed NVFP4 experts, bucketed,
    or BF16 experts the loader quantizes) leaves SGLang's Qwen3-MoE model bit for bit as loading the
    `quads convert` output of the same weights does, every parameter written."""
    import itertools
    import shutil

    from safetensors.torch import save_file

    from quads_megatron.integrations import sglang as plug

    cfg = qwen3_moe_config(hidden=128, moe_inter=64, experts=4, topk=2, heads=4, kv_heads=2, head_dim=32, vocab=256)
    src = write_checkpoint(tmp_path / "hf", cfg)
    checkpoint.convert_hf(src, str(tmp_path / "nvfp4"), checkpoint.ConvertOptions(progress=False))
    model = build_gpt_model(
        cfg, spec="local", dtype=torch.bfloat16, device="cpu", moe_token_dispatcher_type="allgather"
    )
    load_hf_weights(model, load_hf_state(src), cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # the trainer's new weights
        for p in model.parameters():
            p.mul_((1 + 0.3 * torch.rand(p.shape, generator=g)).to(p.dtype))
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    experts = cfg["num_experts"]

    # expected: those weights as an HF checkpoint, converted, loaded by SGLang
    new_hf = tmp_path / "hf_new"
    new_hf.mkdir()
    tensors = dict(hf_non_expert_weights(named, cfg)) | dict(hf_expert_weights_bf16(named, experts))
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(new_hf / "model.safetensors"), {"format": "pt"})
    shutil.copy(os.path.join(src, "config.json"), new_hf / "config.json")
    checkpoint.convert_hf(str(new_hf), str(tmp_path / "nvfp4_new"), checkpoint.ConvertOptions(progress=False))
    want = dict(sglang_cpu_model(tmp_path / "nvfp4_new").named_parameters())

    for packed in (True, False):
        served = sglang_cpu_model(tmp_path / "nvfp4")  # serving the original weights
        before = {n: p.detach().clone() for n, p in served.named_parameters()}
        sent = (
            checkpoint.megatron_expert_tensors(named, ep_rank=0, num_local_experts=experts)
            if packed
            else hf_expert_weights_bf16(named, experts)
        )
        for bucket in checkpoint.bucketed(itertools.chain(hf_non_expert_weights(named, cfg), sent), 1 << 16):
            plug.load_weights(served, bucket)
        got = dict(served.named_parameters())
        assert set(got) == set(want)
        for n, p in got.items():
            assert same_bits(p, want[n]), f"{'packed' if packed else 'BF16'} sync: {n} differs"
            if not n.endswith("input_scale"):  # dynamic activation scales: no input_scale is sent
                assert not same_bits(p, before[n]), f"{n} was not written by the sync"


# ----------------------------------------------------------------------------- TE spec (H200)

TE_SKIP = te_skip_reason()
LOADER = "quads_megatron.integrations.sglang.load_weights"


def test_te_gpt_model_matches_hf(world, tmp_path):
    """The Transformer Engine GPTModel (TEGroupedMLP, fused layernorm names) loads the HF checkpoint and
    its BF16 forward is the HF model's; non-expert weights map back through megatron_to_hf bit for bit."""
    if TE_SKIP:
        pytest.skip(TE_SKIP)
    from transformers import Qwen3MoeForCausalLM

    from quads_megatron.checkpoint.hf_mapping import EXPERT_PARAM

    cfg = qwen3_moe_config()
    src = write_checkpoint(tmp_path / "hf", cfg)
    hf = load_hf_state(src)
    model = build_gpt_model(cfg, spec="te")
    names = [n for n, _ in model.named_parameters()]
    assert any(n.endswith("mlp.experts.linear_fc1.weight0") for n in names), names[:8]  # TEGroupedMLP
    assert sorted(load_hf_weights(model, hf, cfg)) == sorted(hf)
    back = dict(hf_non_expert_weights(model.named_parameters(), cfg))
    assert set(back) == {n for n in hf if not EXPERT_PARAM.search(n)}
    for n, t in back.items():
        assert same_bits(t, hf[n]), n
    ref = Qwen3MoeForCausalLM.from_pretrained(src, torch_dtype=torch.bfloat16).cuda().eval()
    ids = seq_ids(cfg["vocab_size"], 48, seed=7)
    with torch.no_grad():
        lp_meg = token_logprobs(model.eval(), ids)
        logits = ref(torch.tensor([ids], device="cuda")).logits[0, :-1].float()
        lp_hf = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:], device="cuda")[:, None])[:, 0]
    diff = (lp_meg - lp_hf).abs()
    # BF16 on both sides (different attention/GEMM kernels, a routing tie may flip): a mapping error
    # (head order, gate/up swap, RoPE base, routing) moves logprobs by tenths, rounding by thousandths
    ok = bool(diff.mean() < 0.03)
    step("BF16 TE GPTModel vs transformers logprobs", ok, f"mean |diff| {diff.mean():.4f}, max {diff.max():.4f}")
    assert ok, f"TE GPTModel and HF disagree: mean |logprob diff| {diff.mean():.4f}"


# ----------------------------------------------------------------------------- live sync (H200)


def engine_skip_reason() -> str | None:
    if TE_SKIP:
        return TE_SKIP
    try:
        import sglang  # noqa: F401
        from sglang.srt.entrypoints.engine import Engine  # noqa: F401
    except Exception as e:
        return f"needs the SGLang engine ({type(e).__name__}: {e})"
    from quads_megatron.errors import QuadsSglangError
    from quads_megatron.integrations.sglang import check_version

    try:
        check_version()
    except QuadsSglangError as e:  # the engine's scheduler would refuse to load the plugin
        return str(e)
    return None


def convert_with_cli(src: str, dst: str, workdir) -> None:
    """`quads convert` of the HF checkpoint with dynamic RAC 50% embedded (what the engine serves)."""
    import subprocess

    yaml_path = os.path.join(str(workdir), "quads.yaml")
    with open(yaml_path, "w") as f:
        f.write("rollout:\n  activation_scale: dynamic\n  rac: {enabled: true, ratio: 0.5, selection: dynamic}\n")
    cmd = [sys.executable, "-m", "quads_megatron.cli", "convert", src, dst, "--quads-config", yaml_path, "--quiet"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"quads convert failed ({res.returncode}): {res.stderr[-2000:]}"


def start_engine(model_path: str):
    import sglang

    return sglang.Engine(
        model_path=model_path,
        quantization="quads_nvfp4",
        dtype="bfloat16",
        tp_size=1,
        mem_fraction_static=0.2,
        attention_backend="triton",
        sampling_backend="pytorch",
        grammar_backend="none",
        skip_tokenizer_init=True,
        disable_cuda_graph=False,
        cuda_graph_max_bs_decode=4,
        disable_radix_cache=True,  # every request computes every position
        custom_weight_loader=[LOADER],
        random_seed=0,
        log_level="error",
    )


def engine_logprobs(engine, ids: list[int], vocab: int) -> torch.Tensor:
    """fp32 [len(ids) - 1]: the engine's log p(ids[t] | ids[:t]) for t >= 1 (prefill, input logprobs)."""
    out = engine.generate(
        input_ids=ids,
        sampling_params={"temperature": 0.0, "max_new_tokens": 1, "ignore_eos": True},
        return_logprob=True,
        logprob_start_len=0,
    )
    entries = out["meta_info"]["input_token_logprobs"]
    assert len(entries) == len(ids), f"{len(entries)} input logprobs for {len(ids)} tokens"
    want = ew.reported_ids(ids, vocab)
    assert [int(e[1]) for e in entries] == want, "input logprobs are not aligned with the input ids"
    return torch.tensor([float(e[0]) for e in entries[1:]], dtype=torch.float32)


def engine_greedy(engine, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens and their logprobs (the first from the prefill, the rest from CUDA-graph decode)."""
    out = engine.generate(
        input_ids=prompt,
        sampling_params={"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True},
        return_logprob=True,
    )
    entries = out["meta_info"]["output_token_logprobs"]
    assert len(entries) == n, f"{len(entries)} output logprobs for {n} new tokens"
    tokens = [int(t) for t in out["output_ids"]] if "output_ids" in out else [int(e[1]) for e in entries]
    return tokens, torch.tensor([float(e[0]) for e in entries], dtype=torch.float32)


def live_sync(
    engine, named: list[tuple[str, torch.Tensor]], cfg: dict, packed: bool, bucket_bytes: int, flat: bool = False
) -> dict:
    """Trainer weights -> engine in place: BF16 non-expert tensors (HF names, megatron_to_hf) and routed
    experts as packed NVFP4 (megatron_expert_tensors) or BF16 (the loader quantizes), bucketed (flat: each
    bucket as one uint8 tensor, checkpoint.flat_buckets)."""
    import itertools

    t0 = time.perf_counter()
    experts = (
        checkpoint.megatron_expert_tensors(named, ep_rank=0, num_local_experts=cfg["num_experts"])
        if packed
        else hf_expert_weights_bf16(named, num_local_experts=cfg["num_experts"])
    )
    group = checkpoint.flat_buckets if flat else checkpoint.bucketed
    buckets = list(group(itertools.chain(hf_non_expert_weights(named, cfg), experts), bucket_bytes))
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    for i, bucket in enumerate(buckets):
        ok, msg = engine.update_weights_from_tensor(bucket, load_format=LOADER, flush_cache=i == len(buckets) - 1)
        assert ok, f"update_weights_from_tensor (bucket {i}) failed: {msg}"
    t2 = time.perf_counter()
    nbytes = sum(t.numel() * t.element_size() for b in buckets for _, t in b)
    return {"prepare_s": t1 - t0, "send_s": t2 - t1, "mb": nbytes / 1e6, "buckets": len(buckets)}


@contextlib.contextmanager
def rollout_activation_emulation(model, rac_ratio: float):
    """Trainer-side W4A4 emulation of the rollout's expert GEMM inputs: each row (token) of fc1's and
    fc2's input through the contract with a per-token global scale, plus dynamic RAC of rac_ratio
    (0: plain W4A4). Forward pre-hooks on every TEGroupedMLP's grouped linears."""
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    from quads_megatron.config import RACConfig
    from quads_megatron.rollout import reference

    def make_hook(channels: int):
        def hook(module, args):
            x = args[0]
            flat = x.reshape(-1, x.shape[-1])
            if flat.shape[0] == 0:
                return None
            qa = reference.quantize_activation(flat, None, None, channels)
            y = nvfp4.dequantize(qa.x)
            if qa.residual is not None:
                y = y + nvfp4.dequantize(qa.residual)
            return (y.to(x.dtype).reshape(x.shape), *args[1:])

        return hook

    rac = RACConfig(enabled=rac_ratio > 0, ratio=rac_ratio, selection="dynamic")
    handles = []
    try:
        for m in model.modules():
            if isinstance(m, TEGroupedMLP):
                for lin in (m.linear_fc1, m.linear_fc2):
                    handles.append(lin.register_forward_pre_hook(make_hook(rac.num_channels(lin.in_features))))
        assert handles, "no TEGroupedMLP in the model"
        yield
    finally:
        for h in handles:
            h.remove()


def mean_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().mean())


class Checks:
    """Steps of one long GPU test that must not stop each other: each check and each guarded block
    prints PASS/FAIL; the test fails at the end with every failure listed."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        step(name, ok, detail)
        if not ok:
            self.failures.append(f"{name}: {detail}")
        return ok

    @contextlib.contextmanager
    def guard(self, name: str):
        try:
            yield
        except Exception as e:  # recorded; the next independent step still runs
            self.check(name, False, f"{type(e).__name__}: {e}"[:2000])

    def done(self) -> None:
        assert not self.failures, "\n".join(self.failures)


def test_live_sync_into_sglang_engine(world, tmp_path):
    reason = engine_skip_reason()
    if reason:
        pytest.skip(reason)
    import quads_megatron
    from quads_megatron import fake_quant

    cfg = qwen3_moe_config()
    vocab = cfg["vocab_size"]
    src = write_checkpoint(tmp_path / "hf", cfg)
    dst = str(tmp_path / "nvfp4")
    convert_with_cli(src, dst, tmp_path)
    step("quads convert of the HF checkpoint", True, dst)
    checks = Checks()

    quads_megatron.remove()
    quads_megatron.apply({"trainer": {"experts": ["routed"]}})
    engine = None
    try:
        model = build_gpt_model(cfg, spec="te")  # tagged for QAT at construction
        load_hf_weights(model, load_hf_state(src), cfg)
        prompt = seq_ids(vocab, 24, seed=11)
        ids = prompt + seq_ids(vocab, 40, seed=12)  # prompt + forced continuation

        def trainer_logprobs(rac_ratio: float | None = None) -> torch.Tensor:
            """The trainer's recomputation (BF16, QAT weights); with rac_ratio, the rollout's activation
            quantization emulated on the expert GEMM inputs (0: naive W4A4)."""
            with torch.no_grad():
                if rac_ratio is None:
                    return token_logprobs(model, ids).cpu()
                with rollout_activation_emulation(model, rac_ratio):
                    return token_logprobs(model, ids).cpu()

        t_engine = time.perf_counter()
        engine = start_engine(dst)
        step("engine start (quads_nvfp4, RAC 50%, CUDA graphs)", True, f"{time.perf_counter() - t_engine:.0f} s")

        # before: the converted checkpoint against the trainer's QAT model of the same weights
        e0, e0_again = engine_logprobs(engine, ids, vocab), engine_logprobs(engine, ids, vocab)
        jitter = float((e0 - e0_again).abs().max())
        step("engine logprobs repeat bit for bit", jitter == 0.0, f"max |diff| {jitter:.2e}")
        gen0, dec0 = engine_greedy(engine, prompt, 10)
        t0, n0, r0 = trainer_logprobs(), trainer_logprobs(0.0), trainer_logprobs(0.5)
        gap0 = {"engine": mean_abs(e0, t0), "naive W4A4": mean_abs(n0, t0), "trainer RAC emulation": mean_abs(r0, t0)}
        ok = gap0["engine"] < gap0["naive W4A4"]
        checks.check("before the sync: engine closer to the trainer than naive W4A4", ok, str(gap0))

        # (a) one optimizer step of the continuation's NLL (QAT: STE gradients onto the BF16 masters)
        w0 = [(n, p.detach().clone()) for n, p in model.named_parameters()]
        opt = torch.optim.Adam(model.parameters(), lr=5e-3)
        loss = -token_logprobs(model, ids)[len(prompt) - 1 :].mean()
        loss.backward()
        calls = fake_quant.STATS.qdq_calls
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1 = trainer_logprobs()
        checks.check("the optimizer step starts a new QDQ weight version", fake_quant.STATS.qdq_calls > calls)
        step("trainer step", True, f"loss {float(loss):.4f}, trainer logprobs moved {mean_abs(t1, t0):.4f}")
        named1 = [(n, p.detach()) for n, p in model.named_parameters()]
        syncs: dict[str, dict] = {}
        e1 = gen1 = dec1 = f1 = None

        # (b) live sync: packed NVFP4 experts + BF16 non-expert weights, bucketed, in place
        with checks.guard("packed NVFP4 live sync and what the engine serves after it"):
            syncs["packed NVFP4"] = live_sync(engine, named1, cfg, packed=True, bucket_bytes=2 << 20)
            e1 = engine_logprobs(engine, ids, vocab)
            gen1, dec1 = engine_greedy(engine, prompt, 10)  # decode replays the CUDA graphs captured at start
            f1 = engine_logprobs(engine, prompt + gen1, vocab)[len(prompt) - 1 :]

            # (c) engine vs trainer after the sync: as close as RAC allows
            n1, r1 = trainer_logprobs(0.0), trainer_logprobs(0.5)
            diff = (e1 - t1).abs()
            gaps = {
                "engine": float(diff.mean()),
                "naive W4A4": mean_abs(n1, t1),
                "trainer RAC emulation": mean_abs(r1, t1),
                "engine vs RAC emulation": mean_abs(e1, r1),
                "stale engine": mean_abs(e0, t1),
            }
            print(f"[live_sync] after sync: engine vs trainer mean |diff| {diff.mean():.4f} max {diff.max():.4f}")
            ok = gaps["engine"] < gaps["naive W4A4"]
            checks.check("after the sync: engine closer to the trainer than naive W4A4", ok, str(gaps))
            checks.check(
                "the sync moved the engine to the new trainer",
                gaps["engine"] < 0.5 * gaps["stale engine"] and mean_abs(e1, e0) > gaps["engine"],
                str(gaps),
            )
            checks.check("greedy decode changed with the sync", gen0 != gen1 or mean_abs(dec0, dec1) > 0)

        # (d) BF16 path: the original weights, then the new ones; each equal to the packed path bit for bit
        tol = 2 * jitter  # 0 when the engine repeats itself bit for bit (checked above)
        with checks.guard("BF16 live sync of the original weights"):
            syncs["BF16 (original)"] = live_sync(engine, w0, cfg, packed=False, bucket_bytes=2 << 20)
            d_old = float((engine_logprobs(engine, ids, vocab) - e0).abs().max())
            ok = d_old <= tol
            checks.check("BF16 sync of the original weights == `quads convert` output", ok, f"max |diff| {d_old:.2e}")
            if gen1 is not None:  # the old weights' prefill of the tokens decoded after the packed sync
                f1_old = engine_logprobs(engine, prompt + gen1, vocab)[len(prompt) - 1 :]
                graph_gap, stale_gap = mean_abs(dec1[1:], f1[1:]), mean_abs(dec1[1:], f1_old[1:])
                checks.check(
                    "CUDA-graph decode after the sync used the synced weights",
                    graph_gap < 0.5 * stale_gap,
                    f"decode vs prefill {graph_gap:.4f}; vs the old weights' prefill {stale_gap:.4f}",
                )
        with checks.guard("BF16 live sync of the new weights"):
            syncs["BF16 (new)"] = live_sync(engine, named1, cfg, packed=False, bucket_bytes=2 << 20)
            e_new = engine_logprobs(engine, ids, vocab)
            if e1 is not None:
                d_new = float((e_new - e1).abs().max())
                ok = d_new <= tol
                checks.check("BF16 sync of the new weights == the packed NVFP4 sync", ok, f"max |diff| {d_new:.2e}")

        # (e) flat buckets (one CUDA IPC handle per bucket): the same weights as the tensor-by-tensor sync
        with checks.guard("flat-bucket live sync"):
            syncs["packed NVFP4, flat (original)"] = live_sync(engine, w0, cfg, True, 2 << 20, flat=True)
            d_old = float((engine_logprobs(engine, ids, vocab) - e0).abs().max())
            checks.check("flat sync of the original weights == `quads convert` output", d_old <= tol, f"{d_old:.2e}")
            syncs["packed NVFP4, flat (new)"] = live_sync(engine, named1, cfg, True, 2 << 20, flat=True)
            if e1 is not None:
                d_new = float((engine_logprobs(engine, ids, vocab) - e1).abs().max())
                checks.check("flat sync of the new weights == the tensor-by-tensor sync", d_new <= tol, f"{d_new:.2e}")

        # (f) the sync's cost
        for name, s in syncs.items():
            print(
                f"[live_sync] sync {name}: {s['mb']:.2f} MB in {s['buckets']} buckets, prepare {s['prepare_s']:.3f} s, "
                f"send+load {s['send_s']:.3f} s ({s['mb'] / max(s['send_s'], 1e-9):.0f} MB/s)"
            )
    finally:
        if engine is not None:
            engine.shutdown()
        quads_megatron.remove()
    checks.done()
