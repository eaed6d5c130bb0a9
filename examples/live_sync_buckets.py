"""Live weight sync, trainer side: Megatron expert params of one EP rank -> NVFP4 ModelOpt tensors
with HF names, in buckets ready for an inference engine's update_weights_from_tensor.

Runs on a CPU: builds a real megatron-core MoE layer (4 experts) and prints the buckets. In a
real job, call megatron_expert_tensors(model.named_parameters(), ep_rank, num_local_experts) on
every EP rank (after gathering expert-TP shards) and send each bucket to an SGLang server that
runs the quads_nvfp4 method:

    engine.update_weights_from_tensor(bucket, load_format="quads_megatron.integrations.sglang.load_weights")

(the server was launched with --custom-weight-loader quads_megatron.integrations.sglang.load_weights).
checkpoint.flat_buckets(tensors) gives the same buckets as one uint8 tensor each (one CUDA IPC handle
per bucket); the loader unflattens and checks them like separate tensors.
Each bucket keeps an expert's gate and up together (they share one global scale), so the server
can check and apply it on its own. Pass the QUADS config's NVFP4 variant
(``nvfp4_config=load_config("quads.yaml").nvfp4``, the one the trainer fake-quantizes with) when it
is not plain NVFP4.
"""

from quads_megatron import checkpoint
from quads_megatron.demo.cpu_megatron import (
    build_moe_layer,
    init_distributed,
    install_cpu_shims_for_megatron,
    moe_config,
)


def main() -> None:
    install_cpu_shims_for_megatron()
    init_distributed()
    layer = build_moe_layer(moe_config(num_experts=4, hidden=64, ffn=64), layer_number=1)
    named = [(f"decoder.layers.0.mlp.{n}", p.detach()) for n, p in layer.named_parameters()]
    tensors = checkpoint.megatron_expert_tensors(named, ep_rank=0, num_local_experts=4)
    for i, bucket in enumerate(checkpoint.bucketed(tensors, bucket_bytes=16 << 10)):
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        print(f"bucket {i}: {len(bucket)} tensors, {size} bytes")
        for name, t in bucket[:4]:
            print(f"  {name} {tuple(t.shape)} {t.dtype}")
    tensors = checkpoint.megatron_expert_tensors(named, ep_rank=0, num_local_experts=4)
    for i, [(name, flat)] in enumerate(checkpoint.flat_buckets(tensors, bucket_bytes=16 << 10)):
        print(f"flat bucket {i}: one {flat.dtype} tensor of {flat.numel()} bytes, metadata {len(name)} characters")


if __name__ == "__main__":
    main()
