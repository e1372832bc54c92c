"""The MLP blocks: the gated one (``down(act(gate(x)) * up(x))``) that the Llama-style families share,
and the plain one (``down(act(up(x)))``, with biases) of the encoders (BERT's intermediate and output
dense layers).

Gate and up are one merged column-parallel projection (one matmul), down is row-parallel; the
activation is the family's choice (``runtime.engine.layers.choices``). Parameter names
(``gate_up_proj``, ``down_proj``) are what ``checkpoint_targets`` expands to the checkpoint's
``gate_proj`` / ``up_proj`` / ``down_proj``.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.engine.layers.choices import GATED_ACTIVATIONS, GATED_ACTIVATIONS_OF_OUTPUT, PLAIN_ACTIVATIONS
from runtime.engine.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from runtime.engine.ops import DeviceOps


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: str,
        *,
        tp_rank: int,
        tp_size: int,
        dtype: torch.dtype,
        ops: DeviceOps,
        reduce_results: bool = True,
    ) -> None:
        """``reduce_results=False``: a TP rank's output is its partial sum (a sparse MLP's shared
        expert, reduced with the routed experts' in one all-reduce)."""
        super().__init__()
        self.activation = activation
        self._act_and_mul = GATED_ACTIVATIONS[activation]  # (model_config refused any other name)
        self._act_of_output = GATED_ACTIVATIONS_OF_OUTPUT[activation]
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size,
            [intermediate_size, intermediate_size],
            tp_rank=tp_rank,
            tp_size=tp_size,
            params_dtype=dtype,
            ops=ops,
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            tp_rank=tp_rank,
            tp_size=tp_size,
            params_dtype=dtype,
            ops=ops,
            reduce_results=reduce_results,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if gate_up.lora_active():  # (an adapter's product joins the projection before the activation)
            return self.down_proj(self._act_of_output(gate_up.ops, gate_up(x)))
        return self.down_proj(self._act_and_mul(gate_up.ops, x, gate_up.weight, gate_up.bias, gate_up.plan))


class PlainMLP(nn.Module):
    """``down(act(up(x)))`` with both biases: up column-parallel, down row-parallel (its bias added
    once, after the reduction), the activation one of ``choices.PLAIN_ACTIVATIONS``."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: str,
        *,
        tp_rank: int,
        tp_size: int,
        dtype: torch.dtype,
        ops: DeviceOps,
    ) -> None:
        super().__init__()
        self.activation = activation
        self._act = PLAIN_ACTIVATIONS[activation]  # (model_config refused any other name)
        self.up_proj = ColumnParallelLinear(
            hidden_size, [intermediate_size], bias=True, tp_rank=tp_rank, tp_size=tp_size, params_dtype=dtype, ops=ops
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=True, tp_rank=tp_rank, tp_size=tp_size, params_dtype=dtype, ops=ops
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._act(self.up_proj.ops, self.up_proj(x)))
