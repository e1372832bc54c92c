"""What a layer (and the model runner) may ask of the device: the ``DeviceOps`` protocol.

Layers hold the ops object they were built with and call it for every piece of work that
has a device-specific fast version (a fused kernel, a prepacked weight); they never look
at which device or dtype they run on. The model runner asks the same object what serving on
the device assumes (``platform``: memory defaults, CUDA graphs) and for the device's
own way of running a model's decoder layers (``layer_stack``), never the device type.
``runtime.engine.ops.get_ops`` picks the implementation once per (device, dtype). The records
handed across the seam have modules of their own: ``rope.py`` (one forward's rotary inputs),
``layer_stack.py`` (what a device's whole-layer kernels read of a model), ``linear_weights.py`` (a linear
layer's weight and the device's plan for it) and ``experts.py`` (what its expert kernels read of a
mixture-of-experts layer).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from memory.kv_format import KVCacheFormat
from runtime.engine.ops.experts import ExpertLayer, ExpertRouting
from runtime.engine.ops.layer_stack import DecoderStackModel, LayerStack
from runtime.engine.ops.linear_weights import WeightPlan
from runtime.engine.ops.lora import LoraSegments, LoraWeights
from runtime.engine.ops.rope import RopeCache, RopeInputs
from runtime.engine.platform import ServingPlatform
from runtime.engine.quant.weight import KeptWeight


class DeviceOps(Protocol):
    """The device-specific work of a forward. Every method has the plain torch meaning of
    ``runtime.engine.ops.torch_ops.TorchOps``; implementations differ in speed and rounding only."""

    name: str

    def platform(self, device: torch.device) -> ServingPlatform:
        """What serving on ``device`` assumes (memory defaults, CUDA graphs), asked by the model
        runner instead of testing the device type."""
        ...

    def prepare_process(self) -> None:
        """Process-wide settings for serving on this device (once, before the model is built)."""
        ...

    def prepare_model(self, model: nn.Module) -> None:
        """The device's plan for every ``LinearWeightLayer``'s loaded weight (call after every full
        load): set as the layer's ``plan``, which the layer owns and drops when its weight is written
        again (``runtime.engine.ops.linear_weights``)."""
        ...

    def prepared_bytes(self, model: nn.Module) -> int:
        """Bytes ``prepare_model`` laid out beside ``model``'s own tensors (a CPU weight's packed copy):
        resident like the weights, so they come out of the same share of memory as the KV pool."""
        return 0

    def graph_safe(self, model: nn.Module) -> bool:
        """Whether ``model``'s decode forward asks nothing of this device that a CUDA graph cannot
        capture (a host read of routing, as an expert loop makes); the model runner captures no graph
        otherwise."""
        ...

    def layer_stack(self, model: DecoderStackModel) -> LayerStack | None:
        """The device's own way of running ``model``'s decoder layers for every forward the model
        runner runs eagerly (the CPU's one-call stack), or None: the model runs them one by one."""
        ...

    def kernel_report(
        self, model: nn.Module, stack: LayerStack | None, kv_format: KVCacheFormat | None = None
    ) -> dict[str, Any]:
        """What this device chose to run ``model`` with (after ``prepare_model``), and why, with a
        one-line ``summary``: logged at start-up and reported by ``server_info``. ``kv_format``: the
        KV cache's (what reads and writes it, where the device's kernels depend on it)."""
        ...

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | KeptWeight,
        bias: torch.Tensor | None,
        plan: WeightPlan | None = None,
    ) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` (run as the device's ``plan`` for ``weight`` says, where it made one);
        a weight kept quantized (``KeptWeight``) multiplies as its dequantized values would (``reference_linear``), up to
        the kernel's quantization of ``x``."""
        ...

    def lora_add(self, out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, segments: LoraSegments) -> None:
        """Multi-LoRA: in place, ``out [T, N] += `` each run's adapter product of ``x [T, K]`` (the
        shrink by its slot's ``A``, the expand by its ``B`` part by part:
        ``runtime.engine.ops.lora.reference_lora_add``); runs of slot -1 are left as they are.
        ``out`` is the linear's output before any all-reduce and bias; both are row-contiguous."""
        ...

    def embedding(self, ids: torch.Tensor, weight: torch.Tensor | KeptWeight, dtype: torch.dtype) -> torch.Tensor:
        """``F.embedding(ids, weight)`` in ``dtype``; of a quantized weight only the looked-up rows are
        dequantized."""
        ...

    def float_linear(
        self, x: torch.Tensor, weight: torch.Tensor | KeptWeight, plan: WeightPlan | None = None
    ) -> torch.Tensor:
        """``linear(x, weight, None).float()`` (the LM head's fp32 logits), where a device can write
        the fp32 result directly."""
        ...

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """RMSNorm of ``x [..., H]`` as a new tensor (fp32 statistics, cast back before the weight
        multiply, as transformers does). With ``residual``: ``residual += x`` in place first, and
        the norm is of that sum."""
        ...

    def layer_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        """``F.layer_norm(x, (H,), weight, bias, eps)`` of ``x [..., H]`` as a new tensor (BERT's
        LayerNorm: mean and variance over the last dim, then the affine)."""
        ...

    def rope(self, cache: RopeCache, positions: torch.Tensor, dtype: torch.dtype) -> RopeInputs:
        """The forward's rotary inputs for ``positions`` (once per forward, shared by all layers)."""
        ...

    def rotary_(self, q: torch.Tensor, k: torch.Tensor, rope: RopeInputs) -> None:
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` in place (neox halves of the first
        ``rotary_dim`` dims). Token rows may be strided (views of a fused qkv output); within
        a token, heads and dims must be packed."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``x [..., 2 * I]`` (gate first) as a new ``[..., I]`` tensor."""
        ...

    def linear_silu_and_mul(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | KeptWeight,
        bias: torch.Tensor | None,
        plan: WeightPlan | None = None,
    ) -> torch.Tensor:
        """``silu_and_mul(linear(x, weight, bias))`` (a gated MLP's merged gate/up projection), in
        one pass where a device can fuse the two."""
        ...

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``gelu(gate, approximate="tanh") * up`` of ``x [..., 2 * I]`` (gate first) as a new
        ``[..., I]`` tensor (Gemma's gated MLP)."""
        ...

    def gelu(self, x: torch.Tensor) -> torch.Tensor:
        """``F.gelu(x)``, the exact (erf) GELU, as a new tensor (an encoder's ungated MLP)."""
        ...

    def moe_route(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | KeptWeight,
        plan: WeightPlan | None,
        top_k: int,
        renormalize: bool,
        in_model_dtype: bool,
    ) -> ExpertRouting:
        """Each token's ``top_k`` experts for ``x [T, H]`` from its router logits ``linear(x, weight,
        None, plan)`` ``[T, E]`` (the model's dtype): the softmax's fp32 probabilities' top k, in
        descending order, divided by their sum where ``renormalize``, rounded to the logits' dtype
        where ``in_model_dtype`` (``runtime.engine.ops.experts.route_experts``: transformers' routers)."""
        ...

    def moe_shared_gate(
        self, x: torch.Tensor, weight: torch.Tensor | KeptWeight, plan: WeightPlan | None
    ) -> torch.Tensor:
        """``sigmoid(linear(x, weight, None, plan))`` ``[T, 1]`` in ``x``'s dtype: the gate of a sparse
        layer's always-on shared expert (Qwen2-MoE's ``shared_expert_gate``, a ``[1, H]`` weight)."""
        ...

    def moe_experts(self, x: torch.Tensor, routing: ExpertRouting, experts: ExpertLayer) -> torch.Tensor:
        """This rank's share of a sparse MLP layer's output for ``x [T, H]``: for each token, the sum
        over its routed experts that this rank holds of ``weight * down(act(gate) * up)`` (the product
        in the routing weights' dtype, then rounded to ``x``'s), added expert by expert in ascending id
        order as transformers does; a TP rank's partial sums (its slice of each expert's intermediate
        dimension) are left for the layer to reduce. Only the routed experts' weights are read."""
        ...

    def store_kv(self, pool: Any, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` ``[n, Hkv, D]`` at KV slots ``loc`` (int64 ``[n]``) of layer ``layer_id``
        of ``pool`` (an ``MHATokenToKVPool``)."""
        ...

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 ``argmax(dim=-1)`` of ``[rows, cols]`` logits (greedy sampling)."""
        ...

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> None:
        """Constrained decoding: in place, ``logits[r, t] = -inf`` for every token ``t`` whose bit is
        clear in ``bitmask[r]`` (int32 ``[rows, ceil(cols / 32)]``, bit ``t % 32`` of word ``t // 32``),
        for the rows ``rows`` (None: all). ``logits`` is fp32 ``[rows, cols]``, on the bitmask's device."""
        ...
