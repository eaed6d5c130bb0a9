"""The rollout of `quads rl`: an SGLang Engine on the trainer's GPU (colocated), synced in place every step.

The engine serves the SFT checkpoint (HF BF16, or its `quads convert` output for the NVFP4 arms: the
quads_nvfp4 method with the arm's dynamic RAC ratio embedded) and takes the trainer's weights before each
rollout through ``update_weights_from_tensor`` with our loader: BF16 non-expert tensors (HF names) plus
packed NVFP4 experts (the trainer's exact codes and scales) or, for the BF16 arm, BF16 experts, each
bucket as one flat tensor (checkpoint.flat_buckets: one CUDA IPC handle per bucket). The engine
arguments and the sync are those tests/gpu/test_live_sync.py runs on the H200.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator

import torch

from quads_megatron.rl.spec import ArmSpec, ModelSpec, StudySpec

LOADER = "quads_megatron.integrations.sglang.load_weights"
BUCKET_BYTES = 128 << 20


def rollout_yaml(arm: ArmSpec) -> str:
    """The QUADS config's rollout section of an NVFP4 arm (dynamic activation scales, dynamic RAC)."""
    on = "true" if arm.rac_ratio > 0 else "false"
    return (
        f"rollout:\n  activation_scale: dynamic\n  rac: {{enabled: {on}, ratio: {arm.rac_ratio}, selection: dynamic}}\n"
    )


def sync_stream(model: torch.nn.Module, model_spec: ModelSpec, packed: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """What one live sync sends: every non-expert parameter as HF-named BF16-or-FP32 tensors, then the
    routed experts as packed NVFP4 ModelOpt tensors (packed) or HF-named BF16 weights."""
    from quads_megatron import checkpoint
    from quads_megatron.rl.megatron_model import hf_expert_weights_bf16, hf_non_expert_weights

    cfg = model_spec.hf_config()
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    experts = (
        checkpoint.megatron_expert_tensors(named, ep_rank=0, num_local_experts=model_spec.experts)
        if packed
        else hf_expert_weights_bf16(named, num_local_experts=model_spec.experts)
    )
    return itertools.chain(hf_non_expert_weights(named, cfg), experts)


def engine_checkpoint(arm: ArmSpec, hf_dir: str, work_dir: str) -> str:
    """The checkpoint the arm's engine starts from: the HF export (BF16 arm) or its `quads convert`
    output with the arm's rollout settings (one per RAC ratio, converted once, reused)."""
    if arm.rollout == "bf16":
        return hf_dir
    from quads_megatron import cli

    dst = os.path.join(work_dir, f"nvfp4_rac{arm.rac_ratio * 100:g}")
    if os.path.isdir(dst):
        return dst
    os.makedirs(work_dir, exist_ok=True)
    yaml_path = dst + ".quads.yaml"
    with open(yaml_path, "w") as f:
        f.write(rollout_yaml(arm))
    rc = cli.main(["convert", hf_dir, dst, "--quads-config", yaml_path, "--quiet"])
    if rc != 0:
        raise RuntimeError(f"quads convert {hf_dir} {dst} exited with {rc}")
    return dst


def engine_kwargs(arm: ArmSpec, model_path: str, spec: StudySpec) -> dict:
    """SGLang Engine arguments (those the H200 live-sync test runs with)."""
    kw = dict(
        model_path=model_path,
        dtype="bfloat16",
        tp_size=1,
        mem_fraction_static=spec.mem_fraction,
        attention_backend="triton",
        sampling_backend="pytorch",
        grammar_backend="none",
        skip_tokenizer_init=True,
        disable_cuda_graph=not spec.cuda_graph,
        disable_radix_cache=True,  # every request computes every position
        custom_weight_loader=[LOADER],
        random_seed=spec.seed,
        log_level="error",
    )
    if spec.cuda_graph:
        kw["cuda_graph_max_bs_decode"] = min(spec.batch, 256)
    if arm.rollout == "nvfp4":
        kw["quantization"] = "quads_nvfp4"
    return kw


def parse_outputs(outputs: list[dict], answer_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled tokens int64 [N, A] and their logprobs fp32 [N, A] from Engine.generate's responses
    (meta_info.output_token_logprobs entries are (logprob, token id, text))."""
    tokens, logps = [], []
    for i, r in enumerate(outputs):
        entries = r["meta_info"]["output_token_logprobs"]
        if len(entries) != answer_len:
            raise RuntimeError(f"request {i}: {len(entries)} output logprobs for {answer_len} new tokens")
        ids = [int(e[1]) for e in entries]
        if r.get("output_ids") is not None and [int(t) for t in r["output_ids"]][-answer_len:] != ids:
            raise RuntimeError(f"request {i}: output_ids and the logprob entries' token ids differ")
        tokens.append(ids)
        logps.append([float(e[0]) for e in entries])
    return torch.tensor(tokens, dtype=torch.long), torch.tensor(logps, dtype=torch.float32)


class SglangRollout:
    """An SGLang Engine in this process (its scheduler in a child), on the trainer's GPU."""

    def __init__(self, arm: ArmSpec, model_path: str, spec: StudySpec) -> None:
        import sglang

        from quads_megatron.integrations.sglang import check_version

        check_version()  # the scheduler would refuse the quads_nvfp4 plugin outside its range
        self.arm, self.spec = arm, spec
        t0 = time.perf_counter()
        self.engine = sglang.Engine(**engine_kwargs(arm, model_path, spec))
        self.start_s = time.perf_counter() - t0

    def sync(self, model: torch.nn.Module) -> dict[str, float]:
        """Trainer weights -> engine, in place, bucketed; the last bucket flushes the cache."""
        from quads_megatron import checkpoint

        t0 = time.perf_counter()
        stream = sync_stream(model, self.spec.model, packed=self.arm.rollout == "nvfp4")
        buckets = list(checkpoint.flat_buckets(stream, BUCKET_BYTES))
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        for i, bucket in enumerate(buckets):
            ok, msg = self.engine.update_weights_from_tensor(
                bucket, load_format=LOADER, flush_cache=i == len(buckets) - 1
            )
            if not ok:
                raise RuntimeError(f"update_weights_from_tensor (bucket {i} of {len(buckets)}) failed: {msg}")
        mb = sum(t.numel() for b in buckets for _, t in b) / 1e6  # flat uint8 buffers (alignment included)
        return {"perf/sync_prepare_s": t1 - t0, "perf/sync_send_s": time.perf_counter() - t1, "perf/sync_mb": mb}

    def generate(self, prompts: torch.Tensor, answer_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sample of answer_len tokens per prompt row at temperature 1: (tokens, logprobs) on CPU."""
        params = {"temperature": 1.0, "max_new_tokens": answer_len, "ignore_eos": True}
        out = self.engine.generate(input_ids=prompts.tolist(), sampling_params=params, return_logprob=True)
        return parse_outputs(out, answer_len)

    def rng_state(self) -> dict:
        return {}  # the engine's sampling is not resumable bit for bit

    def set_rng_state(self, state: dict) -> None:
        pass

    def close(self) -> None:
        self.engine.shutdown()
