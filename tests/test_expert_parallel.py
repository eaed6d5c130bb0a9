"""Expert parallel on CPU: EP=2 and EP=4 (gloo processes) vs EP=1 with QUADS applied, real megatron-core.

Same global weights and tokens in both layouts: outputs, input grads, per-expert (STE) grads and
summed router grads agree within fp32 summation order, and each expert's NVFP4 codes and scales
(live-sync tensors) are byte-identical across layouts.
"""

import os

import torch
import torch.multiprocessing as mp

from helpers import free_port

E, H, F = 4, 32, 48
BATCHES = 4  # token batches in all; EP=W gives each rank BATCHES / W of them, EP=1 runs every one


def _worker(rank: int, world: int, port: int, workdir: str) -> None:
    import quads_megatron
    from helpers import load_expert_state, random_expert_state
    from quads_megatron import checkpoint
    from quads_megatron.demo.cpu_megatron import (
        build_moe_layer,
        init_distributed,
        install_cpu_shims_for_megatron,
        moe_config,
    )

    install_cpu_shims_for_megatron()
    init_distributed(rank, world, port=port, ep=world)
    quads_megatron.apply()
    layer = build_moe_layer(moe_config(num_experts=E, hidden=H, ffn=F), seed=0)
    load_expert_state(layer, random_expert_state(E, H, F), rank)
    local = E // world
    inputs = torch.load(os.path.join(workdir, "inputs.pt"))
    per_rank = BATCHES // world
    mine = inputs[rank * per_rank : (rank + 1) * per_rank]
    outs, xgrads = [], []
    for x in mine:  # EP=1 sees every rank's tokens, one batch after the other
        x = x.clone().requires_grad_(True)
        out, _ = layer(x)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        outs.append(out.detach())
        xgrads.append(x.grad)
    result = {
        "out": outs,
        "xgrad": xgrads,
        "router_grad": layer.router.weight.grad,
        "expert_grads": {
            rank * local + i: (ex.linear_fc1.weight.grad, ex.linear_fc2.weight.grad)
            for i, ex in enumerate(layer.experts.local_experts)
        },
        "codes": dict(
            checkpoint.megatron_expert_tensors(
                [(f"decoder.layers.0.mlp.{n}", p.detach()) for n, p in layer.named_parameters()], rank, local
            )
        ),
    }
    torch.save(result, os.path.join(workdir, f"ep{world}_rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def test_ep2_and_ep4_match_ep1_with_quads(tmp_path):
    g = torch.Generator().manual_seed(0)
    torch.save(torch.randn(BATCHES, 6, 2, H, generator=g), tmp_path / "inputs.pt")
    for world in (1, 2, 4):
        mp.spawn(_worker, args=(world, free_port(), str(tmp_path)), nprocs=world, join=True)
    ep1 = torch.load(tmp_path / "ep1_rank0.pt")
    close = lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    for world in (2, 4):
        ranks = [torch.load(tmp_path / f"ep{world}_rank{r}.pt") for r in range(world)]
        outs = [o for r in ranks for o in r["out"]]  # in batch order, as EP=1 ran them
        xgrads = [x for r in ranks for x in r["xgrad"]]
        for b in range(BATCHES):
            assert close(outs[b], ep1["out"][b]), (world, b)
            assert close(xgrads[b], ep1["xgrad"][b]), (world, b)
        assert close(sum(r["router_grad"] for r in ranks), ep1["router_grad"]), world  # DP-reduced router grad
        for r in ranks:
            for gidx, (g1, g2) in r["expert_grads"].items():
                assert close(g1, ep1["expert_grads"][gidx][0]) and close(g2, ep1["expert_grads"][gidx][1]), gidx
        live = {k: v for r in ranks for k, v in r["codes"].items()}
        assert live.keys() == ep1["codes"].keys() and len(live) == E * 3 * 3, world
        for k, v in ep1["codes"].items():
            assert torch.equal(v.reshape(-1).view(torch.uint8), live[k].reshape(-1).view(torch.uint8)), (world, k)
