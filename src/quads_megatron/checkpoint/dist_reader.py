"""Reading Megatron-Core distributed checkpoints (torch_dist format) one layer at a time.

Megatron writes a TransformerBlock in one of two layouts (TransformerBlock.sharded_state_dict):
* layer-stacked (the default for homogeneous blocks): ``decoder.layers.<rest>`` with a leading
  layer axis, e.g. routed experts ``decoder.layers.mlp.experts.experts.linear_fc1.weight``
  [L, E, 2F, H];
* per layer (non_homogeneous_layers, e.g. moe_layer_freq > 1): ``decoder.layers.<N>.<rest>``,
  e.g. [E, 2F, H].
Both store global tensors, whatever the EP/TP/PP layout of the run that wrote them (Megatron-LM
writes the stacked one: homogeneous layers, singleton_local_shards=False). One layer of
a stacked tensor is read on its own (only the chunks that overlap it), so memory stays at about
one layer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner

from quads_megatron.errors import DistCheckpointError

_STACKED = re.compile(r"^(?P<pre>.*?)layers\.(?P<rest>[A-Za-z_].*)$")
_PER_LAYER = re.compile(r"^(?P<pre>.*?)layers\.(?P<layer>\d+)\.(?P<rest>.+)$")


OPTIMIZER_PREFIX = "optimizer."  # distributed optimizer state (exp_avg, fp32 master params, ...)


@dataclass(frozen=True)
class LayerTensor:
    """One layer's view of a checkpoint tensor: ``name`` is the per-layer name (``...layers.N.rest``)."""

    key: str  # checkpoint key
    layer: int | None  # index along the leading axis of a stacked key; None: the whole tensor
    name: str


class DistCheckpoint:
    def __init__(self, path: str) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        try:
            self.reader = FileSystemReader(path)
            meta = self.reader.read_metadata().state_dict_metadata
        except Exception as e:
            raise DistCheckpointError(
                f"{path}: not a readable torch_dist (Megatron dist_checkpointing) checkpoint ({e})"
            ) from e
        self.path = path
        self.tensors = {k: m for k, m in meta.items() if isinstance(m, TensorStorageMetadata)}

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def layer_tensors(self) -> list[LayerTensor]:
        """Every model tensor (optimizer state, ``optimizer.*``, is skipped), stacked keys expanded to
        one entry per layer."""
        out = []
        for key, m in self.tensors.items():
            if key.startswith(OPTIMIZER_PREFIX):
                continue
            s = _STACKED.match(key)
            if s is not None and not _PER_LAYER.match(key):
                for layer in range(m.size[0]):
                    out.append(LayerTensor(key, layer, f"{s['pre']}layers.{layer}.{s['rest']}"))
            else:
                out.append(LayerTensor(key, None, key))
        return out

    def read(self, t: LayerTensor) -> torch.Tensor:
        """The tensor (or its layer), in its stored dtype."""
        from torch.distributed.checkpoint import load as dcp_load

        if t.key not in self.tensors:
            raise DistCheckpointError(f"{self.path}: {t.key} is missing (half-written checkpoint?)")
        m = self.tensors[t.key]
        if t.layer is None:
            out = torch.empty(tuple(m.size), dtype=m.properties.dtype)
            dcp_load({t.key: out}, storage_reader=self.reader, no_dist=True)
            return out
        out = torch.empty((1, *m.size[1:]), dtype=m.properties.dtype)
        dcp_load({t.key: out}, storage_reader=self.reader, planner=_SlicePlanner(t.key, t.layer), no_dist=True)
        return out[0]


class _SlicePlanner(DefaultLoadPlanner):
    """Loads [layer : layer+1] of the leading axis of one stacked tensor (chunks that overlap only)."""

    def __init__(self, key: str, layer: int) -> None:
        super().__init__()
        self.key, self.layer = key, layer

    def create_local_plan(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        dest = self.state_dict[self.key]
        md = self.metadata.state_dict_metadata[self.key]
        chunk = ChunkStorageMetadata(
            offsets=torch.Size([self.layer] + [0] * (dest.dim() - 1)), sizes=torch.Size(dest.shape)
        )
        return LoadPlan(create_read_items_for_chunk_list(self.key, md, [chunk]))

    def lookup_tensor(self, index):  # the destination is this layer's chunk; read offsets are relative to it
        return self.state_dict[index.fqn]
