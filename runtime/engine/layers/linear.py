"""Tensor-parallel linear layers and the hook that plugs TP communication in.

Each layer holds only this rank's shard of its weight and knows how to cut that shard
out of a full checkpoint tensor (``weight_loader``), so the weight loader never needs
to know about TP. Conventions (torch ``F.linear``: weight is ``[out, in]``):

- column-parallel: each rank owns a slice of the output features (rows of the weight);
  no communication, the output stays sharded.
- row-parallel: each rank owns a slice of the input features (columns of the weight);
  partial outputs are summed with ``all_reduce`` over the TP group.

Communication goes through the process-wide TP group of ``runtime.engine.distributed``
(``set_tp_group``); none registered (the default) means a single rank, where a layer built
with ``tp_size > 1`` refuses to run rather than silently returning a partial sum.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import nn

from runtime.engine.distributed import tensor_model_parallel_all_reduce
from runtime.engine.ops import DeviceOps, default_ops
from runtime.engine.ops.linear_weights import LinearWeightLayer
from runtime.engine.ops.lora import LinearLora
from runtime.engine.quant.loading import PendingShards, quantized_shard


class LazyWeight(Protocol):
    """A checkpoint tensor that can be read in part (safetensors slice) or whole."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...

    def load(self) -> torch.Tensor: ...


class WeightRows:
    """Rows ``[start, start + rows)`` of a checkpoint tensor, itself a ``LazyWeight``: one part of a
    tensor the checkpoint stores fused (Phi-3's ``qkv_proj``: q, k and v rows stacked; its
    ``gate_up_proj``), so each part goes through its merged layer's loader like a separate tensor
    and a TP rank still reads only the rows of its shard. A GGUF weight kept quantized hands over
    the part's blocks (``quantized``)."""

    def __init__(self, weight: LazyWeight, start: int, rows: int) -> None:
        self.weight, self.start, self.rows = weight, start, rows

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows, *self.weight.shape[1:])

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            return self.weight.narrow(0, self.start + start, length)
        return self.load().narrow(dim, start, length)

    def load(self) -> torch.Tensor:
        return self.weight.narrow(0, self.start, self.rows)

    def quantized(self, dim: int, start: int, length: int) -> Any:
        """The part's rows in their blocks where the fused tensor keeps them (rows only: a part is
        never split by columns), else None (``runtime.engine.quant.loading.quantized_shard``)."""
        if dim != 0:
            return None
        return quantized_shard(self.weight, 0, self.start + start, length)


class WeightShapeError(ValueError):
    """A checkpoint tensor's shape does not match what the config implies."""


WeightLoader = Callable[[nn.Parameter, LazyWeight, str, Any], None]


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by tp_size ({denominator})")
    return numerator // denominator


def check_shape(name: str, got: Sequence[int], expected: Sequence[int]) -> None:
    if tuple(got) != tuple(expected):
        raise WeightShapeError(f"checkpoint tensor {name} has shape {tuple(got)}, expected {tuple(expected)}")


def copy_into(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    """Copy (and convert dtype / move device) a loaded shard into ``param``."""
    check_shape(name, value.shape, param.shape)
    with torch.no_grad():
        param.copy_(value)


def replicated_weight_loader(param: nn.Parameter, weight: LazyWeight, name: str, shard_id: Any = None) -> None:
    check_shape(name, weight.shape, param.shape)
    copy_into(param, weight.load(), name)


class LinearBase(LinearWeightLayer, abc.ABC):
    """What every linear layer holds: this rank's ``[out_rows, in_cols]`` weight (filled by the
    subclass's ``weight_loader``, which decides the sharding), an optional bias of ``out_rows``
    (filled by ``bias_loader``), the quantized shards its loader is handed, and its device ops."""

    def __init__(
        self,
        out_rows: int,
        in_cols: int,
        bias: bool,
        params_dtype: torch.dtype | None,
        ops: DeviceOps | None,
        bias_loader: WeightLoader | None = None,
    ) -> None:
        super().__init__()
        self.ops = ops or default_ops(params_dtype)
        self.weight = nn.Parameter(torch.empty(out_rows, in_cols, dtype=params_dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.quant_shards = PendingShards()  # blocks kept quantized (runtime.engine.quant.loading)
        self.int8_quantizable = True
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_rows, dtype=params_dtype), requires_grad=False)
            self.bias.weight_loader = bias_loader or self.weight_loader  # type: ignore[attr-defined]
        self.lora: LinearLora | None = None  # its adapter slots, on a LoRA server (runtime.engine.lora)

    def add_lora(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out`` (this rank's ``x W^T``, before any reduction) plus the forward's adapter products,
        in place; unchanged where no token uses an adapter."""
        if self.lora is not None:
            segments = self.lora.active()
            if segments is not None:
                self.ops.lora_add(out, x, self.lora.weights, segments)
        return out

    def lora_active(self) -> bool:
        """Some token of this forward adds an adapter's product to this linear's output."""
        return self.lora is not None and self.lora.active() is not None

    def lora_parts(self) -> list[tuple[object, int, int]]:
        """``(shard id, first local output row, rows)`` of each checkpoint projection this linear
        holds, in row order (an adapter's ``B`` of that projection expands into those rows)."""
        return [(None, 0, int(self.weight.shape[0]))]

    def shard_lora(self, a: torch.Tensor, b: torch.Tensor, shard_id: object) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of an adapter's ``a [r, in]`` and ``b [out, r]`` of checkpoint projection
        ``shard_id`` (None: the whole output), cut as this layer cuts its weight."""
        return a, b

    def lora_full_shape(self, shard_id: object) -> tuple[int, int]:
        """``(out, in)`` of checkpoint projection ``shard_id`` before any sharding: the rows of an
        adapter's ``b`` and the columns of its ``a`` (checked before ``shard_lora`` cuts them, since a
        cut of a larger matrix would fit)."""
        return int(self.weight.shape[0]), int(self.weight.shape[1])

    @abc.abstractmethod
    def weight_loader(self, param: nn.Parameter, weight: LazyWeight, name: str, shard_id: Any = None) -> None:
        """Fill ``param`` (the weight, or the bias where it shards as the rows) with this rank's shard
        of checkpoint tensor ``weight``: each layer kind shards its own way."""


class ReplicatedLinear(LinearBase):
    """A full (unsharded) linear; used where every rank needs the whole result."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        ops: DeviceOps | None = None,
    ) -> None:
        super().__init__(out_features, in_features, bias, params_dtype, ops, bias_loader=replicated_weight_loader)

    def weight_loader(self, param: nn.Parameter, weight: LazyWeight, name: str, shard_id: Any = None) -> None:
        self.drop_plan()  # the device's plan read the old values
        check_shape(name, weight.shape, param.shape)
        if not self.quant_shards.take(weight, 0, 0, param.shape[0], 0):
            replicated_weight_loader(param, weight, name, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_lora(self.ops.linear(x, self.weight, self.bias, self.plan), x)


class ColumnParallelLinear(LinearBase):
    """``y = x W^T + b`` with W's output rows split over ranks; the output stays sharded.

    ``output_sizes`` lists the logical sub-matrices stacked along the output dim (e.g.
    ``[intermediate, intermediate]`` for merged gate/up); each is split separately so a
    rank holds ``[gate_shard; up_shard]`` and ``shard_id`` (the sub-matrix index) picks
    where a checkpoint tensor goes.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        params_dtype: torch.dtype | None = None,
        local_sizes: Sequence[int] | None = None,
        ops: DeviceOps | None = None,
    ) -> None:
        if local_sizes is None:
            local_sizes = [divide(s, tp_size, "output features") for s in output_sizes]
        super().__init__(sum(local_sizes), in_features, bias, params_dtype, ops)  # (the bias shards as the rows)
        self.in_features = in_features
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.output_sizes = list(output_sizes)
        self.local_sizes = list(local_sizes)
        self.local_offsets = [sum(self.local_sizes[:i]) for i in range(len(self.local_sizes))]

    def _shard_range(self, shard_id: int) -> tuple[int, int, int]:
        """(offset in this rank's param, start row in the full sub-matrix, number of rows)."""
        size = self.local_sizes[shard_id]
        return self.local_offsets[shard_id], self.tp_rank * size, size

    def weight_loader(self, param: nn.Parameter, weight: LazyWeight, name: str, shard_id: Any = 0) -> None:
        """Load sub-matrix ``shard_id`` of a merged layer; None: ``weight`` holds every sub-matrix
        stacked (a checkpoint that stores the merged layer fused), loaded part by part."""
        if shard_id is None and len(self.output_sizes) > 1:
            rows = sum(self.output_sizes)
            check_shape(name, weight.shape, (rows, self.in_features) if param.dim() == 2 else (rows,))
            starts = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
            for part, (start, size) in enumerate(zip(starts, self.output_sizes)):
                self.weight_loader(param, WeightRows(weight, start, size), name, part)
            return
        self.drop_plan()  # the device's plan read the old values
        shard = int(shard_id or 0)
        full_rows = self.output_sizes[shard]
        expected = (full_rows, self.in_features) if param.dim() == 2 else (full_rows,)
        check_shape(name, weight.shape, expected)
        offset, start, size = self._shard_range(shard)
        if param is self.weight and self.quant_shards.take(weight, 0, start, size, offset):
            return
        copy_into(param.data.narrow(0, offset, size), weight.narrow(0, start, size), name)

    def lora_parts(self) -> list[tuple[object, int, int]]:
        return [(shard, *self._shard_range(shard)[::2]) for shard in range(len(self.output_sizes))]

    def shard_lora(self, a: torch.Tensor, b: torch.Tensor, shard_id: object) -> tuple[torch.Tensor, torch.Tensor]:
        if shard_id is None and len(self.output_sizes) > 1:  # a fused projection: every part's rows
            starts = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
            rows = [b[first + self._shard_range(i)[1] :][: self._shard_range(i)[2]] for i, first in enumerate(starts)]
            return a, torch.cat(rows)
        _, start, size = self._shard_range(shard_id if isinstance(shard_id, int) else 0)
        return a, b[start : start + size]

    def lora_full_shape(self, shard_id: object) -> tuple[int, int]:
        rows = self.output_sizes[shard_id] if isinstance(shard_id, int) else sum(self.output_sizes)
        return rows, self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_lora(self.ops.linear(x, self.weight, self.bias, self.plan), x)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Gate and up projections stored as one matrix (gate rows first) so the MLP does one matmul;
    the gated MLP applies its activation to the output (``runtime.engine.layers.choices``)."""


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul, split by heads over ranks.

    When ``tp_size > num_kv_heads`` each rank keeps one KV head, replicated across the
    ``tp_size // num_kv_heads`` ranks that share it (their query heads use that KV head).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        params_dtype: torch.dtype | None = None,
        ops: DeviceOps | None = None,
    ) -> None:
        local_heads = divide(num_heads, tp_size, "num_attention_heads")
        if tp_size >= num_kv_heads:
            divide(tp_size, num_kv_heads, "tp_size must be a multiple of num_key_value_heads when larger; tp_size")
            local_kv_heads = 1
            kv_head_start = tp_rank // (tp_size // num_kv_heads)
        else:
            local_kv_heads = divide(num_kv_heads, tp_size, "num_key_value_heads")
            kv_head_start = tp_rank * local_kv_heads
        super().__init__(
            hidden_size,
            [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
            bias=bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
            params_dtype=params_dtype,
            local_sizes=[local_heads * head_dim, local_kv_heads * head_dim, local_kv_heads * head_dim],
            ops=ops,
        )
        self.head_dim = head_dim
        self.num_heads = local_heads
        self.num_kv_heads = local_kv_heads
        self.kv_head_start = kv_head_start

    def _shard_range(self, shard_id: int) -> tuple[int, int, int]:
        size = self.local_sizes[shard_id]
        start = self.tp_rank * size if shard_id == 0 else self.kv_head_start * self.head_dim
        return self.local_offsets[shard_id], start, size

    @property
    def q_size(self) -> int:
        return self.local_sizes[0]

    @property
    def kv_size(self) -> int:
        return self.local_sizes[1]


class RowParallelLinear(LinearBase):
    """``y = x W^T + b`` with W's input columns split over ranks; partial sums are all-reduced.

    The input must already be sharded along its last dim (it comes from a column-parallel
    layer). The bias is added once, after the reduction. ``reduce_results=False`` leaves the
    partial sums to the caller (a sparse MLP sums its experts' partials and reduces once).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        params_dtype: torch.dtype | None = None,
        ops: DeviceOps | None = None,
        reduce_results: bool = True,
    ) -> None:
        in_local = divide(in_features, tp_size, "input features")
        super().__init__(out_features, in_local, bias, params_dtype, ops, bias_loader=replicated_weight_loader)
        self.reduce_results = reduce_results
        self.in_features = in_features
        self.out_features = out_features
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.in_local = in_local

    def weight_loader(self, param: nn.Parameter, weight: LazyWeight, name: str, shard_id: Any = None) -> None:
        self.drop_plan()  # the device's plan read the old values
        check_shape(name, weight.shape, (self.out_features, self.in_features))
        if not self.quant_shards.take(weight, 1, self.tp_rank * self.in_local, self.in_local, 0):
            copy_into(param, weight.narrow(1, self.tp_rank * self.in_local, self.in_local), name)

    def shard_lora(self, a: torch.Tensor, b: torch.Tensor, shard_id: object) -> tuple[torch.Tensor, torch.Tensor]:
        """``a``'s columns as the weight's: each rank's product is a partial sum, reduced with the base's."""
        return a[:, self.tp_rank * self.in_local : (self.tp_rank + 1) * self.in_local], b

    def lora_full_shape(self, shard_id: object) -> tuple[int, int]:
        return self.out_features, self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.add_lora(self.ops.linear(x, self.weight, None, self.plan), x)
        if self.reduce_results:
            out = tensor_model_parallel_all_reduce(out, self.tp_size)
        return out if self.bias is None else out + self.bias
