"""Where each tensor of a live weight update lands in an SGLang model, and what it must look like there.

UpdateIndex.resolve maps an incoming (HF / ModelOpt) name to the parameter SGLang's loader writes:
expert tensors through FusedMoE.make_expert_params_mapping (the mapping the models' load_weights use),
the parts of fused linears (q/k/v -> qkv_proj, gate/up -> gate_up_proj) through the model's
packed_modules_mapping, everything else by its own name. expected_shape gives the shape SGLang's loader
takes for it: the checkpoint's full tensor, which the loader narrows to this rank's tensor-parallel
shard itself (so a shard that was not gathered is refused, not zero-padded or half-written).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from quads_megatron.errors import QuadsSglangError
from quads_megatron.integrations.sglang.method import QuadsNvfp4MoEMethod

_EXPERT_NAME = re.compile(r"^(?P<parent>.+)\.experts\.(?P<e>\d+)\.(?P<proj>[^.]+)\.(?P<kind>[^.]+)$")
#: names SGLang's model loaders skip on purpose
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_DEFAULT_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
#: checkpoint names of an expert's (gate, down, up): the Mixtral family (its MoE block is
#: ``block_sparse_moe``) uses w1/w2/w3, the others (Qwen2/3-MoE, DeepSeek, ...) gate_proj/down_proj/up_proj
_W123 = ("w1", "w2", "w3")
_GATE_DOWN_UP = ("gate_proj", "down_proj", "up_proj")
#: expert tensor kinds that hold one fp32 scalar per expert (per GEMM input for input_scale)
PER_TENSOR_KINDS = ("weight_scale_2", "input_scale")


class UnknownTarget(QuadsSglangError):
    """An update name that reaches no parameter of this model (SGLang would drop it silently)."""


@dataclass(frozen=True)
class Target:
    """The destination of one update tensor. param is None for a name this rank does not hold a
    parameter for on purpose (another pipeline stage) or that SGLang's loaders skip."""

    name: str
    param: torch.nn.Parameter | None
    module: torch.nn.Module | None = None
    path: str = ""  # module path (the FusedMoE layer for experts)
    attr: str = ""  # the parameter's attribute on module
    shard: str | int | None = None  # SGLang's shard id: w1/w2/w3, q/k/v, 0/1; None = the whole parameter
    expert: int | None = None
    kind: str = ""  # expert tensors: weight, weight_scale, weight_scale_2, input_scale

    @property
    def is_expert(self) -> bool:
        return self.expert is not None

    @property
    def quads(self) -> bool:
        return self.is_expert and isinstance(getattr(self.module, "quant_method", None), QuadsNvfp4MoEMethod)

    @property
    def gate_up(self) -> bool:
        return self.shard in ("w1", "w3")


class UpdateIndex:
    """Name resolution for one model (built once per update: parameters, modules, FusedMoE layers)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

        self.modules = dict(model.named_modules(remove_duplicate=False))
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.packed = getattr(model, "packed_modules_mapping", None) or _DEFAULT_PACKED
        self.moe = {p: m for p, m in self.modules.items() if isinstance(m, FusedMoE)}
        self._mappings: dict[tuple[tuple[str, ...], int], dict[str, tuple[str, int, str]]] = {}

    def resolve(self, name: str) -> Target:
        """The Target of name, or UnknownTarget naming why it reaches no parameter."""
        if name.endswith(_IGNORED_SUFFIXES):
            return Target(name, None)
        m = _EXPERT_NAME.match(name)
        if m and f"{m['parent']}.experts" in self.moe:
            return self._expert(name, m)
        if name in self.params:
            path, _, attr = name.rpartition(".")
            module = self.modules.get(path)
            if path in self.moe:
                raise UnknownTarget(f"{attr} is the fused FusedMoE parameter; send per-expert tensors (experts.<i>.*)")
            return Target(name, self.params[name], module, path, attr)
        packed = self._packed(name)
        if packed is not None:
            return packed
        if self._other_pipeline_stage(name):
            return Target(name, None)
        raise UnknownTarget("no parameter of this model has this name (nor a q/k/v or gate/up part of one)")

    def _mapping(self, ckpt: tuple[str, ...], num_experts: int) -> dict[str, tuple[str, int, str]]:
        """SGLang's expert mapping, keyed by the checkpoint name part it matches ("experts.3.up_proj.")."""
        key = (ckpt, num_experts)
        if key not in self._mappings:
            from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

            gate, down, up = ckpt
            rows = FusedMoE.make_expert_params_mapping(
                ckpt_gate_proj_name=gate, ckpt_down_proj_name=down, ckpt_up_proj_name=up, num_experts=num_experts
            )
            self._mappings[key] = {weight_name: (param_part, e, shard) for param_part, weight_name, e, shard in rows}
        return self._mappings[key]

    def _expert(self, name: str, m: re.Match) -> Target:
        path = f"{m['parent']}.experts"
        layer = self.moe[path]
        ckpt = _W123 if path.endswith("block_sparse_moe.experts") else _GATE_DOWN_UP
        if m["proj"] not in ckpt:
            raise UnknownTarget(f"expert projection {m['proj']!r}: this model's loader reads {'/'.join(ckpt)}")
        if int(m["e"]) >= layer.num_experts:
            raise UnknownTarget(f"expert {int(m['e'])} outside [0, {layer.num_experts}) of {path}")
        weight_name = f"experts.{m['e']}.{m['proj']}."
        hit = self._mapping(ckpt, layer.num_experts).get(weight_name)
        if hit is None:  # e.g. a zero-padded expert index, which SGLang's mapping does not match either
            raise UnknownTarget(f"expert index {m['e']!r} is not in SGLang's expert mapping")
        param_part, expert, shard = hit
        dest = name.replace(weight_name, param_part)  # what the models' load_weights do
        if dest not in self.params:
            raise UnknownTarget(f"{path} has no parameter {dest.rpartition('.')[2]} for expert tensors '{m['kind']}'")
        return Target(name, self.params[dest], layer, path, dest.rpartition(".")[2], shard, expert, m["kind"])

    def _packed(self, name: str) -> Target | None:
        parent, _, rest = name.rpartition(".")
        owner, _, part = parent.rpartition(".")
        for fused, parts in self.packed.items():
            if part not in parts:
                continue
            path = f"{owner}.{fused}" if owner else fused
            param = self.params.get(f"{path}.{rest}")
            if param is None:
                continue
            module = self.modules[path]
            i = list(parts).index(part)
            from sglang.srt.layers.linear import QKVParallelLinear

            shard = ("q", "k", "v")[i] if isinstance(module, QKVParallelLinear) else i
            return Target(name, param, module, path, rest, shard)
        return None

    def _other_pipeline_stage(self, name: str) -> bool:
        """Whether name lies under a layer that another pipeline stage holds (PPMissingLayer here)."""
        from sglang.srt.layers.utils.common import PPMissingLayer

        parts = name.split(".")
        for i in range(1, len(parts)):
            module = self.modules.get(".".join(parts[:i]))
            if module is None:
                return False
            if isinstance(module, PPMissingLayer):
                return True
        return False


def expected_shape(target: Target, unpacked: bool = False) -> tuple[int | None, ...]:
    """The shape SGLang's loader takes for target (None: a size this check cannot derive).

    Experts: the per-expert slice of the FusedMoE parameter with the intermediate dimension scaled
    back to the full size (x moe_tp_size, unless the layer loads pre-sharded weights); gate/up each take
    half of w13's rows; per-tensor scales are scalars. unpacked: a BF16 expert weight (two FP4 codes a
    byte in the packed layout). Non-experts: the full HF tensor of tensor-parallel linears and vocab
    embeddings (the loader narrows it), the parameter's own shape for any other module.
    """
    param, module = target.param, target.module
    if target.is_expert:
        if target.kind in PER_TENSOR_KINDS:
            return ()
        if param.dim() != 3:
            raise QuadsSglangError(f"{target.path}.{target.attr}: per-expert tensors of this layout are not supported")
        rows, cols = param.shape[1:]
        tp = 1 if getattr(module, "use_presharded_weights", False) else module.moe_tp_size
        if target.gate_up:
            gated = getattr(getattr(module, "moe_runner_config", None), "is_gated", True)
            rows = (rows // 2 if gated else rows) * tp
        else:
            cols = cols * tp
        return (rows, cols * 2 if unpacked else cols)
    from sglang.srt.layers.linear import LinearBase, QKVParallelLinear
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if isinstance(module, VocabParallelEmbedding) and target.attr == "weight":
        return (module.org_vocab_size, module.embedding_dim)
    if not isinstance(module, LinearBase) or target.attr not in ("weight", "bias"):
        return tuple(param.shape)
    if getattr(module, "use_presharded_weights", False):  # the loader takes this rank's shard as it is
        rows = param.shape[0] if target.shard is None else None
        return (rows, param.shape[1]) if target.attr == "weight" else (rows,)
    if target.shard is None:
        rows = module.output_size
    elif isinstance(module, QKVParallelLinear):
        heads = module.total_num_heads if target.shard == "q" else module.total_num_kv_heads
        rows = heads * (module.v_head_size if target.shard == "v" else module.head_size)
    else:
        rows = module.output_sizes[target.shard]
    return (rows, module.input_size) if target.attr == "weight" else (rows,)
