"""The sparse MLP block that every mixture-of-experts family shares: router, top-k, experts, combine.

``SparseMoeMLP`` replaces a decoder layer's dense gated MLP. For each token the router (``gate``,
a replicated linear to one logit per expert) gives a softmax over the experts in fp32; the token
goes to its ``top_k`` most probable ones, weighted by those probabilities (renormalised to sum to
1 where the family says so, then rounded to the model's dtype where transformers' router rounds
them). The routed experts run on the device (``DeviceOps.moe_experts``: tokens grouped by expert,
one product per routed expert over its tokens, only those experts' weights read) and an optional
shared expert (Qwen2-MoE) adds its output behind a sigmoid gate. Every choice follows transformers
op for op: the same ``torch.topk`` breaks ties, and the experts' outputs are added in ascending
expert order, so greedy output equals its ``generate`` token for token.

Parallelism: every rank routes every token (the router is replicated; attention's all-reduce left
the whole activations on each rank). Under ``--tp-size`` each rank holds each expert's slice of
the intermediate dimension, as a dense MLP's; under ``--ep-size`` the ranks form ``ep_size`` groups
that each hold whole experts (``MoeConfig.local_experts``), a rank computes only its experts'
tokens, and one all-reduce over the TP group combines every rank's partial sums (SGLang's EP
without a dedicated all-to-all: the tokens are already on every rank).

Parameter names are the checkpoints' (``gate.weight``, ``experts.<id>.gate_up_proj`` expanded to
``gate_proj``/``up_proj``, ``experts.<id>.down_proj``, ``shared_expert.*``, ``shared_expert_gate.weight``);
a rank names only its own experts, so other ranks' tensors are skipped when the checkpoint loads.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.engine.config_reading import MoeConfig
from runtime.engine.distributed import tensor_model_parallel_all_reduce
from runtime.engine.layers.choices import GATED_ACTIVATIONS
from runtime.engine.layers.linear import ReplicatedLinear
from runtime.engine.layers.mlp import GatedMLP
from runtime.engine.model_config import ModelConfig
from runtime.engine.ops import DeviceOps
from runtime.engine.ops.experts import ExpertLayer, ExpertRouting, ExpertWeight, route_experts
from runtime.engine.ops.layer_stack import RoutedExperts, SharedExpert
from runtime.engine.ops.linear_weights import WeightPlan


def route(logits: torch.Tensor, moe: MoeConfig) -> ExpertRouting:
    """Each token's top-k experts from its router ``logits [T, E]`` (the model's dtype) as
    transformers' routers choose them (``route_experts``: the plain meaning of ``DeviceOps.moe_route``,
    which the layer calls)."""
    return route_experts(logits, moe.top_k, moe.renormalize, moe.weights_in_model_dtype)


def _router(hidden_size: int, outputs: int, dtype: torch.dtype, ops: DeviceOps) -> ReplicatedLinear:
    """A routing projection, replicated and kept dense under ``--quantization int8`` (as SGLang keeps
    its MoE gate): a quantized router would change which experts a token goes to."""
    router = ReplicatedLinear(hidden_size, outputs, params_dtype=dtype, ops=ops)
    router.int8_quantizable = False
    return router


class SparseMoeMLP(ExpertLayer):
    """A decoder layer's sparse MLP on one rank (see the module doc): ``moe`` says its experts and
    routing (a mixture of experts' own config holds it), ``config`` its sizes and activation."""

    def __init__(
        self, config: ModelConfig, moe: MoeConfig, tp_rank: int, tp_size: int, dtype: torch.dtype, ops: DeviceOps
    ) -> None:
        super().__init__()
        if tp_size % moe.ep_size:
            raise ValueError(f"--tp-size ({tp_size}) must be a multiple of --ep-size ({moe.ep_size})")
        self.moe, self.ops, self.tp_size = moe, ops, tp_size
        self.num_experts = moe.num_experts
        self.local_experts = moe.local_experts(tp_rank, tp_size)
        self.activation = config.hidden_act
        self.act_and_mul = GATED_ACTIVATIONS[config.hidden_act]
        expert_tp = tp_size // moe.ep_size  # the ranks of an EP group split each of its experts
        self.gate = _router(config.hidden_size, moe.num_experts, dtype, ops)
        # global id -> its expert, looked up per routed expert in every forward; the ModuleDict below
        # holds the same modules under the checkpoint's names (``experts.<id>``)
        self._by_id: dict[int, GatedMLP] = {
            expert: GatedMLP(
                config.hidden_size,
                moe.intermediate_size,
                config.hidden_act,
                tp_rank=tp_rank % expert_tp,
                tp_size=expert_tp,
                dtype=dtype,
                ops=ops,
                reduce_results=False,
            )
            for expert in self.local_experts
        }
        self.experts = nn.ModuleDict({str(expert): mlp for expert, mlp in self._by_id.items()})
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(
                config.hidden_size,
                moe.shared_expert_intermediate_size,
                config.hidden_act,
                tp_rank=tp_rank,
                tp_size=tp_size,
                dtype=dtype,
                ops=ops,
                reduce_results=False,
            )
            self.shared_expert_gate = _router(config.hidden_size, 1, dtype, ops)

    def expert_weights(self, expert: int) -> tuple[ExpertWeight, ExpertWeight]:
        mlp = self._by_id[expert]
        return mlp.gate_up_proj.weight, mlp.down_proj.weight

    def expert_plans(self, expert: int) -> tuple[WeightPlan | None, WeightPlan | None]:
        mlp = self._by_id[expert]
        return mlp.gate_up_proj.plan, mlp.down_proj.plan

    def routed_experts(self) -> RoutedExperts:
        """The router and this rank's experts' linears for a device's whole-layer kernels (every
        expert without expert parallelism; with it, fewer than the router's rows, which such a
        device declines)."""
        ids = self.local_experts
        return RoutedExperts(
            router=self.gate,
            gate_up=tuple(self._by_id[expert].gate_up_proj for expert in ids),
            down=tuple(self._by_id[expert].down_proj for expert in ids),
            top_k=self.moe.top_k,
            renormalize=self.moe.renormalize,
            weights_in_model_dtype=self.moe.weights_in_model_dtype,
            shared=None
            if self.shared_expert is None or self.shared_expert_gate is None
            else SharedExpert(self.shared_expert_gate, self.shared_expert.gate_up_proj, self.shared_expert.down_proj),
        )

    def _route(self, x: torch.Tensor) -> ExpertRouting:
        moe, gate = self.moe, self.gate
        return self.ops.moe_route(x, gate.weight, gate.plan, moe.top_k, moe.renormalize, moe.weights_in_model_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.ops.moe_experts(x, self._route(x), self)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = self.shared_expert_gate
            out = out + self.ops.moe_shared_gate(x, gate.weight, gate.plan) * self.shared_expert(x)
        return tensor_model_parallel_all_reduce(out, self.tp_size)
